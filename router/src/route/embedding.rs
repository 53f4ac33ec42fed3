//! The `embedding` strategy: MiniLM sentence embeddings of the request against each answering
//! agent's description and routing examples.
//!
//! Each agent is represented by the unit vectors of its description and of each routing
//! example ("anchors"). A request's similarity to an agent depends on [`Method`]: the mean of
//! its `k` highest cosine similarities with the agent's anchors (k-nearest neighbours), or its
//! cosine similarity with the agent's centroid (the normalised mean of its anchors). The scores
//! are the softmax of the similarities at [`TEMPERATURE`]: a distribution over the agents, as
//! the `llm` strategy's, so that the margin means the same for both. MiniLM's similarities of
//! unrelated texts crowd together (0.1 to 0.5), so a raw cosine lead says little; the softmax
//! turns a clear lead into a large share and a near tie into two close ones.
//!
//! Cost: one encoder pass over the request (a few milliseconds per token on the CPU), then one
//! dot product of 384 floats per anchor (about a hundred for the default swarm: nothing).
//!
//! Registry changes: the anchors are an [`Index`] built for one registry snapshot and cached
//! with it; a request carrying a different snapshot rebuilds the index, re-embedding only the
//! agents whose description or examples changed. A rebuild happens under the cache's lock, so
//! concurrent requests after an edit wait for one rebuild instead of each doing it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use engine::Embedder;

use super::{answering_agents, decide, Route};
use crate::{AgentId, AgentSpec, Registry, Result, RoutingStrategy};

/// How a request's similarity to an agent's anchors becomes the agent's score.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// Similarity to the normalised mean of the agent's anchors.
    Centroid,
    /// Mean similarity to the agent's `k` most similar anchors.
    Nearest { k: usize },
}

/// The method that routes the development set best (see `swarmgate eval routing`): better than
/// the centroid by 4 points, with k = 1 and k = 3 within a point of it.
pub const DEFAULT_METHOD: Method = Method::Nearest { k: 2 };

/// The softmax temperature over cosine similarities (see the module header).
pub const TEMPERATURE: f32 = 0.05;

/// One agent's anchors and the texts they were computed from.
#[derive(Debug)]
struct AgentAnchors {
    texts: Vec<String>,
    vectors: Vec<Vec<f32>>,
    centroid: Vec<f32>,
}

/// The anchors of every answering agent of one registry snapshot.
#[derive(Debug, Default)]
struct Index {
    agents: BTreeMap<AgentId, Arc<AgentAnchors>>,
}

/// Routes by embeddings; see the module header. Shared by reference between requests.
pub struct EmbeddingRouter {
    embedder: Arc<Embedder>,
    margin: f32,
    method: Method,
    /// The snapshot the index was built for, kept alive so that pointer equality identifies it.
    cache: Mutex<Option<(Arc<Registry>, Arc<Index>)>>,
}

impl EmbeddingRouter {
    pub fn new(embedder: Arc<Embedder>, margin: f32, method: Method) -> Self {
        Self {
            embedder,
            margin,
            method,
            cache: Mutex::new(None),
        }
    }

    pub fn margin(&self) -> f32 {
        self.margin
    }

    /// Builds the index for `registry` now rather than on the first request. Blocking.
    pub fn prepare(&self, registry: &Arc<Registry>) -> Result<()> {
        self.index(registry).map(drop)
    }

    /// Routes `text` (a request's last user turn) among `registry`'s answering agents.
    /// Blocking: it runs the encoder.
    pub fn route(&self, registry: &Arc<Registry>, text: &str) -> Result<Route> {
        let index = self.index(registry)?;
        let query = self
            .embedder
            .embed(&[text])?
            .pop()
            .expect("one embedding per input");
        let usage = engine::Usage {
            prompt_tokens: query.tokens,
            ..engine::Usage::default()
        };
        let query = query.vector;
        let similarities: Vec<f32> = index
            .agents
            .values()
            .map(|anchors| self.similarity(&query, anchors))
            .collect();
        let scores = index
            .agents
            .keys()
            .cloned()
            .zip(softmax(&similarities, TEMPERATURE))
            .collect();
        Ok(Route {
            agent: decide(registry, &scores, self.margin),
            strategy: RoutingStrategy::Embedding,
            scores,
            usage,
        })
    }

    fn similarity(&self, query: &[f32], anchors: &AgentAnchors) -> f32 {
        match self.method {
            Method::Centroid => dot(query, &anchors.centroid),
            Method::Nearest { k } => {
                let mut similar: Vec<f32> = anchors.vectors.iter().map(|v| dot(query, v)).collect();
                similar.sort_by(|a, b| b.total_cmp(a));
                let k = k.clamp(1, similar.len().max(1));
                similar.iter().take(k).sum::<f32>() / k as f32
            }
        }
    }

    /// The index for `registry`, from the cache or rebuilt.
    fn index(&self, registry: &Arc<Registry>) -> Result<Arc<Index>> {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((built_for, index)) = cache.as_ref() {
            if Arc::ptr_eq(built_for, registry) {
                return Ok(index.clone());
            }
        }
        let previous = cache.take().map(|(_, index)| index).unwrap_or_default();
        let mut agents = BTreeMap::new();
        for spec in answering_agents(registry) {
            let texts = anchor_texts(spec);
            let anchors = match previous.agents.get(&spec.name) {
                Some(kept) if kept.texts == texts => kept.clone(),
                _ => Arc::new(self.anchors(texts)?),
            };
            agents.insert(spec.name.clone(), anchors);
        }
        let index = Arc::new(Index { agents });
        *cache = Some((registry.clone(), index.clone()));
        Ok(index)
    }

    fn anchors(&self, texts: Vec<String>) -> Result<AgentAnchors> {
        let vectors: Vec<Vec<f32>> = self
            .embedder
            .embed(&texts)?
            .into_iter()
            .map(|e| e.vector)
            .collect();
        let mut centroid = vec![0.0; self.embedder.dimensions()];
        for vector in &vectors {
            for (c, x) in centroid.iter_mut().zip(vector) {
                *c += x;
            }
        }
        let norm = dot(&centroid, &centroid).sqrt();
        if norm > 0.0 {
            centroid.iter_mut().for_each(|c| *c /= norm);
        }
        Ok(AgentAnchors {
            texts,
            vectors,
            centroid,
        })
    }
}

/// What an agent is represented by: its description and its routing examples.
fn anchor_texts(spec: &AgentSpec) -> Vec<String> {
    let description = spec.description.trim();
    (!description.is_empty())
        .then(|| description.to_owned())
        .into_iter()
        .chain(spec.routing_examples.iter().cloned())
        .collect()
}

/// `exp(x / temperature)`, normalised to sum to one.
fn softmax(values: &[f32], temperature: f32) -> Vec<f32> {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f32> = values
        .iter()
        .map(|v| ((v - max) / temperature).exp())
        .collect();
    let total: f32 = weights.iter().sum();
    weights.into_iter().map(|w| w / total).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::test_support::{default_registry, minilm};
    use crate::{AgentKind, SharedRegistry};

    fn router(margin: f32) -> EmbeddingRouter {
        EmbeddingRouter::new(minilm(), margin, DEFAULT_METHOD)
    }

    #[test]
    fn obvious_requests_go_to_their_specialist_with_scores_for_every_agent() {
        let registry = Arc::new(default_registry());
        let router = router(0.05);
        for (text, agent) in [
            (
                "My Go program panics with a nil pointer dereference in the HTTP handler",
                "coder",
            ),
            ("What is the integral of x^2 from 0 to 3?", "math"),
            ("My order arrived damaged, I want a refund", "support"),
        ] {
            let route = router.route(&registry, text).unwrap();
            assert_eq!(route.agent.as_str(), agent, "{text}: {route:?}");
            assert_eq!(route.strategy, RoutingStrategy::Embedding);
            let names: Vec<_> = route.scores.keys().map(AgentId::as_str).collect();
            assert_eq!(
                names,
                ["analyst", "coder", "general", "math", "support", "writer"]
            );
            assert!(route.scores.values().all(|s| (0.0..=1.0).contains(s)));
            let total: f32 = route.scores.values().sum();
            assert!((total - 1.0).abs() < 1e-4, "{route:?}");
            assert_eq!(
                route
                    .scores
                    .iter()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .unwrap()
                    .0,
                &route.agent
            );
        }
    }

    #[test]
    fn a_close_call_goes_to_general() {
        let registry = Arc::new(default_registry());
        let text = "Write a poem about debugging a SQL query";
        let route = router(0.05).route(&registry, text).unwrap();
        // With a margin above every lead, only general can take it.
        let route_strict = router(0.99).route(&registry, text).unwrap();
        assert_eq!(route_strict.agent.as_str(), "general", "{route:?}");
        assert_eq!(route_strict.scores, route.scores);
        // Small talk has no specialist at all.
        let route = router(0.05)
            .route(&registry, "hello, how are you today?")
            .unwrap();
        assert_eq!(route.agent.as_str(), "general", "{route:?}");
    }

    #[test]
    fn the_index_follows_registry_edits() {
        let shared = SharedRegistry::new(default_registry());
        let router = router(0.05);
        let text = "Which wine goes with grilled salmon?";
        let before = router.route(&shared.snapshot(), text).unwrap();
        assert_ne!(before.agent.as_str(), "sommelier");
        let mut sommelier =
            AgentSpec::new(AgentId::new("sommelier").unwrap(), AgentKind::Specialist);
        sommelier.description =
            "Wine pairing and wine recommendations for food and occasions.".into();
        sommelier.routing_examples = vec![
            "Which red wine goes with a beef stew?".into(),
            "Suggest a white wine for a seafood dinner.".into(),
            "What should I serve with a cheese board?".into(),
        ];
        shared.update(|r| r.add(sommelier)).unwrap();
        let after = router.route(&shared.snapshot(), text).unwrap();
        assert_eq!(after.agent.as_str(), "sommelier", "{after:?}");
        shared
            .update(|r| r.remove(&AgentId::new("sommelier").unwrap()))
            .unwrap();
        let removed = router.route(&shared.snapshot(), text).unwrap();
        assert!(!removed.scores.contains_key("sommelier"));
        assert_eq!(
            removed.scores, before.scores,
            "unchanged agents keep their anchors"
        );
    }

    #[test]
    fn scoring_methods() {
        let anchors = AgentAnchors {
            texts: vec![],
            vectors: vec![vec![1.0, 0.0], vec![0.0, 1.0], vec![-1.0, 0.0]],
            centroid: vec![0.0, 1.0],
        };
        let query = [0.6, 0.8];
        let score =
            |method| EmbeddingRouter::new(minilm(), 0.0, method).similarity(&query, &anchors);
        assert!((score(Method::Nearest { k: 1 }) - 0.8).abs() < 1e-6);
        assert!((score(Method::Nearest { k: 2 }) - 0.7).abs() < 1e-6);
        assert!((score(Method::Centroid) - 0.8).abs() < 1e-6);
        assert!((score(Method::Nearest { k: 3 }) - 0.8 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn softmax_sharpens_a_lead_and_keeps_a_tie() {
        let shares = softmax(&[0.5, 0.4, 0.4], 0.05);
        assert!((shares.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        // A lead of 0.1 in cosine is e^2 (7.4) times the share.
        assert!(
            (shares[0] / shares[1] - 2f32.exp()).abs() < 1e-3,
            "{shares:?}"
        );
        assert_eq!(shares[1], shares[2]);
    }
}
