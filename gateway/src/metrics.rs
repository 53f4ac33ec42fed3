//! Prometheus metrics, rendered in the text format at `GET /metrics`.
//!
//! Each [`crate::AppState`] owns its own recorder (no global one), so tests can run several servers
//! in one process and read each one's figures. Handles are registered once and kept; labelled
//! series are looked up by label at record time. Every label takes values from a fixed set
//! (routes, statuses, reasons, tiers), so the number of series is bounded.
//!
//! Where each family comes from:
//! - [`track`], a layer around everything: `swarmgate_http_requests_total{route,status}` and,
//!   from the [`Rejection`] error responses carry, `swarmgate_rejections_total{reason}`;
//! - [`Metrics::observe`], around each request's engine events: time to first token,
//!   inter-token latency, end-to-end duration, prompt and generation tokens;
//! - [`crate::limits::admit`]: the time a request waited for admission;
//! - the swarm's pipeline ([`crate::service::swarm`]), per agent (`agent` label; agents are few and
//!   named by the swarm's operators): requests answered, first-token and inter-token latency,
//!   verdicts, retries, and prompt tokens with those served from the prefix cache (their ratio
//!   is the agent's hit rate);
//! - the engine's [`EngineStats`], read when `/metrics` is scraped: running and waiting
//!   sequences, the KV cache's gauges and counters, and the engine's device memory by part (with
//!   a GPU's free memory). Reading them takes the engine's stats lock for a copy, never across
//!   an await.
//!
//! Histogram samples pile up until rendered; [`Metrics::upkeep`] folds them in periodically so
//! memory stays flat on a server nobody scrapes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use engine::{EngineStats, Event, KvSnapshot};
use futures::{Stream, StreamExt};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, Unit};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use crate::error::{ApiError, Rejection};

const HTTP_REQUESTS: &str = "swarmgate_http_requests_total";
const REJECTIONS: &str = "swarmgate_rejections_total";
const REQUEST_DURATION: &str = "swarmgate_request_duration_seconds";
const TIME_TO_FIRST_TOKEN: &str = "swarmgate_time_to_first_token_seconds";
const INTER_TOKEN_LATENCY: &str = "swarmgate_inter_token_latency_seconds";
const QUEUE_TIME: &str = "swarmgate_queue_time_seconds";
const PROMPT_TOKENS: &str = "swarmgate_prompt_tokens_total";
const GENERATION_TOKENS: &str = "swarmgate_generation_tokens_total";
const RUNNING: &str = "swarmgate_running_sequences";
const AGENT_REQUESTS: &str = "swarmgate_agent_requests_total";
const AGENT_TIME_TO_FIRST_TOKEN: &str = "swarmgate_agent_time_to_first_token_seconds";
const AGENT_INTER_TOKEN_LATENCY: &str = "swarmgate_agent_inter_token_latency_seconds";
const AGENT_VERDICTS: &str = "swarmgate_agent_verdicts_total";
const AGENT_RETRIES: &str = "swarmgate_agent_retries_total";
const AGENT_PROMPT_TOKENS: &str = "swarmgate_agent_prompt_tokens_total";
const AGENT_CACHED_TOKENS: &str = "swarmgate_agent_cached_prompt_tokens_total";
const WAITING: &str = "swarmgate_waiting_sequences";
const DEVICE_MEMORY: &str = "swarmgate_device_memory_bytes";
const DEVICE_FREE_MEMORY: &str = "swarmgate_device_free_memory_bytes";
const MODEL_RUNNING: &str = "swarmgate_model_running_sequences";
const MODEL_WAITING: &str = "swarmgate_model_waiting_sequences";
const MODEL_KV_BLOCKS: &str = "swarmgate_model_kv_blocks";
const MODEL_PREFILL_TOKENS: &str = "swarmgate_model_prefill_tokens_total";
const MODEL_DECODE_TOKENS: &str = "swarmgate_model_decode_tokens_total";
const DRAFT_TOKENS: &str = "swarmgate_draft_tokens_total";
const ACCEPTED_DRAFT_TOKENS: &str = "swarmgate_draft_accepted_tokens_total";

/// The parts of the engine's device memory, as `part` labels.
const MEMORY_PARTS: [&str; 3] = ["weights", "kv", "activations"];

/// The route label of requests no route matched: one series, whatever the path.
const UNMATCHED: &str = "unmatched";

/// How often histogram samples are folded in when nobody scrapes.
pub const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Histogram buckets, in seconds, per family: each spans what that latency plausibly takes.
const BUCKETS: [(&str, &[f64]); 6] = [
    (
        REQUEST_DURATION,
        &[
            0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
        ],
    ),
    (
        TIME_TO_FIRST_TOKEN,
        &[
            0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ],
    ),
    (
        INTER_TOKEN_LATENCY,
        &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0],
    ),
    (
        AGENT_TIME_TO_FIRST_TOKEN,
        &[
            0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ],
    ),
    (
        AGENT_INTER_TOKEN_LATENCY,
        &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0],
    ),
    (
        QUEUE_TIME,
        &[
            0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0,
        ],
    ),
];

/// One engine figure, exported as one series.
struct EngineSeries<T> {
    name: &'static str,
    labels: &'static [(&'static str, &'static str)],
    help: &'static str,
    read: fn(&KvSnapshot) -> T,
}

const KV_BLOCKS_HELP: &str = "KV cache blocks by tier and state: free; used (held by a sequence); \
     cached (kept for prefix reuse, evictable); pinned (kept for a pinned prefix, may also be \
     used); retained (held for an agent run's next turn, evicted after every other cached \
     block; may also be used or counted as cached); swapped (holding a preempted sequence's \
     cache).";

const KV_BLOCKS: [EngineSeries<usize>; 8] = {
    const fn series(
        labels: &'static [(&'static str, &'static str)],
        read: fn(&KvSnapshot) -> usize,
    ) -> EngineSeries<usize> {
        EngineSeries {
            name: "swarmgate_kv_blocks",
            labels,
            help: KV_BLOCKS_HELP,
            read,
        }
    }
    [
        series(&[("tier", "device"), ("state", "free")], |kv| {
            kv.gauges.device_free
        }),
        series(&[("tier", "device"), ("state", "used")], |kv| {
            kv.gauges.device_used
        }),
        series(&[("tier", "device"), ("state", "cached")], |kv| {
            kv.gauges.device_cached
        }),
        series(&[("tier", "device"), ("state", "pinned")], |kv| {
            kv.gauges.device_pinned
        }),
        series(&[("tier", "device"), ("state", "retained")], |kv| {
            kv.gauges.device_retained
        }),
        series(&[("tier", "host"), ("state", "free")], |kv| {
            kv.gauges.host_free
        }),
        series(&[("tier", "host"), ("state", "cached")], |kv| {
            kv.gauges.host_cached
        }),
        series(&[("tier", "host"), ("state", "swapped")], |kv| {
            kv.gauges.host_swapped
        }),
    ]
};

const PREFIX_HITS_HELP: &str =
    "Prompt tokens found in the prefix cache, by the tier they came from.";
const SWAPS_HELP: &str = "KV blocks moved by preemption: swapped out to the host, or back in.";
const EVICTIONS_HELP: &str =
    "Cached KV blocks evicted: from the device (to the host tier or dropped), or from the host.";

const RETENTION_HELP: &str = "KV blocks held on the device for an agent run's next turn (a turn \
     that ended in tool calls, a warm-up, a cache_ttl_secs hint): holds placed, prefix hits on \
     held blocks, held blocks demoted under pressure, and holds that ran out their time.";

const KV_COUNTERS: [EngineSeries<u64>; 12] = [
    EngineSeries {
        name: "swarmgate_prefix_cache_queries_tokens_total",
        labels: &[],
        help: "Prompt tokens looked up in the prefix cache.",
        read: |kv| kv.counters.prefix_query_tokens,
    },
    EngineSeries {
        name: "swarmgate_prefix_cache_hits_tokens_total",
        labels: &[("tier", "device")],
        help: PREFIX_HITS_HELP,
        read: |kv| kv.counters.device_hit_tokens,
    },
    EngineSeries {
        name: "swarmgate_prefix_cache_hits_tokens_total",
        labels: &[("tier", "host")],
        help: PREFIX_HITS_HELP,
        read: |kv| kv.counters.host_hit_tokens,
    },
    EngineSeries {
        name: "swarmgate_kv_swaps_total",
        labels: &[("direction", "out")],
        help: SWAPS_HELP,
        read: |kv| kv.counters.swapped_out_blocks,
    },
    EngineSeries {
        name: "swarmgate_kv_swaps_total",
        labels: &[("direction", "in")],
        help: SWAPS_HELP,
        read: |kv| kv.counters.swapped_in_blocks,
    },
    EngineSeries {
        name: "swarmgate_kv_evictions_total",
        labels: &[("tier", "device")],
        help: EVICTIONS_HELP,
        read: |kv| kv.counters.device_evictions,
    },
    EngineSeries {
        name: "swarmgate_kv_evictions_total",
        labels: &[("tier", "host")],
        help: EVICTIONS_HELP,
        read: |kv| kv.counters.host_evictions,
    },
    EngineSeries {
        name: "swarmgate_kv_retained_blocks_total",
        labels: &[("event", "held")],
        help: RETENTION_HELP,
        read: |kv| kv.counters.retained_blocks,
    },
    EngineSeries {
        name: "swarmgate_kv_retained_blocks_total",
        labels: &[("event", "hit")],
        help: RETENTION_HELP,
        read: |kv| kv.counters.retained_hit_blocks,
    },
    EngineSeries {
        name: "swarmgate_kv_retained_blocks_total",
        labels: &[("event", "demoted")],
        help: RETENTION_HELP,
        read: |kv| kv.counters.retained_demoted_blocks,
    },
    EngineSeries {
        name: "swarmgate_kv_retained_blocks_total",
        labels: &[("event", "expired")],
        help: RETENTION_HELP,
        read: |kv| kv.counters.retention_expired_blocks,
    },
    EngineSeries {
        name: "swarmgate_kv_recomputes_total",
        labels: &[],
        help: "Preemptions that dropped a sequence's KV cache, to compute it again later.",
        read: |kv| kv.recomputes,
    },
];

/// The server's metrics. Cloning is one reference-count increment.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    request_duration: Histogram,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    queue_time: Histogram,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    running: Gauge,
    waiting: Gauge,
    device_memory: [Gauge; 3],
    kv_blocks: Vec<Gauge>,
    kv_counters: Vec<Counter>,
}

/// Where registrations say they come from; the Prometheus recorder ignores it.
static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let builder = BUCKETS
            .iter()
            .fold(PrometheusBuilder::new(), |b, (name, buckets)| {
                b.set_buckets_for_metric(Matcher::Full((*name).into()), buckets)
                    .expect("bucket lists are not empty")
            });
        let recorder = builder.build_recorder();
        describe(&recorder);
        let counter = |name: &'static str, labels: &[(&'static str, &'static str)]| {
            recorder.register_counter(&key(name, labels), &METADATA)
        };
        let gauge = |name: &'static str, labels: &[(&'static str, &'static str)]| {
            recorder.register_gauge(&key(name, labels), &METADATA)
        };
        let histogram =
            |name: &'static str| recorder.register_histogram(&key(name, &[]), &METADATA);
        let inner = Inner {
            request_duration: histogram(REQUEST_DURATION),
            time_to_first_token: histogram(TIME_TO_FIRST_TOKEN),
            inter_token_latency: histogram(INTER_TOKEN_LATENCY),
            queue_time: histogram(QUEUE_TIME),
            prompt_tokens: counter(PROMPT_TOKENS, &[]),
            generation_tokens: counter(GENERATION_TOKENS, &[]),
            running: gauge(RUNNING, &[]),
            waiting: gauge(WAITING, &[]),
            device_memory: MEMORY_PARTS.map(|part| gauge(DEVICE_MEMORY, &[("part", part)])),
            kv_blocks: KV_BLOCKS
                .iter()
                .map(|series| gauge(series.name, series.labels))
                .collect(),
            kv_counters: KV_COUNTERS
                .iter()
                .map(|series| counter(series.name, series.labels))
                .collect(),
            handle: recorder.handle(),
            recorder,
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The text exposition, with the figures of the engine in this process, if it is here, as
    /// of now.
    pub fn render(&self, stats: Option<&EngineStats>) -> String {
        use std::sync::atomic::Ordering::Relaxed;
        let inner = &self.inner;
        let Some(stats) = stats else {
            return inner.handle.render();
        };
        inner.running.set(stats.running.load(Relaxed) as f64);
        inner.waiting.set(stats.waiting.load(Relaxed) as f64);
        let kv = stats.kv();
        for (gauge, series) in inner.kv_blocks.iter().zip(&KV_BLOCKS) {
            gauge.set((series.read)(&kv) as f64);
        }
        for (counter, series) in inner.kv_counters.iter().zip(&KV_COUNTERS) {
            counter.absolute((series.read)(&kv));
        }
        let m = &stats.memory;
        for (gauge, bytes) in inner
            .device_memory
            .iter()
            .zip([m.weights, m.kv, m.activations])
        {
            gauge.set(bytes as f64);
        }
        for model in &stats.models {
            let key = |name: &'static str| {
                Key::from_parts(name, vec![Label::new("model", model.id.clone())])
            };
            let gauge = |name| inner.recorder.register_gauge(&key(name), &METADATA);
            let counter = |name| inner.recorder.register_counter(&key(name), &METADATA);
            gauge(MODEL_RUNNING).set(model.running.load(Relaxed) as f64);
            gauge(MODEL_WAITING).set(model.waiting.load(Relaxed) as f64);
            gauge(MODEL_KV_BLOCKS).set(model.kv_blocks.load(Relaxed) as f64);
            counter(MODEL_PREFILL_TOKENS).absolute(model.prefill_tokens.load(Relaxed));
            counter(MODEL_DECODE_TOKENS).absolute(model.decode_tokens.load(Relaxed));
        }
        for (name, n) in [
            (DRAFT_TOKENS, &stats.draft_tokens),
            (ACCEPTED_DRAFT_TOKENS, &stats.accepted_draft_tokens),
        ] {
            (inner.recorder.register_counter(&key(name, &[]), &METADATA)).absolute(n.load(Relaxed));
        }
        // Only a GPU reports its free memory: on the CPU there is no such series.
        if let Some(free) = m.free() {
            inner
                .recorder
                .register_gauge(&key(DEVICE_FREE_MEMORY, &[]), &METADATA)
                .set(free as f64);
        }
        inner.handle.render()
    }

    /// Folds histogram samples in; run every [`UPKEEP_INTERVAL`] while serving.
    pub async fn upkeep(self) {
        let mut every = tokio::time::interval(UPKEEP_INTERVAL);
        loop {
            every.tick().await;
            self.inner.handle.run_upkeep();
        }
    }

    /// A request waited `waited` for its admission slot.
    pub fn queued(&self, waited: Duration) {
        self.inner.queue_time.record(waited);
    }

    /// Counts a refusal.
    fn reject(&self, rejection: Rejection) {
        let labels = [Label::from_static_parts("reason", rejection.0)];
        let key = Key::from_parts(REJECTIONS, labels.to_vec());
        self.inner
            .recorder
            .register_counter(&key, &METADATA)
            .increment(1);
    }

    /// Counts a failure in a stream whose headers are already sent: it never becomes an error
    /// response, so [`track`] cannot see it.
    pub fn stream_failed(&self, error: &ApiError) {
        if let Some(rejection) = error.rejection() {
            self.reject(rejection);
        }
    }

    /// Records a request's latencies and token counts from its events as they pass, also as
    /// `agent`'s when it is set. `arrived` is when the request reached the server: first-token
    /// and end-to-end times count from it.
    pub fn observe<S>(
        &self,
        events: S,
        arrived: Instant,
        agent: Option<&str>,
    ) -> impl Stream<Item = S::Item> + Send + Unpin
    where
        S: Stream<Item = Result<Event, ApiError>> + Send + Unpin,
    {
        let inner = self.inner.clone();
        let agent = agent.map(|name| AgentSeries::new(&inner.recorder, name));
        let mut last_token: Option<Instant> = None;
        events.inspect(move |item| {
            let now = Instant::now();
            match item {
                Ok(Event::Delta { tokens, .. }) if !tokens.is_empty() => {
                    match last_token {
                        None => {
                            inner.time_to_first_token.record(now - arrived);
                            if let Some(agent) = &agent {
                                agent.time_to_first_token.record(now - arrived);
                            }
                        }
                        Some(previous) => {
                            let gap = ((now - previous) / tokens.len() as u32).as_secs_f64();
                            inner.inter_token_latency.record_many(gap, tokens.len());
                            if let Some(agent) = &agent {
                                agent.inter_token_latency.record_many(gap, tokens.len());
                            }
                        }
                    }
                    last_token = Some(now);
                }
                Ok(Event::Delta { .. } | Event::PromptLogprobs(_)) => {}
                Ok(Event::Finished { usage, .. }) => {
                    inner.prompt_tokens.increment(usage.prompt_tokens as u64);
                    inner
                        .generation_tokens
                        .increment(usage.completion_tokens as u64);
                    inner.request_duration.record(now - arrived);
                    if let Some(agent) = &agent {
                        agent.prompt_tokens.increment(usage.prompt_tokens as u64);
                        agent.cached_tokens.increment(usage.cached_tokens as u64);
                    }
                }
                Err(_) => inner.request_duration.record(now - arrived),
            }
        })
    }

    /// Counts a swarm request answered by `agent`.
    pub fn agent_request(&self, agent: &str) {
        self.agent_counter(AGENT_REQUESTS, agent, None).increment(1);
    }

    /// Counts the verifier's verdict (`passed`, `failed`, `skipped`) on `agent`'s answer.
    pub fn agent_verdict(&self, agent: &str, verdict: &str) {
        self.agent_counter(AGENT_VERDICTS, agent, Some(("verdict", verdict)))
            .increment(1);
    }

    /// Counts an answer of `agent` generated again after the verifier rejected it.
    pub fn agent_retry(&self, agent: &str) {
        self.agent_counter(AGENT_RETRIES, agent, None).increment(1);
    }

    fn agent_counter(
        &self,
        name: &'static str,
        agent: &str,
        label: Option<(&'static str, &str)>,
    ) -> Counter {
        let mut labels = vec![Label::new("agent", agent.to_owned())];
        labels.extend(label.map(|(k, v)| Label::new(k, v.to_owned())));
        self.inner
            .recorder
            .register_counter(&Key::from_parts(name, labels), &METADATA)
    }
}

/// One agent's series, looked up once per request.
struct AgentSeries {
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    prompt_tokens: Counter,
    cached_tokens: Counter,
}

impl AgentSeries {
    fn new(recorder: &PrometheusRecorder, agent: &str) -> Self {
        let key = |name| Key::from_parts(name, vec![Label::new("agent", agent.to_owned())]);
        Self {
            time_to_first_token: recorder
                .register_histogram(&key(AGENT_TIME_TO_FIRST_TOKEN), &METADATA),
            inter_token_latency: recorder
                .register_histogram(&key(AGENT_INTER_TOKEN_LATENCY), &METADATA),
            prompt_tokens: recorder.register_counter(&key(AGENT_PROMPT_TOKENS), &METADATA),
            cached_tokens: recorder.register_counter(&key(AGENT_CACHED_TOKENS), &METADATA),
        }
    }
}

fn key(name: &'static str, labels: &[(&'static str, &'static str)]) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(k, v)| Label::from_static_parts(k, v))
        .collect();
    Key::from_parts(name, labels)
}

fn describe(recorder: &PrometheusRecorder) {
    let seconds = Some(Unit::Seconds);
    let counters = [
        (
            HTTP_REQUESTS,
            "HTTP requests answered, by route and status.",
        ),
        (REJECTIONS, "Requests refused, by reason."),
        (PROMPT_TOKENS, "Prompt tokens of finished requests."),
        (GENERATION_TOKENS, "Tokens generated for finished requests."),
        (
            MODEL_PREFILL_TOKENS,
            "Prompt tokens the engine computed, by model.",
        ),
        (MODEL_DECODE_TOKENS, "Tokens the engine decoded, by model."),
        (
            DRAFT_TOKENS,
            "Tokens decode steps ran as drafts (speculative decoding).",
        ),
        (
            ACCEPTED_DRAFT_TOKENS,
            "Draft tokens sampling agreed with, each a decode step saved.",
        ),
        (AGENT_REQUESTS, "Swarm requests answered, by agent."),
        (
            AGENT_VERDICTS,
            "Verifier verdicts on returned answers, by agent and verdict.",
        ),
        (
            AGENT_RETRIES,
            "Answers generated again after the verifier rejected them, by agent.",
        ),
        (AGENT_PROMPT_TOKENS, "Prompt tokens of agents' generations."),
        (
            AGENT_CACHED_TOKENS,
            "Prompt tokens of agents' generations served from the prefix cache.",
        ),
    ];
    for (name, help) in counters {
        recorder.describe_counter(KeyName::from_const_str(name), None, help.into());
    }
    for series in KV_COUNTERS.iter() {
        recorder.describe_counter(
            KeyName::from_const_str(series.name),
            None,
            series.help.into(),
        );
    }
    let histograms = [
        (
            REQUEST_DURATION,
            "Time from arrival to the end of generation.",
        ),
        (
            TIME_TO_FIRST_TOKEN,
            "Time from arrival to the first generated token.",
        ),
        (
            INTER_TOKEN_LATENCY,
            "Time between consecutive generated tokens.",
        ),
        (QUEUE_TIME, "Time waited for an admission slot."),
        (
            AGENT_TIME_TO_FIRST_TOKEN,
            "Time from arrival to an agent's first generated token.",
        ),
        (
            AGENT_INTER_TOKEN_LATENCY,
            "Time between consecutive tokens an agent generated.",
        ),
    ];
    for (name, help) in histograms {
        recorder.describe_histogram(KeyName::from_const_str(name), seconds, help.into());
    }
    let gauges = [
        (RUNNING, "Sequences the engine is running."),
        (WAITING, "Sequences waiting in the engine's queue."),
        (
            DEVICE_MEMORY,
            "Bytes the engine holds on its device (RAM on the CPU), by part: weights; kv (the \
             device tier of the KV cache, allocated at start-up); activations (the reserve for a \
             step's transient tensors, an upper bound).",
        ),
        (
            DEVICE_FREE_MEMORY,
            "Free memory of the engine's GPU (GPU engines only).",
        ),
        (MODEL_RUNNING, "Sequences the engine is running, by model."),
        (
            MODEL_WAITING,
            "Sequences waiting in the engine's queue, by model.",
        ),
        (
            MODEL_KV_BLOCKS,
            "Device KV blocks each model's sequences hold: the models draw from one pool, so \
             the split follows the load.",
        ),
    ];
    for (name, help) in gauges {
        recorder.describe_gauge(KeyName::from_const_str(name), None, help.into());
    }
    for series in KV_BLOCKS.iter() {
        recorder.describe_gauge(
            KeyName::from_const_str(series.name),
            None,
            series.help.into(),
        );
    }
}

/// The layer: counts every response by route and status, and refusals by reason.
pub async fn track(State(metrics): State<Metrics>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or(UNMATCHED, MatchedPath::as_str)
        .to_owned();
    let response = next.run(request).await;
    let labels = vec![
        Label::new("route", route),
        Label::new("status", response.status().as_str().to_owned()),
    ];
    let key = Key::from_parts(HTTP_REQUESTS, labels);
    metrics
        .inner
        .recorder
        .register_counter(&key, &METADATA)
        .increment(1);
    if let Some(rejection) = response.extensions().get::<Rejection>() {
        metrics.reject(*rejection);
    }
    response
}

/// A scrape's answer: `text`, in Prometheus' text exposition format.
pub fn exposition(text: String) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}
