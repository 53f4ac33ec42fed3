//! A sequence as the scheduler sees it: its tokens, how many of them are in the KV cache, the
//! blocks holding them (on the device, or swapped out to the host tier), and the keys that
//! order it against the others.
//!
//! What a sequence *produces* (sampling, text, events) lives with the engine loop, so scheduling can
//! be reasoned about and tested without a model.

use std::cmp::Reverse;

use crate::kv_cache::{BlockTable, PrefixHit, SwappedBlocks};
use crate::request::RequestId;
use crate::speculative::Drafter;

pub struct Sequence {
    pub id: RequestId,
    /// Which of the engine's models runs it (an index into its models).
    pub model: usize,
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Leading tokens whose keys and values are in the cache.
    num_computed: usize,
    pub blocks: BlockTable,
    /// Set while preempted by swapping: the cache lives in the host tier.
    pub swapped: Option<SwappedBlocks>,
    /// Prompt tokens served from the prefix cache at first admission.
    cached_tokens: Option<usize>,
    /// Its prompt is being scored (prompt log-probabilities): every prompt position needs its
    /// logits, so none may come from the prefix cache. Cleared once the whole prompt has been
    /// computed, so that a recompute after preemption is an ordinary prefill.
    prompt_logprobs: bool,
    pub priority: i32,
    /// When its agent run first arrived (its own arrival when it is no run's turn, or runs are
    /// not scheduled): within a priority class, runs are served first come, first served.
    pub run_arrival: u64,
    /// Admission order: earlier arrivals of a run (or class) run first.
    pub arrival: u64,
    /// Output tokens admission leaves room for (the caller's expectation, up to its maximum).
    pub expected_output: usize,
    /// Set when its decode steps may carry a draft ([`crate::speculative`]).
    pub drafter: Option<Drafter>,
}

/// Sort key: higher priority first, then the earlier run, then first come, first served.
pub type OrderKey = (Reverse<i32>, u64, u64);

impl Sequence {
    pub fn new(
        id: RequestId,
        prompt: Vec<u32>,
        blocks: BlockTable,
        priority: i32,
        arrival: u64,
    ) -> Self {
        Self {
            id,
            model: 0,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            blocks,
            swapped: None,
            cached_tokens: None,
            prompt_logprobs: false,
            priority,
            run_arrival: arrival,
            arrival,
            expected_output: 0,
            drafter: None,
        }
    }

    /// Blocks this sequence holds to compute its tokens up to `end`, from where it is (blocks a
    /// sliding window has left behind by then are not counted).
    pub fn blocks_for(&self, end: usize) -> usize {
        self.blocks.blocks_for(self.num_computed, end)
    }

    /// The same sequence, run by the engine's model `model`.
    pub fn of_model(mut self, model: usize) -> Self {
        self.model = model;
        self
    }

    /// The same sequence, as a turn of a run that first arrived at `run_arrival`.
    pub fn in_run(mut self, run_arrival: u64) -> Self {
        self.run_arrival = run_arrival;
        self
    }

    /// The same sequence, expected to generate `tokens` tokens.
    pub fn expecting(mut self, tokens: usize) -> Self {
        self.expected_output = tokens;
        self
    }

    /// The same sequence, its answer starting with `tokens` (forced, not sampled): they are
    /// computed with the prompt.
    pub fn answer_starting(mut self, tokens: &[u32]) -> Self {
        self.tokens.extend_from_slice(tokens);
        self
    }

    /// The same sequence, its decode steps drafting with `drafter`.
    pub fn drafting(mut self, drafter: Drafter) -> Self {
        self.drafter = Some(drafter);
        self
    }

    /// The same sequence, with its prompt to be scored.
    pub fn with_prompt_logprobs(mut self) -> Self {
        self.prompt_logprobs = true;
        self
    }

    /// Whether its prompt chunks need logits at every position.
    pub fn wants_prompt_logprobs(&self) -> bool {
        self.prompt_logprobs
    }

    pub fn key(&self) -> OrderKey {
        (Reverse(self.priority), self.run_arrival, self.arrival)
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    pub fn num_computed(&self) -> usize {
        self.num_computed
    }

    /// Prompt tokens the prefix cache supplied (0 before admission).
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens.unwrap_or(0)
    }

    /// Whether it has been admitted before (it may since have been preempted).
    pub fn was_admitted(&self) -> bool {
        self.cached_tokens.is_some()
    }

    /// Takes what the prefix cache holds of this sequence's tokens, as already computed.
    pub(crate) fn reuse_prefix(&mut self) -> PrefixHit {
        debug_assert_eq!(self.num_computed, 0);
        debug_assert!(
            !self.prompt_logprobs,
            "cached positions have no logits to score"
        );
        let hit = self.blocks.attach_prefix(&self.tokens);
        self.num_computed = hit.tokens();
        hit
    }

    /// The sequence was admitted with `hit` from the prefix cache; the first admission is what
    /// its usage reports, of its prompt (a hit may reach into a forced answer start).
    pub(crate) fn admitted_with(&mut self, hit: PrefixHit) {
        self.cached_tokens
            .get_or_insert(hit.tokens().min(self.prompt_len));
    }

    /// Tokens still to run through the model before the next one can be sampled: 1 while
    /// decoding, more while (re)filling the cache.
    pub fn num_pending(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Waiting only for its last sampled token to run: a decode step, not the end of a prompt
    /// chunk.
    pub fn is_decoding(&self) -> bool {
        self.num_pending() == 1 && self.num_generated() > 0
    }

    /// `n` more tokens are in the cache; the blocks they filled go to the prefix cache, and
    /// those a sliding window has left behind are given back.
    pub(crate) fn advance(&mut self, n: usize) {
        self.num_computed += n;
        debug_assert!(self.num_computed <= self.tokens.len());
        if self.num_computed >= self.prompt_len {
            self.prompt_logprobs = false;
        }
        self.blocks.advance(&self.tokens, self.num_computed);
    }

    /// A draft of at most `most` tokens to run after its last token (see
    /// [`Drafter::propose`]); empty when it does not draft.
    pub(crate) fn draft(&mut self, most: usize) -> Vec<u32> {
        match &mut self.drafter {
            Some(drafter) => drafter.propose(&self.tokens, most).to_vec(),
            None => Vec::new(),
        }
    }

    /// The first `accepted` of the `drafted` tokens its last step ran after its last token were
    /// what it sampled: their keys and values, computed in that step, are its cache too; the
    /// blocks only the rejected ones reached go back.
    pub(crate) fn accept_draft(&mut self, drafted: usize, accepted: usize) {
        if let Some(drafter) = &mut self.drafter {
            drafter.verified(drafted, accepted);
        }
        if accepted > 0 {
            self.advance(accepted);
        }
        // The next step computes the last token sampled: the blocks past it go back.
        self.blocks.shrink_to(self.tokens.len());
    }

    /// Appends generated tokens: the one sampled, and any the grammar forced after it.
    pub(crate) fn push_tokens(&mut self, tokens: &[u32]) {
        debug_assert_eq!(
            self.num_pending(),
            0,
            "tokens are appended after their step ran"
        );
        if let (Some(drafter), Some(&first)) = (&mut self.drafter, tokens.first()) {
            drafter.sampled(first);
        }
        self.tokens.extend_from_slice(tokens);
    }

    /// Drops the cached keys and values; they will be recomputed from the tokens.
    pub(crate) fn evict(&mut self) {
        self.blocks.clear();
        self.blocks.shape_for(self.tokens.len());
        self.swapped = None;
        self.num_computed = 0;
    }
}
