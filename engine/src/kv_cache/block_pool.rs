//! The pool of KV blocks: a flat array of reference counts and a free list.
//!
//! Design: blocks are identified by index ([`BlockId`]); the pool keeps one reference count per
//! block and a LIFO free list (recently freed blocks are reused first, warm in cache).
//! Allocation and release are O(1) per block. A [`BlockTable`] is the only way to hold blocks:
//! it owns one reference to each of its blocks and gives them back on `drop`.
//!
//! Invariants: a block is on the free list exactly when its reference count is zero; the number
//! of free blocks plus the number of referenced blocks is the pool size.
//!
//! The engine is single-threaded, so the shared state is an `Rc<RefCell<_>>`; borrows are never
//! held across calls out of this module.

use std::cell::RefCell;
use std::rc::Rc;

/// Index of a block in the pool (and in [`super::KvStorage`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

#[derive(Debug)]
struct PoolState {
    ref_counts: Vec<u32>,
    free: Vec<BlockId>,
}

/// Cloneable handle to the pool; clones share it.
#[derive(Clone, Debug)]
pub struct BlockPool {
    state: Rc<RefCell<PoolState>>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        let free = (0..num_blocks as u32).rev().map(BlockId).collect();
        Self {
            state: Rc::new(RefCell::new(PoolState {
                ref_counts: vec![0; num_blocks],
                free,
            })),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.state.borrow().ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.state.borrow().free.len()
    }

    /// An empty table whose blocks come from this pool.
    pub fn table(&self) -> BlockTable {
        BlockTable {
            pool: self.clone(),
            blocks: Vec::new(),
        }
    }

    /// Takes `n` free blocks, or none if fewer are free.
    fn take(&self, n: usize) -> Option<Vec<BlockId>> {
        let mut s = self.state.borrow_mut();
        if s.free.len() < n {
            return None;
        }
        let at = s.free.len() - n;
        let taken: Vec<BlockId> = s.free.split_off(at);
        for b in &taken {
            debug_assert_eq!(s.ref_counts[b.index()], 0);
            s.ref_counts[b.index()] = 1;
        }
        Some(taken)
    }

    fn release(&self, blocks: &[BlockId]) {
        let mut s = self.state.borrow_mut();
        for &b in blocks.iter().rev() {
            let rc = &mut s.ref_counts[b.index()];
            assert!(*rc > 0, "block {b:?} released more often than taken");
            *rc -= 1;
            if *rc == 0 {
                s.free.push(b);
            }
        }
    }

    /// Checks the pool's invariants; for tests and debug assertions.
    pub fn check_invariants(&self) -> Result<(), String> {
        let s = self.state.borrow();
        let mut on_free = vec![false; s.ref_counts.len()];
        for b in &s.free {
            if std::mem::replace(&mut on_free[b.index()], true) {
                return Err(format!("{b:?} is on the free list twice"));
            }
        }
        for (i, (&rc, &free)) in s.ref_counts.iter().zip(&on_free).enumerate() {
            if (rc == 0) != free {
                return Err(format!("block {i}: ref count {rc}, on free list: {free}"));
            }
        }
        Ok(())
    }
}

/// The blocks of one sequence, in position order: token `p` lives in `blocks[p / block_size]`.
#[derive(Debug)]
pub struct BlockTable {
    pool: BlockPool,
    blocks: Vec<BlockId>,
}

impl BlockTable {
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Grows the table to `n` blocks; all or nothing. Returns false when the pool has too few.
    pub fn grow_to(&mut self, n: usize) -> bool {
        if n <= self.blocks.len() {
            return true;
        }
        match self.pool.take(n - self.blocks.len()) {
            Some(new) => {
                self.blocks.extend(new);
                true
            }
            None => false,
        }
    }

    /// Gives every block back (preemption by recompute).
    pub fn clear(&mut self) {
        self.pool.release(&self.blocks);
        self.blocks.clear();
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_return_blocks_on_drop() {
        let pool = BlockPool::new(8);
        let mut a = pool.table();
        assert!(a.grow_to(3));
        let mut b = pool.table();
        assert!(b.grow_to(5));
        assert_eq!(pool.num_free(), 0);
        assert!(!a.grow_to(4), "pool is exhausted");
        assert_eq!(a.len(), 3, "a failed grow takes nothing");
        drop(b);
        assert_eq!(pool.num_free(), 5);
        a.clear();
        assert_eq!(pool.num_free(), 8);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn freed_blocks_are_reused_first() {
        let pool = BlockPool::new(4);
        let mut a = pool.table();
        assert!(a.grow_to(1));
        let first = a.blocks()[0];
        drop(a);
        let mut b = pool.table();
        assert!(b.grow_to(1));
        assert_eq!(b.blocks()[0], first);
    }
}
