//! The engine loop, on its own thread: receive requests, plan a step, run the model, sample,
//! send events, repeat.
//!
//! The worker owns everything the step touches (model, KV storage, scheduler, per-request
//! output state); the async world reaches it only through the command channel and each
//! request's event channel. A request whose event receiver is gone is cancelled at the next step
//! and its blocks freed; one past its deadline ends with an error event.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use tokenizers::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::kv_cache::{BlockPool, KvStorage};
use crate::model::{ForwardBatch, Llama};
use crate::request::{Event, FinishReason, GenerateRequest, RequestId, Usage};
use crate::sampler::Sampler;
use crate::scheduler::{Scheduler, SchedulerConfig, StepPlan};
use crate::sequence::Sequence;
use crate::stop::TextStream;

/// A request on its way to the worker.
pub(crate) struct Submission {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub request: GenerateRequest,
    pub events: UnboundedSender<Event>,
    pub slot: QueueSlot,
}

pub(crate) enum Command {
    Submit(Box<Submission>),
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

/// Live figures the engine publishes after every step.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub free_blocks: AtomicUsize,
    pub total_blocks: AtomicUsize,
    pub steps: AtomicU64,
    pub prefill_tokens: AtomicU64,
    pub decode_tokens: AtomicU64,
    /// Forward-pass time, split between prefill and decode in proportion to their tokens.
    pub prefill_nanos: AtomicU64,
    pub decode_nanos: AtomicU64,
    pub preemptions: AtomicU64,
}

/// What the worker keeps per request besides its [`Sequence`].
struct Output {
    events: UnboundedSender<Event>,
    sampler: Sampler,
    text: TextStream,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
    deadline: Option<Instant>,
    _slot: QueueSlot,
}

pub(crate) struct Worker {
    model: Llama,
    kv: KvStorage,
    scheduler: Scheduler,
    outputs: HashMap<RequestId, Output>,
    tokenizer: Arc<Tokenizer>,
    eos: Vec<u32>,
    commands: Receiver<Command>,
    next_arrival: u64,
    stats: Arc<EngineStats>,
}

impl Worker {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: Llama,
        kv: KvStorage,
        config: SchedulerConfig,
        tokenizer: Arc<Tokenizer>,
        eos: Vec<u32>,
        commands: Receiver<Command>,
        stats: Arc<EngineStats>,
    ) -> Self {
        let pool = BlockPool::new(kv.num_blocks());
        Self {
            model,
            kv,
            scheduler: Scheduler::new(config, pool),
            outputs: HashMap::new(),
            tokenizer,
            eos,
            commands,
            next_arrival: 0,
            stats,
        }
    }

    /// Runs until every handle is dropped and the last request has finished.
    pub fn run(mut self) {
        self.publish_stats();
        while self.receive() {
            self.reap();
            if !self.scheduler.is_idle() {
                let plan = self.scheduler.schedule();
                for id in &plan.unservable {
                    let error = "the sequence does not fit in the KV cache";
                    self.finish(*id, FinishReason::Error, Some(error));
                }
                if !plan.items.is_empty() {
                    self.step(&plan);
                }
            }
            self.publish_stats();
        }
        tracing::info!("engine stopped");
    }

    /// Takes new commands: waits for one when idle, else drains what is there. Returns false
    /// when the engine should stop.
    fn receive(&mut self) -> bool {
        if self.scheduler.is_idle() {
            match self.commands.recv() {
                Ok(cmd) => self.handle(cmd),
                Err(_) => return false,
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
                    prompt,
                    request,
                    events,
                    slot,
                } = *s;
                let mut stop_tokens = request.stop_token_ids.clone();
                if !request.ignore_eos {
                    stop_tokens.extend(&self.eos);
                }
                self.outputs.insert(
                    id,
                    Output {
                        events,
                        sampler: Sampler::new(request.sampling, request.logprobs, &prompt),
                        text: TextStream::new(self.tokenizer.clone(), request.stop),
                        max_tokens: request.max_tokens,
                        stop_tokens,
                        deadline: request.deadline,
                        _slot: slot,
                    },
                );
                self.next_arrival += 1;
                let table = self.scheduler.pool().table();
                let seq = Sequence::new(id, prompt, table, request.priority, self.next_arrival);
                self.scheduler.add(seq);
            }
        }
    }

    /// Drops cancelled requests and ends expired ones.
    fn reap(&mut self) {
        let now = Instant::now();
        let mut cancelled = Vec::new();
        let mut expired = Vec::new();
        for (id, out) in &self.outputs {
            if out.events.is_closed() {
                cancelled.push(*id);
            } else if out.deadline.is_some_and(|d| now >= d) {
                expired.push(*id);
            }
        }
        for id in cancelled {
            tracing::debug!(id = id.0, "cancelled by the client");
            self.finish(id, FinishReason::Cancelled, None);
        }
        for id in expired {
            self.finish(id, FinishReason::Error, Some("deadline exceeded"));
        }
    }

    fn step(&mut self, plan: &StepPlan) {
        let mut batch = ForwardBatch::default();
        for item in &plan.items {
            batch.push(&item.tokens, item.pos0, item.blocks.clone(), item.sample);
        }
        let started = Instant::now();
        let logits = self
            .model
            .forward(&batch, &mut self.kv)
            .and_then(|l| Ok(l.to_vec2::<f32>()?));
        let elapsed = started.elapsed().as_nanos() as u64;
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "forward pass failed");
                for item in &plan.items {
                    self.finish(
                        item.id,
                        FinishReason::Error,
                        Some("internal error in the model"),
                    );
                }
                return;
            }
        };
        self.scheduler.commit(plan);
        let sampled = plan.items.iter().filter(|i| i.sample);
        for (item, mut row) in sampled.zip(logits) {
            self.on_logits(item.id, &mut row);
        }
        let decode = plan.items.iter().filter(|i| i.decode).count() as u64;
        let prefill = plan.num_prefill_tokens() as u64;
        let prefill_nanos = elapsed * prefill / (prefill + decode).max(1);
        let s = &self.stats;
        s.steps.fetch_add(1, Ordering::Relaxed);
        s.decode_tokens.fetch_add(decode, Ordering::Relaxed);
        s.prefill_tokens.fetch_add(prefill, Ordering::Relaxed);
        s.prefill_nanos.fetch_add(prefill_nanos, Ordering::Relaxed);
        s.decode_nanos
            .fetch_add(elapsed - prefill_nanos, Ordering::Relaxed);
    }

    /// Samples a sequence's next token and tells the client.
    fn on_logits(&mut self, id: RequestId, logits: &mut [f32]) {
        let Some(out) = self.outputs.get_mut(&id) else {
            return;
        };
        let sampled = out.sampler.sample(logits);
        let token = sampled.token;
        self.scheduler.append(id, token);
        if out.stop_tokens.contains(&token) {
            return self.finish(id, FinishReason::Stop, None);
        }
        let step = match out.text.push(token) {
            Ok(step) => step,
            Err(e) => {
                tracing::error!(error = %e, "detokenization failed");
                return self.finish(id, FinishReason::Error, Some("detokenization failed"));
            }
        };
        let _ = out.events.send(Event::Delta {
            text: step.text,
            tokens: vec![token],
            logprobs: sampled.logprob.into_iter().collect(),
        });
        if step.stopped {
            return self.finish(id, FinishReason::Stop, None);
        }
        let seq = self
            .scheduler
            .get(id)
            .expect("a sampled sequence is running");
        let context = self.model.config().context_length;
        if seq.num_generated() >= out.max_tokens || seq.tokens().len() >= context {
            self.finish(id, FinishReason::Length, None);
        }
    }

    /// Ends a request: releases any text still held back (when the text ended normally), sends
    /// the final event, and drops the sequence, which frees its blocks.
    fn finish(&mut self, id: RequestId, reason: FinishReason, error: Option<&str>) {
        let seq = self.scheduler.remove(id);
        let Some(mut out) = self.outputs.remove(&id) else {
            return;
        };
        if matches!(reason, FinishReason::Stop | FinishReason::Length) {
            let rest = out.text.flush();
            if !rest.is_empty() {
                let _ = out.events.send(Event::Delta {
                    text: rest,
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                });
            }
        }
        let usage = seq.map_or_else(Usage::default, |s| Usage {
            prompt_tokens: s.prompt_len(),
            completion_tokens: s.num_generated(),
        });
        let _ = out.events.send(Event::Finished {
            reason,
            usage,
            error: error.map(str::to_owned),
        });
    }

    fn publish_stats(&self) {
        let s = &self.stats;
        s.running
            .store(self.scheduler.num_running(), Ordering::Relaxed);
        s.waiting
            .store(self.scheduler.num_waiting(), Ordering::Relaxed);
        s.free_blocks
            .store(self.scheduler.pool().num_free(), Ordering::Relaxed);
        s.total_blocks
            .store(self.scheduler.pool().num_blocks(), Ordering::Relaxed);
        s.preemptions
            .store(self.scheduler.stats().preemptions, Ordering::Relaxed);
    }
}
