//! The engine loop, on its own thread: receive requests, plan a step, run the model, sample,
//! send events, repeat.
//!
//! The loop owns everything the step touches (model, KV memory of both tiers, scheduler,
//! per-request output state); the async world reaches it only through the command channel and
//! each request's event channel. A request whose event receiver is gone is cancelled at the next
//! step and its blocks freed; one past its deadline ends with an error event, and so does one
//! whose reader stopped reading (its bounded buffer is full): the loop never waits on a reader,
//! and never holds more than [`crate::EVENT_BUFFER`] unread events per request.
//!
//! A step: schedule, run the copies between the KV tiers that scheduling queued (swaps, host-tier
//! prefix hits, evictions to the host) in one batch, run the forward pass, score prompt tokens,
//! sample.
//!
//! Agent runs ([`crate::runs`]): a request that is a turn of a run takes its run's place in the
//! queue; when a turn ends as its retention says (in tool calls, say), its blocks are held on
//! the device for a time-to-live priced by the run's program's pauses, until the run's next turn
//! is admitted or the time is up. The loop lets expired holds go at each turn, and wakes for
//! them when idle, so the figures it publishes stay true.
//!
//! Prompt log-probabilities are computed chunk by chunk: a chunk of a sequence scoring its prompt
//! returns logits for every token, and its rows are reduced to entries (the token after each
//! position, and the top alternatives) and dropped in the step that made them, so the logits
//! held never exceed one step's token budget however long the prompt. The entries go out in one
//! event when the last chunk has run, before the first sampled token.

use std::any::Any;
use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::D;
use tokenizers::Tokenizer;
use tokio::sync::mpsc::Sender;

use crate::constraint::Constraint;
use crate::kv_cache::{
    BlockKey, HostStore, KvConfig, KvCounters, KvGauges, KvManager, KvShape, KvStorage,
};
use crate::model::{ForwardBatch, Llama, Logits};
use crate::request::{
    Event, FinishReason, GenerateRequest, RequestId, Retention, RunTurn, TokenLogprob, Usage,
};
use crate::runs::Runs;
use crate::sampler::{self, Sampled, Sampler};
use crate::scheduler::{PlanItem, Scheduler, SchedulerConfig, StepPlan};
use crate::sequence::Sequence;
use crate::speculative::Drafter;
use crate::stop::TextStream;
use crate::team;

/// The most events one step sends a request: its prompt's log-probabilities, a token, the
/// text held back, and the end. A request whose buffer has less room is not being read.
const EVENTS_PER_STEP: usize = 4;
/// How often a stalled loop (work waiting, none of it admissible, nothing running) looks again
/// at its requests (cancelled, expired) and at the runs waiting for tools.
const STALLED_POLL: Duration = Duration::from_millis(10);

/// A request on its way to the engine loop.
pub(crate) struct Submission {
    pub id: RequestId,
    /// The index of the model that runs it.
    pub model: usize,
    pub prompt: Vec<u32>,
    pub request: GenerateRequest,
    /// The request's grammar, compiled by the submitter.
    pub constraint: Option<Constraint>,
    pub events: Sender<Event>,
    pub slot: QueueSlot,
}

pub(crate) enum Command {
    Submit(Box<Submission>),
    /// Prefill `prompt` and pin its full blocks until `Unpin` with the same id; `pinned` gets
    /// the number of blocks pinned (dropped unsent if the prefill fails).
    Pin {
        id: u64,
        model: usize,
        prompt: Vec<u32>,
        pinned: tokio::sync::oneshot::Sender<usize>,
    },
    Unpin {
        id: u64,
    },
}

/// Who a sequence runs for.
enum Origin {
    /// A client's request, holding its place in the queue bound.
    Client(QueueSlot),
    /// The pre-warming of the pin with this id.
    Pin(u64),
}

/// A pinned prefix, from the engine loop's side.
enum Pin {
    /// Being prefilled by an internal request; its event receiver is kept here so the request
    /// is not taken for cancelled.
    Warming {
        _events: tokio::sync::mpsc::Receiver<Event>,
        pinned: tokio::sync::oneshot::Sender<usize>,
    },
    Pinned(Vec<BlockKey>),
}

/// Counts a request against the engine's queue bound for as long as it is in the engine.
pub(crate) struct QueueSlot(Arc<AtomicUsize>);

impl QueueSlot {
    /// Takes a slot unless `max` are taken.
    pub fn try_take(counter: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        counter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(counter.clone()))
    }
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the KV cache looks like, both tiers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvSnapshot {
    pub gauges: KvGauges,
    pub counters: KvCounters,
    /// Preemptions that swapped a sequence out to the host tier.
    pub swaps_out: u64,
    /// Preemptions that dropped a sequence's cache, to recompute it.
    pub recomputes: u64,
    /// Sequences that grew past their model's window with every layer together, their cache
    /// computed again with the windowed layers apart.
    pub relayouts: u64,
}

/// What the engine holds in its device's memory (RAM for the CPU), in bytes.
#[derive(Clone, Debug, Default)]
pub struct DeviceMemory {
    pub weights: usize,
    /// The device tier of the KV cache, allocated whole at start-up.
    pub kv: usize,
    /// The reserve for a step's transient tensors (an upper bound, not a measurement).
    pub activations: usize,
    /// The device, to ask for its free memory; `None` on the CPU.
    pub gpu: Option<candle_core::Device>,
}

impl DeviceMemory {
    /// The GPU's free memory now; `None` on the CPU, or if the driver does not answer.
    pub fn free(&self) -> Option<usize> {
        let gpu = self.gpu.as_ref()?;
        crate::device::memory(gpu)
            .ok()
            .flatten()
            .map(|(free, _)| free)
    }
}

/// Live figures the engine publishes after every step.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Fixed at start-up.
    pub memory: DeviceMemory,
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub steps: AtomicU64,
    pub prefill_tokens: AtomicU64,
    pub decode_tokens: AtomicU64,
    /// Forward-pass time, split between prefill and decode in proportion to their tokens.
    pub prefill_nanos: AtomicU64,
    pub decode_nanos: AtomicU64,
    pub preemptions: AtomicU64,
    /// Tokens decode steps ran as drafts ([`crate::speculative`]), and those sampling took.
    pub draft_tokens: AtomicU64,
    pub accepted_draft_tokens: AtomicU64,
    /// Blocks copied between the tiers (either way), and the time the copies took.
    pub copied_blocks: AtomicU64,
    pub copy_nanos: AtomicU64,
    /// Per model, in the engine's order of its models.
    pub models: Vec<ModelStats>,
    kv: Mutex<KvSnapshot>,
}

/// Live figures of one of the engine's models.
#[derive(Debug, Default)]
pub struct ModelStats {
    pub id: String,
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub prefill_tokens: AtomicU64,
    pub decode_tokens: AtomicU64,
    /// Device blocks its sequences hold now (each counted once, however many share it): its
    /// share of the pool the models draw from.
    pub kv_blocks: AtomicUsize,
}

impl EngineStats {
    pub(crate) fn new(memory: DeviceMemory, models: impl IntoIterator<Item = String>) -> Self {
        Self {
            memory,
            models: models
                .into_iter()
                .map(|id| ModelStats {
                    id,
                    ..ModelStats::default()
                })
                .collect(),
            ..Self::default()
        }
    }

    pub fn kv(&self) -> KvSnapshot {
        *self.kv.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What the engine loop keeps per request besides its [`Sequence`].
struct Output {
    /// The model that runs it.
    model: usize,
    events: Sender<Event>,
    sampler: Sampler,
    text: TextStream,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
    deadline: Option<Instant>,
    /// Internal requests (prefix pre-warming) take no queue slot. Released before the final
    /// event is sent: whoever sees a request end may submit the next one at once.
    slot: Option<QueueSlot>,
    /// Set for the request that pre-warms a pinned prefix.
    pin: Option<u64>,
    /// Set while the prompt is being scored; taken when its event is sent.
    prompt_logprobs: Option<PromptLogprobs>,
    run: Option<RunTurn>,
    retention: Option<Retention>,
}

impl Output {
    /// Whether `token` ends the answer: a stop token, or the end of a complete constrained one.
    fn stops_at(&self, token: u32) -> bool {
        self.stop_tokens.contains(&token) || self.sampler.completes(token)
    }

    /// Chooses a step's tokens from `picks` in order, as decoding one token at a time would:
    /// the token from pick `i` is taken, and pick `i + 1` (computed after `draft[i]`) is read
    /// only when that token is `draft[i]` and nothing ended the answer or forced the tokens
    /// after it. `room`: the tokens the answer may still take.
    fn take(&mut self, picks: &mut Picks, draft: &[u32], room: usize) -> Stepped {
        let mut stepped = Stepped::default();
        for i in 0..picks.len() {
            let sampled = match picks {
                Picks::Rows(rows) => self.sampler.sample(&mut rows[i]),
                Picks::Tokens(tokens) => self.sampler.record(tokens[i]),
            };
            let token = sampled.token;
            stepped.sampled.push(sampled);
            if self.sampler.constraint_error().is_some() || self.stops_at(token) {
                break;
            }
            // What the grammar forces after this token joins it, within the answer's limits.
            let room = room.saturating_sub(stepped.sampled.len());
            stepped.forced = self.sampler.fast_forward(room);
            if !stepped.forced.is_empty() || room == 0 || draft.get(i) != Some(&token) {
                break;
            }
        }
        stepped
    }
}

/// A prompt's log-probabilities as its chunks run.
struct PromptLogprobs {
    /// Alternatives reported per token.
    top: usize,
    /// Entry `i` scores prompt token `i + 1`, from the logits at position `i`.
    entries: Vec<TokenLogprob>,
}

/// What a forward brings back from the device: every logits row, or only the tokens a plain
/// greedy choice made there.
enum StepOutput {
    Rows(Vec<Vec<f32>>),
    Tokens(Vec<u32>),
}

/// What a step gave a sampled item to choose its tokens from, in order: one per token of a
/// decode step with a draft, else one: its logits rows, or the tokens a plain greedy choice
/// made of them on the device.
enum Picks {
    Rows(Vec<Vec<f32>>),
    Tokens(Vec<u32>),
}

impl Picks {
    fn len(&self) -> usize {
        match self {
            Self::Rows(rows) => rows.len(),
            Self::Tokens(tokens) => tokens.len(),
        }
    }
}

/// The tokens a step gave a sequence: those sampled (more than one when its draft was right,
/// the first ones), and those its grammar forces after the last.
#[derive(Default)]
struct Stepped {
    sampled: Vec<Sampled>,
    forced: Vec<u32>,
}

/// One of the models the loop runs, and what its requests' outputs need of it.
pub(crate) struct Lane {
    pub model: Llama,
    pub tokenizer: Arc<Tokenizer>,
    pub eos: Vec<u32>,
    /// Mixed into its blocks' hashes (see [`crate::kv_cache::prefix::model_salt`]).
    pub salt: u64,
    /// How it keeps its blocks: tokens a block (as many as its keys and values fit in one of
    /// the pool's blocks), its layers with a window apart for longer sequences.
    pub shape: KvShape,
}

/// Everything the engine loop is built from.
pub(crate) struct LoopSetup {
    /// The models, their blocks all drawn from `storage` and `kv`'s one pool.
    pub lanes: Vec<Lane>,
    pub storage: KvStorage,
    pub host: HostStore,
    pub kv: KvConfig,
    pub scheduler: SchedulerConfig,
    /// Order waiting work by its run's first arrival.
    pub run_scheduling: bool,
}

pub(crate) struct EngineLoop {
    lanes: Vec<Lane>,
    storage: KvStorage,
    host: HostStore,
    scheduler: Scheduler,
    pins: HashMap<u64, Pin>,
    outputs: HashMap<RequestId, Output>,
    commands: Receiver<Command>,
    next_arrival: u64,
    runs: Runs,
    run_scheduling: bool,
    /// The last schedule ran nothing and nothing is running: the waiting work waits for a run
    /// in progress to finish its tool call.
    stalled: bool,
    stats: Arc<EngineStats>,
}

impl EngineLoop {
    pub fn new(setup: LoopSetup, commands: Receiver<Command>, stats: Arc<EngineStats>) -> Self {
        let LoopSetup {
            lanes,
            storage,
            host,
            kv,
            scheduler,
            run_scheduling,
        } = setup;
        Self {
            lanes,
            storage,
            host,
            scheduler: Scheduler::new(scheduler, KvManager::new(kv)),
            pins: HashMap::new(),
            outputs: HashMap::new(),
            commands,
            next_arrival: 0,
            runs: Runs::default(),
            run_scheduling,
            stalled: false,
            stats,
        }
    }

    /// Runs until every handle is dropped and the last request has finished, or until a panic
    /// outside sampling leaves the loop's state in doubt: then every request in flight ends with
    /// an error event and the loop stops for good (the handle reports it, and the server exits
    /// so that its supervisor restarts it). A panic while sampling one sequence ends only that
    /// sequence (see [`EngineLoop::step`]).
    pub fn run(mut self) {
        self.publish_stats();
        loop {
            match panic::catch_unwind(AssertUnwindSafe(|| self.turn())) {
                Ok(true) => {}
                Ok(false) => break tracing::info!("engine stopped"),
                Err(payload) => {
                    let reason = panic_message(&*payload);
                    tracing::error!(panic = %reason, "the engine loop panicked; stopping it");
                    break self.fail_all(&format!("the engine failed: {reason}"));
                }
            }
        }
    }

    /// One turn of the loop: take commands, then run a step if there is work. Returns false when
    /// the engine should stop.
    fn turn(&mut self) -> bool {
        if !self.receive() {
            return false;
        }
        self.reap();
        self.expire_holds();
        if !self.scheduler.is_idle() {
            self.observe_pressure();
            self.runs.end_tool_waits(Instant::now());
            if self.run_scheduling {
                self.scheduler
                    .set_paused_runs(self.runs.waiting_for_tools());
            }
            let plan = self.scheduler.schedule();
            self.stalled = plan.items.is_empty() && self.scheduler.num_running() == 0;
            self.on_admitted(&plan);
            let kv = self.scheduler.kv();
            let copies = kv.take_copies();
            let started = Instant::now();
            if let Err(e) = self.storage.run_copies(&copies, &mut self.host) {
                // Only a failing device gets here; what its blocks hold is in doubt, so the loop
                // stops as after a panic.
                tracing::error!(error = %e, "copying KV blocks between the tiers failed");
                self.fail_all(&format!("the engine failed: {e}"));
                return false;
            }
            let s = &self.stats;
            s.copied_blocks
                .fetch_add(copies.len() as u64, Ordering::Relaxed);
            s.copy_nanos
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            kv.copies_done();
            let copy_secs = started.elapsed().as_secs_f64();
            self.runs.observe_copies(copies.len(), copy_secs);
            // Published before the step's events, so that a client reading the figures after
            // its answer sees what its admission did (prefix hits, swaps).
            self.publish_stats();
            for id in &plan.unservable {
                let error = "the sequence does not fit in the KV cache";
                self.finish(*id, FinishReason::Error, Some(error));
            }
            if !plan.items.is_empty() {
                self.step(&plan);
            }
        } else {
            self.stalled = false;
        }
        self.publish_stats();
        true
    }

    /// Ends every request in flight with `error`, touching nothing but their event channels
    /// (the scheduler's state is not to be trusted after a panic).
    fn fail_all(&mut self, error: &str) {
        for (_, mut out) in self.outputs.drain() {
            out.slot = None;
            let _ = out.events.try_send(Event::Finished {
                reason: FinishReason::Error,
                usage: Usage::default(),
                error: Some(error.to_owned()),
            });
        }
    }

    /// Takes new commands: waits for one when idle (no longer than until the next hold
    /// expires) or stalled (a moment), else drains what is there. Returns false when the
    /// engine should stop.
    fn receive(&mut self) -> bool {
        if self.scheduler.is_idle() || self.stalled {
            let wake = match self.stalled {
                true => Some(Instant::now() + STALLED_POLL),
                false => self.runs.next_expiry(),
            };
            let received = match wake {
                Some(at) => {
                    let wait = at.saturating_duration_since(Instant::now());
                    match self.commands.recv_timeout(wait) {
                        Ok(cmd) => Ok(Some(cmd)),
                        Err(RecvTimeoutError::Timeout) => Ok(None),
                        // No handle left, work still waiting: finish it (below).
                        Err(RecvTimeoutError::Disconnected) if self.stalled => {
                            std::thread::sleep(STALLED_POLL);
                            Ok(None)
                        }
                        Err(RecvTimeoutError::Disconnected) => Err(()),
                    }
                }
                None => self.commands.recv().map(Some).map_err(|_| ()),
            };
            match received {
                Ok(Some(cmd)) => self.handle(cmd),
                Ok(None) => {}
                Err(()) => return false,
            }
        }
        loop {
            match self.commands.try_recv() {
                Ok(cmd) => self.handle(cmd),
                Err(TryRecvError::Empty) => return true,
                // No handle left: finish what is in flight, then stop.
                Err(TryRecvError::Disconnected) => return !self.scheduler.is_idle(),
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(s) => {
                let Submission {
                    id,
                    model,
                    prompt,
                    request,
                    constraint,
                    events,
                    slot,
                } = *s;
                let submitted = (id, model, prompt);
                self.admit(submitted, request, constraint, events, Origin::Client(slot));
            }
            Command::Pin {
                id,
                model,
                prompt,
                pinned,
            } => {
                let (events, rx) = crate::event_channel();
                let request = GenerateRequest {
                    sampling: crate::SamplingParams::greedy(),
                    max_tokens: 1,
                    ignore_eos: true,
                    ..GenerateRequest::new(crate::Prompt::Tokens(Vec::new()))
                };
                self.pins.insert(
                    id,
                    Pin::Warming {
                        _events: rx,
                        pinned,
                    },
                );
                // Internal requests use ids above any the handle gives out.
                let submitted = (RequestId(u64::MAX - id), model, prompt);
                self.admit(submitted, request, None, events, Origin::Pin(id));
            }
            Command::Unpin { id } => match self.pins.remove(&id) {
                Some(Pin::Pinned(keys)) => self.scheduler.kv().unpin(&keys),
                // Dropping the receiver cancels the pre-warming request.
                Some(Pin::Warming { .. }) | None => {}
            },
        }
    }

    /// Takes in request `id` for the model with index `model`, its prompt checked.
    fn admit(
        &mut self,
        (id, model, prompt): (RequestId, usize, Vec<u32>),
        request: GenerateRequest,
        constraint: Option<Constraint>,
        events: Sender<Event>,
        origin: Origin,
    ) {
        let (slot, pin) = match origin {
            Origin::Client(slot) => (Some(slot), None),
            Origin::Pin(pin) => (None, Some(pin)),
        };
        let lane = &self.lanes[model];
        let mut stop_tokens = request.stop_token_ids.clone();
        if !request.ignore_eos {
            stop_tokens.extend(&lane.eos);
        }
        let prompt_logprobs = request.prompt_logprobs.map(|top| PromptLogprobs {
            top,
            entries: Vec::with_capacity(prompt.len().saturating_sub(1)),
        });
        let mut sampler =
            Sampler::new(request.sampling, request.logprobs, &prompt).scoring(request.score_tokens);
        if let Some(constraint) = constraint {
            sampler = sampler.with_constraint(constraint, lane.eos[0]);
        }
        // What the grammar forces before anything is sampled (a tool-call envelope's opening)
        // is the answer's start: it is prefilled with the prompt instead of decoded a token at a
        // time. At least one token is left to sample; a prompt to be scored reports its
        // log-probabilities before any answer, so its answer starts after the prefill.
        let context = lane.model.config().context_length;
        let room = match request.prompt_logprobs {
            Some(_) => 0,
            None => request
                .max_tokens
                .saturating_sub(1)
                .min(context.saturating_sub(prompt.len() + 1)),
        };
        let forced = sampler.fast_forward(room);
        self.outputs.insert(
            id,
            Output {
                model,
                events,
                sampler,
                text: TextStream::new(lane.tokenizer.clone(), request.stop),
                max_tokens: request.max_tokens,
                stop_tokens,
                deadline: request.deadline,
                slot,
                pin,
                prompt_logprobs,
                run: request.run.clone(),
                retention: request.retention.clone(),
            },
        );
        self.next_arrival += 1;
        let arrival = self.next_arrival;
        let run_arrival = request.run.as_ref().map_or(arrival, |run| {
            let first = match run.warm_up {
                true => self.runs.first_arrival(&run.id).unwrap_or(arrival),
                false => {
                    let now = Instant::now();
                    if let Some(retention) = &request.retention {
                        self.runs
                            .keep_for_next_turn(&run.id, now + retention.longest());
                    }
                    self.runs.arrive(&run.id, arrival, now)
                }
            };
            if self.run_scheduling {
                first
            } else {
                arrival
            }
        });
        let expected = request
            .expected_output_tokens
            .map_or(0, |t| t.min(request.max_tokens));
        let lane = &self.lanes[model];
        let table = (self.scheduler.kv().table())
            .for_model(lane.salt, &lane.shape, prompt.len() + forced.len())
            .salted(request.cache_salt);
        let end = (prompt.len() + request.max_tokens).min(context);
        let mut seq = Sequence::new(id, prompt, table, request.priority, arrival)
            .of_model(model)
            .in_run(run_arrival)
            .expecting(expected)
            .answer_starting(&forced)
            .drafting(Drafter::new(end));
        if request.prompt_logprobs.is_some() {
            seq = seq.with_prompt_logprobs();
        }
        self.scheduler.add(seq);
        if !forced.is_empty() {
            self.emit(id, forced, Vec::new());
        }
    }

    /// Drops cancelled requests, and ends expired ones and those whose reader stopped reading
    /// (their event buffer has no room left for a step's events).
    fn reap(&mut self) {
        let now = Instant::now();
        let mut cancelled = Vec::new();
        let mut ended = Vec::new();
        for (id, out) in &self.outputs {
            if out.events.is_closed() {
                cancelled.push(*id);
            } else if out.deadline.is_some_and(|d| now >= d) {
                ended.push((*id, "deadline exceeded"));
            } else if out.events.capacity() < EVENTS_PER_STEP {
                ended.push((*id, "the client stopped reading the answer"));
            }
        }
        for id in cancelled {
            tracing::debug!(id = id.0, "cancelled by the client");
            self.finish(id, FinishReason::Cancelled, None);
        }
        for (id, why) in ended {
            self.finish(id, FinishReason::Error, Some(why));
        }
    }

    /// Runs a step: each model's forward over its items of the plan (one after the other, on
    /// the one cache; a model's sequences keeping their layers together and those keeping
    /// windowed layers apart in forwards of their own), then the sampling of every item that
    /// samples.
    fn step(&mut self, plan: &StepPlan) {
        // On a device, rows that would only be argmaxed are argmaxed there: the token ids come
        // back instead of vocabulary-wide rows.
        let on_device = self.storage.device().is_some();
        let started = Instant::now();
        let mut outputs = Vec::with_capacity(self.lanes.len());
        for (m, lane) in self.lanes.iter().enumerate() {
            let mine = plan.items.iter().filter(|i| i.model == m);
            let (whole, split): (Vec<&PlanItem>, _) = mine.partition(|i| i.blocks.len() == 1);
            for items in [whole, split] {
                if items.is_empty() {
                    continue;
                }
                let mut batch = ForwardBatch::default();
                for item in &items {
                    let logits = logits_of(item);
                    batch.push(&item.tokens, item.pos0, item.blocks.clone(), logits);
                }
                let greedy = on_device && plain_greedy(&self.outputs, &items);
                let output = lane.model.forward(&batch, &mut self.storage).and_then(|l| {
                    Ok(match greedy {
                        true => StepOutput::Tokens(l.argmax(D::Minus1)?.to_vec1::<u32>()?),
                        false => StepOutput::Rows(l.to_vec2::<f32>()?),
                    })
                });
                outputs.push((items, output));
            }
        }
        let elapsed = started.elapsed().as_nanos() as u64;
        let mut ran = Vec::with_capacity(outputs.len());
        for (items, output) in outputs {
            match output {
                Ok(output) => ran.push((items, output)),
                Err(e) => {
                    tracing::error!(error = %e, "forward pass failed");
                    for item in items {
                        let error = Some("internal error in the model");
                        self.finish(item.id, FinishReason::Error, error);
                    }
                }
            }
        }
        if ran.is_empty() {
            return;
        }
        self.count_step(plan, elapsed);
        for (items, output) in ran {
            match output {
                StepOutput::Rows(rows) => self.on_rows(&items, rows),
                StepOutput::Tokens(tokens) => self.on_greedy_tokens(&items, tokens),
            }
        }
    }

    /// Applies one model's logits `rows` to its `items`, in the order they ran: prompt
    /// log-probabilities, then sampling.
    fn on_rows(&mut self, items: &[&PlanItem], rows: Vec<Vec<f32>>) {
        let mut logits = rows.into_iter();
        let mut to_sample = Vec::new();
        for &item in items {
            // Moved out, not copied, and dropped with this item: a vocabulary-wide row each.
            let n = logits_of(item).rows(item.tokens.len());
            let mut rows: Vec<Vec<f32>> = logits.by_ref().take(n).collect();
            if item.prompt_logprobs {
                self.on_prompt_logits(item, &mut rows);
            }
            if item.sample {
                let picks = rows.split_off(rows.len() - 1 - item.draft);
                to_sample.push((item, Picks::Rows(picks)));
            }
        }
        self.sample(to_sample);
    }

    /// Applies the tokens chosen on the device, one per logits row of the items in order.
    fn on_greedy_tokens(&mut self, items: &[&PlanItem], tokens: Vec<u32>) {
        let mut tokens = tokens.into_iter();
        let mut to_sample = Vec::new();
        for &item in items {
            let picks: Vec<u32> = (tokens.by_ref())
                .take(logits_of(item).rows(item.tokens.len()))
                .collect();
            if item.sample {
                to_sample.push((item, Picks::Tokens(picks)));
            }
        }
        self.sample(to_sample);
    }

    /// Chooses each sampled item's tokens from its picks, then applies them in batch order.
    /// Sampling (penalties, filters, grammar masks) is per sequence: it runs on the compute
    /// threads side by side. A panic there touched only that sequence's sampler, so it ends
    /// that sequence and nothing else.
    fn sample(&mut self, to_sample: Vec<(&PlanItem, Picks)>) {
        let mut work = Vec::with_capacity(to_sample.len());
        for (item, picks) in to_sample {
            let Some(seq) = self.scheduler.get(item.id) else {
                // Every sampled item's sequence is running; were one not, its request ends
                // with an error rather than without a final event.
                tracing::error!(id = item.id.0, "a sampled sequence is not running");
                self.finish(
                    item.id,
                    FinishReason::Error,
                    Some("internal error: sequence lost"),
                );
                continue;
            };
            let Some(out) = self.outputs.remove(&item.id) else {
                continue;
            };
            let context = self.lanes[out.model].model.config().context_length;
            let room = (out.max_tokens.saturating_sub(seq.num_generated()))
                .min(context.saturating_sub(seq.tokens().len()));
            // Replaced by the sampler's result (or its panic) below.
            let stepped: std::thread::Result<Stepped> = Err(Box::new("not sampled"));
            work.push((item, out, picks, room, stepped));
        }
        team::for_each_mut(&mut work, |(item, out, picks, room, stepped)| {
            let draft = &item.tokens[item.tokens.len() - item.draft..];
            *stepped = panic::catch_unwind(AssertUnwindSafe(|| out.take(picks, draft, *room)));
        });
        // Every output goes back before any result is applied: should applying one panic, the
        // loop's recovery finds every request in flight there.
        let mut results = Vec::with_capacity(work.len());
        for (item, out, _, _, stepped) in work {
            self.outputs.insert(item.id, out);
            results.push((item, stepped));
        }
        for (item, stepped) in results {
            match stepped {
                Ok(stepped) => self.on_sampled(item, stepped),
                Err(payload) => {
                    let reason = panic_message(&*payload);
                    tracing::error!(id = item.id.0, panic = %reason, "sampling panicked");
                    self.finish(
                        item.id,
                        FinishReason::Error,
                        Some("internal error in the sampler"),
                    );
                }
            }
        }
    }

    /// Commits a step that ran, and counts it before any event goes out, so that whoever reads an
    /// answer sees its step counted.
    fn count_step(&mut self, plan: &StepPlan, elapsed: u64) {
        self.scheduler.commit(plan);
        let decode = plan.items.iter().filter(|i| i.decode).count() as u64;
        let prefill = plan.num_prefill_tokens() as u64;
        // Drafts are computed like any token: the step's time is split by what it ran.
        let drafts: u64 = plan.items.iter().map(|i| i.draft as u64).sum();
        for item in &plan.items {
            let m = &self.stats.models[item.model];
            let (counter, n) = match item.decode {
                true => (&m.decode_tokens, 1),
                false => (&m.prefill_tokens, item.tokens.len() as u64),
            };
            counter.fetch_add(n, Ordering::Relaxed);
        }
        let prefill_nanos = elapsed * prefill / (prefill + decode + drafts).max(1);
        let s = &self.stats;
        s.steps.fetch_add(1, Ordering::Relaxed);
        s.decode_tokens.fetch_add(decode, Ordering::Relaxed);
        s.prefill_tokens.fetch_add(prefill, Ordering::Relaxed);
        s.prefill_nanos.fetch_add(prefill_nanos, Ordering::Relaxed);
        s.decode_nanos
            .fetch_add(elapsed - prefill_nanos, Ordering::Relaxed);
        self.runs.observe_step(
            prefill as usize,
            (prefill + decode + drafts) as usize,
            elapsed as f64 * 1e-9,
        );
    }

    /// Scores the prompt tokens that follow a chunk's positions, from the chunk's `rows` (one
    /// per token), and sends the entries once the chunk ends the prompt.
    fn on_prompt_logits(&mut self, item: &PlanItem, rows: &mut [Vec<f32>]) {
        let (Some(out), Some(seq)) = (self.outputs.get_mut(&item.id), self.scheduler.get(item.id))
        else {
            return;
        };
        let Some(partial) = out.prompt_logprobs.as_mut() else {
            return;
        };
        let prompt = &seq.tokens()[..seq.prompt_len()];
        // A recompute after preemption (which takes no prefix hit) runs positions again: what
        // they give replaces what they gave, so nothing is reported twice.
        partial.entries.truncate(item.pos0);
        debug_assert_eq!(partial.entries.len(), item.pos0, "chunks come in order");
        for (pos, row) in (item.pos0..).zip(rows.iter_mut()) {
            // The last prompt position scores no prompt token; its row is the one sampled.
            let Some(&next) = prompt.get(pos + 1) else {
                break;
            };
            partial
                .entries
                .push(sampler::logprob_at(row, next, partial.top));
        }
        if item.pos0 + item.tokens.len() < prompt.len() {
            return;
        }
        let entries = out
            .prompt_logprobs
            .take()
            .map_or_else(Vec::new, |s| s.entries);
        debug_assert_eq!(entries.len(), prompt.len() - 1);
        let _ = out.events.try_send(Event::PromptLogprobs(entries));
    }

    /// Records the tokens a step gave a sequence (those sampled, with any the grammar forces
    /// after them), takes the part of its draft they confirm into its cache, and tells the
    /// client.
    fn on_sampled(&mut self, item: &PlanItem, stepped: Stepped) {
        let id = item.id;
        let Some(out) = self.outputs.get_mut(&id) else {
            return;
        };
        #[cfg(any(test, feature = "fault-injection"))]
        assert!(
            !out.sampler.has_fault(&sampler::faults::STEP),
            "fault injected into the engine loop"
        );
        if let Some(e) = out.sampler.constraint_error() {
            tracing::error!(error = %e, "constrained decoding failed");
            let error = format!("constrained decoding failed: {e}");
            return self.finish(id, FinishReason::Error, Some(&error));
        }
        let Stepped { sampled, forced } = stepped;
        let last = sampled.last().expect("a step samples a token").token;
        // Every token sampled but the last was a draft token, computed in this step.
        let accepted = sampled.len() - 1;
        let stop = out.stops_at(last);
        let mut logprobs: Vec<TokenLogprob> = Vec::with_capacity(sampled.len());
        let mut tokens: Vec<u32> = Vec::with_capacity(sampled.len() + forced.len());
        for s in sampled {
            tokens.push(s.token);
            logprobs.extend(s.logprob);
        }
        tokens.extend(forced);
        // The token that stops the answer is not shown; a stop string may end it sooner.
        let shown = tokens.len() - usize::from(stop);
        let (released, cut) = match shown {
            0 => (0, false),
            _ => match self.send(id, &tokens[..shown], logprobs) {
                Some(sent) => sent,
                None => return,
            },
        };
        if cut {
            // What drafting sampled past the stop string was never generated.
            tokens.truncate(released);
        }
        self.scheduler.append(id, &tokens);
        if item.draft > 0 {
            let accepted = accepted.min(tokens.len() - 1) as u64;
            let s = &self.stats;
            s.draft_tokens
                .fetch_add(item.draft as u64, Ordering::Relaxed);
            s.accepted_draft_tokens
                .fetch_add(accepted, Ordering::Relaxed);
            s.decode_tokens.fetch_add(accepted, Ordering::Relaxed);
            (s.models[item.model].decode_tokens).fetch_add(accepted, Ordering::Relaxed);
        }
        if stop || cut {
            return self.finish(id, FinishReason::Stop, None);
        }
        if item.draft > 0 {
            self.scheduler.accept_draft(id, item.draft, accepted);
        }
        self.check_length(id);
    }

    /// Tells the client of a sequence's new tokens (already in the sequence), and ends the
    /// sequence when they stop it or reach its length limit.
    fn emit(&mut self, id: RequestId, tokens: Vec<u32>, logprobs: Vec<TokenLogprob>) {
        match self.send(id, &tokens, logprobs) {
            None => {}
            Some((_, true)) => self.finish(id, FinishReason::Stop, None),
            Some((_, false)) => self.check_length(id),
        }
    }

    /// Ends a sequence that reached its length limit.
    fn check_length(&mut self, id: RequestId) {
        let (Some(out), Some(seq)) = (self.outputs.get(&id), self.scheduler.get(id)) else {
            return;
        };
        if seq.num_generated() >= out.max_tokens
            || seq.tokens().len() >= self.lanes[out.model].model.config().context_length
        {
            self.finish(id, FinishReason::Length, None);
        }
    }

    /// Sends a sequence's new tokens to its client, cut at a stop string, with the
    /// log-probabilities of those sent. Returns how many were sent and whether a stop string
    /// ended the answer there; `None` when they could not be (the sequence has ended).
    fn send(
        &mut self,
        id: RequestId,
        tokens: &[u32],
        mut logprobs: Vec<TokenLogprob>,
    ) -> Option<(usize, bool)> {
        let out = self.outputs.get_mut(&id)?;
        let (mut text, mut released, mut stopped) = (String::new(), 0, false);
        for &t in tokens {
            match out.text.push(t) {
                Ok(step) => {
                    text.push_str(&step.text);
                    released += 1;
                    stopped = step.stopped;
                }
                Err(e) => {
                    tracing::error!(error = %e, "detokenization failed");
                    self.finish(id, FinishReason::Error, Some("detokenization failed"));
                    return None;
                }
            }
            if stopped {
                break;
            }
        }
        logprobs.truncate(released);
        let _ = out.events.try_send(Event::Delta {
            text,
            tokens: tokens[..released].to_vec(),
            logprobs,
        });
        Some((released, stopped))
    }

    /// Ends a request: releases any text still held back (when the text ended normally), sends
    /// the final event, and drops the sequence, which frees its blocks.
    fn finish(&mut self, id: RequestId, reason: FinishReason, error: Option<&str>) {
        let seq = self.scheduler.remove(id);
        let Some(mut out) = self.outputs.remove(&id) else {
            return;
        };
        // A pre-warmed prefix: pin its full blocks, unless it was unpinned meanwhile. If its
        // prefill failed there is nothing to pin: forgetting the pin tells its holder so.
        let prefilled = seq
            .as_ref()
            .filter(|_| matches!(reason, FinishReason::Stop | FinishReason::Length));
        match (out.pin, prefilled) {
            (Some(pin), None) => {
                self.pins.remove(&pin);
            }
            (Some(pin), Some(seq)) if matches!(self.pins.get(&pin), Some(Pin::Warming { .. })) => {
                let keys = seq.blocks.prefix_keys(seq.prompt_len());
                let blocks = self.scheduler.kv().pin(&keys);
                tracing::info!(blocks, "prefix pinned");
                if let Some(Pin::Warming { pinned, .. }) = self.pins.insert(pin, Pin::Pinned(keys))
                {
                    // The holder may have stopped waiting; the pin stands either way.
                    let _ = pinned.send(blocks);
                }
            }
            _ => {}
        }
        if matches!(reason, FinishReason::Stop | FinishReason::Length) {
            let rest = out.text.flush();
            if !rest.is_empty() {
                let _ = out.events.try_send(Event::Delta {
                    text: rest,
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                });
            }
        }
        if let (Some(seq), Some(retention)) = (prefilled, out.retention.take()) {
            self.retain(seq, out.run.as_ref(), &retention);
        } else if let Some(run) = out.run.as_ref().filter(|run| !run.warm_up) {
            if let Some(old) = self.runs.ended(&run.id, None, None, Instant::now()) {
                self.scheduler.kv().unhold(&old, false);
            }
        }
        let usage = seq.map_or_else(Usage::default, |s| Usage {
            prompt_tokens: s.prompt_len(),
            completion_tokens: s.num_generated(),
            cached_tokens: s.cached_tokens(),
        });
        out.slot = None;
        let _ = out.events.try_send(Event::Finished {
            reason,
            usage,
            error: error.map(str::to_owned),
        });
    }

    /// A turn ended normally with a retention: when its answer is what the retention waits for,
    /// hold its blocks for the time the run's program's pauses make worth it.
    fn retain(&mut self, seq: &Sequence, run: Option<&RunTurn>, retention: &Retention) {
        let answer = &seq.tokens()[seq.prompt_len()..];
        let waits = match &retention.if_answer_starts_with {
            None => true,
            // No token is shorter than a byte: the opening is within its length in tokens.
            Some(opening) => {
                let head = &answer[..answer.len().min(opening.len() + 8)];
                self.lanes[seq.model]
                    .tokenizer
                    .decode(head, true)
                    .is_ok_and(|text| text.trim_start().starts_with(opening.as_str()))
            }
        };
        let now = Instant::now();
        // A run-less request holds under a name of its own, which no turn will ever claim.
        let holder = run.map_or_else(|| format!("\0request {}", seq.id.0), |r| r.id.clone());
        let paused = run.filter(|_| waits && retention.if_answer_starts_with.is_some());
        let hold = waits.then(|| {
            let kv = self.scheduler.kv();
            let keys = seq.blocks.prefix_keys(seq.num_computed());
            let ttl = match (retention.adaptive, run) {
                (true, Some(run)) => {
                    let size = (keys.len(), seq.num_computed());
                    let g = kv.gauges();
                    let host_room = g.host_free + g.host_cached >= keys.len();
                    let max = retention.max_secs;
                    let ttl = self
                        .runs
                        .ttl(&run.program, size, g.device_total, host_room, max);
                    tracing::debug!(run = %run.id, ttl_ms = ttl.as_millis(), "turn held");
                    ttl
                }
                _ => retention.longest(),
            };
            (keys, now + ttl)
        });
        let hold = hold.filter(|(_, until)| *until > now).inspect(|(keys, _)| {
            self.scheduler.kv().hold(keys);
        });
        let program = paused.map(|r| (r.program.as_str(), now + retention.longest()));
        let replaced = match run.is_some_and(|r| r.warm_up) {
            // A warm-up holds its run's next prefix; the run's last turn still waits.
            true => self.runs.hold(&holder, hold, now),
            false => self.runs.ended(&holder, program, hold, now),
        };
        if let Some(old) = replaced {
            self.scheduler.kv().unhold(&old, false);
        }
    }

    /// The runs whose turns `plan` admitted take back the blocks their last turns left held,
    /// and no longer wait for tools.
    fn on_admitted(&mut self, plan: &StepPlan) {
        for id in &plan.admitted {
            let Some(run) = self.outputs.get(id).and_then(|out| out.run.as_ref()) else {
                continue;
            };
            // A pre-warming of the next turn goes in while the tool still runs.
            if !run.warm_up {
                self.runs.resumed(&run.id);
            }
            if let Some(keys) = self.runs.admitted(&run.id) {
                self.scheduler.kv().unhold(&keys, false);
            }
        }
    }

    /// Lets go of the holds whose time is up.
    fn expire_holds(&mut self) {
        for keys in self.runs.expire(Instant::now()) {
            self.scheduler.kv().unhold(&keys, true);
        }
    }

    /// Measures how much of the device pool the work in the engine wants.
    fn observe_pressure(&mut self) {
        // Counts kept by the pool, not a walk over its blocks: this runs every step.
        let kv = self.scheduler.kv();
        let total = kv.num_blocks();
        let taken = total - kv.num_available();
        let demand = taken + self.scheduler.waiting_demand_blocks();
        self.runs
            .observe_pressure(demand as f64 / total.max(1) as f64);
    }

    fn publish_stats(&self) {
        let s = &self.stats;
        let sched = self.scheduler.stats();
        s.running
            .store(self.scheduler.num_running(), Ordering::Relaxed);
        s.waiting
            .store(self.scheduler.num_waiting(), Ordering::Relaxed);
        s.preemptions.store(sched.preemptions, Ordering::Relaxed);
        let kv = self.scheduler.kv();
        let gauges = kv.gauges();
        match &s.models[..] {
            [only] => {
                only.running
                    .store(self.scheduler.num_running(), Ordering::Relaxed);
                only.waiting
                    .store(self.scheduler.num_waiting(), Ordering::Relaxed);
                only.kv_blocks.store(gauges.device_used, Ordering::Relaxed);
            }
            _ => self.publish_model_stats(),
        }
        *s.kv.lock().unwrap_or_else(|e| e.into_inner()) = KvSnapshot {
            gauges,
            counters: kv.counters(),
            swaps_out: sched.swaps_out,
            recomputes: sched.recomputes,
            relayouts: sched.relayouts,
        };
    }
}

impl EngineLoop {
    /// Each model's sequences, and the device blocks they hold (once each).
    fn publish_model_stats(&self) {
        let n = self.lanes.len();
        let (mut running, mut waiting) = (vec![0; n], vec![0; n]);
        let mut blocks = vec![std::collections::HashSet::new(); n];
        for seq in self.scheduler.running() {
            running[seq.model] += 1;
            blocks[seq.model].extend(seq.blocks.held());
        }
        for seq in self.scheduler.waiting() {
            waiting[seq.model] += 1;
        }
        for (m, stats) in self.stats.models.iter().enumerate() {
            stats.running.store(running[m], Ordering::Relaxed);
            stats.waiting.store(waiting[m], Ordering::Relaxed);
            stats.kv_blocks.store(blocks[m].len(), Ordering::Relaxed);
        }
    }
}

/// What a panic said, when it said it with a string.
fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

/// Whether `items` have logits rows, and every one is a plain greedy sampler's to argmax.
fn plain_greedy(outputs: &HashMap<RequestId, Output>, items: &[&PlanItem]) -> bool {
    items.iter().any(|item| item.sample)
        && items.iter().all(|item| {
            !item.prompt_logprobs
                && (!item.sample
                    || outputs
                        .get(&item.id)
                        .is_none_or(|out| out.sampler.is_plain_greedy()))
        })
}

/// The rows of `item` the forward pass must return.
fn logits_of(item: &PlanItem) -> Logits {
    match (item.prompt_logprobs || item.draft > 0, item.sample) {
        (true, _) => Logits::Every,
        (false, true) => Logits::Last,
        (false, false) => Logits::None,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use super::*;
    use crate::test_support::{model_path, SMOLLM2_GGUF};
    use crate::{EngineConfig, EngineHandle, EventStream, Prompt, SamplingParams};

    fn engine() -> EngineHandle {
        EngineHandle::start(&EngineConfig {
            model: model_path(SMOLLM2_GGUF),
            kv_cache_mb: 16,
            ..EngineConfig::default()
        })
        .unwrap()
    }

    fn submit(engine: &EngineHandle, seed: u64) -> EventStream {
        engine
            .submit(GenerateRequest {
                sampling: SamplingParams {
                    seed: Some(seed),
                    ..SamplingParams::default()
                },
                max_tokens: 8,
                ..GenerateRequest::new(Prompt::Text("Once upon a time".into()))
            })
            .unwrap()
    }

    /// The final event of `stream`: its reason and error.
    fn outcome(mut stream: EventStream) -> (FinishReason, Option<String>) {
        loop {
            match stream
                .blocking_next()
                .expect("the stream ends with Finished")
            {
                Event::Finished { reason, error, .. } => return (reason, error),
                Event::Delta { .. } | Event::PromptLogprobs(_) => {}
            }
        }
    }

    #[test]
    fn a_panic_while_sampling_ends_only_its_sequence() {
        const SEED: u64 = 0x5A_4D_91;
        let engine = engine();
        sampler::faults::SAMPLE.store(SEED, Ordering::Relaxed);
        let doomed = submit(&engine, SEED);
        let neighbour = submit(&engine, 1);
        assert_eq!(
            outcome(doomed),
            (
                FinishReason::Error,
                Some("internal error in the sampler".into())
            )
        );
        assert_eq!(outcome(neighbour), (FinishReason::Length, None));
        assert_eq!(outcome(submit(&engine, 2)), (FinishReason::Length, None));
        assert!(engine.is_running());
        // The figures are published once the step that ended the sequences is over.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while engine.stats().kv().gauges.device_used > 0 {
            assert!(std::time::Instant::now() < deadline, "blocks leaked");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_panic_in_the_loop_fails_every_request_and_stops_the_engine() {
        const SEED: u64 = 0x5A_4D_92;
        let engine = engine();
        sampler::faults::STEP.store(SEED, Ordering::Relaxed);
        let neighbour = submit(&engine, 3);
        let doomed = submit(&engine, SEED);
        for stream in [doomed, neighbour] {
            let (reason, error) = outcome(stream);
            assert_eq!(reason, FinishReason::Error);
            let error = error.unwrap();
            assert!(error.contains("the engine failed"), "{error}");
        }
        let stopped = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(10), engine.stopped()).await
            });
        assert!(stopped.is_ok(), "the handle reports the stop");
        assert!(!engine.is_running());
        assert!(matches!(
            engine.submit(GenerateRequest::new(Prompt::Text("Hi".into()))),
            Err(crate::EngineError::Stopped)
        ));
    }
}
