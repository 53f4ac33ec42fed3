//! Iteration-level scheduling: which sequences run in the next forward pass, with how many
//! tokens each, and who gives up memory when it runs out.
//!
//! Contract (as in vLLM v1): [`Scheduler::schedule`] returns a [`StepPlan`]; the caller runs the
//! model on it, then calls [`Scheduler::commit`] and, for each sampled token,
//! [`Scheduler::append`]; finished, cancelled or expired sequences leave through
//! [`Scheduler::remove`], and their blocks go back to the KV manager as they are dropped.
//!
//! Each step, under a per-step token budget:
//! 1. every decoding sequence gets its one token (so a long prompt never stalls them);
//! 2. running sequences still filling their cache get a chunk (chunked prefill);
//! 3. waiting sequences are admitted, highest priority, then by their agent run's first arrival
//!    (program-level first come first served: a run's later turns do not queue behind runs that
//!    started after it), then first come first served, while their first chunk's blocks fit
//!    (keeping, while others run, a small watermark free for their decodes and room for the
//!    output a sequence is expected to make). The queue head is never skipped for want of
//!    memory, so a large request cannot be starved by small ones; with nothing running, a head
//!    that the whole pool cannot take is reported unservable, since no block would ever come
//!    back for it. With a limit on agent runs in progress,
//!    turns that would start a run are passed over while it is reached: the runs that started
//!    first finish first, instead of every run sharing the engine until the end.
//!
//! Admission first reuses every leading block the prefix cache holds (device or host tier), so
//! only the rest of the prompt is computed; except for a sequence scoring its prompt, which needs
//! the logits of every prompt position and so computes them all (its chunks ask for every row).
//!
//! When a decoding sequence needs a block and none can be had, the last in that order (the
//! newest run's newest sequence of the lowest priority) that is not yet scheduled this step is
//! preempted: its blocks are swapped out to the
//! host tier (or, when the host tier is full, dropped, to be recomputed from its tokens) and it
//! goes back to the waiting queue; admission swaps it back in.

use std::collections::BTreeSet;

use crate::kv_cache::{most_that_fit, BlockId, KvManager, PrefixHit};
use crate::request::RequestId;
use crate::sequence::Sequence;
use crate::speculative::DraftPolicy;

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Most tokens (decode tokens plus prefill chunks) in one forward pass.
    pub max_step_tokens: usize,
    /// Most sequences running at once.
    pub max_running: usize,
    /// Most agent runs in progress at once (see [`Scheduler::set_paused_runs`]); `None`: no
    /// limit.
    pub max_active_runs: Option<usize>,
    /// Blocks admission leaves free so running sequences can keep decoding.
    pub watermark_blocks: usize,
    /// When decode steps carry drafts.
    pub drafts: DraftPolicy,
}

/// One sequence's share of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanItem {
    pub id: RequestId,
    /// The model that runs it.
    pub model: usize,
    /// Position of the first token.
    pub pos0: usize,
    pub tokens: Vec<u32>,
    /// The sequence's blocks, a table per layer group of its model.
    pub blocks: Vec<Vec<BlockId>>,
    /// The chunk reaches the end of the sequence: sample its next token.
    pub sample: bool,
    /// A decode step (one token after the previous one was sampled), not a prefill chunk.
    pub decode: bool,
    /// A prompt chunk of a sequence scoring its prompt: every token's logits are wanted, not
    /// only the last one's.
    pub prompt_logprobs: bool,
    /// The last `draft` of `tokens` are a guess at what follows the sequence (a decode step's
    /// draft): each has its logits row, and is in the cache only once sampling agrees with it.
    pub draft: usize,
}

#[derive(Debug, Default)]
pub struct StepPlan {
    pub items: Vec<PlanItem>,
    /// Sequences that cannot progress even with the whole pool: they must be ended.
    pub unservable: Vec<RequestId>,
    /// Sequences admitted (or swapped back in) by this plan.
    pub admitted: Vec<RequestId>,
}

impl StepPlan {
    /// Tokens prefilled (prompt chunks and recomputation) in this step.
    pub fn num_prefill_tokens(&self) -> usize {
        self.items
            .iter()
            .filter(|i| !i.decode)
            .map(|i| i.tokens.len())
            .sum()
    }
}

/// Counters since start-up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub preemptions: u64,
    /// Preemptions that swapped the sequence out.
    pub swaps_out: u64,
    /// Preemptions that dropped the cache, to recompute it.
    pub recomputes: u64,
    /// Sequences that grew past their model's window with every layer together, their cache
    /// computed again with the windowed layers apart.
    pub relayouts: u64,
}

/// The prefill tokens each model may still take in the step being planned, by model index
/// (see [`Scheduler::prefill_shares`]); `None`: no limit but the step's budget.
type Shares = Option<Vec<usize>>;

/// What `seq` may take of `budget` within its model's share.
fn share(shares: &Shares, seq: &Sequence, budget: usize) -> usize {
    match shares {
        Some(shares) => budget.min(shares.get(seq.model).copied().unwrap_or(0)),
        None => budget,
    }
}

/// Counts `n` tokens against `model`'s share.
fn take_share(shares: &mut Shares, model: usize, n: usize) {
    if let Some(share) = shares.as_mut().and_then(|s| s.get_mut(model)) {
        *share = share.saturating_sub(n);
    }
}

pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvManager,
    /// Sorted by [`Sequence::key`].
    waiting: Vec<Sequence>,
    /// Sorted by [`Sequence::key`].
    running: Vec<Sequence>,
    /// The runs (by first arrival) waiting for a tool: in progress, though none of their turns
    /// is here.
    paused_runs: BTreeSet<u64>,
    stats: SchedulerStats,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, kv: KvManager) -> Self {
        Self {
            config,
            kv,
            waiting: Vec::new(),
            running: Vec::new(),
            paused_runs: BTreeSet::new(),
            stats: SchedulerStats::default(),
        }
    }

    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Blocks the waiting sequences would need to hold their tokens.
    pub fn waiting_demand_blocks(&self) -> usize {
        self.waiting
            .iter()
            .map(|s| s.blocks_for(s.tokens().len()))
            .sum()
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn add(&mut self, seq: Sequence) {
        insert_sorted(&mut self.waiting, seq);
    }

    /// The runs (by first arrival) now waiting for a tool. With a limit on runs in progress,
    /// they count against it, and their next turns are admitted as the turns of a run in
    /// progress.
    pub fn set_paused_runs(&mut self, runs: impl IntoIterator<Item = u64>) {
        if self.config.max_active_runs.is_some() {
            self.paused_runs.clear();
            self.paused_runs.extend(runs);
        }
    }

    /// Every sequence, waiting or running.
    pub fn sequences(&self) -> impl Iterator<Item = &Sequence> {
        self.running.iter().chain(&self.waiting)
    }

    pub fn running(&self) -> impl Iterator<Item = &Sequence> {
        self.running.iter()
    }

    /// Sequences waiting for admission (new, or preempted), holding no device block.
    pub fn waiting(&self) -> impl Iterator<Item = &Sequence> {
        self.waiting.iter()
    }

    pub fn get(&self, id: RequestId) -> Option<&Sequence> {
        self.sequences().find(|s| s.id == id)
    }

    /// Takes a sequence out of the scheduler, wherever it is. Dropping it frees its blocks.
    pub fn remove(&mut self, id: RequestId) -> Option<Sequence> {
        for queue in [&mut self.running, &mut self.waiting] {
            if let Some(i) = queue.iter().position(|s| s.id == id) {
                return Some(queue.remove(i));
            }
        }
        None
    }

    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        // A sequence grown past its model's window with every layer together starts again
        // with its windowed layers apart, its cache computed again (once).
        for seq in &mut self.running {
            if seq.blocks.outgrew_window(seq.num_computed()) {
                seq.evict();
                self.stats.relayouts += 1;
            }
        }
        loop {
            let mut budget = self.config.max_step_tokens;
            let preemptions = self.stats.preemptions;
            self.schedule_decodes(&mut plan, &mut budget);
            let mut shares = self.prefill_shares(budget);
            self.schedule_prefills(&mut plan, &mut budget, &mut shares);
            // Memory just ran out: admitting now would only thrash (a preempted sequence could
            // be re-admitted and preempted again).
            if self.stats.preemptions == preemptions {
                self.admit(&mut plan, &mut budget, &mut shares);
            }
            self.add_drafts(&mut plan, &mut budget);
            if !plan.items.is_empty() || self.running.is_empty() {
                return plan;
            }
            // Nothing could run: every running sequence is filling its cache and none fits.
            if self.running.len() == 1 {
                let id = self.running[0].id;
                plan.unservable.push(id);
                self.remove(id);
            } else {
                let id = self.running.last().expect("not empty").id;
                self.preempt(id);
            }
        }
    }

    /// Step 1: one token for every decoding sequence, preempting when blocks run out.
    fn schedule_decodes(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        let order: Vec<RequestId> = self
            .running
            .iter()
            .filter(|s| s.is_decoding())
            .map(|s| s.id)
            .collect();
        for id in order {
            if *budget == 0 {
                break;
            }
            // Ends when scheduled, or preempted (as someone else's victim, or its own).
            while let Some(i) = self.running.iter().position(|s| s.id == id) {
                let end = self.running[i].num_computed() + 1;
                if self.running[i].blocks.grow_to(end) {
                    self.plan_item(plan, i, 1, true);
                    *budget -= 1;
                    break;
                }
                let victim = self
                    .running
                    .iter()
                    .rev()
                    .find(|s| !plan.items.iter().any(|it| it.id == s.id))
                    .expect("the sequence itself is unscheduled")
                    .id;
                if victim == id && self.running.len() == 1 {
                    // Alone with the whole pool and still out of blocks.
                    plan.unservable.push(id);
                    self.remove(id);
                    break;
                }
                self.preempt(victim);
                if victim == id {
                    break;
                }
            }
        }
    }

    /// Step 4: with the step still narrow (see [`DraftPolicy`]), decode steps carry drafts, in
    /// the order they were planned, from the budget and the blocks the rest of the plan left
    /// (never the watermark).
    fn add_drafts(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        let mut width: usize = plan.items.iter().map(|it| it.tokens.len()).sum();
        let policy = self.config.drafts;
        for item in plan.items.iter_mut().filter(|it| it.decode) {
            let room = policy.step_tokens.saturating_sub(width).min(*budget);
            if room == 0 {
                break;
            }
            let Some(seq) = self.running.iter_mut().find(|s| s.id == item.id) else {
                continue;
            };
            let draft = seq.draft(room);
            let end = seq.tokens().len() + draft.len();
            let spare = self
                .kv
                .num_available()
                .saturating_sub(self.config.watermark_blocks);
            let fits = seq.blocks_for(end).saturating_sub(seq.blocks.len()) <= spare;
            if draft.is_empty() || !fits || !seq.blocks.grow_to(end) {
                continue;
            }
            item.tokens.extend_from_slice(&draft);
            item.draft = draft.len();
            item.blocks = seq.blocks.tables();
            width += draft.len();
            *budget -= draft.len();
        }
    }

    /// The prefill tokens each model may take this step (see [`Shares`]): when the prompts of
    /// several models wait to be computed, the budget the decodes left is shared max-min fairly
    /// by what each model's sequences have pending (a model wanting less than an equal part gets
    /// all it wants, the others share the rest), so one model's long prompts do not hold back
    /// the others' admissions. `None` while one model or none has prompts pending.
    fn prefill_shares(&self, budget: usize) -> Shares {
        let mut demand: Vec<usize> = Vec::new();
        let pending = (self.running.iter())
            .filter(|s| !s.is_decoding())
            .chain(&self.waiting);
        for seq in pending {
            if demand.len() <= seq.model {
                demand.resize(seq.model + 1, 0);
            }
            demand[seq.model] += seq.num_pending();
        }
        if demand.iter().filter(|&&d| d > 0).count() < 2 {
            return None;
        }
        let mut shares = vec![0; demand.len()];
        let mut left = budget;
        let mut open: Vec<usize> = (0..demand.len()).filter(|&m| demand[m] > 0).collect();
        while !open.is_empty() && left > 0 {
            let each = left / open.len();
            if each == 0 {
                // Fewer tokens than models: one each to the first, in model order.
                for &m in open.iter().take(left) {
                    shares[m] += 1;
                }
                break;
            }
            for &m in &open {
                let give = (demand[m] - shares[m]).min(each);
                shares[m] += give;
                left -= give;
            }
            open.retain(|&m| shares[m] < demand[m]);
        }
        Some(shares)
    }

    /// Step 2: chunks for running sequences still filling their cache, each model within its
    /// share.
    fn schedule_prefills(&mut self, plan: &mut StepPlan, budget: &mut usize, shares: &mut Shares) {
        for i in 0..self.running.len() {
            if *budget == 0 {
                break;
            }
            let seq = &self.running[i];
            if seq.is_decoding() || plan.items.iter().any(|it| it.id == seq.id) {
                continue;
            }
            let n = self.fit(seq, seq.num_pending().min(share(shares, seq, *budget)), 0);
            if n == 0 {
                continue;
            }
            let end = seq.num_computed() + n;
            let grown = self.running[i].blocks.grow_to(end);
            debug_assert!(grown, "fit() checked the free blocks");
            take_share(shares, self.running[i].model, n);
            self.plan_item(plan, i, n, false);
            *budget -= n;
        }
    }

    /// Step 3: admit waiting sequences in order while their first chunk fits: swapped ones are
    /// swapped back in, new ones take what the prefix cache has. A model whose share is spent
    /// has its candidates passed over, in place, for the other models'.
    fn admit(&mut self, plan: &mut StepPlan, budget: &mut usize, shares: &mut Shares) {
        // With a limit on runs in progress: the limit and those runs.
        let mut bound = self
            .config
            .max_active_runs
            .map(|max| (max, self.active_runs()));
        // The next candidate: turns that would start a run are passed over while the limit is
        // reached (every later turn of a run in progress is behind them only when of a lower
        // priority).
        let mut next = 0;
        while *budget > 0 && self.running.len() < self.config.max_running {
            if next >= self.waiting.len() {
                break;
            }
            let at_bound = bound.as_ref().is_some_and(|(max, runs)| runs.len() >= *max);
            let spent = share(shares, &self.waiting[next], *budget) == 0;
            if spent || (at_bound && self.starts_run(&self.waiting[next])) {
                next += 1;
                continue;
            }
            // The watermark keeps room for running sequences' decodes; with none running, the
            // candidate may take the whole pool (see `hold_back`).
            let alone = self.running.is_empty();
            let reserve = match alone {
                true => 0,
                false => self.config.watermark_blocks,
            };
            let mut seq = self.waiting.remove(next);
            if self.kv.num_available() <= reserve {
                match self.hold_back(plan, next, seq, alone) {
                    true => break,
                    false => continue,
                }
            }
            let mut lookup = None;
            if let Some(swapped) = seq.swapped.take() {
                let need = seq.blocks_for(seq.num_computed() + 1).max(swapped.len());
                let swapped_in = match self.kv.num_available() < need + reserve {
                    true => Err(swapped),
                    false => seq.blocks.swap_in(swapped),
                };
                if let Err(swapped) = swapped_in {
                    seq.swapped = Some(swapped);
                    match self.hold_back(plan, next, seq, alone) {
                        true => break,
                        false => continue,
                    }
                }
            } else if seq.num_computed() == 0 {
                // A sequence scoring its prompt looks nothing up: no cache holds logits.
                lookup = Some(match seq.wants_prompt_logprobs() {
                    true => PrefixHit::default(),
                    false => seq.reuse_prefix(),
                });
            }
            // A new sequence is admitted once the rest of its prompt and its expected output fit
            // beside the others (alone, whatever fits: it could never wait for more).
            let expected = match lookup.is_some() && !alone {
                true => {
                    let len = seq.tokens().len();
                    seq.blocks_for(len + seq.expected_output) - seq.blocks_for(len)
                }
                false => 0,
            };
            let pending = seq.num_pending();
            let n = match expected > 0 && self.fit(&seq, pending, reserve + expected) < pending {
                true => 0,
                false => self.fit(&seq, pending.min(share(shares, &seq, *budget)), reserve),
            };
            if n == 0 {
                // Only a new sequence can get here (a swap-in checked its room): it gives back the
                // prefix blocks it took (alone, they and the rest of the pool hold no room for
                // one more token).
                seq.evict();
                match self.hold_back(plan, next, seq, alone) {
                    true => break,
                    false => continue,
                }
            }
            let grown = seq.blocks.grow_to(seq.num_computed() + n);
            debug_assert!(grown, "fit() checked the available blocks");
            if let Some(hit) = lookup {
                if !seq.wants_prompt_logprobs() {
                    self.kv.count_prefix_lookup(seq.tokens().len(), hit);
                }
                seq.admitted_with(hit);
            }
            if let Some((_, runs)) = &mut bound {
                runs.insert(seq.run_arrival);
            }
            let decode = seq.is_decoding();
            take_share(shares, seq.model, n);
            plan.admitted.push(seq.id);
            let i = insert_sorted(&mut self.running, seq);
            self.plan_item(plan, i, n, decode);
            *budget -= n;
        }
    }

    /// A candidate that cannot be admitted now goes back to its place `i` in the queue and
    /// waits (true: admission stops there). With nothing running (`alone`), nothing would ever
    /// give it a block (only running sequences give blocks back): it is reported unservable
    /// instead, and dropped, and the next candidate is tried (false).
    fn hold_back(&mut self, plan: &mut StepPlan, i: usize, seq: Sequence, alone: bool) -> bool {
        if alone {
            plan.unservable.push(seq.id);
            return false;
        }
        self.waiting.insert(i, seq);
        true
    }

    /// The runs in progress, by first arrival: those with a sequence running, and those waiting
    /// for a tool.
    fn active_runs(&self) -> BTreeSet<u64> {
        let running = self.running.iter().map(|s| s.run_arrival);
        self.paused_runs.iter().copied().chain(running).collect()
    }

    /// Whether admitting `seq` would start a run: it is no later turn of a run in progress,
    /// and no sequence put back after it had begun.
    fn starts_run(&self, seq: &Sequence) -> bool {
        !seq.was_admitted()
            && !self.paused_runs.contains(&seq.run_arrival)
            && !self
                .running
                .iter()
                .any(|s| s.run_arrival == seq.run_arrival)
    }

    /// How many of `want` tokens `seq` can compute with its blocks and the available ones,
    /// leaving `reserve` blocks available.
    fn fit(&self, seq: &Sequence, want: usize, reserve: usize) -> usize {
        let usable = self.kv.num_available().saturating_sub(reserve) + seq.blocks.len();
        // Blocks needed grow with the tokens.
        most_that_fit(want, |n| seq.blocks_for(seq.num_computed() + n) <= usable)
    }

    fn plan_item(&self, plan: &mut StepPlan, i: usize, n: usize, decode: bool) {
        let seq = &self.running[i];
        let pos0 = seq.num_computed();
        plan.items.push(PlanItem {
            id: seq.id,
            model: seq.model,
            pos0,
            tokens: seq.tokens()[pos0..pos0 + n].to_vec(),
            blocks: seq.blocks.tables(),
            sample: pos0 + n == seq.tokens().len(),
            decode,
            prompt_logprobs: seq.wants_prompt_logprobs(),
            draft: 0,
        });
    }

    fn preempt(&mut self, id: RequestId) {
        let i = self
            .running
            .iter()
            .position(|s| s.id == id)
            .expect("only running sequences are preempted");
        let mut seq = self.running.remove(i);
        self.stats.preemptions += 1;
        match seq.blocks.swap_out() {
            Some(swapped) => {
                seq.swapped = Some(swapped);
                self.stats.swaps_out += 1;
                tracing::debug!(id = id.0, "preempted; swapped out");
            }
            None => {
                seq.evict();
                self.stats.recomputes += 1;
                tracing::debug!(id = id.0, "preempted; will recompute");
            }
        }
        insert_sorted(&mut self.waiting, seq);
    }

    /// Records that the plan ran: its tokens are now in the cache, and the blocks they filled
    /// are offered to the prefix cache; drafts wait for [`Scheduler::accept_draft`].
    pub fn commit(&mut self, plan: &StepPlan) {
        for item in &plan.items {
            if let Some(seq) = self.running.iter_mut().find(|s| s.id == item.id) {
                seq.advance(item.tokens.len() - item.draft);
            }
        }
    }

    /// After [`Scheduler::append`]: the first `accepted` of the `drafted` tokens the sequence's
    /// step ran were what it sampled, so they are in its cache.
    pub fn accept_draft(&mut self, id: RequestId, drafted: usize, accepted: usize) {
        if let Some(seq) = self.running.iter_mut().find(|s| s.id == id) {
            seq.accept_draft(drafted, accepted);
        }
    }

    /// Appends a sampled token, and any forced after it, to a running sequence: the next step
    /// runs them through the model (more than one as a chunk).
    pub fn append(&mut self, id: RequestId, tokens: &[u32]) {
        if let Some(seq) = self.running.iter_mut().find(|s| s.id == id) {
            seq.push_tokens(tokens);
        }
    }

    /// Checks the books: the KV manager's own invariants, every running sequence's blocks cover
    /// its computed tokens, waiting sequences hold no device blocks, and only swapped ones keep
    /// computed tokens.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        for s in &self.running {
            if !s.blocks.covers(s.num_computed()) || s.swapped.is_some() {
                return Err(format!("running {:?} does not hold its cache", s.id));
            }
        }
        for s in &self.waiting {
            if !s.blocks.is_empty() {
                return Err(format!("waiting {:?} holds device blocks", s.id));
            }
            match &s.swapped {
                Some(sw) if !s.blocks.covered_by(sw, s.num_computed()) => {
                    return Err(format!("swapped {:?} lost part of its cache", s.id));
                }
                None if s.num_computed() != 0 => {
                    return Err(format!("waiting {:?} claims cached tokens", s.id));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Inserts keeping the queue sorted by key; returns the index.
fn insert_sorted(queue: &mut Vec<Sequence>, seq: Sequence) -> usize {
    let i = queue.partition_point(|s| s.key() <= seq.key());
    queue.insert(i, seq);
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use crate::kv_cache::{KvConfig, KvGroup, KvShape};
    use crate::speculative::Drafter;

    fn scheduler_with(
        blocks: usize,
        budget: usize,
        host_slots: usize,
        prefix_caching: bool,
        drafts: DraftPolicy,
    ) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                max_step_tokens: budget,
                max_running: 8,
                max_active_runs: None,
                watermark_blocks: 1,
                drafts,
            },
            KvManager::new(KvConfig {
                num_blocks: blocks,
                block_size: 4,
                host_slots,
                prefix_caching,
                salt: 0,
            }),
        )
    }

    /// No host tier, no prefix cache: preemption recomputes.
    fn scheduler(blocks: usize, budget: usize) -> Scheduler {
        scheduler_with(blocks, budget, 0, false, NO_DRAFTS)
    }

    const NO_DRAFTS: DraftPolicy = DraftPolicy { step_tokens: 0 };

    fn seq_with(s: &Scheduler, id: u64, tokens: Vec<u32>, priority: i32) -> Sequence {
        Sequence::new(RequestId(id), tokens, s.kv().table(), priority, id)
    }

    fn seq(s: &Scheduler, id: u64, prompt: usize, priority: i32) -> Sequence {
        seq_with(
            s,
            id,
            (0..prompt as u32).map(|t| t + 1000 * id as u32).collect(),
            priority,
        )
    }

    /// Runs one step as the engine loop would, sampling token 1 for every sampled item; of a
    /// draft, a part fixed by the item's place is taken (then the token after it).
    fn step(s: &mut Scheduler) -> StepPlan {
        let plan = s.schedule();
        s.commit(&plan);
        for item in plan.items.iter().filter(|i| i.sample) {
            let draft = &item.tokens[item.tokens.len() - item.draft..];
            let accepted = (item.id.0 as usize + item.pos0) % (draft.len() + 1);
            let mut tokens = draft[..accepted].to_vec();
            tokens.push(1);
            s.append(item.id, &tokens);
            if item.draft > 0 {
                s.accept_draft(item.id, item.draft, accepted);
            }
        }
        plan
    }

    /// A sequence of a model with a window keeps its layers together while it fits in the
    /// window, and once it grows past it starts again with the windowed layers apart: its
    /// cache computed again from its tokens (prompt and generated), after which the blocks the
    /// window leaves go back to the pool as it goes on.
    #[test]
    fn a_sequence_past_its_window_keeps_its_windowed_layers_apart() {
        let mut s = scheduler(32, 16);
        let tokens: Vec<u32> = (0..6).collect();
        let table = s.kv().table().for_model(9, &shape(1), tokens.len());
        s.add(Sequence::new(RequestId(1), tokens, table, 0, 1).of_model(1));
        let mut recomputed = 0;
        while s.get(RequestId(1)).unwrap().num_computed() < 30 {
            let plan = step(&mut s);
            recomputed += plan
                .items
                .iter()
                .filter(|i| i.pos0 == 0 && i.tokens.len() > 6)
                .count();
            s.check_invariants().unwrap();
        }
        let q = s.get(RequestId(1)).unwrap();
        assert_eq!(s.stats().relayouts, 1);
        assert_eq!(recomputed, 1, "the cache computed again in one chunk");
        assert_eq!(q.blocks.tables().len(), 2);
        // 30 tokens in: 3 global blocks, and of the windowed ones only those the window reads.
        assert_eq!(q.num_computed(), 30);
        assert_eq!(q.blocks.len(), 3 + 2);
    }

    /// One model's long prompt does not hold back another model's short one that arrived
    /// after it: the step's prefill budget is shared between the models with prompts pending,
    /// and what one does not need goes to the other.
    #[test]
    fn models_share_the_prefill_budget() {
        let mut s = scheduler(64, 16);
        s.add(seq(&s, 1, 100, 0));
        s.add(seq(&s, 2, 6, 0).of_model(1));
        let plan = step(&mut s);
        let tokens = |id: u64| {
            let item = plan.items.iter().find(|i| i.id == RequestId(id));
            item.map(|i| (i.model, i.tokens.len()))
        };
        assert_eq!(
            tokens(2),
            Some((1, 6)),
            "the short prompt is computed whole"
        );
        assert_eq!(
            tokens(1),
            Some((0, 10)),
            "the long one takes the rest of the budget"
        );
        // Alone with prompts pending, a model takes the whole budget again.
        let plan = step(&mut s);
        let prefill: usize = plan
            .items
            .iter()
            .filter(|i| !i.decode)
            .map(|i| i.tokens.len())
            .sum();
        assert_eq!(prefill, 15);
        s.check_invariants().unwrap();
    }

    #[test]
    fn long_prompts_are_chunked_and_decodes_keep_running() {
        let mut s = scheduler(64, 8);
        s.add(seq(&s, 1, 3, 0));
        let plan = step(&mut s);
        assert_eq!(plan.items[0].tokens.len(), 3);
        assert!(plan.items[0].sample);
        s.add(seq(&s, 2, 20, 0));
        // Sequence 1 decodes one token every step while 2 fills in chunks of 7.
        for chunk in [7, 7, 6] {
            let plan = step(&mut s);
            assert_eq!(plan.items[0].id, RequestId(1));
            assert_eq!(plan.items[0].tokens.len(), 1);
            assert_eq!(plan.items[1].id, RequestId(2));
            assert_eq!(plan.items[1].tokens.len(), chunk);
        }
        assert!(step(&mut s).items.iter().all(|i| i.tokens.len() == 1));
    }

    #[test]
    fn higher_priority_is_admitted_first() {
        let mut s = scheduler(64, 4);
        s.add(seq(&s, 1, 4, 0));
        s.add(seq(&s, 2, 4, 5));
        let plan = step(&mut s);
        assert_eq!(plan.items.len(), 1);
        assert_eq!(plan.items[0].id, RequestId(2));
    }

    /// Admits every waiting sequence and returns the order.
    fn admission_order(s: &mut Scheduler) -> Vec<u64> {
        let mut order = Vec::new();
        while s.num_waiting() > 0 {
            let plan = step(s);
            order.extend(plan.admitted.iter().map(|id| id.0));
        }
        order
    }

    #[test]
    fn later_turns_of_a_run_go_before_runs_that_started_after_it() {
        // Runs a (first arrival 1), b (2) and c (5); turns arrive interleaved.
        let turns = [(1, 1), (2, 2), (3, 1), (4, 2), (5, 5), (6, 1)];
        let mut s = scheduler(256, 64);
        for (id, run) in turns {
            s.add(seq(&s, id, 4, 0).in_run(run));
        }
        assert_eq!(admission_order(&mut s), [1, 3, 6, 2, 4, 5]);
        // Without runs, request by request; a priority class still comes first.
        let mut s = scheduler(256, 64);
        for (id, _) in turns {
            s.add(seq(&s, id, 4, i32::from(id == 4)));
        }
        assert_eq!(admission_order(&mut s), [4, 1, 2, 3, 5, 6]);
    }

    #[test]
    fn a_limit_on_runs_in_progress_holds_back_new_runs_not_later_turns() {
        let mut s = scheduler(256, 64);
        s.config.max_active_runs = Some(2);
        // Runs a (first arrival 1) and b (2) start; c (3) and a run-less request (4) wait,
        // c although its answer starts with forced tokens (it is not a turn that had begun).
        for (id, run) in [(1, 1), (2, 2), (3, 3), (4, 4)] {
            let forced: &[u32] = if id == 3 { &[7, 8] } else { &[] };
            s.add(seq(&s, id, 4, 0).in_run(run).answer_starting(forced));
        }
        assert_eq!(step(&mut s).admitted, [RequestId(1), RequestId(2)]);
        // a's turn ends in a tool call: a is still in progress, and its next turn goes in while
        // c still waits.
        s.remove(RequestId(1));
        s.set_paused_runs([1]);
        assert!(step(&mut s).admitted.is_empty());
        s.add(seq(&s, 5, 8, 0).in_run(1));
        assert_eq!(step(&mut s).admitted, [RequestId(5)]);
        // So does a second turn of b beside its first (a parallel call of one run).
        s.add(seq(&s, 6, 4, 0).in_run(2));
        assert_eq!(step(&mut s).admitted, [RequestId(6)]);
        // a's turn runs; b ends without a tool call: c starts, then the run-less request once
        // a is done.
        s.set_paused_runs([]);
        s.remove(RequestId(2));
        s.remove(RequestId(6));
        assert_eq!(step(&mut s).admitted, [RequestId(3)]);
        assert!(step(&mut s).admitted.is_empty());
        s.remove(RequestId(5));
        assert_eq!(step(&mut s).admitted, [RequestId(4)]);
        // Without a limit, everything waiting is admitted at once.
        let mut s = scheduler(256, 64);
        for (id, run) in [(1, 1), (2, 2), (3, 3), (4, 4)] {
            s.add(seq(&s, id, 4, 0).in_run(run));
        }
        assert_eq!(step(&mut s).admitted.len(), 4);
    }

    #[test]
    fn an_expected_output_waits_for_room_beside_the_others() {
        // 10 blocks of 4 tokens (1 kept free): 1 holds 2; 2 expects 24 tokens (6 blocks) on top
        // of its 2, which do not fit beside 1 until 1 is gone.
        let mut s = scheduler(10, 64);
        s.add(seq(&s, 1, 7, 0).expecting(0));
        step(&mut s);
        s.add(seq(&s, 2, 7, 0).expecting(24));
        assert!(step(&mut s).admitted.is_empty());
        assert_eq!(s.num_waiting(), 1);
        s.remove(RequestId(1));
        assert_eq!(step(&mut s).admitted, [RequestId(2)], "alone, it runs");
        // Expecting 16 (4 blocks) fits beside it.
        s.add(seq(&s, 3, 7, 0).expecting(16));
        assert_eq!(step(&mut s).admitted, [RequestId(3)]);
    }

    #[test]
    fn out_of_blocks_preempts_the_newest_lowest_priority() {
        // 4 blocks of 4 tokens; two sequences of 7 tokens hold 2 blocks each.
        let mut s = scheduler(4, 64);
        s.config.watermark_blocks = 0;
        s.add(seq(&s, 1, 7, 0));
        s.add(seq(&s, 2, 7, 0));
        step(&mut s);
        step(&mut s);
        assert_eq!(s.num_running(), 2);
        assert_eq!(s.kv().num_available(), 0);
        assert_eq!(s.stats().preemptions, 0);
        // Both now hold 9 tokens; computing the ninth needs a third block each.
        let plan = step(&mut s);
        assert_eq!(s.stats().preemptions, 1);
        assert_eq!(plan.items.len(), 1);
        assert_eq!(plan.items[0].id, RequestId(1));
        assert_eq!(s.num_waiting(), 1);
        let back = s.get(RequestId(2)).unwrap();
        assert_eq!(back.num_computed(), 0);
        assert_eq!(
            back.tokens().len(),
            9,
            "generated tokens are kept for recompute"
        );
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_sequence_larger_than_the_pool_is_reported() {
        let mut s = scheduler(2, 64);
        s.config.watermark_blocks = 0;
        s.add(seq(&s, 1, 8, 0));
        step(&mut s);
        let plan = step(&mut s);
        assert_eq!(plan.unservable, vec![RequestId(1)]);
        assert!(s.is_idle());
        assert_eq!(s.kv().num_available(), 2);
    }

    #[test]
    fn alone_a_sequence_may_take_the_watermark_too() {
        // 5 blocks of 4 tokens, 1 kept free while others run. The second turn finds the first's
        // 4 full blocks cached; the rest of it fits only in the watermark, which nobody needs.
        let mut s = scheduler_with(5, 64, 0, true, NO_DRAFTS);
        let prompt: Vec<u32> = (0..18).collect();
        s.add(seq_with(&s, 1, prompt.clone(), 0));
        while !step(&mut s).items[0].sample {}
        s.remove(RequestId(1));
        s.add(seq_with(&s, 2, prompt, 0));
        let plan = step(&mut s);
        assert_eq!(plan.admitted, [RequestId(2)]);
        assert_eq!((plan.items[0].pos0, plan.items[0].tokens.len()), (16, 2));
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_waiting_sequence_that_no_block_can_ever_serve_is_reported() {
        // Every block of the pool is pinned: nothing running will ever give one back.
        let mut s = scheduler_with(5, 64, 0, true, NO_DRAFTS);
        let prompt: Vec<u32> = (0..20).collect();
        s.add(seq_with(&s, 1, prompt.clone(), 0));
        while !step(&mut s).items[0].sample {}
        let keys = s.get(RequestId(1)).unwrap().blocks.prefix_keys(20);
        assert_eq!(s.kv().pin(&keys), 5);
        s.remove(RequestId(1));
        // A stranger, and the same prompt again (its hit leaves no block for its last token).
        s.add(seq(&s, 2, 3, 0));
        s.add(seq_with(&s, 3, prompt, 0));
        let plan = step(&mut s);
        assert_eq!(plan.unservable, [RequestId(2), RequestId(3)]);
        assert!(plan.items.is_empty());
        assert!(s.is_idle());
        s.check_invariants().unwrap();
    }

    #[test]
    fn preemption_swaps_out_and_admission_swaps_back_in() {
        let mut s = scheduler_with(4, 64, 8, false, NO_DRAFTS);
        s.config.watermark_blocks = 0;
        s.add(seq(&s, 1, 7, 0));
        s.add(seq(&s, 2, 7, 0));
        step(&mut s);
        step(&mut s);
        let plan = step(&mut s);
        assert_eq!(s.stats().swaps_out, 1);
        assert_eq!(s.stats().recomputes, 0);
        assert_eq!(plan.items.len(), 1);
        let parked = s.get(RequestId(2)).unwrap();
        assert_eq!(
            parked.num_computed(),
            8,
            "a swapped sequence keeps its cache"
        );
        assert_eq!(s.kv().take_copies().len(), 2);
        s.kv().copies_done();
        s.remove(RequestId(1));
        let plan = step(&mut s);
        assert_eq!(plan.items[0].id, RequestId(2));
        assert_eq!(plan.items[0].tokens.len(), 1, "back in, it only decodes");
        assert_eq!(plan.items[0].pos0, 8);
        assert_eq!(s.kv().take_copies().len(), 2);
        s.kv().copies_done();
        s.check_invariants().unwrap();
    }

    #[test]
    fn admission_reuses_a_cached_prefix() {
        let mut s = scheduler_with(16, 64, 0, true, NO_DRAFTS);
        let shared: Vec<u32> = (0..9).collect();
        s.add(seq_with(&s, 1, shared.clone(), 0));
        step(&mut s);
        s.remove(RequestId(1));
        let mut other = shared[..8].to_vec();
        other.extend([50, 51, 52]);
        s.add(seq_with(&s, 2, other, 0));
        let plan = step(&mut s);
        assert_eq!(
            plan.items[0].pos0, 8,
            "the two full shared blocks are reused"
        );
        assert_eq!(plan.items[0].tokens, vec![50, 51, 52]);
        assert_eq!(s.get(RequestId(2)).unwrap().cached_tokens(), 8);
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_sequence_wanting_prompt_logprobs_computes_its_whole_prompt_once() {
        let mut s = scheduler_with(16, 4, 0, true, NO_DRAFTS);
        let prompt: Vec<u32> = (0..9).collect();
        s.add(seq_with(&s, 1, prompt.clone(), 0));
        while !step(&mut s).items[0].sample {}
        s.remove(RequestId(1));
        let looked_up = s.kv().counters().prefix_query_tokens;
        s.add(seq_with(&s, 2, prompt, 0).with_prompt_logprobs());
        // The cached blocks are not taken: every chunk, from position 0, wants every row.
        for (pos0, len) in [(0, 4), (4, 4), (8, 1)] {
            let plan = step(&mut s);
            let item = &plan.items[0];
            assert_eq!((item.pos0, item.tokens.len()), (pos0, len));
            assert!(item.prompt_logprobs);
            assert_eq!(item.sample, pos0 == 8);
        }
        assert_eq!(s.get(RequestId(2)).unwrap().cached_tokens(), 0);
        assert_eq!(
            s.kv().counters().prefix_query_tokens,
            looked_up,
            "no lookup was made"
        );
        assert!(
            !step(&mut s).items[0].prompt_logprobs,
            "decodes score nothing"
        );
        // Recomputed after preemption, the prompt is not scored again, and the cache serves it.
        s.preempt(RequestId(2));
        let plan = step(&mut s);
        assert_eq!(plan.items[0].pos0, 8);
        assert!(!plan.items[0].prompt_logprobs);
        s.check_invariants().unwrap();
    }

    #[derive(Clone, Debug)]
    enum Op {
        Add {
            prompt: usize,
            priority: i32,
            prompt_logprobs: bool,
            /// Which of two models sharing the pool runs it.
            model: usize,
        },
        Step,
        Finish(usize),
        Cancel(usize),
        Expire(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..100, -1i32..2, any::<bool>(), 0usize..2).prop_map(
                |(prompt, priority, prompt_logprobs, model)| {
                    Op::Add {
                        prompt,
                        priority,
                        prompt_logprobs,
                        model,
                    }
                }
            ),
            Just(Op::Step),
            Just(Op::Step),
            Just(Op::Step),
            any::<usize>().prop_map(Op::Finish),
            any::<usize>().prop_map(Op::Cancel),
            any::<usize>().prop_map(Op::Expire),
        ]
    }

    /// The salts of the two models of [`no_block_leaks`]; the first is the pool's own.
    const MODEL_SALTS: [u64; 2] = [0, 0x6E6D];
    /// How they keep their blocks: the first, every layer together, 4 tokens a block; the
    /// second, every layer together 3 tokens a block while a sequence fits in its window of 7
    /// positions, then its global layers 10 tokens a block and its windowed layers 5 (fewer
    /// layers, so a block holds more of their tokens).
    fn shape(model: usize) -> KvShape {
        match model {
            0 => KvShape::whole(4),
            _ => KvShape {
                whole: KvGroup::whole(3),
                split: vec![
                    KvGroup::whole(10),
                    KvGroup {
                        block_size: 5,
                        window: Some(7),
                    },
                ],
            },
        }
    }

    proptest! {
        /// Whatever mix of finishing, cancelled, preempted and timed-out sequences of two models
        /// drawing from one pool (each with its own tokens per block, one with layers keeping
        /// a sliding window apart), the block accounting holds after every operation, no block
        /// ever serves both models (their prompts share tokens, never blocks), no sequence
        /// holds blocks its window has left behind, every sequence left is served or reported
        /// once nothing more arrives, and every block is back in the pool at the end.
        #[test]
        fn no_block_leaks(
            ops in prop::collection::vec(op(), 1..200),
            blocks in 6usize..24,
            host in 0usize..16,
            prefix_caching in any::<bool>(),
            shared in 0u32..100,
            drafts in prop_oneof![Just(0usize), 1usize..24],
        ) {
            let mut s = scheduler_with(blocks, 16, host, prefix_caching, DraftPolicy { step_tokens: drafts });
            let mut next = 0;
            for op in ops {
                match op {
                    Op::Add { prompt, priority, prompt_logprobs, model } => {
                        // The engine rejects prompts without room for one more token in the
                        // pool; the longest it takes fill all of it but that token.
                        let prompt = prompt.min(blocks * 4 - 1);
                        next += 1;
                        // Half the prompts share a prefix, for the prefix cache to find.
                        let tokens: Vec<u32> = (0..prompt as u32)
                            .map(|t| if next % 2 == 0 && t < shared { t } else { t + 1000 * next as u32 })
                            .collect();
                        let table = s.kv().table().for_model(MODEL_SALTS[model], &shape(model), tokens.len());
                        let end = tokens.len() + 40;
                        let seq = Sequence::new(RequestId(next), tokens, table, priority, next)
                            .of_model(model)
                            .drafting(Drafter::new(end));
                        s.add(if prompt_logprobs { seq.with_prompt_logprobs() } else { seq });
                    }
                    Op::Step => {
                        let plan = step(&mut s);
                        // The engine loop runs the step's copies before the forward pass.
                        s.kv().take_copies();
                        s.kv().copies_done();
                        for id in &plan.unservable {
                            prop_assert!(s.get(*id).is_none());
                        }
                    }
                    // Finishing, cancelling and expiring all end in removal: the paths differ
                    // in what the engine loop tells the client, not in what happens to blocks.
                    Op::Finish(k) | Op::Cancel(k) | Op::Expire(k) => {
                        let ids: Vec<RequestId> = s.sequences().map(|q| q.id).collect();
                        if !ids.is_empty() {
                            let id = ids[k % ids.len()];
                            prop_assert!(s.remove(id).is_some());
                        }
                    }
                }
                if let Err(e) = s.check_invariants() {
                    prop_assert!(false, "{}", e);
                }
                let mut owner = std::collections::HashMap::new();
                for q in s.running() {
                    for b in q.blocks.held() {
                        let first = *owner.entry(b).or_insert(q.model);
                        prop_assert_eq!(first, q.model, "{:?} serves both models", b);
                    }
                    // What the next step (16 tokens at most) needs, and no block behind it.
                    let (at, most) = (q.num_computed(), q.tokens().len().min(q.num_computed() + 16));
                    prop_assert!(q.blocks.len() <= q.blocks.blocks_for(at, most.max(at + 1)));
                }
            }
            // Nothing more arrives: every sequence is served (ending after two tokens) or
            // reported, none is left waiting for blocks nobody will give back.
            for _ in 0..1000 {
                if s.is_idle() {
                    break;
                }
                step(&mut s);
                s.kv().take_copies();
                s.kv().copies_done();
                let done: Vec<RequestId> =
                    s.sequences().filter(|q| q.num_generated() >= 2).map(|q| q.id).collect();
                for id in done {
                    s.remove(id);
                }
            }
            prop_assert!(s.is_idle(), "sequences left waiting: {}", s.num_waiting());
            let g = s.kv().gauges();
            prop_assert_eq!(g.device_used, 0);
            prop_assert_eq!(g.device_free + g.device_cached, blocks);
            prop_assert_eq!(g.host_swapped, 0);
        }
    }
}
