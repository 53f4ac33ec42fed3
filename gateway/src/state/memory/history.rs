//! [`Histories`]: the conversation histories of a [`super::MemoryStore`], bounded in time and
//! in bytes.
//!
//! Each history expires `ttl` after its last read or append, and an append trims it to its
//! [`HistoryLimit`] (see [`crate::state`]). Over all histories, the store holds at most `budget`
//! bytes (entries and names): past it, an append first drops expired histories, then the ones
//! that would expire soonest, which, every session having the same TTL, are the least recently
//! used. Only the history just appended to is never dropped for the budget, so the store holds
//! at most `budget` plus that one history.
//!
//! Expiry is kept in an ordered index beside the map, so dropping the expired or the oldest
//! histories costs O(log n) each, and reads and appends cost O(log n) plus the history's own
//! entries (a read copies them out; an append may walk them to trim).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::state::HistoryLimit;

/// The histories of one process, behind the store's lock.
#[derive(Debug)]
pub struct Histories {
    by_name: HashMap<String, History>,
    /// Every history's name by its expiry; the sequence number tells equal instants apart.
    by_expiry: BTreeMap<(Instant, u64), String>,
    /// Bytes of every history's entries and name.
    bytes: usize,
    budget: usize,
    next: u64,
}

#[derive(Debug)]
struct History {
    /// The opening first, then the turns, oldest first.
    entries: VecDeque<String>,
    /// Bytes of `entries`.
    bytes: usize,
    expiry: (Instant, u64),
}

impl Histories {
    /// No histories, holding at most `budget` bytes in all (as the module header says).
    pub fn new(budget: usize) -> Self {
        Self {
            by_name: HashMap::new(),
            by_expiry: BTreeMap::new(),
            bytes: 0,
            budget,
            next: 0,
        }
    }

    /// The entries of `name` as of `now` (empty when there is none), kept until `now + ttl`.
    pub fn read(&mut self, name: &str, ttl: Duration, now: Instant) -> Vec<String> {
        self.drop_expired(now);
        let expiry = self.expiry(now, ttl);
        let Some(history) = self.by_name.get_mut(name) else {
            return Vec::new();
        };
        let old = std::mem::replace(&mut history.expiry, expiry);
        let entries = history.entries.iter().cloned().collect();
        self.by_expiry.remove(&old);
        self.by_expiry.insert(expiry, name.to_owned());
        entries
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
        self.drop_expired(now);
        let expiry = self.expiry(now, limit.ttl);
        match self.by_name.get_mut(name) {
            Some(history) => {
                self.by_expiry.remove(&history.expiry);
                history.expiry = expiry;
            }
            None => {
                self.bytes += name.len() + opening.len();
                let entries = VecDeque::from([opening.to_owned()]);
                let bytes = opening.len();
                let history = History {
                    entries,
                    bytes,
                    expiry,
                };
                self.by_name.insert(name.to_owned(), history);
            }
        }
        self.by_expiry.insert(expiry, name.to_owned());
        let history = self.by_name.get_mut(name).expect("found or made above");
        history.entries.push_back(turn.to_owned());
        history.bytes += turn.len();
        self.bytes += turn.len();
        // Entry 0 is the opening and the last one the turn just appended: both stay.
        while history.bytes > limit.max_bytes && history.entries.len() > 2 {
            let dropped = history.entries.remove(1).expect("more than two entries");
            history.bytes -= dropped.len();
            self.bytes -= dropped.len();
        }
        while self.bytes > self.budget {
            let Some((&oldest, victim)) = self.by_expiry.iter().next() else {
                break;
            };
            if victim == name {
                // The history just appended to expires last: nothing else is left to drop.
                break;
            }
            self.remove(oldest);
        }
    }

    fn expiry(&mut self, now: Instant, ttl: Duration) -> (Instant, u64) {
        self.next += 1;
        (now + ttl, self.next)
    }

    fn drop_expired(&mut self, now: Instant) {
        while let Some(&expiry) = self.by_expiry.keys().next() {
            if expiry.0 > now {
                return;
            }
            self.remove(expiry);
        }
    }

    fn remove(&mut self, expiry: (Instant, u64)) {
        let name = self
            .by_expiry
            .remove(&expiry)
            .expect("the index holds the expiry");
        let history = self
            .by_name
            .remove(&name)
            .expect("every indexed name has a history");
        self.bytes -= name.len() + history.bytes;
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
            .by_name
            .iter()
            .map(|(name, h)| name.len() + h.entries.iter().map(String::len).sum::<usize>())
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
        assert_eq!(store.bytes, counted(&store));
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
        assert_eq!(store.by_name.len(), 1, "the expired history was dropped");
        assert_eq!(store.bytes, counted(&store));
        assert!(store.read("s", TTL, t2 + TTL).is_empty());
        assert_eq!((store.bytes, store.by_expiry.len()), (0, 0));
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
        assert_eq!(store.bytes, counted(&store));
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
        assert_eq!(store.bytes, 40, "exactly the budget: nothing dropped");
        let t1 = t0 + Duration::from_secs(10);
        // "a" is used again, so "b" is now the least recently used.
        assert_eq!(store.read("a", TTL, t1).len(), 2);
        store.append("e", "o", &turn, limit(100), t1);
        assert!(store.read("b", TTL, t1).is_empty(), "b was dropped");
        for name in ["a", "c", "d", "e"] {
            assert_eq!(store.read(name, TTL, t1).len(), 2, "{name} stays");
        }
        assert!(store.bytes <= 40);
        // A history larger than the whole budget pushes out every other one, not itself.
        let huge = "h".repeat(100);
        store.append("big", "o", &huge, limit(1000), t1);
        assert_eq!(store.by_name.len(), 1);
        assert_eq!(store.read("big", TTL, t1).len(), 2);
        assert_eq!(store.bytes, counted(&store));
    }
}
