//! Consensus: one request answered by several samples that run together, and one answer kept.
//!
//! The samples are `n` answers of the routed agent (each with its own seed when the request has
//! one) or one answer from each agent the request names. They are submitted at once, so the
//! engine schedules them into the same steps: three samples cost about the time of one, not
//! three. `majority` keeps the answer most samples agree on, compared after normalising case,
//! punctuation and spacing (ties go to the earlier sample) and then verified as any answer
//! is; `best_of_verifier` verifies every sample and keeps the best (a pass before a failure,
//! then the higher score). Consensus never retries: its samples already are the second
//! opinions.

use router::{AgentSpec, Registry};

use crate::api::swarm::{ConsensusReport, ConsensusSample, VerdictReport};
use crate::api::ChatCompletionRequest;
use crate::error::ApiError;
use crate::service::swarm::run::{skipped, verdict_report, Generated, Outcome, Run};

/// Most samples one request may ask for: each is a sequence in the engine.
pub const MAX_SAMPLES: usize = 8;

/// Samples when the request names neither `n` nor agents.
const DEFAULT_SAMPLES: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    Majority,
    BestOfVerifier,
}

impl Strategy {
    fn as_str(self) -> &'static str {
        match self {
            Self::Majority => "majority",
            Self::BestOfVerifier => "best_of_verifier",
        }
    }
}

/// A request's valid `swarm.consensus`.
#[derive(Debug)]
pub(crate) struct Consensus {
    strategy: Strategy,
    n: usize,
    /// The named agents, one sample each; `None` for `n` samples of the routed agent.
    agents: Option<Vec<AgentSpec>>,
}

impl Consensus {
    /// The request's consensus, if it asks for one; a 400 naming the field when it is invalid.
    pub fn from_request(
        request: &ChatCompletionRequest,
        registry: &Registry,
    ) -> Result<Option<Self>, ApiError> {
        let Some(options) = request.swarm.as_ref().and_then(|s| s.consensus.as_ref()) else {
            return Ok(None);
        };
        let strategy = match options.strategy.as_deref() {
            None | Some("majority") => Strategy::Majority,
            Some("best_of_verifier") => Strategy::BestOfVerifier,
            Some(other) => {
                return Err(ApiError::invalid(
                    "swarm.consensus.strategy",
                    format!("{other:?} is not one of \"majority\", \"best_of_verifier\""),
                ))
            }
        };
        let agents = match &options.agents {
            None => None,
            Some(names) => Some(
                names
                    .iter()
                    .enumerate()
                    .map(|(i, name)| {
                        registry
                            .get(name)
                            .filter(|a| !a.kind.is_system())
                            .cloned()
                            .ok_or_else(|| {
                                ApiError::invalid(
                                    format!("swarm.consensus.agents[{i}]"),
                                    format!("{name:?} is not an agent that answers"),
                                )
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let named = agents.as_ref().map(Vec::len);
        let n = match (options.n, named) {
            (None, None) => DEFAULT_SAMPLES,
            (None, Some(count)) => count,
            (Some(n), Some(count)) if n != count as i64 => {
                return Err(ApiError::invalid(
                    "swarm.consensus.n",
                    format!("n is {n} but {count} agents are named; leave n out"),
                ))
            }
            (Some(n), _) => usize::try_from(n).unwrap_or(0),
        };
        if !(2..=MAX_SAMPLES).contains(&n) {
            return Err(ApiError::invalid(
                "swarm.consensus.n",
                format!("a consensus takes 2 to {MAX_SAMPLES} samples, not {n}"),
            ));
        }
        Ok(Some(Self {
            strategy,
            n,
            agents,
        }))
    }

    /// How many samples run side by side.
    pub fn width(&self) -> usize {
        self.n
    }

    /// Runs the samples together and keeps one; `routed` is the agent the request went to.
    pub async fn run(
        self,
        run: &mut Run,
        request: &ChatCompletionRequest,
        routed: AgentSpec,
    ) -> Result<Outcome, ApiError> {
        let agents = self.agents.unwrap_or_else(|| vec![routed; self.n]);
        let mut prepared = Vec::with_capacity(agents.len());
        for (j, agent) in agents.iter().enumerate() {
            let mut valid = run.prepare(agent, request, &[]).await?;
            if let Some(seed) = &mut valid.generate.sampling.seed {
                *seed = seed.wrapping_add(j as u64);
            }
            prepared.push((agent, valid));
        }
        let answers = run.generate(&prepared, 1).await?;
        let keys: Vec<String> = answers.iter().map(|a| normalise(&a.text)).collect();
        let votes: Vec<usize> = keys
            .iter()
            .map(|k| keys.iter().filter(|other| *other == k).count())
            .collect();
        let mut scores = vec![None; answers.len()];
        let (chosen, verdict) = match self.strategy {
            Strategy::Majority => {
                let most = votes.iter().copied().max().unwrap_or(0);
                let chosen = votes.iter().position(|&v| v == most).unwrap_or(0);
                let verdict = verified(run, &agents[chosen], &answers[chosen], chosen, false).await;
                (chosen, verdict)
            }
            Strategy::BestOfVerifier => {
                let mut verdicts = Vec::with_capacity(answers.len());
                for (j, answer) in answers.iter().enumerate() {
                    let verdict = verified(run, &agents[j], answer, j, true).await;
                    scores[j] = verdict.score;
                    verdicts.push(verdict);
                }
                let chosen = best(&verdicts);
                (chosen, verdicts.swap_remove(chosen))
            }
        };
        let samples = answers
            .iter()
            .zip(&agents)
            .zip(votes.iter().zip(&scores))
            .map(|((answer, agent), (&votes, &score))| ConsensusSample {
                agent: agent.name.to_string(),
                content: answer.text.clone(),
                votes,
                score,
            })
            .collect();
        let mut answers = answers;
        let answer = answers.swap_remove(chosen);
        Ok(Outcome {
            agent: agents[chosen].clone(),
            text: answer.text,
            finish_reason: answer.finish_reason,
            verdict: VerdictReport {
                attempts: self.n as u32,
                ..verdict
            },
            consensus: Some(ConsensusReport {
                strategy: self.strategy.as_str().into(),
                chosen,
                samples,
            }),
        })
    }
}

/// `answer`'s verdict under `agent`'s checks (sample `index`); skipped when the verifier cannot
/// run, or when the agent's policy does not verify and `always` is not set.
async fn verified(
    run: &mut Run,
    agent: &AgentSpec,
    answer: &Generated,
    index: usize,
    always: bool,
) -> VerdictReport {
    let policy = agent.verifier_policy().unwrap_or_default();
    let attempt = index as u32 + 1;
    let report = if policy.enabled || always {
        match run.verify(&policy.checks, answer, attempt).await {
            Ok(verdict) => verdict_report(&verdict, attempt),
            Err(e) => skipped(attempt, vec![format!("verifier: {e}")]),
        }
    } else {
        skipped(attempt, Vec::new())
    };
    run.state
        .metrics()
        .agent_verdict(agent.name.as_str(), &report.status);
    report
}

/// The index of the best verdict: a pass before a failure, then the higher score; ties keep
/// the earlier sample.
fn best(verdicts: &[VerdictReport]) -> usize {
    let rank = |v: &VerdictReport| (u8::from(v.status == "passed"), v.score.unwrap_or(0.0));
    (0..verdicts.len())
        .reduce(|best, j| {
            let (a, b) = (rank(&verdicts[best]), rank(&verdicts[j]));
            if b.0.cmp(&a.0).then(b.1.total_cmp(&a.1)).is_gt() {
                j
            } else {
                best
            }
        })
        .unwrap_or(0)
}

/// An answer as votes compare it: lowercase words of letters and digits, single-spaced.
fn normalise(text: &str) -> String {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_that_differ_only_in_form_vote_together() {
        assert_eq!(
            normalise("The answer is 42."),
            normalise("the answer is  42")
        );
        assert_eq!(normalise("**42**\n"), "42");
        assert_ne!(normalise("42"), normalise("43"));
    }

    #[test]
    fn the_best_verdict_is_a_pass_then_the_higher_score_then_the_earlier() {
        let verdict = |status: &str, score: f32| VerdictReport {
            status: status.into(),
            score: Some(score),
            reasons: Vec::new(),
            attempts: 1,
            escalated: false,
        };
        let verdicts = [
            verdict("failed", 0.9),
            verdict("passed", 0.4),
            verdict("passed", 0.7),
            verdict("passed", 0.7),
        ];
        assert_eq!(best(&verdicts), 2);
        assert_eq!(best(&verdicts[..2]), 1);
        assert_eq!(best(&verdicts[..1]), 0);
    }
}
