//! The KV cache: fixed-size blocks of keys and values in two tiers.
//!
//! - [`block_pool`]: the device tier's books (reference counts, free list, cached blocks in LRU
//!   order, pins);
//! - [`host_tier`]: the host tier's books (cached and swapped blocks in CPU RAM);
//! - [`prefix`]: content addresses of full blocks, chained over the whole prefix;
//! - [`manager`]: the policy over both (prefix reuse, eviction to the host, swapping) and the
//!   per-sequence [`BlockTable`], which frees its blocks when dropped;
//! - [`storage`]: the memory itself, and the copies between the tiers;
//! - `transfer`: the transfers behind those copies for a cache held as tensors (on a GPU,
//!   asynchronous, on a copy stream of their own).

pub mod block_pool;
pub mod host_tier;
pub mod manager;
pub mod prefix;
pub mod storage;
mod transfer;

pub use block_pool::BlockId;
pub use host_tier::HostSlot;
pub use manager::{
    most_that_fit, BlockTable, CopyOp, KvConfig, KvCounters, KvGauges, KvGroup, KvManager, KvShape,
    PrefixHit, SwappedBlocks, GONE,
};
pub use prefix::{BlockHash, BlockKey};
pub use storage::{HostStore, KvDtype, KvLayout, KvStorage, LayerKv, Slots};
