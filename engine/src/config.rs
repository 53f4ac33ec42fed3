//! The engine's settings: one struct that is both command-line flags and the `[engine]` section
//! of the configuration file.

use std::path::PathBuf;

use crate::model::DeviceWeights;
use crate::speculative::Speculative;
use crate::DeviceSpec;

/// Engine settings. Every flag also reads a `SWARMGATE_*` environment variable.
#[derive(Clone, Debug, clap::Args, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// The GGUF model to serve.
    #[arg(
        long,
        env = "SWARMGATE_MODEL",
        default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    )]
    pub model: PathBuf,
    /// More GGUF models for the same engine (repeat the flag, or separate them with commas):
    /// one scheduler batches every model's sequences, and their KV blocks come from one pool
    /// (each block the memory of the largest model's --block-size tokens; a smaller model's
    /// blocks hold as many tokens as fit), so memory moves to whichever model the load is on.
    /// Requests name a model by its file's stem; the first model is the default.
    #[arg(
        long = "extra-model",
        env = "SWARMGATE_EXTRA_MODELS",
        value_delimiter = ','
    )]
    pub extra_models: Vec<PathBuf>,
    /// Where the model runs: `cpu`, or `cuda:N` (a build with the `cuda` feature).
    #[arg(long, env = "SWARMGATE_DEVICE", default_value = "cpu")]
    pub device: DeviceSpec,
    /// Memory for the device tier of the KV cache, in MiB; the block pool is preallocated from it,
    /// resident from start-up.
    #[arg(long, env = "SWARMGATE_KV_CACHE_MB", default_value_t = 1024)]
    pub kv_cache_mb: usize,
    /// On a GPU, the form of the weights: `f32` (dequantized once at load: the CPU kernels'
    /// products, 4 bytes a weight), `f16` (half of that, tensor-core GEMMs), or `quantized` (the
    /// GGUF's blocks, candle's quantized kernels: the least memory).
    #[arg(long, env = "SWARMGATE_GPU_WEIGHTS", value_enum, default_value_t = DeviceWeights::F32)]
    pub gpu_weights: DeviceWeights,
    /// On a GPU, the share of its memory this engine may hold (weights, activations and the KV
    /// pool, which gets what remains), as vLLM's flag; overrides --kv-cache-mb there.
    #[arg(long, env = "SWARMGATE_GPU_MEMORY_UTILIZATION")]
    pub gpu_memory_utilization: Option<f64>,
    /// Size the device pool in blocks instead (overrides --kv-cache-mb); small values force
    /// the host tier into use.
    #[arg(long, env = "SWARMGATE_DEVICE_KV_BLOCKS")]
    pub device_kv_blocks: Option<usize>,
    /// Memory for the host tier (an LRU store in CPU RAM for evicted and swapped-out blocks), in
    /// MiB; 0 disables it (evicted blocks are dropped, preemption recomputes).
    #[arg(long, env = "SWARMGATE_HOST_KV_CACHE_MB", default_value_t = 2048)]
    pub host_kv_cache_mb: usize,
    /// Reuse the KV blocks of prompt prefixes seen before (automatic prefix caching).
    #[arg(long, env = "SWARMGATE_PREFIX_CACHE", default_value_t = true, action = clap::ArgAction::Set)]
    pub prefix_cache: bool,
    /// Serve agent runs first come, first served by each run's first arrival (within a priority
    /// class), so a run's later turns do not queue behind runs that started after it; false:
    /// every request by its own arrival.
    #[arg(long, env = "SWARMGATE_RUN_SCHEDULING", default_value_t = true, action = clap::ArgAction::Set)]
    pub run_scheduling: bool,
    /// With run scheduling, most agent runs in progress at once: runs with a turn in the
    /// engine, and runs whose last turn waits for a tool (for at most --tool-kv-ttl-max-secs).
    /// A run's later turns are never held back by it; a new run (or a run-less request) waits
    /// to start until one of them finishes. Set it near the batch beyond which the device's throughput
    /// stops growing on long agent contexts: the runs that started first then finish first
    /// instead of every run sharing the engine until the end. 0: no limit.
    #[arg(long, env = "SWARMGATE_MAX_ACTIVE_RUNS", default_value_t = 0)]
    pub max_active_runs: usize,
    /// Tokens per KV block.
    #[arg(long, env = "SWARMGATE_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// Most tokens in one forward pass (decode tokens plus prefill chunks). Smaller keeps
    /// inter-token latency low while long prompts are prefilled; larger prefills faster.
    #[arg(long, env = "SWARMGATE_MAX_STEP_TOKENS", default_value_t = 256)]
    pub max_step_tokens: usize,
    /// Most sequences decoding at once.
    #[arg(long, env = "SWARMGATE_MAX_RUNNING", default_value_t = 64)]
    pub max_running: usize,
    /// Most requests in the engine (running and queued); beyond it submissions are refused as
    /// overloaded rather than queued without bound.
    #[arg(long, env = "SWARMGATE_MAX_QUEUED", default_value_t = 512)]
    pub max_queued: usize,
    /// Events a request's stream may hold unread (about one per token); a reader this far
    /// behind has stopped reading, and its request ends with an error instead of holding its
    /// memory.
    #[arg(long, env = "SWARMGATE_MAX_UNREAD_EVENTS", default_value_t = crate::EVENT_BUFFER)]
    pub max_unread_events: usize,
    /// Compute threads (default: one per core).
    #[arg(long, env = "SWARMGATE_THREADS")]
    pub threads: Option<usize>,
    /// Speculative decoding: `ngram` drafts a decode step's next tokens from the tokens the
    /// sequence already holds (prompt lookup: agents copy from their context) and checks them
    /// in the same forward, while steps are narrow enough for that to pay; the tokens are the
    /// same as with `off`.
    #[arg(long, env = "SWARMGATE_SPECULATIVE", value_enum, default_value_t = Speculative::Ngram)]
    pub speculative: Speculative,
    /// With speculative decoding, drafts are added to a step while it holds at most this many
    /// tokens: up to there a step costs about what one token does (its weights are read once
    /// for all of its rows), so a wrong guess costs little. Wider steps (many sequences
    /// decoding) draft nothing.
    #[arg(long, env = "SWARMGATE_SPECULATIVE_STEP_TOKENS", default_value_t = 8)]
    pub speculative_step_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            model: PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            extra_models: Vec::new(),
            device: DeviceSpec::Cpu,
            kv_cache_mb: 1024,
            gpu_weights: DeviceWeights::F32,
            gpu_memory_utilization: None,
            device_kv_blocks: None,
            host_kv_cache_mb: 2048,
            prefix_cache: true,
            run_scheduling: true,
            max_active_runs: 0,
            block_size: 16,
            max_step_tokens: 256,
            max_running: 64,
            max_queued: 512,
            max_unread_events: crate::EVENT_BUFFER,
            threads: None,
            speculative: Speculative::Ngram,
            speculative_step_tokens: 8,
        }
    }
}

impl EngineConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.block_size == 0 || self.max_step_tokens == 0 || self.max_running == 0 {
            return Err("block size, step tokens and running sequences must be positive".into());
        }
        if self.max_unread_events < 8 {
            return Err("max_unread_events must be at least 8".into());
        }
        if self.threads == Some(0) {
            return Err("threads must be positive".into());
        }
        if let Some(share) = self.gpu_memory_utilization {
            if !(share > 0.0 && share <= 1.0) {
                return Err(format!(
                    "gpu_memory_utilization must be in (0, 1], not {share}"
                ));
            }
            if self.device == DeviceSpec::Cpu {
                return Err("gpu_memory_utilization needs a GPU device (--device cuda:N)".into());
            }
        }
        Ok(())
    }

    pub fn threads(&self) -> usize {
        self.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
    }
}
