//! Swarmgate's inference engine: many sequences, each at its own position, decoding together in
//! one batch that requests join and leave at every step (iteration-level scheduling).
//!
//! The pieces, from the outside in:
//! - [`EngineHandle`] is the cloneable front door: [`EngineHandle::submit`] validates a
//!   [`GenerateRequest`] and returns an [`EventStream`] of text deltas and one final event
//!   (preceded, when asked for, by the prompt's log-probabilities).
//!   Dropping the stream cancels the request.
//! - [`engine_loop`] runs the loop on its own thread: plan a step, run the model, sample, send events.
//! - [`scheduler`] decides each step's batch (decodes first, then chunked prefills, then
//!   admissions under a token budget) and preempts, by swapping to the host tier, when KV blocks
//!   run out.
//! - [`kv_cache`] is the paged KV cache in two tiers: the device pool with automatic prefix
//!   caching (full blocks shared by content, least recently used evicted first, pinned prefixes
//!   kept) and a host tier in CPU RAM that keeps evicted and swapped-out blocks; per-sequence
//!   block tables free their blocks on drop.
//! - [`model`] loads the GGUF and runs llama's forward over a ragged batch; its kernels are
//!   batch-invariant, so a request's tokens do not depend on what shares its batch.
//! - [`sampler`] and [`stop`] turn logits into tokens and tokens into streamed text.
//!
//! Apart from generation, [`embed::Embedder`] computes sentence embeddings with a BERT model
//! ([`model::bert`]) on threads of its own; it blocks its caller and shares nothing with the
//! engine loop.

pub mod config;
pub mod constraint;
pub mod device;
pub mod embed;
mod engine_loop;
pub mod error;
pub mod kv_cache;
pub mod model;
pub mod request;
pub mod runs;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
pub mod speculative;
pub mod stop;
pub mod team;
#[cfg(test)]
pub(crate) mod test_support;

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tokenizers::Tokenizer;
use tokio::sync::mpsc::Receiver;

pub use config::EngineConfig;
pub use device::DeviceSpec;
pub use embed::{Embedder, EmbedderConfig, Embedding};
pub use engine_loop::{DeviceMemory, EngineStats, KvSnapshot, ModelStats};
pub use error::{EngineError, Result};
pub use model::chat_prompt::{ChatEncoder, ChatPrompt};
pub use model::chat_template::{ChatMessage, ChatTemplate};
pub use request::{
    CacheSalt, Event, FinishReason, GenerateRequest, Prompt, RequestId, ResponseFormat, Retention,
    RunTurn, SamplingParams, TokenLogprob, Usage,
};
pub use speculative::Speculative;

use engine_loop::{Command, EngineLoop, Lane, LoopSetup, QueueSlot, Submission};
use kv_cache::{HostStore, KvConfig, KvGroup, KvShape, KvStorage};
use model::{Backend, Gguf, Llama, LlamaConfig};
use scheduler::SchedulerConfig;
use speculative::DraftPolicy;
use team::Team;

/// What callers need to know about the served model.
pub struct ModelInfo {
    /// The model file's name without extension.
    pub id: String,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: ChatTemplate,
    /// Encodes rendered chats with control tokens from the template only.
    pub chat_encoder: ChatEncoder,
    pub context_length: usize,
    /// Tokens the KV cache can hold in all.
    pub kv_capacity_tokens: usize,
    /// The end-of-sequence tokens.
    pub eos: Vec<u32>,
    /// The token a raw text prompt starts with, when the model asks for one
    /// (`tokenizer.ggml.add_bos_token`: Gemma's `<bos>`; SmolLM2 asks for none).
    pub bos: Option<u32>,
    /// The grammar compiler for constrained output, with its cache.
    pub grammars: Arc<constraint::Grammars>,
}

impl ModelInfo {
    /// What a GGUF's metadata says about its model, without loading a tensor: for a process that
    /// prepares prompts for engines running elsewhere. `kv_capacity_tokens` is then the context
    /// length (the engines check their own cache).
    pub fn load(path: &std::path::Path) -> Result<Self> {
        Self::from_gguf(&Gguf::open(path)?, path, None)
    }

    /// `kv_capacity_tokens`: `None` for the context length.
    fn from_gguf(
        gguf: &Gguf,
        path: &std::path::Path,
        kv_capacity_tokens: Option<usize>,
    ) -> Result<Self> {
        let context_length = LlamaConfig::from_gguf(gguf)?.context_length;
        let id = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let tokenizer = Arc::new(model::tokenizer::tokenizer_from_gguf(gguf.content())?);
        let mut eos = vec![gguf.u32("tokenizer.ggml.eos_token_id")?];
        // A chat model ends its turn with its end-of-turn token (Gemma's `<end_of_turn>`;
        // SmolLM2's `<|im_end|>` is its EOS already).
        if let Some(eot) = tokenizer.token_to_id("<end_of_turn>") {
            if !eos.contains(&eot) {
                eos.push(eot);
            }
        }
        let bos = match model::tokenizer::adds_bos(gguf.content())? {
            true => Some(gguf.u32("tokenizer.ggml.bos_token_id")?),
            false => None,
        };
        let grammars = constraint::Grammars::new(tokenizer.clone(), eos[0], 0)
            .map_err(|e| EngineError::Tokenizer(format!("grammar vocabulary: {e}")))?;
        Ok(Self {
            id,
            chat_encoder: ChatEncoder::new(tokenizer.clone())?,
            tokenizer,
            chat_template: ChatTemplate::from_gguf(gguf.content())?,
            context_length,
            kv_capacity_tokens: kv_capacity_tokens.unwrap_or(context_length),
            eos,
            bos,
            grammars: Arc::new(grammars),
        })
    }

    /// Encodes a raw text prompt: special-token text in it becomes the control token, and it
    /// starts with the model's BOS when the model asks for one and the text does not already
    /// (as llama.cpp's server encodes completion prompts).
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec();
        if let Some(bos) = self.bos {
            if !text.is_empty() && ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Checks `request` and returns its prompt's token ids: sampling parameters the sampler can
    /// honour, at least one token to generate, stop strings within their bounds, ids in the
    /// vocabulary, a prompt that leaves room in the context window. A [`Prompt::Text`] is raw
    /// text, encoded by [`ModelInfo::encode_text`] (chat contents come as [`Prompt::Tokens`]
    /// from [`ModelInfo::encode_chat`]).
    pub fn check(&self, request: &GenerateRequest) -> Result<Vec<u32>> {
        request
            .sampling
            .validate()
            .map_err(EngineError::InvalidRequest)?;
        if let Some(retention) = &request.retention {
            retention.validate().map_err(EngineError::InvalidRequest)?;
        }
        if request.max_tokens == 0 {
            return Err(EngineError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        stop::check_stop_strings(&request.stop)?;
        let prompt = match &request.prompt {
            Prompt::Tokens(t) => t.clone(),
            Prompt::Text(text) => self.encode_text(text)?,
        };
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        let vocab = self.tokenizer.get_vocab_size(true) as u32;
        if let Some(t) = prompt.iter().find(|&&t| t >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {t} is not in the vocabulary"
            )));
        }
        let limit = self.context_length.min(self.kv_capacity_tokens);
        if prompt.len() >= limit {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt has {} tokens; this model takes at most {}",
                prompt.len(),
                limit - 1
            )));
        }
        Ok(prompt)
    }

    /// Renders chat messages with the model's own template and encodes them, control tokens
    /// coming only from the template (see [`model::chat_prompt`]); with `add_generation_prompt`
    /// the prompt ends with the header that opens the assistant's reply.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<ChatPrompt> {
        self.chat_encoder
            .encode(&self.chat_template, messages, add_generation_prompt)
    }

    /// Compiles `format` into one sequence's constraint (`None` for free text).
    pub fn constraint(&self, format: &ResponseFormat) -> Result<Option<constraint::Constraint>> {
        self.grammars
            .compile(format)
            .map_err(|e| EngineError::InvalidRequest(format!("response_format: {e}")))
    }
}

/// Runs generation requests: the engine in this process ([`EngineHandle`]), or engines reached
/// over a network. Callers that only generate (a router, a verifier) take this, so they run
/// wherever the engines are.
pub trait Generate: Send + Sync {
    /// The model requests are prepared for (tokenizer, chat template, limits).
    fn model(&self) -> &ModelInfo;

    /// Checks and queues `request`; its events follow on the returned stream, which cancels the
    /// request when dropped. Fails, without queueing, when the request can never be served or
    /// no engine can take it now.
    fn submit(&self, request: GenerateRequest) -> BoxFuture<'_, Result<EventStream>>;
}

struct Shared {
    commands: Sender<Command>,
    /// Closed when the engine loop ends (its sender lives on the engine thread), which happens
    /// only when every handle is gone, or if the loop fails.
    running: tokio::sync::watch::Receiver<()>,
    /// The models served, in the engine loop's order; the first is the default.
    models: Vec<ModelInfo>,
    next_id: AtomicU64,
    next_pin: AtomicU64,
    queued: Arc<AtomicUsize>,
    max_queued: usize,
    max_unread_events: usize,
    stats: Arc<EngineStats>,
}

/// Bytes kept free on a GPU beyond the estimates: cuBLAS workspaces, the allocator's slack.
pub const GPU_HEADROOM: usize = 256 << 20;

/// The most tokens one sequence of a model whose layers keep `groups` can hold in a pool of
/// `num_blocks` blocks, computed in chunks of up to `chunk` tokens: a chunk reads the window
/// before its first token, so a layer with a window holds the blocks of the window and of the
/// chunk, and the others every block.
fn pool_tokens(groups: &[KvGroup], num_blocks: usize, chunk: usize) -> usize {
    let blocks = |end: usize| -> usize {
        let from = end.saturating_sub(chunk.max(1));
        groups.iter().map(|g| g.blocks_for(from, end)).sum()
    };
    let most = num_blocks * groups.iter().map(|g| g.block_size).max().unwrap_or(0);
    // Blocks needed never fall as the sequence grows by a chunk or more.
    kv_cache::most_that_fit(most, |end| blocks(end) <= num_blocks)
}

/// Bytes for the device tier of the KV cache: `--kv-cache-mb`, or on a GPU with
/// `--gpu-memory-utilization` that share of its memory less what is in use already (the weights
/// just loaded, other processes), the step's activations and a headroom.
fn kv_budget(
    config: &EngineConfig,
    device: &candle_core::Device,
    activations: usize,
) -> Result<usize> {
    let (Some(share), Some((free, total))) =
        (config.gpu_memory_utilization, device::memory(device)?)
    else {
        return Ok(config.kv_cache_mb << 20);
    };
    let allowed = (share * total as f64) as usize;
    let needed = (total - free) + activations + GPU_HEADROOM;
    allowed.checked_sub(needed).ok_or_else(|| {
        EngineError::Device(format!(
            "{}: nothing is left for the KV cache: {share} of {} MiB allows {} MiB, and {} MiB are \
             in use (the weights among them) with {} MiB more needed for activations",
            config.device,
            total >> 20,
            allowed >> 20,
            (total - free) >> 20,
            (activations + GPU_HEADROOM) >> 20
        ))
    })
}

/// On a GPU, refuses `what` of `bytes` that, with the activations and the headroom, would not
/// fit in its free memory: a message naming the sizes and `way_out`, rather than the driver's
/// out-of-memory error halfway through a load or a step.
fn fits_on_device(
    spec: &DeviceSpec,
    device: &candle_core::Device,
    (what, bytes): (&str, usize),
    activations: usize,
    way_out: &str,
) -> Result<()> {
    let Some((free, _)) = device::memory(device)? else {
        return Ok(());
    };
    if bytes + activations + GPU_HEADROOM > free {
        return Err(EngineError::Device(format!(
            "{spec}: {what} ({} MiB) and {} MiB for activations do not fit in the {} MiB free \
             ({way_out})",
            bytes >> 20,
            (activations + GPU_HEADROOM) >> 20,
            free >> 20
        )));
    }
    Ok(())
}

/// Cloneable handle to a running engine. The engine stops when the last handle is dropped and
/// its requests have finished.
#[derive(Clone)]
pub struct EngineHandle {
    shared: Arc<Shared>,
}

impl EngineHandle {
    /// Loads the model and starts the engine thread. Blocking: it reads the whole model.
    pub fn start(config: &EngineConfig) -> Result<Self> {
        config.validate().map_err(EngineError::InvalidRequest)?;
        let backend = match config.device.open()? {
            candle_core::Device::Cpu => Backend::Kernels,
            device => Backend::Tensors {
                device,
                weights: config.gpu_weights,
            },
        };
        Self::start_on(config, backend)
    }

    /// [`Self::start`] with the model on `backend`, whatever `config.device` says: how the
    /// tests run the device path (its cache as tensors, its greedy choice on the device) on the
    /// CPU.
    pub fn start_on(config: &EngineConfig, backend: Backend) -> Result<Self> {
        config.validate().map_err(EngineError::InvalidRequest)?;
        let paths: Vec<&std::path::Path> = std::iter::once(&config.model)
            .chain(&config.extra_models)
            .map(|p| p.as_path())
            .collect();
        if paths.len() > 1 && !matches!(backend, Backend::Kernels) {
            return Err(EngineError::InvalidRequest(
                "several models share one engine on the CPU kernels only: run one engine per \
                 model on a GPU"
                    .into(),
            ));
        }
        let mut ggufs = paths
            .iter()
            .map(|p| Gguf::open(p))
            .collect::<Result<Vec<_>>>()?;
        let device = backend.device();
        // The models' forwards run one after the other: a step needs the largest one's.
        let activations = ggufs
            .iter()
            .map(|g| {
                Ok(LlamaConfig::from_gguf(g)?
                    .activation_bytes(config.max_step_tokens, config.max_running))
            })
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .max()
            .unwrap_or(0);
        if let Backend::Tensors { weights, .. } = &backend {
            let what = format!("the weights of {} as {weights}", config.model.display());
            let bytes = Llama::device_weight_bytes(&ggufs[0], *weights)?;
            let way_out = "--gpu-weights f16 or quantized take less";
            fits_on_device(
                &config.device,
                &device,
                (&what, bytes),
                activations,
                way_out,
            )?;
        }
        let models = ggufs
            .iter_mut()
            .map(|g| Llama::load(g, &backend))
            .collect::<Result<Vec<_>>>()?;
        let layouts: Vec<_> = models
            .iter()
            .map(|m| m.kv_layout(config.block_size))
            .collect();
        // Every block takes the largest model's block of memory, whichever model holds it.
        let bytes_per_block = layouts.iter().map(|l| l.bytes_per_block()).max();
        let bytes_per_block = bytes_per_block.unwrap_or(1);
        let num_blocks = match config.device_kv_blocks {
            Some(blocks) => blocks,
            None => kv_budget(config, &device, activations)? / bytes_per_block,
        };
        fits_on_device(
            &config.device,
            &device,
            (
                "a KV cache beside the weights",
                num_blocks * bytes_per_block,
            ),
            activations,
            "lower --kv-cache-mb, or use --gpu-memory-utilization",
        )?;
        if num_blocks < 2 {
            return Err(EngineError::InvalidRequest(format!(
                "the KV cache must hold at least 2 blocks of {bytes_per_block} bytes"
            )));
        }
        let host_slots = (config.host_kv_cache_mb << 20) / bytes_per_block;
        tracing::info!(
            models = ?paths,
            device = %config.device,
            num_blocks,
            host_slots,
            prefix_cache = config.prefix_cache,
            block_size = config.block_size,
            threads = config.threads(),
            "engine starting"
        );
        let storage = match &models[..] {
            [model] => model.kv_storage(config.block_size, num_blocks)?,
            _ => KvStorage::shared(&layouts, num_blocks)?,
        };
        let host = HostStore::for_storage(&storage, host_slots);
        // The largest model's blocks hold `--block-size` tokens, a smaller model's as many as
        // fit in the same memory; layers with a sliding window keep blocks of their own.
        let shapes: Vec<KvShape> = models.iter().map(|m| m.kv_shape(&storage)).collect();
        let infos = ggufs
            .iter()
            .zip(&paths)
            .zip(&shapes)
            .map(|((g, p), shape)| {
                let capacity = pool_tokens(shape.longest(), num_blocks, config.max_step_tokens);
                ModelInfo::from_gguf(g, p, Some(capacity))
            })
            .collect::<Result<Vec<_>>>()?;
        for (i, info) in infos.iter().enumerate() {
            if infos[..i].iter().any(|other| other.id == info.id) {
                return Err(EngineError::InvalidRequest(format!(
                    "the model {} is given twice",
                    info.id
                )));
            }
        }
        let memory = DeviceMemory {
            weights: models.iter().map(Llama::weight_bytes).sum(),
            kv: num_blocks * bytes_per_block,
            activations,
            gpu: (!device.is_cpu()).then_some(device),
        };
        let stats = Arc::new(EngineStats::new(
            memory,
            infos.iter().map(|info| info.id.clone()),
        ));
        let lanes: Vec<Lane> = models
            .into_iter()
            .zip(&infos)
            .zip(shapes)
            .map(|((model, info), shape)| Lane {
                model,
                tokenizer: info.tokenizer.clone(),
                eos: info.eos.clone(),
                salt: kv_cache::prefix::model_salt(&info.id),
                shape,
            })
            .collect();
        let kv = KvConfig {
            num_blocks,
            block_size: lanes[0].shape.whole.block_size,
            host_slots,
            prefix_caching: config.prefix_cache,
            salt: lanes[0].salt,
        };
        let run_scheduling = config.run_scheduling;
        let scheduler = SchedulerConfig {
            max_step_tokens: config.max_step_tokens,
            max_running: config.max_running,
            max_active_runs: (config.run_scheduling && config.max_active_runs > 0)
                .then_some(config.max_active_runs),
            watermark_blocks: (num_blocks / 100).max(1),
            drafts: DraftPolicy::new(config.speculative, config.speculative_step_tokens),
        };
        let (tx, rx) = std::sync::mpsc::channel();
        // The engine's parallel loops run on its team; candle's own operations between them
        // (norms, RoPE) are small and run on the engine thread, in a one-thread rayon pool, so
        // that they neither start rayon's global pool nor compete with the team for the cores.
        let threads = config.threads();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .map_err(|e| EngineError::Model(format!("cannot start the engine thread: {e}")))?;
        let team = Team::new(threads)
            .map_err(|e| EngineError::Model(format!("cannot start compute threads: {e}")))?;
        let loop_stats = stats.clone();
        let (running_tx, running) = tokio::sync::watch::channel(());
        std::thread::Builder::new()
            .name("swarmgate-engine".into())
            .spawn(move || {
                let _running = running_tx;
                let setup = LoopSetup {
                    lanes,
                    storage,
                    host,
                    kv,
                    scheduler,
                    run_scheduling,
                };
                pool.install(|| team.install(|| EngineLoop::new(setup, rx, loop_stats).run()))
            })
            .map_err(|e| EngineError::Model(format!("cannot start the engine thread: {e}")))?;
        Ok(Self {
            shared: Arc::new(Shared {
                commands: tx,
                running,
                models: infos,
                next_id: AtomicU64::new(1),
                next_pin: AtomicU64::new(1),
                queued: Arc::new(AtomicUsize::new(0)),
                max_queued: config.max_queued,
                max_unread_events: config.max_unread_events,
                stats,
            }),
        })
    }

    /// The engine's first model: the one requests naming none run on.
    pub fn model(&self) -> &ModelInfo {
        &self.shared.models[0]
    }

    /// Every model the engine serves, the first the default.
    pub fn models(&self) -> &[ModelInfo] {
        &self.shared.models
    }

    /// The index of the model named `id` (`None`: the first).
    fn model_index(&self, id: Option<&str>) -> Result<usize> {
        let Some(id) = id else { return Ok(0) };
        let models = &self.shared.models;
        models.iter().position(|m| m.id == id).ok_or_else(|| {
            let served: Vec<&str> = models.iter().map(|m| m.id.as_str()).collect();
            EngineError::InvalidRequest(format!(
                "this engine does not serve the model {id:?} (it serves {})",
                served.join(", ")
            ))
        })
    }

    /// Whether the engine loop is still taking requests (it has not failed).
    pub fn is_running(&self) -> bool {
        self.shared.running.has_changed().is_ok()
    }

    /// Completes when the engine loop has ended. While a handle exists the loop ends only by
    /// failing, so this is how a server learns that it must exit for its supervisor to restart it.
    pub async fn stopped(&self) {
        let mut running = self.shared.running.clone();
        while running.changed().await.is_ok() {}
    }

    pub fn stats(&self) -> &EngineStats {
        &self.shared.stats
    }

    /// Validates and queues a request, compiling its grammar here (on the caller's thread, not
    /// the engine loop's). Fails at once, without queueing, when the request can never be served
    /// or the engine is full.
    pub fn submit(&self, request: GenerateRequest) -> Result<EventStream> {
        let model = self.model_index(request.model.as_deref())?;
        let info = &self.shared.models[model];
        let prompt = info.check(&request)?;
        let constraint = info.constraint(&request.response_format)?;
        let slot =
            QueueSlot::try_take(&self.shared.queued, self.shared.max_queued).ok_or_else(|| {
                EngineError::Overloaded(format!(
                    "{} requests already queued",
                    self.shared.max_queued
                ))
            })?;
        let id = RequestId(self.shared.next_id.fetch_add(1, Ordering::Relaxed));
        let (events, rx) = tokio::sync::mpsc::channel(self.shared.max_unread_events);
        let prompt_tokens = prompt.len();
        self.shared
            .commands
            .send(Command::Submit(Box::new(Submission {
                id,
                model,
                prompt,
                request,
                constraint,
                events,
                slot,
            })))
            .map_err(|_| EngineError::Stopped)?;
        Ok(EventStream {
            id,
            prompt_tokens,
            rx,
        })
    }

    /// Pre-warms `prefix` (prefills it once, in the background) and keeps its full KV blocks on
    /// the device, never evicted, until the returned pin is dropped: for an agent's system
    /// prompt, which every one of its requests starts with. `model` names the engine's model
    /// that runs those requests (`None`: the first).
    pub fn pin_prefix(&self, model: Option<&str>, prefix: &Prompt) -> Result<PrefixPin> {
        let model = self.model_index(model)?;
        let prompt = self.shared.models[model].check(&GenerateRequest::new(prefix.clone()))?;
        let id = self.shared.next_pin.fetch_add(1, Ordering::Relaxed);
        let tokens = prompt.len();
        let (pinned, ready) = tokio::sync::oneshot::channel();
        self.shared
            .commands
            .send(Command::Pin {
                id,
                model,
                prompt,
                pinned,
            })
            .map_err(|_| EngineError::Stopped)?;
        Ok(PrefixPin {
            id,
            tokens,
            blocks: None,
            ready: Some(ready),
            commands: self.shared.commands.clone(),
        })
    }
}

impl Generate for EngineHandle {
    fn model(&self) -> &ModelInfo {
        EngineHandle::model(self)
    }

    fn submit(&self, request: GenerateRequest) -> BoxFuture<'_, Result<EventStream>> {
        Box::pin(std::future::ready(EngineHandle::submit(self, request)))
    }
}

/// Keeps a prefix's KV blocks pinned on the device; dropping it unpins them.
pub struct PrefixPin {
    id: u64,
    tokens: usize,
    /// Blocks pinned, once known.
    blocks: Option<usize>,
    /// Answers once the prefill has run and its blocks are pinned.
    ready: Option<tokio::sync::oneshot::Receiver<usize>>,
    commands: Sender<Command>,
}

impl PrefixPin {
    /// Length of the pinned prefix in tokens (only its full blocks are pinned).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Waits until the prefix is prefilled and pinned; returns how many blocks were pinned: 0
    /// when the prefill failed (the engine stopped, or the cache could not hold the prefix).
    pub async fn pinned(&mut self) -> usize {
        if let Some(ready) = self.ready.take() {
            self.blocks = Some(ready.await.unwrap_or(0));
        }
        self.blocks.unwrap_or(0)
    }
}

impl Drop for PrefixPin {
    fn drop(&mut self) {
        // An engine that has stopped holds nothing to unpin.
        let _ = self.commands.send(Command::Unpin { id: self.id });
    }
}

/// The events of one request, in the order [`Event`] states: the prompt's log-probabilities when
/// asked for, deltas, then one `Finished`. Dropping it cancels the request.
pub struct EventStream {
    id: RequestId,
    prompt_tokens: usize,
    rx: Receiver<Event>,
}

/// Events a request's stream holds unread at most, unless configured otherwise
/// ([`EngineConfig::max_unread_events`]). A reader that falls this far behind has stopped
/// reading: the engine ends its request rather than wait for it or buffer without end.
pub const EVENT_BUFFER: usize = 1024;

/// A channel for one request's events, bounded by [`EVENT_BUFFER`]: what a stream served
/// elsewhere (another process, a relay) is fed through.
pub fn event_channel() -> (tokio::sync::mpsc::Sender<Event>, Receiver<Event>) {
    tokio::sync::mpsc::channel(EVENT_BUFFER)
}

impl EventStream {
    /// A stream fed by `rx`, for requests served elsewhere than in this process: whoever holds
    /// the sender sends the events in [`Event`]'s order and sees the stream dropped as the
    /// sender closing.
    pub fn new(id: RequestId, prompt_tokens: usize, rx: Receiver<Event>) -> Self {
        Self {
            id,
            prompt_tokens,
            rx,
        }
    }

    pub fn id(&self) -> RequestId {
        self.id
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    pub async fn next(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// For synchronous callers (tools, tests); never call it inside an async runtime.
    pub fn blocking_next(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }
}

impl futures::Stream for EventStream {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        self.rx.poll_recv(cx)
    }
}
