//! A chat request to the swarm (`model: "swarm"`, `"auto"` or an agent's name), from the
//! routing decision to the released answer.
//!
//! 1. **Route.** `swarm`/`auto` asks the routing agent which answering agent takes the
//!    conversation's last user turn; an agent's name skips routing.
//! 2. **Answer as the agent.** The agent's system prompt goes first (so every prompt of the agent
//!    starts with the tokens its pin keeps warm, [`router::AgentSpec::system_prefix`]), its
//!    sampling defaults fill what the request left out, and the request is validated like any
//!    chat request. Each generation is charged to the agent's token budget as well as the
//!    caller's, and counted in the agent's metrics.
//! 3. **Verify, then release.** The agent's verifier policy checks the answer. A rejected answer
//!    is generated again ([`OnFailure::Retry`]): the same conversation, then the rejected answer
//!    and the verifier's critique, with a new seed; the retry's prompt starts with the first
//!    attempt's, so the prefix cache serves it. A JSON failure also turns on JSON-constrained
//!    decoding for the retry. [`OnFailure::EscalateToGeneral`] hands the request to the general
//!    agent instead. After the last try the answer is released marked `failed`; a retry that
//!    cannot run (a budget, the context) releases the answer it had. A verifier that fails
//!    releases the answer as `skipped`, with the reason.
//! 4. **Consensus** (`swarm.consensus`): `n` samples, or one per named agent, submitted together
//!    so that they share the engine's steps; the majority's answer or the verifier's best
//!    ([`crate::service::swarm::consensus`]).
//! 5. **Account.** Every hop (route, each generation, each verification) is listed with its
//!    tokens in `swarm.usage`, and `usage` is their sum.
//!
//! Streams: when the answer is verified before release (`stream_mode = "buffer"`, and always
//! for consensus) the stream starts once the verdict is in, and its first chunk carries the
//! whole `swarm` object. Otherwise (`provisional`, or no verification) tokens flow as they come,
//! the first chunk names the agent, and a last chunk before `[DONE]` carries the verdict and the
//! hops ([`crate::http::swarm_chat`] sends them).

use engine::FinishReason;
use router::{AgentKind, AgentSpec, OnFailure, Registry, Verdict, VerifierChecks, VerifierPolicy};

use crate::api::swarm::{HopUsage, RouteRequest, SwarmReport, VerdictReport};
use crate::api::{self, ChatCompletionRequest, ChatMessage, MessageContent, Stop};
use crate::error::ApiError;
use crate::limits::{Admission, Seats};
use crate::service::admission::{AdmittedEngine, Events};
use crate::service::choices::{Choices, Collected};
use crate::service::swarm::consensus::Consensus;
use crate::service::swarm::{route_response, Swarm, AUTO_MODEL, SWARM_MODEL};
use crate::service::verify::{deterministic, similarity};
use crate::service::AppState;
use crate::session::Turn;
use crate::validate::structured::{self, Reply};
use crate::validate::swarm::validate_route;
use crate::validate::{off_io, validate_chat, ValidChatRequest};

/// Characters of a rejected answer repeated in the retry's prompt.
const REJECTED_ANSWER_CHARS: usize = 2000;

/// The answer the pipeline hands to its endpoint to send (one per request, moved once: the
/// variants' sizes cost nothing).
#[allow(clippy::large_enum_variant)]
pub enum Answered {
    /// Released: verified when the policy verifies, and already kept as the session's turn.
    Whole {
        run: Run,
        report: SwarmReport,
        outcome: Outcome,
        stream: bool,
        include_usage: bool,
        reply: Reply,
    },
    /// To stream as it is generated, verified once done; kept as `turn` when it ends.
    Live {
        run: Run,
        report: SwarmReport,
        live: Live,
        turn: Turn,
    },
}

/// An answer to stream as it is generated.
pub struct Live {
    pub agent: AgentSpec,
    /// How the answer is verified once it is done.
    pub policy: VerifierPolicy,
    pub valid: ValidChatRequest,
    /// The generation's events.
    pub events: Events,
}

/// Answers `request`, which [`Swarm::answers`], as `turn` of its session: the released answer
/// is the one the session keeps.
pub async fn create(
    state: AppState,
    admission: Admission,
    swarm: Swarm,
    request: ChatCompletionRequest,
    turn: Turn,
    run_key: Option<String>,
) -> Result<Answered, ApiError> {
    if request.options.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            "n",
            "the swarm returns one answer; ask for several samples with swarm.consensus",
        ));
    }
    let consensus = Consensus::from_request(&request, swarm.registry().snapshot().as_ref())?;
    let question = validate_route(RouteRequest {
        messages: request.messages.clone(),
        strategy: None,
    })?
    .text;
    // Every hop runs in these seats: the samples side by side, the router and the verifier
    // one at a time between them.
    let seats = admission
        .reserve(&state, consensus.as_ref().map_or(1, Consensus::width))
        .await?;
    let mut run = Run::new(state, admission, seats, question);
    run.run_key = run_key;
    let registry = swarm.registry().snapshot();
    let (agent, route) = match request.model.as_deref() {
        Some(SWARM_MODEL | AUTO_MODEL) => {
            let engine = run.engine(swarm.router_agent());
            let route = swarm
                .route(&engine, run.question.clone(), None)
                .await
                .map_err(|e| engine.explain(e))?;
            run.hop("route", "router", 0, route.usage);
            let agent = answering(&registry, route.agent.as_str())?;
            (agent, Some(route_response(route)))
        }
        name => (answering(&registry, name.unwrap_or_default())?, None),
    };
    // The answering agent's priority is the request's, for every hop from here on.
    run.prioritize(agent.priority);
    run.state.metrics().agent_request(agent.name.as_str());
    let report = SwarmReport {
        agent: agent.name.to_string(),
        route,
        ..SwarmReport::default()
    };
    let stream = request.options.stream.unwrap_or(false);
    let mut policy = agent.verifier_policy().unwrap_or_default();
    policy.checks.json |= wants_json(&request);
    // Tool calls and schema answers are valid by construction: no prose for the verifier to
    // judge, and nothing a retry could fix.
    let prepared = run.prepare(&agent, &request, &[]).await?;
    let include_usage = prepared.include_usage;
    if prepared.structured.format != engine::ResponseFormat::Text {
        policy.enabled = false;
    }
    let reply = prepared.structured.reply;
    if let Some(consensus) = consensus {
        let outcome = consensus.run(&mut run, &request, agent).await?;
        turn.commit(&outcome.text).await?;
        return Ok(Answered::Whole {
            run,
            report,
            outcome,
            stream,
            include_usage,
            reply,
        });
    }
    if stream && (!policy.enabled || policy.stream_mode == router::StreamMode::Provisional) {
        let valid = run.prepare(&agent, &request, &[]).await?;
        let events = run.submit(&agent, &valid).await?;
        let live = Live {
            agent,
            policy,
            valid,
            events,
        };
        return Ok(Answered::Live {
            run,
            report,
            live,
            turn,
        });
    }
    let outcome = run.answer(&registry, &request, agent, policy).await?;
    turn.commit(&outcome.text).await?;
    Ok(Answered::Whole {
        run,
        report,
        outcome,
        stream,
        include_usage,
        reply,
    })
}

/// The agent's default `tools` and `response_format`, where the request brings none.
fn agent_defaults(agent: &AgentSpec, request: &mut ChatCompletionRequest) -> Result<(), ApiError> {
    let broken = |field: &str, e: serde_json::Error| {
        ApiError::Internal(format!(
            "agent {}: its {field} do not parse: {e}",
            agent.name
        ))
    };
    if request.tools.is_none() && !agent.tools.is_empty() {
        let tools = serde_json::Value::Array(agent.tools.clone());
        request.tools = Some(serde_json::from_value(tools).map_err(|e| broken("tools", e))?);
    }
    if request.response_format.is_none() {
        if let Some(format) = &agent.response_format {
            request.response_format = Some(
                serde_json::from_value(format.clone()).map_err(|e| broken("response_format", e))?,
            );
        }
    }
    Ok(())
}

/// The agent named `name`, which must answer users.
fn answering(registry: &Registry, name: &str) -> Result<AgentSpec, ApiError> {
    registry
        .get(name)
        .filter(|agent| !agent.kind.is_system())
        .cloned()
        .ok_or_else(|| ApiError::ModelNotFound(name.to_owned()))
}

/// The answer a request releases.
pub struct Outcome {
    pub agent: AgentSpec,
    pub text: String,
    pub finish_reason: api::FinishReason,
    pub verdict: VerdictReport,
    pub consensus: Option<api::swarm::ConsensusReport>,
}

/// One generation's result.
pub struct Generated {
    pub text: String,
    pub finish_reason: api::FinishReason,
}

/// One swarm request as it runs: what it may spend and what it has spent.
pub struct Run {
    pub state: AppState,
    /// The first generation's limits; later hops get [`Run::later`].
    admission: Admission,
    /// The limits of every hop after the first: the first-token deadline was the request's,
    /// and these start after it, so only the total deadline binds them.
    later: Admission,
    /// The request's seats in the admission queue, which every hop runs in.
    seats: Seats,
    submitted: bool,
    /// The conversation's last user turn: what answers are checked against.
    pub question: String,
    pub hops: Vec<HopUsage>,
    /// The agent run the request is a turn of ([`crate::runs`]).
    run_key: Option<String>,
}

impl Run {
    fn new(state: AppState, admission: Admission, seats: Seats, question: String) -> Self {
        let mut later = admission;
        later.deadlines.first_token = later.deadlines.total;
        Self {
            state,
            admission,
            later,
            seats,
            submitted: false,
            question,
            hops: Vec::new(),
            run_key: None,
        }
    }

    /// Runs every later hop at `priority`.
    fn prioritize(&mut self, priority: i32) {
        self.admission.priority = priority;
        self.later.priority = priority;
    }

    /// The engine for the internal agent `agent` (the router, the verifier) serving this
    /// request: see [`Admission::engine`].
    pub fn engine(&self, agent: Option<&str>) -> AdmittedEngine {
        let admission = if self.submitted {
            &self.later
        } else {
            &self.admission
        };
        admission.engine(&self.state, &self.seats, agent)
    }

    /// Lists a hop and its tokens.
    pub fn hop(&mut self, hop: &str, agent: &str, attempt: u32, usage: engine::Usage) {
        self.hops.push(HopUsage {
            hop: hop.to_owned(),
            agent: agent.to_owned(),
            attempt,
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            total_tokens: usage.prompt_tokens + usage.completion_tokens,
            cached_tokens: usage.cached_tokens,
        });
    }

    /// The sum of the hops: what `usage` reports.
    pub fn usage(&self) -> api::Usage {
        let sum = |f: fn(&HopUsage) -> usize| self.hops.iter().map(f).sum::<usize>();
        api::Usage {
            prompt_tokens: sum(|h| h.prompt_tokens),
            completion_tokens: sum(|h| h.completion_tokens),
            total_tokens: sum(|h| h.total_tokens),
            prompt_tokens_details: api::PromptTokensDetails {
                cached_tokens: sum(|h| h.cached_tokens),
            },
        }
    }

    /// `request` as `agent` runs it, followed by `extra` turns: the agent's system prompt first,
    /// its sampling defaults where the request set nothing, validated for the served model.
    pub async fn prepare(
        &self,
        agent: &AgentSpec,
        request: &ChatCompletionRequest,
        extra: &[ChatMessage],
    ) -> Result<ValidChatRequest, ApiError> {
        if self.state.agent_model(agent).is_none() {
            return Err(ApiError::ModelNotFound(agent.model.to_string()));
        }
        let mut request = request.clone();
        request.model = None;
        request.swarm = None;
        if !agent.system_prompt.trim().is_empty() {
            request
                .messages
                .insert(0, message("system", agent.system_prompt.clone()));
        }
        request.messages.extend(extra.iter().cloned());
        agent_defaults(agent, &mut request)?;
        let defaults = &agent.sampling;
        let options = &mut request.options;
        let widen = |v: Option<f32>| v.map(f64::from);
        options.temperature = options.temperature.or(widen(defaults.temperature));
        options.top_p = options.top_p.or(widen(defaults.top_p));
        options.min_p = options.min_p.or(widen(defaults.min_p));
        options.repetition_penalty = options
            .repetition_penalty
            .or(widen(defaults.repetition_penalty));
        options.presence_penalty = options
            .presence_penalty
            .or(widen(defaults.presence_penalty));
        options.frequency_penalty = options
            .frequency_penalty
            .or(widen(defaults.frequency_penalty));
        options.top_k = options.top_k.or(defaults.top_k.map(|k| k as i64));
        if options.stop.is_none() {
            options.stop = defaults.stop.clone().map(Stop::Many);
        }
        let mut limits = self.limits();
        // The agent's `max_tokens` is its default, within the caller's bound like the server's.
        if let Some(n) = defaults.max_tokens {
            limits.max_tokens.chat_default = Some(n);
        }
        let state = self.state.clone();
        let agent = agent.clone();
        off_io(move || {
            let model = state.agent_model(&agent).unwrap_or_else(|| state.model());
            validate_chat(request, model, &limits)
        })
        .await
    }

    /// The bounds on what the caller may ask.
    fn limits(&self) -> structured::StructuredLimits {
        self.state.structured_limits(self.admission.caller)
    }

    /// Submits `valid` as `agent`'s generation: charged to the agent's budget and the caller's,
    /// under the request's deadlines, counted in the agent's metrics.
    pub async fn submit(
        &mut self,
        agent: &AgentSpec,
        valid: &ValidChatRequest,
    ) -> Result<Events, ApiError> {
        let model = (self.state.agent_model(agent)).unwrap_or_else(|| self.state.model());
        structured::compile(model, &valid.structured, &self.limits()).await?;
        let cost = (valid.prompt_tokens + valid.generate.max_tokens) as u64;
        let name = agent.name.as_str();
        let budget = self
            .state
            .limits()
            .charge_agent(name, agent.tokens_per_minute, cost)
            .await?;
        let mut admission = if self.submitted {
            self.later
        } else {
            self.admission
        };
        // The agent's system prompt is every caller's: its cached blocks are shared.
        admission.shared_prefix = match agent.system_prefix(model) {
            Some(Ok(tokens)) => tokens.len(),
            _ => 0,
        };
        let mut generate = valid.generate.clone();
        generate.run = crate::runs::turn(self.run_key.as_deref(), name);
        let events = admission
            .submit_as(
                &self.state,
                &self.seats,
                valid.prompt_tokens,
                generate,
                Some(name),
                budget,
            )
            .await?;
        self.submitted = true;
        Ok(events)
    }

    /// Generates `agent`'s answers to the prepared requests side by side and lists each as a
    /// `generate` hop, numbered from `first_attempt`.
    pub async fn generate(
        &mut self,
        prepared: &[(&AgentSpec, ValidChatRequest)],
        first_attempt: u32,
    ) -> Result<Vec<Generated>, ApiError> {
        let mut streams = Vec::with_capacity(prepared.len());
        for (agent, valid) in prepared {
            streams.push(self.submit(agent, valid).await?);
        }
        let (collected, _) = Choices::new(streams, 1).collect().await?;
        Ok(collected
            .into_iter()
            .zip(prepared)
            .enumerate()
            .map(|(i, (choice, (agent, _)))| {
                let Collected {
                    text,
                    finish_reason,
                    usage,
                    ..
                } = choice;
                self.hop(
                    "generate",
                    agent.name.as_str(),
                    first_attempt + i as u32,
                    usage,
                );
                Generated {
                    text,
                    finish_reason: finish_reason.unwrap_or(api::FinishReason::Stop),
                }
            })
            .collect())
    }

    /// The verifier's verdict on `answer` under `checks`, listed as a `verify` hop; `Err` names
    /// why the verifier could not run.
    pub async fn verify(
        &mut self,
        checks: &VerifierChecks,
        answer: &Generated,
        attempt: u32,
    ) -> Result<Verdict, String> {
        let finish_reason =
            (answer.finish_reason == api::FinishReason::Length).then_some(FinishReason::Length);
        let (question, text, failures) = deterministic(
            &self.state,
            self.question.clone(),
            answer.text.clone(),
            finish_reason,
            checks,
        )
        .await
        .map_err(|e| e.to_string())?;
        let candidate = router::Candidate {
            question: &question,
            answer: &text,
            finish_reason,
        };
        let verifier = self.state.verifier();
        let engine = self.engine(verifier.agent());
        let mut embedded = 0;
        let relevance = match self.state.embeddings() {
            Some(embeddings) if checks.relevance && failures.is_empty() => {
                let (similarity, tokens) = similarity(embeddings, &self.question, &answer.text)
                    .await
                    .map_err(|e| e.to_string())?;
                embedded = tokens;
                Some(similarity)
            }
            _ => None,
        };
        let verdict = verifier
            .verify(&engine, &candidate, checks, failures, relevance)
            .await
            .map_err(|e| engine.explain(e).to_string())?;
        let mut usage = verdict.usage;
        usage.prompt_tokens += embedded;
        let agent = "verifier";
        self.hop("verify", agent, attempt, usage);
        Ok(verdict)
    }

    /// Answers with `agent`, verifying, retrying and escalating as its policy says.
    async fn answer(
        &mut self,
        registry: &Registry,
        request: &ChatCompletionRequest,
        mut agent: AgentSpec,
        mut policy: VerifierPolicy,
    ) -> Result<Outcome, ApiError> {
        let wants_json = wants_json(request);
        let mut extra: Vec<ChatMessage> = Vec::new();
        let mut json_retry = false;
        let mut retries = 0;
        let mut escalated = false;
        let mut attempt = 1;
        let mut last: Option<(Generated, VerdictReport)> = None;
        loop {
            let prepared = self
                .prepare(&agent, request, &extra)
                .await
                .map(|mut valid| {
                    if json_retry {
                        valid.generate.response_format = engine::ResponseFormat::JsonObject;
                    }
                    if let Some(seed) = &mut valid.generate.sampling.seed {
                        *seed = seed.wrapping_add(u64::from(attempt - 1));
                    }
                    valid
                });
            let generated = match (prepared, last.take()) {
                (Ok(valid), previous) => {
                    match self.generate(&[(&agent, valid)], attempt).await {
                        Ok(mut answers) => answers.pop().expect("one answer per request"),
                        Err(e) => match previous {
                            // A retry that cannot run releases the answer it was to replace.
                            Some(previous) => {
                                return Ok(released(agent, previous, escalated, Some(e)))
                            }
                            None => return Err(e),
                        },
                    }
                }
                (Err(e), Some(previous)) => {
                    return Ok(released(agent, previous, escalated, Some(e)));
                }
                (Err(e), None) => return Err(e),
            };
            if !policy.enabled {
                self.state
                    .metrics()
                    .agent_verdict(agent.name.as_str(), "skipped");
                let verdict = skipped(attempt, Vec::new());
                return Ok(released(agent, (generated, verdict), escalated, None));
            }
            let mut checks = policy.checks.clone();
            checks.json |= wants_json;
            let verdict = match self.verify(&checks, &generated, attempt).await {
                Ok(verdict) => verdict,
                Err(e) => {
                    tracing::warn!(error = %e, "the verifier failed; releasing unverified");
                    self.state
                        .metrics()
                        .agent_verdict(agent.name.as_str(), "skipped");
                    let verdict = skipped(attempt, vec![format!("verifier: {e}")]);
                    return Ok(released(agent, (generated, verdict), escalated, None));
                }
            };
            let report = verdict_report(&verdict, attempt);
            self.state
                .metrics()
                .agent_verdict(agent.name.as_str(), &report.status);
            if verdict.passed {
                return Ok(released(agent, (generated, report), escalated, None));
            }
            match policy.on_failure {
                OnFailure::Retry if retries < policy.max_retries => {
                    retries += 1;
                    self.state.metrics().agent_retry(agent.name.as_str());
                    json_retry |= verdict
                        .reasons
                        .iter()
                        .any(|r| r.starts_with("invalid_json"));
                    extra = critique(&generated.text, &verdict, json_retry);
                }
                OnFailure::EscalateToGeneral if !escalated && agent.kind != AgentKind::General => {
                    escalated = true;
                    agent = registry.general().clone();
                    policy = agent.verifier_policy().unwrap_or_default();
                    extra.clear();
                    json_retry = false;
                }
                _ => return Ok(released(agent, (generated, report), escalated, None)),
            }
            last = Some((generated, report));
            attempt += 1;
        }
    }
}

/// The answer to release, with its verdict; `cut_short` is why a retry did not run.
fn released(
    agent: AgentSpec,
    (generated, mut verdict): (Generated, VerdictReport),
    escalated: bool,
    cut_short: Option<ApiError>,
) -> Outcome {
    if let Some(e) = cut_short {
        verdict.reasons.push(format!("retry: {e}"));
    }
    verdict.escalated = escalated;
    Outcome {
        agent,
        text: generated.text,
        finish_reason: generated.finish_reason,
        verdict,
        consensus: None,
    }
}

/// The verifier's verdict as the API shows it.
pub fn verdict_report(verdict: &Verdict, attempts: u32) -> VerdictReport {
    VerdictReport {
        status: if verdict.passed { "passed" } else { "failed" }.into(),
        score: Some(verdict.score),
        reasons: verdict.reasons.clone(),
        attempts,
        escalated: false,
    }
}

/// The verdict of an answer the verifier did not check.
pub fn skipped(attempts: u32, reasons: Vec<String>) -> VerdictReport {
    VerdictReport {
        status: "skipped".into(),
        score: None,
        reasons,
        attempts,
        escalated: false,
    }
}

/// Whether the request asked for a JSON answer.
fn wants_json(request: &ChatCompletionRequest) -> bool {
    request
        .response_format
        .as_ref()
        .is_some_and(|f| f.kind == "json_object")
}

/// The turns a retry adds to the conversation: the rejected answer and the verifier's critique.
fn critique(answer: &str, verdict: &Verdict, json: bool) -> Vec<ChatMessage> {
    let answer = match answer.char_indices().nth(REJECTED_ANSWER_CHARS) {
        Some((cut, _)) => &answer[..cut],
        None => answer,
    };
    let mut note = format!(
        "A reviewer rejected that answer: {}. Answer my previous message again and fix this.",
        verdict.reasons.join("; ")
    );
    if json {
        note.push_str(" Reply with valid JSON only.");
    }
    vec![
        message("assistant", answer.to_owned()),
        message("user", note),
    ]
}

fn message(role: &str, text: String) -> ChatMessage {
    ChatMessage {
        role: role.to_owned(),
        content: Some(MessageContent::Text(text)),
        ..ChatMessage::default()
    }
}
