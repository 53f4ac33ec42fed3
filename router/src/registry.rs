//! The swarm's agents by name, and the rules they keep together.
//!
//! Invariants, true of every [`Registry`] value: [`Registry::new`] checks them and
//! [`Registry::add`] and [`Registry::remove`] keep them, refusing an edit that would break one
//! and leaving the registry as it was.
//! - every agent passes [`AgentSpec::validate`] (a specialist has a description and at least
//!   three routing examples, ...), and names are unique;
//! - exactly one general fallback agent, so every request has somewhere to go;
//! - at most one router and at most one verifier agent, so there is never a choice of which
//!   one to ask;
//! - if an agent's verifier policy asks for a judge, there is a verifier agent to ask.
//!
//! `remove` refuses the general and system agents: the swarm cannot run without its fallback,
//! and the routing and verification stages are configured against the system agents.
//!
//! Sharing: [`SharedRegistry`] publishes the registry as immutable `Arc<Registry>` snapshots. A
//! request takes one snapshot (a read lock held for one `Arc` clone) and keeps it from routing
//! to verification, so it sees one consistent swarm even while an operator edits it. An edit
//! clones the current registry, changes the clone, and publishes it (a write lock held for one
//! pointer store); a separate mutex serializes edits so that two concurrent ones cannot lose
//! each other, and cloning happens outside the lock readers wait on. This beats an
//! `Arc<RwLock<Registry>>`, where a reader would hold the lock for as long as it looks at
//! agents, and does not need `arc-swap`: reads happen once per request and edits are rare, so
//! two locks held for nanoseconds cost nothing measurable.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use crate::{AgentId, AgentKind, AgentSpec, Result, RouterError};

/// The agents of one swarm, by name; see the module header for what it guarantees.
#[derive(Clone, Debug, PartialEq)]
pub struct Registry {
    agents: BTreeMap<AgentId, AgentSpec>,
}

impl Registry {
    /// A registry of `agents`, or the first rule they break.
    pub fn new(agents: impl IntoIterator<Item = AgentSpec>) -> Result<Self> {
        let mut map = BTreeMap::new();
        for spec in agents {
            spec.validate()?;
            if map.contains_key(&spec.name) {
                return Err(RouterError::DuplicateAgent(spec.name));
            }
            map.insert(spec.name.clone(), spec);
        }
        let registry = Self { agents: map };
        registry.check_roles()?;
        Ok(registry)
    }

    /// Adds an agent, unless it is invalid, its name is taken, or it would break a rule
    /// between agents (a second general, router or verifier).
    pub fn add(&mut self, spec: AgentSpec) -> Result<()> {
        spec.validate()?;
        if self.agents.contains_key(&spec.name) {
            return Err(RouterError::DuplicateAgent(spec.name));
        }
        let name = spec.name.clone();
        self.agents.insert(name.clone(), spec);
        // Trying the registry with the agent in it keeps one definition of the rules.
        if let Err(e) = self.check_roles() {
            self.agents.remove(&name);
            return Err(e);
        }
        Ok(())
    }

    /// Removes a specialist and returns it; the general and system agents stay.
    pub fn remove(&mut self, name: &AgentId) -> Result<AgentSpec> {
        let kind = match self.agents.get(name) {
            Some(spec) => spec.kind,
            None => return Err(RouterError::UnknownAgent(name.clone())),
        };
        let reason = match kind {
            AgentKind::Specialist => {
                return Ok(self.agents.remove(name).expect("the agent was just found"))
            }
            AgentKind::General => "it is the fallback for requests no specialist takes",
            AgentKind::Router | AgentKind::Verifier => {
                "system agents are part of how the swarm routes and verifies"
            }
        };
        Err(RouterError::Protected {
            agent: name.clone(),
            reason,
        })
    }

    pub fn get(&self, name: &str) -> Option<&AgentSpec> {
        self.agents.get(name)
    }

    /// Every agent, by name.
    pub fn agents(&self) -> impl Iterator<Item = &AgentSpec> + '_ {
        self.agents.values()
    }

    /// The agents of one kind, by name.
    pub fn list(&self, kind: AgentKind) -> impl Iterator<Item = &AgentSpec> + '_ {
        self.agents().filter(move |a| a.kind == kind)
    }

    /// The fallback agent, which every registry has.
    pub fn general(&self) -> &AgentSpec {
        self.list(AgentKind::General)
            .next()
            .expect("a registry always has its general agent")
    }

    /// Checks every invariant of the module header; `Ok` for every registry this module built.
    pub fn check(&self) -> Result<()> {
        for spec in self.agents() {
            spec.validate()?;
        }
        self.check_roles()
    }

    fn check_roles(&self) -> Result<()> {
        let names = |kind| {
            self.list(kind)
                .map(|a| format!("`{}`", a.name))
                .collect::<Vec<_>>()
        };
        let general = names(AgentKind::General);
        if general.len() != 1 {
            return Err(RouterError::Invariant(format!(
                "a swarm has exactly one general fallback agent, this one has {}{}",
                general.len(),
                listed(&general)
            )));
        }
        for kind in [AgentKind::Router, AgentKind::Verifier] {
            let agents = names(kind);
            if agents.len() > 1 {
                return Err(RouterError::Invariant(format!(
                    "a swarm has at most one {kind} agent, this one has {}{}",
                    agents.len(),
                    listed(&agents)
                )));
            }
        }
        let has_verifier = self.list(AgentKind::Verifier).next().is_some();
        let judged = self.agents().find(|a| {
            a.verifier_policy()
                .is_some_and(|p| p.enabled && p.checks.judge)
        });
        if let (Some(agent), false) = (judged, has_verifier) {
            return Err(RouterError::Invariant(format!(
                "agent `{}` asks for a judge, but the swarm has no verifier agent",
                agent.name
            )));
        }
        Ok(())
    }
}

fn listed(names: &[String]) -> String {
    if names.is_empty() {
        String::new()
    } else {
        format!(" ({})", names.join(", "))
    }
}

/// A registry shared by every request handler; see the module header for the locking scheme.
#[derive(Debug)]
pub struct SharedRegistry {
    current: RwLock<Arc<Registry>>,
    editing: Mutex<()>,
}

impl SharedRegistry {
    pub fn new(registry: Registry) -> Self {
        Self {
            current: RwLock::new(Arc::new(registry)),
            editing: Mutex::new(()),
        }
    }

    /// The registry as it is now; later edits do not change it.
    pub fn snapshot(&self) -> Arc<Registry> {
        // A poisoned lock only means a panic elsewhere while it was held; the critical sections
        // here store or clone one `Arc` and cannot leave it half-written.
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Applies `edit` to a copy of the registry and publishes the copy if `edit` succeeds;
    /// on error nothing changes. `edit` can only use the registry's own methods, so the
    /// published registry keeps every invariant.
    pub fn update<T>(&self, edit: impl FnOnce(&mut Registry) -> Result<T>) -> Result<T> {
        let _one_edit_at_a_time = self.editing.lock().unwrap_or_else(PoisonError::into_inner);
        let mut next = Registry::clone(&self.snapshot());
        let out = edit(&mut next)?;
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(next);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::{VerifierChecks, VerifierPolicy};

    fn id(name: &str) -> AgentId {
        AgentId::new(name).unwrap()
    }

    /// A valid agent of `kind` named `name`.
    fn agent(name: &str, kind: AgentKind) -> AgentSpec {
        let mut spec = AgentSpec::new(id(name), kind);
        match kind {
            AgentKind::Specialist => {
                spec.description = format!("Handles {name} questions.");
                spec.routing_examples = (1..=3).map(|i| format!("{name} question {i}")).collect();
            }
            AgentKind::General => {}
            AgentKind::Router | AgentKind::Verifier => {
                spec.system_prompt = "Answer in one word.".into()
            }
        }
        spec
    }

    fn swarm() -> Registry {
        Registry::new([
            agent("coder", AgentKind::Specialist),
            agent("math", AgentKind::Specialist),
            agent("general", AgentKind::General),
            agent("router", AgentKind::Router),
            agent("verifier", AgentKind::Verifier),
        ])
        .unwrap()
    }

    fn judged(name: &str) -> AgentSpec {
        AgentSpec {
            verifier: Some(VerifierPolicy {
                checks: VerifierChecks {
                    judge: true,
                    ..VerifierChecks::default()
                },
                ..VerifierPolicy::default()
            }),
            ..agent(name, AgentKind::Specialist)
        }
    }

    fn invariant(result: Result<impl std::fmt::Debug>) -> String {
        match result {
            Err(RouterError::Invariant(message)) => message,
            other => panic!("expected an invariant error, got {other:?}"),
        }
    }

    #[test]
    fn agents_are_listed_by_name_and_kind() {
        let registry = swarm();
        let names: Vec<_> = registry.agents().map(|a| a.name.as_str()).collect();
        assert_eq!(names, ["coder", "general", "math", "router", "verifier"]);
        let specialists: Vec<_> = registry
            .list(AgentKind::Specialist)
            .map(|a| a.name.as_str())
            .collect();
        assert_eq!(specialists, ["coder", "math"]);
        assert_eq!(registry.general().name.as_str(), "general");
        assert_eq!(registry.get("math").unwrap().kind, AgentKind::Specialist);
        assert!(registry.get("poet").is_none());
        registry.check().unwrap();
    }

    #[test]
    fn a_swarm_needs_exactly_one_general_agent() {
        let none = Registry::new([agent("coder", AgentKind::Specialist)]);
        assert!(invariant(none).contains("exactly one general"));
        let two = Registry::new([
            agent("general", AgentKind::General),
            agent("fallback", AgentKind::General),
        ]);
        let message = invariant(two);
        assert!(message.contains("`fallback`, `general`"), "{message}");
    }

    #[test]
    fn a_swarm_has_at_most_one_router_and_one_verifier() {
        let mut registry = swarm();
        let message = invariant(registry.add(agent("router2", AgentKind::Router)));
        assert!(message.contains("at most one router"), "{message}");
        invariant(registry.add(agent("judge", AgentKind::Verifier)));
        invariant(registry.add(agent("general2", AgentKind::General)));
        assert_eq!(registry, swarm(), "a refused add changes nothing");
    }

    #[test]
    fn duplicate_names_are_refused() {
        let mut registry = swarm();
        let err = registry.add(agent("math", AgentKind::Specialist));
        assert!(matches!(err, Err(RouterError::DuplicateAgent(n)) if n.as_str() == "math"));
        let err = Registry::new([
            agent("general", AgentKind::General),
            agent("math", AgentKind::Specialist),
            agent("math", AgentKind::Specialist),
        ]);
        assert!(matches!(err, Err(RouterError::DuplicateAgent(_))));
    }

    #[test]
    fn invalid_agents_are_refused_with_their_field() {
        let mut registry = swarm();
        let mut spec = agent("poet", AgentKind::Specialist);
        spec.routing_examples.truncate(2);
        let err = registry.add(spec).unwrap_err().to_string();
        assert!(err.starts_with("agent `poet`: routing_examples"), "{err}");
        assert!(registry.get("poet").is_none());
    }

    #[test]
    fn only_specialists_can_be_removed() {
        let mut registry = swarm();
        assert_eq!(registry.remove(&id("math")).unwrap().name.as_str(), "math");
        for name in ["general", "router", "verifier"] {
            let err = registry.remove(&id(name));
            assert!(
                matches!(&err, Err(RouterError::Protected { agent, .. }) if agent.as_str() == name),
                "{err:?}"
            );
        }
        assert!(matches!(
            registry.remove(&id("math")),
            Err(RouterError::UnknownAgent(_))
        ));
        registry.check().unwrap();
    }

    #[test]
    fn a_judged_agent_needs_a_verifier_agent() {
        let message = invariant(Registry::new([
            agent("general", AgentKind::General),
            judged("coder"),
        ]));
        assert!(message.contains("`coder` asks for a judge"), "{message}");
        let mut registry = swarm();
        registry.add(judged("poet")).unwrap();
        registry.check().unwrap();
    }

    #[derive(Clone, Debug)]
    enum Edit {
        Add(&'static str, AgentKind),
        Remove(&'static str),
    }

    fn edit() -> impl Strategy<Value = Edit> {
        let name = prop::sample::select(vec![
            "coder", "math", "poet", "general", "fallback", "router", "verifier", "judge",
        ]);
        let kind = prop::sample::select(vec![
            AgentKind::Specialist,
            AgentKind::General,
            AgentKind::Router,
            AgentKind::Verifier,
        ]);
        prop_oneof![
            (name.clone(), kind).prop_map(|(n, k)| Edit::Add(n, k)),
            name.prop_map(Edit::Remove),
        ]
    }

    proptest! {
        /// Whatever sequence of adds and removes is attempted, the registry keeps every
        /// invariant, and an edit that fails leaves it exactly as it was.
        #[test]
        fn edits_keep_the_invariants(edits in prop::collection::vec(edit(), 0..40)) {
            let mut registry = Registry::new([agent("general", AgentKind::General)]).unwrap();
            for edit in edits {
                let before = registry.clone();
                let result = match edit {
                    Edit::Add(name, kind) => registry.add(agent(name, kind)),
                    Edit::Remove(name) => registry.remove(&id(name)).map(drop),
                };
                prop_assert!(registry.check().is_ok());
                if result.is_err() {
                    prop_assert_eq!(&registry, &before);
                }
                prop_assert_eq!(registry.list(AgentKind::General).count(), 1);
            }
        }
    }

    #[test]
    fn snapshots_do_not_see_later_edits() {
        let shared = SharedRegistry::new(swarm());
        let before = shared.snapshot();
        shared
            .update(|r| r.add(agent("poet", AgentKind::Specialist)))
            .unwrap();
        assert!(before.get("poet").is_none());
        assert!(shared.snapshot().get("poet").is_some());
    }

    #[test]
    fn a_failed_update_publishes_nothing() {
        let shared = SharedRegistry::new(swarm());
        let err = shared.update(|r| {
            r.add(agent("poet", AgentKind::Specialist))?;
            r.remove(&id("general"))
        });
        assert!(matches!(err, Err(RouterError::Protected { .. })));
        assert!(shared.snapshot().get("poet").is_none());
    }

    #[test]
    fn concurrent_readers_always_see_a_valid_registry() {
        let shared = SharedRegistry::new(swarm());
        let names: Vec<String> = (0..50).map(|i| format!("agent{i}")).collect();
        std::thread::scope(|s| {
            s.spawn(|| {
                for name in &names {
                    shared
                        .update(|r| r.add(agent(name, AgentKind::Specialist)))
                        .unwrap();
                }
            });
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..200 {
                        let snapshot = shared.snapshot();
                        snapshot.check().unwrap();
                    }
                });
            }
        });
        assert_eq!(shared.snapshot().agents().count(), 55);
    }
}
