//! The `embedding` strategy: MiniLM sentence embeddings of the request against each answering
//! agent's description and routing examples.
//!
//! Each agent is represented by its description and each of its routing examples ("anchors"),
//! each as a MiniLM unit vector and as a character n-gram vector ([`super::lexical`]). A
//! request's similarity to an anchor is the cosine of their MiniLM vectors plus
//! [`LEXICAL_WEIGHT`] times that of their n-gram vectors: the hybrid of dense and sparse
//! retrieval, since MiniLM reads English only and misses the literal words of a domain.
//!
//! Two models read those similarities, and the agents' scores are their two distributions
//! averaged ([`RIDGE_SHARE`]):
//! - nearest neighbours: an agent's similarity is the mean of its [`NEIGHBOURS`] highest
//!   anchor similarities, and the distribution is their softmax at [`TEMPERATURE`]. MiniLM's
//!   similarities of unrelated texts crowd together (0.1 to 0.5), so a raw lead says little;
//!   the softmax turns a clear lead into a large share and a near tie into two close ones;
//! - kernel ridge classification ([`super::ridge`]) over every anchor, with the anchor
//!   similarity as its kernel, as a softmax at [`RIDGE_TEMPERATURE`]: it weighs what separates
//!   the agents across all their anchors, where the neighbours follow whichever few anchors
//!   share the request's topic.
//!
//! The result is a distribution over the agents, as the `llm` strategy's, so that the margin
//! means the same for both.
//!
//! Cost: one encoder pass over the request (a few milliseconds per token on the CPU), then per
//! anchor (about 450 for the default swarm) one dot product of 384 floats and one of sparse
//! n-gram vectors, and one product with the ridge coefficients: about a millisecond in all.
//!
//! Registry changes: the anchors are an [`Index`] built for one registry snapshot and cached
//! with it; a request carrying a different snapshot rebuilds the index, re-embedding only the
//! agents whose description or examples changed (the n-gram vectors, whose weights depend on
//! every anchor, are recomputed, and the ridge model refitted: no encoder work, a fraction of a
//! second). A rebuild happens under the cache's lock, so
//! concurrent requests after an edit wait for one rebuild instead of each doing it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use engine::Embedder;

use super::lexical::{NgramIdf, NgramVector};
use super::ridge::Ridge;
use super::{answering_agents, decide, Route};
use crate::verifier::head;
use crate::{AgentId, AgentSpec, Registry, Result, RouterError, RoutingStrategy};

/// The nearest neighbours' half scores an agent by the mean similarity of its this many anchors
/// most similar to the request. Chosen on the development set and on leave-one-out routing of
/// the default swarm's examples: 1 and 3 route both worse (by 1 to 5 points).
pub const NEIGHBOURS: usize = 2;

/// The weight of the n-gram similarity beside MiniLM's (see the module header). Chosen with
/// five-fold cross-validation over the default swarm's examples and the development set: 0.5
/// and 1.0 within half a point of each other, both 4 points above MiniLM alone.
pub const LEXICAL_WEIGHT: f32 = 1.0;

/// The softmax temperature over the nearest neighbours' similarities (see the module header).
pub const TEMPERATURE: f32 = 0.05;

/// The softmax temperature over the ridge model's scores.
pub const RIDGE_TEMPERATURE: f32 = 0.1;

/// Anchors beyond which the ridge model is not fitted (its solve grows with their cube: a few
/// milliseconds for the default swarm's 450, about a second at this bound) and the nearest
/// neighbours score alone.
pub const RIDGE_MAX_ANCHORS: usize = 1500;

/// Characters of a request its n-gram vector reads (MiniLM reads its first 256 tokens).
const QUERY_CHARS: usize = 2000;

/// The ridge model's share of the scores; the nearest neighbours' distribution has the rest.
/// Cross-validated over the default swarm's examples: neighbours alone 75%, ridge alone 80%,
/// half of each 82%; on the development set 97%, 95% and 97%.
pub const RIDGE_SHARE: f32 = 0.5;

/// One agent's anchors and the texts they were computed from.
#[derive(Debug)]
struct AgentAnchors {
    texts: Vec<String>,
    vectors: Vec<Vec<f32>>,
}

/// One agent in an [`Index`]: its anchors and their n-gram vectors under the index's IDF.
#[derive(Debug)]
struct IndexedAgent {
    anchors: Arc<AgentAnchors>,
    ngrams: Vec<NgramVector>,
}

/// The anchors of every answering agent of one registry snapshot.
#[derive(Debug, Default)]
struct Index {
    agents: BTreeMap<AgentId, IndexedAgent>,
    /// The n-gram weights over every anchor of the snapshot.
    idf: NgramIdf,
    /// Fitted over every anchor, the agents in `agents`' order; `None` past
    /// [`RIDGE_MAX_ANCHORS`].
    ridge: Option<Ridge>,
}

/// Routes by embeddings; see the module header. Shared by reference between requests.
pub struct EmbeddingRouter {
    embedder: Arc<Embedder>,
    margin: f32,
    /// The snapshot the index was built for, kept alive so that pointer equality identifies it.
    cache: Mutex<Option<(Arc<Registry>, Arc<Index>)>>,
}

impl EmbeddingRouter {
    pub fn new(embedder: Arc<Embedder>, margin: f32) -> Self {
        Self {
            embedder,
            margin,
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
        let query = Query {
            dense: query.vector,
            ngrams: index.idf.vector(head(text, QUERY_CHARS)),
        };
        let similarities: Vec<Vec<f32>> = index
            .agents
            .values()
            .map(|agent| agent.similarities(&query))
            .collect();
        let neighbours: Vec<f32> = similarities.iter().map(|s| nearest(s)).collect();
        let mut shares = softmax(&neighbours, TEMPERATURE);
        if let Some(ridge) = &index.ridge {
            let ridge = softmax(&ridge.scores(&similarities.concat()), RIDGE_TEMPERATURE);
            for (share, r) in shares.iter_mut().zip(ridge) {
                *share = (1.0 - RIDGE_SHARE) * *share + RIDGE_SHARE * r;
            }
        }
        let scores = index.agents.keys().cloned().zip(shares).collect();
        Ok(Route {
            agent: decide(registry, &scores, self.margin),
            strategy: RoutingStrategy::Embedding,
            scores,
            usage,
        })
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
        let mut anchors = BTreeMap::new();
        for spec in answering_agents(registry) {
            let texts = anchor_texts(spec);
            let kept = previous.agents.get(&spec.name).map(|a| &a.anchors);
            let agent = match kept {
                Some(kept) if kept.texts == texts => kept.clone(),
                _ => Arc::new(self.anchors(texts)?),
            };
            anchors.insert(spec.name.clone(), agent);
        }
        let idf = NgramIdf::fit(
            anchors
                .values()
                .flat_map(|a| a.texts.iter().map(String::as_str)),
        );
        let agents: BTreeMap<AgentId, IndexedAgent> = anchors
            .into_iter()
            .map(|(name, anchors)| {
                let ngrams = anchors.texts.iter().map(|t| idf.vector(t)).collect();
                (name, IndexedAgent { anchors, ngrams })
            })
            .collect();
        let ridge = fit_ridge(&agents)?;
        let index = Arc::new(Index { agents, idf, ridge });
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
        Ok(AgentAnchors { texts, vectors })
    }
}

impl IndexedAgent {
    /// The query's similarity to each of this agent's anchors: MiniLM cosine plus
    /// [`LEXICAL_WEIGHT`] times n-gram cosine.
    fn similarities(&self, query: &Query) -> Vec<f32> {
        self.anchors
            .vectors
            .iter()
            .zip(&self.ngrams)
            .map(|(v, n)| dot(&query.dense, v) + LEXICAL_WEIGHT * query.ngrams.dot(n))
            .collect()
    }
}

/// The mean of the [`NEIGHBOURS`] highest of an agent's anchor similarities.
fn nearest(similarities: &[f32]) -> f32 {
    let mut similar = similarities.to_vec();
    similar.sort_by(|a, b| b.total_cmp(a));
    let k = NEIGHBOURS.clamp(1, similar.len().max(1));
    similar.iter().take(k).sum::<f32>() / k as f32
}

/// The ridge model over every anchor of `agents`, with the similarity of
/// [`IndexedAgent::similarities`] as its kernel; `None` past [`RIDGE_MAX_ANCHORS`].
fn fit_ridge(agents: &BTreeMap<AgentId, IndexedAgent>) -> Result<Option<Ridge>> {
    let anchors: Vec<(&[f32], &NgramVector, usize)> = agents
        .values()
        .enumerate()
        .flat_map(|(class, agent)| {
            agent
                .anchors
                .vectors
                .iter()
                .zip(&agent.ngrams)
                .map(move |(v, n)| (v.as_slice(), n, class))
        })
        .collect();
    let n = anchors.len();
    if n > RIDGE_MAX_ANCHORS {
        return Ok(None);
    }
    let mut kernel = vec![0.0f64; n * n];
    for (i, (vi, ni, _)) in anchors.iter().enumerate() {
        for (j, (vj, nj, _)) in anchors.iter().enumerate().take(i + 1) {
            let k = f64::from(dot(vi, vj) + LEXICAL_WEIGHT * ni.dot(nj));
            kernel[i * n + j] = k;
            kernel[j * n + i] = k;
        }
    }
    let labels: Vec<usize> = anchors.iter().map(|a| a.2).collect();
    Ridge::fit(&kernel, &labels, agents.len())
        .map(Some)
        .ok_or_else(|| {
            RouterError::Invariant(
                "the routing anchors' similarity matrix is not positive definite".into(),
            )
        })
}

/// A request as the index compares it.
struct Query {
    dense: Vec<f32>,
    ngrams: NgramVector,
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
        EmbeddingRouter::new(minilm(), margin)
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

    /// The held-out set (`tests/data/routing-heldout.jsonl`, 40 requests per answering agent,
    /// 15% of them in French, Spanish, German, Italian or Portuguese) was written apart from
    /// the swarm's examples and the development set, and nothing was tuned on it.
    #[test]
    fn the_default_swarm_routes_the_held_out_set_at_92_percent() {
        #[derive(serde::Deserialize)]
        struct Labelled {
            query: String,
            agent: String,
        }
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/routing-heldout.jsonl"
        );
        let labelled: Vec<Labelled> = std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        assert_eq!(labelled.len(), 240);
        let registry = Arc::new(default_registry());
        let router = router(0.05);
        let mut wrong = Vec::new();
        for item in &labelled {
            let route = router.route(&registry, &item.query).unwrap();
            if route.agent.as_str() != item.agent {
                wrong.push(format!("{} -> {}: {}", item.agent, route.agent, item.query));
            }
        }
        let accuracy = 1.0 - wrong.len() as f64 / labelled.len() as f64;
        assert!(accuracy >= 0.92, "{accuracy:.3}: {wrong:#?}");
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
    fn anchor_similarity_adds_the_weighted_ngram_cosine_and_neighbours_take_the_top_k() {
        let texts = ["alpha", "beta", "gamma"];
        let idf = NgramIdf::fit(texts);
        let agent = IndexedAgent {
            ngrams: texts.iter().map(|t| idf.vector(t)).collect(),
            anchors: Arc::new(AgentAnchors {
                texts: texts.map(String::from).to_vec(),
                vectors: vec![vec![1.0, 0.0], vec![0.0, 1.0], vec![-1.0, 0.0]],
            }),
        };
        // MiniLM similarities 0.6, 0.8, -0.6; n-gram similarities 0, 1, 0 (the query's text is
        // the second anchor's, which shares no n-gram with the others).
        let query = Query {
            dense: vec![0.6, 0.8],
            ngrams: idf.vector("beta"),
        };
        let similarities = agent.similarities(&query);
        let w = LEXICAL_WEIGHT;
        for (found, wanted) in similarities.iter().zip([0.6, 0.8 + w, -0.6]) {
            assert!((found - wanted).abs() < 1e-6, "{similarities:?}");
        }
        assert!((nearest(&similarities) - (1.4 + w) / 2.0).abs() < 1e-6);
        assert_eq!(nearest(&[0.3]), 0.3);
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
