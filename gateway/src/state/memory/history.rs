//! [`Histories`]: the conversation histories of a [`super::MemoryStore`], bounded in time and
//! in bytes.
//!
//! Each history expires `ttl` after its last read or append, and an append trims it to its
//! [`HistoryLimit`] (see [`crate::state`]). Over all histories, the store holds at most `budget`
//! bytes (entries and names), as an [`Expiring`] map does: past it, an append drops the
//! histories that would expire soonest (the least recently used), never the one appended to.
//! Reads and appends cost O(log n) plus the history's own entries (a read copies them out; an
//! append may walk them to trim).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::expiring::Expiring;
use crate::state::HistoryLimit;

/// The histories of one process, behind the store's lock: each one's entries, the opening
/// first, then the turns, oldest first.
#[derive(Debug)]
pub struct Histories(Expiring<VecDeque<String>>);

impl Histories {
    /// No histories, holding at most `budget` bytes in all (as the module header says).
    pub fn new(budget: usize) -> Self {
        Self(Expiring::new(budget))
    }

    /// The entries of `name` as of `now` (empty when there is none), kept until `now + ttl`.
    pub fn read(&mut self, name: &str, ttl: Duration, now: Instant) -> Vec<String> {
        self.0
            .touch(name, ttl, now)
            .map(|entries| entries.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Appends `turn` to `name` (created with `opening` if absent) as of `now`, trims it to
    /// `limit`, then brings the store back within its budget.
    pub fn append(
        &mut self,
        name: &str,
        opening: &str,
        turn: &str,
        limit: HistoryLimit,
        now: Instant,
    ) {
        if self.0.touch(name, limit.ttl, now).is_none() {
            let entries = VecDeque::from([opening.to_owned()]);
            self.0.insert(name, entries, opening.len(), limit.ttl, now);
        }
        let entries = self
            .0
            .touch(name, limit.ttl, now)
            .expect("found or made above");
        entries.push_back(turn.to_owned());
        let mut size: usize = entries.iter().map(String::len).sum();
        // Entry 0 is the opening and the last one the turn just appended: both stay.
        while size > limit.max_bytes && entries.len() > 2 {
            let dropped = entries.remove(1).expect("more than two entries");
            size -= dropped.len();
        }
        self.0.resize(name, size);
        self.0.fit(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(60);

    fn limit(max_bytes: usize) -> HistoryLimit {
        HistoryLimit {
            ttl: TTL,
            max_bytes,
        }
    }

    /// The store's bytes as its histories' entries and names add up.
    fn counted(histories: &Histories) -> usize {
        histories
            .0
            .iter()
            .map(|(name, h)| name.len() + h.iter().map(String::len).sum::<usize>())
            .sum()
    }

    #[test]
    fn a_history_is_its_opening_then_its_turns() {
        let mut store = Histories::new(1 << 20);
        let t0 = Instant::now();
        assert!(store.read("s", TTL, t0).is_empty());
        store.append("s", "open", "one", limit(1000), t0);
        store.append("s", "ignored", "two", limit(1000), t0);
        assert_eq!(
            store.read("s", TTL, t0),
            ["open", "one", "two"],
            "the opening is only taken when the history starts"
        );
        assert!(store.read("other", TTL, t0).is_empty());
        assert_eq!(store.0.bytes(), counted(&store));
    }

    #[test]
    fn a_history_expires_ttl_after_its_last_use() {
        let mut store = Histories::new(1 << 20);
        let t0 = Instant::now();
        store.append("s", "", "one", limit(1000), t0);
        store.append("idle", "", "one", limit(1000), t0);
        // Read just before it would expire: kept for another TTL from then.
        let t1 = t0 + TTL - Duration::from_millis(1);
        assert_eq!(store.read("s", TTL, t1).len(), 2);
        let t2 = t0 + TTL + Duration::from_secs(1);
        assert_eq!(store.read("s", TTL, t2).len(), 2, "refreshed at t1");
        assert!(
            store.read("idle", TTL, t2).is_empty(),
            "unused for a TTL: gone"
        );
        assert_eq!(store.0.len(), 1, "the expired history was dropped");
        assert_eq!(store.0.bytes(), counted(&store));
        assert!(store.read("s", TTL, t2 + TTL).is_empty());
        assert_eq!((store.0.bytes(), store.0.len()), (0, 0));
    }

    #[test]
    fn over_its_cap_a_history_drops_its_oldest_turns_but_not_its_opening() {
        let mut store = Histories::new(1 << 20);
        let t0 = Instant::now();
        // Opening 4 bytes, turns 3 bytes each: 13 bytes hold the opening and three turns.
        for turn in ["one", "two", "six", "ten"] {
            store.append("s", "open", turn, limit(13), t0);
        }
        assert_eq!(store.read("s", TTL, t0), ["open", "two", "six", "ten"]);
        // A turn larger than the cap on its own is kept, and only it.
        let long = "x".repeat(50);
        store.append("s", "open", &long, limit(13), t0);
        assert_eq!(store.read("s", TTL, t0), ["open", long.as_str()]);
        assert_eq!(store.0.bytes(), counted(&store));
    }

    #[test]
    fn past_the_budget_the_least_recently_used_histories_go() {
        // Each history: a 1-byte name, a 1-byte opening and 8-byte turns.
        let mut store = Histories::new(40);
        let t0 = Instant::now();
        let turn = "t".repeat(8);
        for (i, name) in ["a", "b", "c", "d"].into_iter().enumerate() {
            store.append(
                name,
                "o",
                &turn,
                limit(100),
                t0 + Duration::from_secs(i as u64),
            );
        }
        assert_eq!(store.0.bytes(), 40, "exactly the budget: nothing dropped");
        let t1 = t0 + Duration::from_secs(10);
        // "a" is used again, so "b" is now the least recently used.
        assert_eq!(store.read("a", TTL, t1).len(), 2);
        store.append("e", "o", &turn, limit(100), t1);
        assert!(store.read("b", TTL, t1).is_empty(), "b was dropped");
        for name in ["a", "c", "d", "e"] {
            assert_eq!(store.read(name, TTL, t1).len(), 2, "{name} stays");
        }
        assert!(store.0.bytes() <= 40);
        // A history larger than the whole budget pushes out every other one, not itself.
        let huge = "h".repeat(100);
        store.append("big", "o", &huge, limit(1000), t1);
        assert_eq!(store.0.len(), 1);
        assert_eq!(store.read("big", TTL, t1).len(), 2);
        assert_eq!(store.0.bytes(), counted(&store));
    }
}
