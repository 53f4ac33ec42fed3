//! Paged KV cache: fixed-size blocks of key/value vectors, handed out to sequences by a pool.
//!
//! [`BlockPool`] decides which blocks are free and who holds them; [`KvStorage`] is the memory
//! the blocks name. A sequence's [`BlockTable`] returns its blocks to the pool when it is dropped,
//! so no path (finish, error, cancel, preemption, deadline) can leak one.

pub mod block_pool;
pub mod storage;

pub use block_pool::{BlockId, BlockPool, BlockTable};
pub use storage::{KvLayout, KvStorage};
