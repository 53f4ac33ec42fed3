//! Agents' system prompts kept warm: every answering agent's [`AgentSpec::system_prefix`] is
//! prefilled once and its full KV blocks pinned on the device, so that each of the agent's
//! requests starts with a prefix-cache hit, however much other traffic went through the cache
//! meanwhile.
//!
//! Pins are taken when the swarm is loaded and when an agent is added, and released when it is
//! removed; [`Pins::sync`] brings them in step with a swarm reloaded from the agent store.
//! Agents with the same system prompt share its blocks (the cache keys blocks by content), so
//! pinning one prompt twice costs nothing more.
//!
//! Invariant: the pinned prefixes together never take more than [`SHARE_DENOMINATOR`]⁻¹ of the
//! device's KV capacity, so that pins can never starve the requests they are meant to speed up;
//! an agent whose prompt does not fit in what is left stays unpinned (and is logged), and serves
//! as any other request would, from whatever the cache holds.

use std::collections::BTreeMap;

use engine::{EngineHandle, PrefixPin, Prompt};
use tokio::sync::Mutex;

use crate::{AgentId, AgentSpec};

/// Pins may take at most 1/`SHARE_DENOMINATOR` of the device KV capacity.
pub const SHARE_DENOMINATOR: usize = 2;

/// The pinned prefix of each agent that has one. Pinning is serialized (one lock, held while
/// the prefills run), so the share is never overcommitted by two edits at once.
pub struct Pins {
    engine: EngineHandle,
    pinned: Mutex<BTreeMap<AgentId, Pinned>>,
}

/// One agent's pin, and the system prompt it holds.
struct Pinned {
    prompt: String,
    pin: PrefixPin,
}

impl Pins {
    pub fn new(engine: EngineHandle) -> Self {
        Self {
            engine,
            pinned: Mutex::new(BTreeMap::new()),
        }
    }

    /// Pins each of `agents`' system prompts, replacing earlier pins of the same names, and
    /// waits until they are prefilled (together, in shared engine steps) and pinned. Returns
    /// the tokens pinned. An agent without a system prompt, or whose prompt does not fit in the
    /// share left (see the module header), stays unpinned.
    pub async fn pin(&self, agents: &[&AgentSpec]) -> engine::Result<usize> {
        let mut pinned = self.pinned.lock().await;
        self.pin_locked(&mut pinned, agents).await
    }

    /// Makes the pins those of exactly `agents`: releases the pins of agents not among them,
    /// and pins those whose system prompt is not pinned yet (new agents, changed prompts).
    /// Returns the tokens newly pinned.
    pub async fn sync(&self, agents: &[&AgentSpec]) -> engine::Result<usize> {
        let mut pinned = self.pinned.lock().await;
        pinned.retain(|name, _| agents.iter().any(|a| a.name == *name));
        let changed: Vec<&AgentSpec> = agents
            .iter()
            .copied()
            .filter(|a| {
                pinned
                    .get(&a.name)
                    .is_none_or(|p| p.prompt != a.system_prompt)
            })
            .collect();
        self.pin_locked(&mut pinned, &changed).await
    }

    async fn pin_locked(
        &self,
        pinned: &mut BTreeMap<AgentId, Pinned>,
        agents: &[&AgentSpec],
    ) -> engine::Result<usize> {
        // The models share one pool: so does the share.
        let share = self.engine.model().kv_capacity_tokens / SHARE_DENOMINATOR;
        let mut warming = Vec::new();
        for agent in agents {
            pinned.remove(&agent.name);
            // An agent on a model this engine does not serve runs elsewhere.
            let model = agent.model_among(self.engine.models());
            let Some(prefix) = model.and_then(|model| agent.system_prefix(model)) else {
                continue;
            };
            let model = model.map(|m| m.id.as_str());
            // Tokenized once here: the share check needs the length, the engine the ids.
            let ids = prefix?;
            let tokens = ids.len();
            let taken: usize = pinned
                .values()
                .map(|p| &p.pin)
                .chain(warming.iter().map(|(_, pin)| pin))
                .map(PrefixPin::tokens)
                .sum();
            if taken + tokens > share {
                tracing::warn!(
                    agent = %agent.name,
                    tokens,
                    taken,
                    share,
                    "system prompt not pinned: the pinned share of the KV cache is full"
                );
                continue;
            }
            let pin = self.engine.pin_prefix(model, &Prompt::Tokens(ids))?;
            warming.push((*agent, pin));
        }
        let mut total = 0;
        for (agent, mut pin) in warming {
            if pin.pinned().await == 0 {
                // Shorter than a block, or its prefill failed: nothing is kept warm.
                tracing::warn!(agent = %agent.name, "system prompt not pinned");
                continue;
            }
            total += pin.tokens();
            let prompt = agent.system_prompt.clone();
            pinned.insert(agent.name.clone(), Pinned { prompt, pin });
        }
        Ok(total)
    }

    /// Releases `agent`'s pin, if it has one.
    pub async fn unpin(&self, agent: &str) {
        self.pinned.lock().await.remove(agent);
    }

    /// Tokens of `agent`'s pinned prefix (only its full blocks are pinned); 0 when it has none.
    pub async fn tokens(&self, agent: &str) -> usize {
        self.pinned
            .lock()
            .await
            .get(agent)
            .map_or(0, |p| p.pin.tokens())
    }

    /// The agents whose system prompts are pinned.
    pub async fn warm(&self) -> Vec<String> {
        let pinned = self.pinned.lock().await;
        pinned.keys().map(ToString::to_string).collect()
    }
}
