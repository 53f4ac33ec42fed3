//! Agent runs as the engine sees them: when each run first arrived (its place in the queue), the
//! KV blocks its last turn left held on the device, and how long to hold them.
//!
//! An agent's turn that ends in tool calls is followed, after the tool's pause, by a turn whose
//! prompt is everything so far plus the tool's result. Holding the finished turn's blocks on the
//! device for that pause saves the follow-up from recomputing them (or reloading them from the
//! host tier); holding them too long keeps device memory from others. The time-to-live is a
//! small cost model, per program (agent):
//!
//! - *benefit* of holding for `τ`: the chance that the pause is at most `τ` (from the pauses
//!   seen between that program's turns) times the seconds the follow-up would otherwise spend
//!   bringing the blocks back (recomputed at the measured prefill speed, or reloaded from the
//!   host tier at the measured copy speed when it has room);
//! - *cost*: the share of the device pool held, times the expected time it is held
//!   (`E[min(pause, τ)]`), times how contended the pool is (0 when idle, 1 when demand fills
//!   it): the engine time others lose to memory they could not have.
//!
//! The TTL is the `τ` with the greatest benefit less cost, among the pauses seen (with a margin)
//! and the bound; until a program has shown a few pauses, the bound itself.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::kv_cache::BlockKey;

/// Pauses kept per program: the most recent ones.
const PAUSES_KEPT: usize = 64;
/// Pauses a program must have shown before its TTL is fitted to them.
const MIN_PAUSES: usize = 3;
/// A TTL covers a pause with this much to spare.
const PAUSE_MARGIN: f64 = 1.25;
/// Runs remembered; past this, those idle longest (holding nothing) are forgotten.
const MAX_RUNS: usize = 16_384;
/// How fast the measured speeds and pressure follow what they measure (per observation).
const EWMA_ALPHA: f64 = 0.1;

/// What holding a turn's blocks would save and cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HoldCost {
    /// Seconds the follow-up would spend bringing the blocks back without the hold.
    pub saved_secs: f64,
    /// Share of the device pool the hold takes (0 to 1).
    pub share: f64,
    /// How contended the pool is: 0 idle, 1 demand fills it.
    pub pressure: f64,
}

/// The TTL for a hold: see the module's documentation. `pauses` in seconds, any order.
pub fn choose_ttl(pauses: &[f64], cost: HoldCost, max_secs: f64) -> f64 {
    if max_secs <= 0.0 {
        return 0.0;
    }
    if pauses.len() < MIN_PAUSES {
        return max_secs;
    }
    let n = pauses.len() as f64;
    let value = |ttl: f64| {
        let covered = pauses.iter().filter(|&&p| p <= ttl).count() as f64 / n;
        let held = pauses.iter().map(|&p| p.min(ttl)).sum::<f64>() / n;
        covered * cost.saved_secs - cost.pressure * cost.share * held
    };
    let candidates = pauses
        .iter()
        .map(|p| (p * PAUSE_MARGIN).min(max_secs))
        .chain([0.0, max_secs]);
    // The best value; between equals, the shorter time.
    candidates
        .map(|ttl| (value(ttl), ttl))
        .fold((f64::NEG_INFINITY, 0.0), |best, c| {
            if c.0 > best.0 || (c.0 == best.0 && c.1 < best.1) {
                c
            } else {
                best
            }
        })
        .1
}

/// Blocks held for a run until `until`.
#[derive(Debug)]
struct Hold {
    keys: Vec<BlockKey>,
    until: Instant,
}

#[derive(Debug)]
struct RunState {
    first_arrival: u64,
    last_seen: Instant,
    /// Set when its last turn ended waiting for a tool: the program, and when.
    paused: Option<(String, Instant)>,
    hold: Option<Hold>,
    /// Set while its last turn waits for a tool: until when the run counts as in progress
    /// (its next turn's admission ends that).
    waits_until: Option<Instant>,
}

/// A moving average that starts at a prior.
#[derive(Clone, Copy, Debug)]
struct Ewma(f64);

impl Ewma {
    fn observe(&mut self, x: f64) {
        if x.is_finite() {
            self.0 += EWMA_ALPHA * (x - self.0);
        }
    }
}

/// The engine's books on runs and holds, and the measurements the TTL is priced with.
#[derive(Debug)]
pub struct Runs {
    runs: HashMap<String, RunState>,
    /// Every hold's end and its run, soonest first: expiry looks at the due ones only.
    expiries: BTreeSet<(Instant, String)>,
    /// Every run waiting for a tool, by the end of its wait: see [`Runs::waiting_for_tools`].
    tool_waits: BTreeSet<(Instant, String)>,
    pauses: HashMap<String, VecDeque<f64>>,
    /// Seconds of forward pass per prefilled token.
    prefill_secs_per_token: Ewma,
    /// Seconds to copy one block between the tiers.
    copy_secs_per_block: Ewma,
    pressure: Ewma,
}

impl Default for Runs {
    fn default() -> Self {
        Self {
            runs: HashMap::new(),
            expiries: BTreeSet::new(),
            tool_waits: BTreeSet::new(),
            pauses: HashMap::new(),
            // Priors, until steps are measured: a small model's prefill on a CPU, a memcpy.
            prefill_secs_per_token: Ewma(1e-3),
            copy_secs_per_block: Ewma(2e-5),
            pressure: Ewma(0.0),
        }
    }
}

impl Runs {
    /// A turn of `run` arrives as the engine's `arrival`-th request: returns the run's first
    /// arrival, and learns the pause since its last turn when that one waited for a tool.
    pub fn arrive(&mut self, run: &str, arrival: u64, now: Instant) -> u64 {
        if self.runs.len() >= MAX_RUNS && !self.runs.contains_key(run) {
            self.forget_idle();
        }
        let state = self.runs.entry(run.to_owned()).or_insert(RunState {
            first_arrival: arrival,
            last_seen: now,
            paused: None,
            hold: None,
            waits_until: None,
        });
        state.last_seen = now;
        if let Some((program, since)) = state.paused.take() {
            let pauses = self.pauses.entry(program).or_default();
            if pauses.len() == PAUSES_KEPT {
                pauses.pop_front();
            }
            pauses.push_back(now.duration_since(since).as_secs_f64());
        }
        state.first_arrival
    }

    /// Forgets the runs holding nothing, idle longest first, down to half the bound.
    fn forget_idle(&mut self) {
        let mut idle: Vec<(Instant, String)> = self
            .runs
            .iter()
            .filter(|(_, r)| r.hold.is_none())
            .map(|(id, r)| (r.last_seen, id.clone()))
            .collect();
        idle.sort();
        let excess = self.runs.len().saturating_sub(MAX_RUNS / 2);
        for (_, id) in idle.into_iter().take(excess) {
            if let Some(until) = self.runs.remove(&id).and_then(|r| r.waits_until) {
                self.tool_waits.remove(&(until, id));
            }
        }
    }

    /// The next turn of `run` is waiting to be admitted: the hold its last turn left lasts until
    /// then, or at most until `bound`. (Its time was chosen for the tool's pause; a turn that
    /// queues for room would otherwise find its blocks let go while it waits.)
    pub fn keep_for_next_turn(&mut self, run: &str, bound: Instant) {
        let Some(hold) = self.runs.get_mut(run).and_then(|r| r.hold.as_mut()) else {
            return;
        };
        if hold.until < bound {
            self.expiries.remove(&(hold.until, run.to_owned()));
            hold.until = bound;
            self.expiries.insert((bound, run.to_owned()));
        }
    }

    /// When `run` first arrived, if it is known.
    pub fn first_arrival(&self, run: &str) -> Option<u64> {
        self.runs.get(run).map(|r| r.first_arrival)
    }

    /// A turn of `run` was admitted: the hold its last turn left is over (its blocks are the
    /// new turn's now); returns its keys, to let go.
    pub fn admitted(&mut self, run: &str) -> Option<Vec<BlockKey>> {
        let hold = self.runs.get_mut(run)?.hold.take()?;
        self.expiries.remove(&(hold.until, run.to_owned()));
        Some(hold.keys)
    }

    /// The next turn of `run` was admitted: it no longer waits for a tool.
    pub fn resumed(&mut self, run: &str) {
        if let Some(until) = self.runs.get_mut(run).and_then(|r| r.waits_until.take()) {
            self.tool_waits.remove(&(until, run.to_owned()));
        }
    }

    /// A turn of `run` ended; `paused` names its program when it waits for a tool, and until
    /// when the run counts as in progress without a turn in the engine. `keys` are now held
    /// until `until` (when set); returns the keys of the hold this one replaces.
    pub fn ended(
        &mut self,
        run: &str,
        paused: Option<(&str, Instant)>,
        hold: Option<(Vec<BlockKey>, Instant)>,
        now: Instant,
    ) -> Option<Vec<BlockKey>> {
        let state = self.state(run, now);
        state.paused = paused.map(|(p, _)| (p.to_owned(), now));
        let waits_until = paused.map(|(_, until)| until);
        if let Some(old) = std::mem::replace(&mut state.waits_until, waits_until) {
            self.tool_waits.remove(&(old, run.to_owned()));
        }
        if let Some(until) = waits_until {
            self.tool_waits.insert((until, run.to_owned()));
        }
        self.hold(run, hold, now)
    }

    /// Ends the waits for tools whose bound has passed at `now`.
    pub fn end_tool_waits(&mut self, now: Instant) {
        while let Some((until, run)) = self.tool_waits.pop_first() {
            if until > now {
                self.tool_waits.insert((until, run));
                break;
            }
            if let Some(state) = self.runs.get_mut(&run) {
                state.waits_until = None;
            }
        }
    }

    /// The runs in progress without a turn in the engine: their last turn waits for a tool
    /// (see [`Runs::end_tool_waits`]). Their first arrivals.
    pub fn waiting_for_tools(&self) -> impl Iterator<Item = u64> + '_ {
        self.tool_waits
            .iter()
            .map(|(_, run)| self.runs[run].first_arrival)
    }

    /// `keys` of `run` are now held until `until` (when set), in place of what was; returns
    /// the keys of the hold this one replaces.
    pub fn hold(
        &mut self,
        run: &str,
        hold: Option<(Vec<BlockKey>, Instant)>,
        now: Instant,
    ) -> Option<Vec<BlockKey>> {
        let new = hold.map(|(keys, until)| Hold { keys, until });
        let until = new.as_ref().map(|h| h.until);
        let old = std::mem::replace(&mut self.state(run, now).hold, new);
        // The old expiry goes first: the new one may fall on the same instant.
        if let Some(old) = &old {
            self.expiries.remove(&(old.until, run.to_owned()));
        }
        if let Some(until) = until {
            self.expiries.insert((until, run.to_owned()));
        }
        old.map(|h| h.keys)
    }

    fn state(&mut self, run: &str, now: Instant) -> &mut RunState {
        let state = self.runs.entry(run.to_owned()).or_insert(RunState {
            first_arrival: 0,
            last_seen: now,
            paused: None,
            hold: None,
            waits_until: None,
        });
        state.last_seen = now;
        state
    }

    /// Holds whose time is up at `now`: their keys, to let go.
    pub fn expire(&mut self, now: Instant) -> Vec<Vec<BlockKey>> {
        let mut expired = Vec::new();
        while let Some((until, run)) = self.expiries.pop_first() {
            if until > now {
                self.expiries.insert((until, run));
                break;
            }
            let state = self.runs.get_mut(&run).expect("an expiry names a run");
            expired.extend(state.hold.take().map(|h| h.keys));
        }
        expired
    }

    /// When the next hold's time is up.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.expiries.first().map(|(until, _)| *until)
    }

    /// How long to hold `blocks` of `tokens` tokens that `program` left (see [`choose_ttl`]).
    /// `total_blocks`: the device pool; `host_room`: whether the host tier would take them.
    pub fn ttl(
        &self,
        program: &str,
        (blocks, tokens): (usize, usize),
        total_blocks: usize,
        host_room: bool,
        max_secs: f64,
    ) -> Duration {
        let recompute = tokens as f64 * self.prefill_secs_per_token.0;
        let reload = blocks as f64 * self.copy_secs_per_block.0;
        let cost = HoldCost {
            saved_secs: if host_room {
                recompute.min(reload)
            } else {
                recompute
            },
            share: blocks as f64 / total_blocks.max(1) as f64,
            pressure: self.pressure.0,
        };
        let pauses: Vec<f64> = self
            .pauses
            .get(program)
            .map_or_else(Vec::new, |p| p.iter().copied().collect());
        Duration::from_secs_f64(choose_ttl(&pauses, cost, max_secs))
    }

    /// A forward pass prefilled `tokens` tokens (of `total` in its batch) in `secs`.
    pub fn observe_step(&mut self, tokens: usize, total: usize, secs: f64) {
        if tokens >= 16 {
            self.prefill_secs_per_token.observe(secs / total as f64);
        }
    }

    /// The copies between the tiers moved `blocks` blocks in `secs`.
    pub fn observe_copies(&mut self, blocks: usize, secs: f64) {
        if blocks > 0 {
            self.copy_secs_per_block.observe(secs / blocks as f64);
        }
    }

    /// Demand on the device pool this step, as a share of it (capped at 1).
    pub fn observe_pressure(&mut self, demand: f64) {
        self.pressure.observe(demand.clamp(0.0, 1.0));
    }

    /// Runs remembered; for tests.
    pub fn len(&self) -> usize {
        self.runs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::prefix::block_key;

    fn cost(saved_secs: f64, share: f64, pressure: f64) -> HoldCost {
        HoldCost {
            saved_secs,
            share,
            pressure,
        }
    }

    #[test]
    fn until_a_program_shows_its_pauses_the_bound_is_the_ttl() {
        assert_eq!(choose_ttl(&[], cost(1.0, 0.5, 1.0), 30.0), 30.0);
        assert_eq!(choose_ttl(&[1.0, 2.0], cost(1.0, 0.5, 1.0), 30.0), 30.0);
        assert_eq!(choose_ttl(&[1.0; 10], cost(1.0, 0.1, 0.0), 0.0), 0.0);
    }

    #[test]
    fn an_idle_pool_holds_long_enough_for_every_pause_seen() {
        let pauses = [0.5, 1.0, 2.0, 8.0];
        assert_eq!(choose_ttl(&pauses, cost(0.2, 0.3, 0.0), 60.0), 10.0);
        // Pauses longer than the bound: holding would never help.
        assert_eq!(choose_ttl(&[50.0; 4], cost(0.2, 0.3, 0.0), 30.0), 0.0);
    }

    #[test]
    fn a_contended_pool_holds_only_what_pays() {
        // Mostly quick tools, a few slow ones: hold through the quick pauses only.
        let mut pauses = vec![1.0; 8];
        pauses.extend([60.0, 60.0]);
        let ttl = choose_ttl(&pauses, cost(0.5, 0.2, 1.0), 120.0);
        assert_eq!(ttl, 1.25);
        // Recomputing is nearly free beside what the hold takes: no hold.
        assert_eq!(choose_ttl(&[1.0; 8], cost(0.001, 0.5, 1.0), 120.0), 0.0);
    }

    #[test]
    fn runs_keep_their_first_arrival_and_learn_pauses_after_tool_turns() {
        let mut runs = Runs::default();
        let t0 = Instant::now();
        assert_eq!(runs.arrive("a", 1, t0), 1);
        assert_eq!(runs.arrive("b", 2, t0), 2);
        let keys = vec![block_key(0, None, &[1, 2, 3, 4])];
        let until = t0 + Duration::from_secs(5);
        let bound = t0 + Duration::from_secs(30);
        assert!(runs
            .ended("a", Some(("coder", bound)), Some((keys.clone(), until)), t0)
            .is_none());
        assert_eq!(runs.next_expiry(), Some(until));
        let waiting = |runs: &mut Runs, at| {
            runs.end_tool_waits(at);
            runs.waiting_for_tools().collect::<Vec<u64>>()
        };
        assert_eq!(
            waiting(&mut runs, t0),
            [1],
            "in progress while its tool runs"
        );
        // The follow-up arrives 2 s later: its place is the run's, the pause is learned; the
        // run is in progress until that turn is admitted.
        assert_eq!(runs.arrive("a", 3, t0 + Duration::from_secs(2)), 1);
        assert_eq!(waiting(&mut runs, t0 + Duration::from_secs(6)), [1]);
        let ttl = runs.ttl("coder", (1, 4), 100, false, 30.0);
        assert_eq!(
            ttl,
            Duration::from_secs(30),
            "one pause is not enough to fit"
        );
        assert_eq!(runs.pauses["coder"], [2.0]);
        // It waits for room past the hold's time: the hold lasts until it is admitted, within
        // the bound.
        runs.keep_for_next_turn("a", t0 + Duration::from_secs(30));
        assert!(runs.expire(until).is_empty());
        assert_eq!(runs.next_expiry(), Some(t0 + Duration::from_secs(30)));
        assert_eq!(runs.admitted("a"), Some(keys.clone()));
        assert!(runs.admitted("a").is_none(), "let go once");
        runs.resumed("a");
        assert!(waiting(&mut runs, t0).is_empty());
        // A run whose tool never returns is in progress only until the bound.
        runs.ended("a", Some(("coder", bound)), None, t0);
        assert_eq!(waiting(&mut runs, bound - Duration::from_secs(1)), [1]);
        assert!(waiting(&mut runs, bound).is_empty());
        // A hold nobody comes back for expires; one whose next turn is admitted first does not.
        runs.ended("b", None, Some((keys.clone(), until)), t0);
        assert!(runs.expire(t0 + Duration::from_secs(4)).is_empty());
        assert_eq!(runs.expire(until), vec![keys.clone()]);
        assert_eq!(runs.next_expiry(), None);
        runs.keep_for_next_turn("b", t0 + Duration::from_secs(30));
        assert_eq!(runs.next_expiry(), None, "nothing held, nothing kept");
    }

    #[test]
    fn idle_runs_are_forgotten_past_the_bound_but_not_those_holding_blocks() {
        let mut runs = Runs::default();
        let t0 = Instant::now();
        let until = t0 + Duration::from_secs(60);
        runs.arrive("held", 0, t0);
        runs.ended("held", None, Some((Vec::new(), until)), t0);
        for i in 1..=MAX_RUNS as u64 {
            runs.arrive(&format!("r{i}"), i, t0 + Duration::from_millis(i));
        }
        assert!(runs.len() <= MAX_RUNS / 2 + 1);
        assert_eq!(runs.arrive("held", 99_999, t0), 0, "kept with its place");
    }
}
