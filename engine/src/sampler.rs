//! Choosing the next token from a row of logits.
//!
//! Order of operations (as vLLM and OpenAI define them): penalties on the raw logits
//! (repetition over prompt and output; presence and frequency over output only), then greedy
//! argmax when temperature is below [`GREEDY_BELOW`] (0 included), otherwise temperature, then
//! the min_p, top_k and top_p filters, then one draw from the request's own random generator. Each request owns its generator, seeded
//! from its `seed`, so its tokens never depend on what else shares the batch.
//!
//! Log-probabilities are those of the model's distribution (log-softmax of the raw logits), as
//! OpenAI reports them, not of the filtered distribution that was sampled. A prompt token is
//! scored by the same code ([`logprob_at`]) from the logits at the position before it.
//!
//! With a [`Constraint`], the token the rule above chooses is checked against the grammar first
//! (one parser step); only if the grammar refuses it is the full mask computed and the choice
//! made again among the allowed tokens (same rule, the generator's next draw). A model that
//! follows its instructions thus rarely pays for a mask. Once the grammar is complete the
//! end-of-sequence token is the only choice.
//!
//! Numerics: any finite parameters sample a token; nothing here panics on what a request sets.
//! Penalties may push logits to ±inf (a repetition penalty of 1e-30 divides by almost nothing):
//! after them a NaN counts as impossible and +inf as the largest finite value, so the most
//! likely token always has weight exp(0) = 1 and survives every filter. A temperature so small
//! that its inverse would overflow is greedy, as vLLM treats any temperature under 1e-5.
//!
//! Cost: O(vocab) per token. The nucleus (top_p) is found by partial selection of growing
//! candidate sets rather than a full sort of the vocabulary.

use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::constraint::{Constraint, GrammarError};
use crate::request::{SamplingParams, TokenLogprob};

/// Temperatures below this sample greedily (vLLM's `_SAMPLING_EPS`): dividing by less would
/// only sharpen the distribution onto its argmax, and 1/t would overflow `f32` near 1e-39.
pub const GREEDY_BELOW: f32 = 1e-5;

/// The token chosen, and its log-probabilities when they were asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    top_logprobs: Option<usize>,
    /// Tokens whose log-probabilities are reported at every step.
    score_tokens: Vec<u32>,
    /// Tokens of the prompt, for the repetition penalty (empty when that penalty is off).
    prompt_tokens: HashSet<u32>,
    /// How often each token was generated, for all three penalties.
    output_counts: HashMap<u32, u32>,
    constraint: Option<Constraint>,
    /// The token that ends a constrained answer.
    eos: u32,
    /// Set when the constraint failed; the sequence must end with an error.
    constraint_error: Option<GrammarError>,
}

impl Sampler {
    pub fn new(params: SamplingParams, top_logprobs: Option<usize>, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        let prompt_tokens = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Self {
            params,
            rng: StdRng::seed_from_u64(seed),
            top_logprobs,
            score_tokens: Vec::new(),
            prompt_tokens,
            output_counts: HashMap::new(),
            constraint: None,
            eos: 0,
            constraint_error: None,
        }
    }

    /// Also reports `tokens`' log-probabilities at every step.
    pub fn scoring(mut self, tokens: Vec<u32>) -> Self {
        self.score_tokens = tokens;
        self
    }

    /// Samples only what `constraint` allows; `eos` ends the answer once it is complete.
    pub fn with_constraint(mut self, constraint: Constraint, eos: u32) -> Self {
        self.constraint = Some(constraint);
        self.eos = eos;
        self
    }

    /// Whether this request's seed is the one `fault` is armed with.
    #[cfg(any(test, feature = "fault-injection"))]
    pub(crate) fn has_fault(&self, fault: &std::sync::atomic::AtomicU64) -> bool {
        let armed = fault.load(std::sync::atomic::Ordering::Relaxed);
        armed != 0 && self.params.seed == Some(armed)
    }

    /// Whether a grammar constrains the output.
    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// Whether `token` ends a constrained answer.
    pub fn completes(&self, token: u32) -> bool {
        self.constraint.is_some() && token == self.eos
    }

    /// Why the constraint failed, if it did (the last token sampled is then meaningless).
    pub fn constraint_error(&self) -> Option<&GrammarError> {
        self.constraint_error.as_ref()
    }

    /// Whether [`Sampler::sample`] would take the raw logits' argmax and report nothing besides:
    /// greedy, no penalty, no grammar, no log-probabilities. Such a choice can be made where the
    /// logits are (a GPU), and only the token brought back to [`Sampler::record`].
    pub fn is_plain_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature < GREEDY_BELOW
            && p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && self.constraint.is_none()
            && self.top_logprobs.is_none()
            && self.score_tokens.is_empty()
    }

    /// Records `token`, chosen elsewhere as a plain greedy [`Sampler::sample`] would have chosen
    /// it, as generated.
    pub fn record(&mut self, token: u32) -> Sampled {
        *self.output_counts.entry(token).or_insert(0) += 1;
        Sampled {
            token,
            logprob: None,
        }
    }

    /// Picks the next token from `logits` (overwritten as scratch) and records it as generated.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        #[cfg(any(test, feature = "fault-injection"))]
        assert!(
            !self.has_fault(&faults::SAMPLE),
            "fault injected into sampling"
        );
        let wants_logprobs = self.top_logprobs.is_some() || !self.score_tokens.is_empty();
        let logprob_of =
            wants_logprobs.then(|| (log_softmax(logits), self.top_logprobs.unwrap_or(0)));
        self.apply_penalties(logits);
        let token = match self.constraint.take() {
            None => self.choose(logits),
            Some(mut constraint) => {
                let token = if constraint.is_done() {
                    self.eos
                } else {
                    self.choose_allowed(logits, &mut constraint)
                        .and_then(|t| constraint.accept(t).map(|()| t))
                        .unwrap_or_else(|e| {
                            self.constraint_error = Some(e);
                            self.eos
                        })
                };
                self.constraint = Some(constraint);
                token
            }
        };
        *self.output_counts.entry(token).or_insert(0) += 1;
        let logprob = logprob_of.map(|(lp, n)| TokenLogprob {
            scored: self
                .score_tokens
                .iter()
                .map(|&t| (t, lp.get(t as usize).copied().unwrap_or(f32::NEG_INFINITY)))
                .collect(),
            ..token_logprob(&lp, token, n)
        });
        Sampled { token, logprob }
    }

    /// After a sampled token: the tokens the grammar forces next (at most `max`), taken as
    /// generated without sampling, so that they run through the model as one chunk instead of a
    /// step each (jump-forward decoding). None without a grammar, or when log-probabilities are
    /// reported (each token would need its own logits row).
    pub fn fast_forward(&mut self, max: usize) -> Vec<u32> {
        if self.top_logprobs.is_some() || !self.score_tokens.is_empty() {
            return Vec::new();
        }
        let Some(constraint) = self.constraint.as_mut().filter(|c| !c.is_done()) else {
            return Vec::new();
        };
        let tokens = constraint.fast_forward(max);
        for &token in &tokens {
            *self.output_counts.entry(token).or_insert(0) += 1;
        }
        tokens
    }

    /// Applies the penalties, then makes every logit comparable: NaN becomes -inf (never
    /// chosen), +inf the largest finite value.
    fn apply_penalties(&self, logits: &mut [f32]) {
        self.penalize(logits);
        for l in logits.iter_mut() {
            if l.is_nan() {
                *l = f32::NEG_INFINITY;
            } else if *l == f32::INFINITY {
                *l = f32::MAX;
            }
        }
    }

    fn penalize(&self, logits: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let seen = self.prompt_tokens.iter().chain(self.output_counts.keys());
            for &t in seen {
                let l = &mut logits[t as usize];
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &count) in &self.output_counts {
                logits[t as usize] -= p.presence_penalty + p.frequency_penalty * count as f32;
            }
        }
    }

    fn choose(&mut self, logits: &mut [f32]) -> u32 {
        if self.params.temperature < GREEDY_BELOW {
            argmax(logits)
        } else {
            self.draw(logits)
        }
    }

    /// Chooses as [`Sampler::choose`] would among the tokens `constraint` allows: the
    /// unconstrained choice when the grammar takes it, else a choice under the full mask.
    fn choose_allowed(
        &mut self,
        logits: &mut [f32],
        constraint: &mut Constraint,
    ) -> Result<u32, GrammarError> {
        let original = logits.to_vec();
        let token = self.choose(logits);
        if constraint.allows(token) {
            return Ok(token);
        }
        logits.copy_from_slice(&original);
        constraint.mask(logits)?;
        if logits.iter().all(|&l| l == f32::NEG_INFINITY) {
            return Err(GrammarError("the grammar allows no token here".into()));
        }
        Ok(self.choose(logits))
    }

    /// Temperature, filters, one draw. `logits` hold no NaN and no +inf (see
    /// [`Sampler::apply_penalties`]); when every one is -inf the lowest index is chosen.
    fn draw(&mut self, logits: &mut [f32]) -> u32 {
        let p = &self.params;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return 0;
        }
        let inv_t = 1.0 / p.temperature;
        // Unnormalised probabilities; filters zero out what they drop.
        for l in logits.iter_mut() {
            *l = ((*l - max) * inv_t).exp();
        }
        let probs = logits;
        if p.min_p > 0.0 {
            // The most likely token has weight exp(0) = 1.
            for x in probs.iter_mut() {
                if *x < p.min_p {
                    *x = 0.0;
                }
            }
        }
        let mut candidates: Vec<u32> = (0..probs.len() as u32)
            .filter(|&i| probs[i as usize] > 0.0)
            .collect();
        if p.top_k > 0 && p.top_k < candidates.len() {
            partition_top(&mut candidates, probs, p.top_k);
            candidates.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            nucleus(&mut candidates, probs, p.top_p);
        }
        let total: f32 = candidates.iter().map(|&i| probs[i as usize]).sum();
        let mut u = self.rng.random::<f32>() * total;
        for &i in &candidates {
            u -= probs[i as usize];
            if u <= 0.0 {
                return i;
            }
        }
        // Rounding can leave a sliver of `u`: it belongs to the last candidate. The most likely
        // token (weight 1) survives every filter, so there is one.
        candidates.last().copied().unwrap_or_else(|| argmax(probs))
    }
}

/// Panics on demand, for the tests of what the engine and its servers do when code panics: a
/// fault armed with a seed fires in requests with that seed. Only in tests and with the
/// `fault-injection` feature.
#[cfg(any(test, feature = "fault-injection"))]
pub mod faults {
    use std::sync::atomic::AtomicU64;

    /// Fires in [`super::Sampler::sample`].
    pub static SAMPLE: AtomicU64 = AtomicU64::new(0);
    /// Fires in the engine loop, after sampling.
    pub static STEP: AtomicU64 = AtomicU64::new(0);
}

/// Index of the largest value; the lowest index wins ties.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// The log-probability of `token`, and the `top` most likely tokens, under the model's
/// distribution at one position: what a prompt token is scored with, given the logits at the
/// position before it. `logits` is overwritten with its log-softmax, so that a caller done with
/// the row pays for no copy of the vocabulary.
pub fn logprob_at(logits: &mut [f32], token: u32, top: usize) -> TokenLogprob {
    log_softmax_in_place(logits);
    token_logprob(logits, token, top)
}

/// The entry for `token` given log-probabilities `lp`; nothing is scored.
fn token_logprob(lp: &[f32], token: u32, top: usize) -> TokenLogprob {
    TokenLogprob {
        token,
        logprob: lp[token as usize],
        top: top_n(lp, top),
        scored: Vec::new(),
    }
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let mut lp = logits.to_vec();
    log_softmax_in_place(&mut lp);
    lp
}

fn log_softmax_in_place(logits: &mut [f32]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Every token impossible: each log-probability is -inf (not -inf - -inf = NaN).
    if max == f32::NEG_INFINITY {
        return;
    }
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    let log_z = max + sum.ln();
    for l in logits.iter_mut() {
        *l -= log_z;
    }
}

/// The `n` largest entries of `values`, largest first (lowest index first among equals).
fn top_n(values: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    let n = n.min(idx.len());
    if n == 0 {
        return Vec::new();
    }
    partition_top(&mut idx, values, n);
    idx.truncate(n);
    sort_desc(&mut idx, values);
    idx.into_iter().map(|i| (i, values[i as usize])).collect()
}

/// Moves the `k` largest candidates to the front (in no particular order).
fn partition_top(candidates: &mut [u32], values: &[f32], k: usize) {
    if k < candidates.len() {
        candidates.select_nth_unstable_by(k - 1, |&a, &b| cmp_desc(values, a, b));
    }
}

fn cmp_desc(values: &[f32], a: u32, b: u32) -> std::cmp::Ordering {
    values[b as usize]
        .total_cmp(&values[a as usize])
        .then(a.cmp(&b))
}

fn sort_desc(candidates: &mut [u32], values: &[f32]) {
    candidates.sort_unstable_by(|&a, &b| cmp_desc(values, a, b));
}

/// Keeps the smallest most-likely prefix of `candidates` whose mass reaches `top_p` of the total.
fn nucleus(candidates: &mut Vec<u32>, probs: &[f32], top_p: f32) {
    let total: f32 = candidates.iter().map(|&i| probs[i as usize]).sum();
    let target = top_p * total;
    // Grow the partially selected head until it holds enough mass, then sort only that head.
    let mut head = 64.min(candidates.len());
    loop {
        partition_top(candidates, probs, head);
        let mass: f32 = candidates[..head].iter().map(|&i| probs[i as usize]).sum();
        if mass >= target || head == candidates.len() {
            break;
        }
        head = (head * 4).min(candidates.len());
    }
    candidates.truncate(head);
    sort_desc(candidates, probs);
    let mut acc = 0.0;
    let keep = candidates
        .iter()
        .position(|&i| {
            acc += probs[i as usize];
            acc >= target
        })
        .map_or(candidates.len(), |p| p + 1);
    candidates.truncate(keep);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            seed: Some(7),
            ..SamplingParams::default()
        };
        f(&mut p);
        p
    }

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 0.5, 2.9, -1.0]
    }

    #[test]
    fn extreme_parameters_sample_without_panicking() {
        // 1e-40 as f32 is subnormal: its inverse overflowed to inf, and (l - max) * inf made
        // every weight NaN.
        let mut s = Sampler::new(params(|p| p.temperature = 1e-40), None, &[]);
        assert_eq!(s.sample(&mut logits()).token, 1);
        // A penalty that divides by almost nothing sends seen logits to +inf.
        let mut r = Sampler::new(
            params(|p| p.repetition_penalty = f32::MIN_POSITIVE),
            None,
            &[1, 4],
        );
        let t = r.sample(&mut logits()).token;
        assert!(t == 1 || t == 4, "sampled {t}");
        let mut all_impossible = vec![f32::NEG_INFINITY; 4];
        assert_eq!(s.sample(&mut all_impossible).token, 0);
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy(), None, &[]);
        assert_eq!(s.sample(&mut logits()).token, 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let run = || {
            let mut s = Sampler::new(params(|_| {}), None, &[]);
            (0..50)
                .map(|_| s.sample(&mut logits()).token)
                .collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        assert!(
            a.iter().collect::<HashSet<_>>().len() > 2,
            "temperature 1 explores"
        );
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(params(|p| p.top_k = 1), None, &[]);
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits()).token, 1);
        }
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Probabilities of tokens 1 and 4 dominate: a small top_p keeps only them.
        let mut s = Sampler::new(params(|p| p.top_p = 0.5), None, &[]);
        for _ in 0..50 {
            let t = s.sample(&mut logits()).token;
            assert!(t == 1 || t == 4, "sampled {t}");
        }
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let mut s = Sampler::new(params(|p| p.min_p = 0.5), None, &[]);
        for _ in 0..50 {
            let t = s.sample(&mut logits()).token;
            assert!([1, 2, 4].contains(&t), "sampled {t}");
        }
    }

    #[test]
    fn penalties_push_away_from_repeats() {
        let mut s = Sampler::new(
            SamplingParams {
                frequency_penalty: 1.0,
                ..SamplingParams::greedy()
            },
            None,
            &[],
        );
        assert_eq!(s.sample(&mut logits()).token, 1);
        // Token 1 now costs 1.0: 2.0 < 2.9, so token 4 wins.
        assert_eq!(s.sample(&mut logits()).token, 4);
        let mut r = Sampler::new(
            SamplingParams {
                repetition_penalty: 2.0,
                ..SamplingParams::greedy()
            },
            None,
            &[1],
        );
        // Token 1 is in the prompt: 3.0 / 2 = 1.5 < 2.9.
        assert_eq!(r.sample(&mut logits()).token, 4);
    }

    #[test]
    fn scored_tokens_report_their_logprobs_without_top_logprobs() {
        let mut s = Sampler::new(SamplingParams::greedy(), None, &[]).scoring(vec![5, 2]);
        let lp = s.sample(&mut logits()).logprob.unwrap();
        let expect = log_softmax(&logits());
        assert!(lp.top.is_empty());
        assert_eq!(lp.scored, vec![(5, expect[5]), (2, expect[2])]);
    }

    #[test]
    fn a_prompt_token_gets_what_a_sampled_one_would() {
        let mut s = Sampler::new(SamplingParams::greedy(), Some(3), &[]);
        let sampled = s.sample(&mut logits()).logprob.unwrap();
        assert_eq!(logprob_at(&mut logits(), 1, 3), sampled);
        let other = logprob_at(&mut logits(), 5, 0);
        assert_eq!(other.logprob, log_softmax(&logits())[5]);
        assert!(other.top.is_empty() && other.scored.is_empty());
    }

    #[test]
    fn logprobs_are_the_models() {
        let mut s = Sampler::new(SamplingParams::greedy(), Some(2), &[]);
        let lp = s.sample(&mut logits()).logprob.unwrap();
        let expect = log_softmax(&logits());
        assert_eq!(lp.token, 1);
        assert!((lp.logprob - expect[1]).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 4]);
        let total: f32 = expect.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;

        /// Logits as models and penalties make them: ordinary, huge, tiny, impossible, tied.
        fn logit() -> impl Strategy<Value = f32> {
            prop_oneof![
                4 => -30.0f32..30.0,
                1 => Just(f32::NEG_INFINITY),
                1 => Just(f32::MAX),
                1 => Just(-f32::MAX),
                1 => Just(0.0),
                1 => Just(1e-40),
                1 => any::<f32>().prop_filter("finite", |x| x.is_finite()),
            ]
        }

        /// A finite value from `[lo, hi]`, edges and subnormals included.
        fn between(lo: f32, hi: f32) -> impl Strategy<Value = f32> {
            prop_oneof![
                Just(lo),
                Just(hi),
                lo..=hi,
                (1e-45f32..1e-30).prop_map(move |x| x.clamp(lo, hi)),
            ]
        }

        /// Any parameters a validated request can carry.
        fn params() -> impl Strategy<Value = SamplingParams> {
            let tiny_or_huge = prop_oneof![
                Just(f32::MIN_POSITIVE),
                Just(f32::MAX),
                (-38.0f32..38.0).prop_map(|e| 10f32.powf(e).max(f32::MIN_POSITIVE)),
            ];
            (
                prop_oneof![between(0.0, 2.0), Just(1e-40), Just(GREEDY_BELOW)],
                0usize..80,
                between(f32::MIN_POSITIVE, 1.0),
                between(0.0, 1.0),
                tiny_or_huge,
                between(-2.0, 2.0),
                between(-2.0, 2.0),
                any::<u64>(),
            )
                .prop_map(
                    |(temperature, top_k, top_p, min_p, rep, pres, freq, seed)| SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                        repetition_penalty: rep,
                        presence_penalty: pres,
                        frequency_penalty: freq,
                        seed: Some(seed),
                    },
                )
        }

        fn unpenalized(mut p: SamplingParams) -> SamplingParams {
            p.repetition_penalty = 1.0;
            p.presence_penalty = 0.0;
            p.frequency_penalty = 0.0;
            p
        }

        proptest! {
            #[test]
            fn any_valid_parameters_sample_a_token(
                params in params(),
                row in prop::collection::vec(logit(), 1..48),
                prompt in prop::collection::vec(0u32..48, 0..8),
            ) {
                prop_assert_eq!(params.validate(), Ok(()));
                let prompt: Vec<u32> = prompt.into_iter().filter(|&t| (t as usize) < row.len()).collect();
                let mut s = Sampler::new(params, Some(3), &prompt);
                for _ in 0..6 {
                    let sampled = s.sample(&mut row.clone());
                    prop_assert!((sampled.token as usize) < row.len());
                    let lp = sampled.logprob.unwrap();
                    prop_assert!(!lp.logprob.is_nan());
                    prop_assert!(lp.top.iter().all(|(_, l)| !l.is_nan()));
                }
            }

            #[test]
            fn only_possible_tokens_are_sampled(
                params in params(),
                row in prop::collection::vec(logit(), 1..48),
            ) {
                prop_assume!(row.iter().any(|l| l.is_finite()));
                let mut s = Sampler::new(unpenalized(params), None, &[]);
                for _ in 0..6 {
                    let token = s.sample(&mut row.clone()).token;
                    prop_assert!(row[token as usize].is_finite(), "sampled impossible token {}", token);
                }
            }

            #[test]
            fn tiny_temperatures_are_greedy(
                params in params(),
                temperature in prop_oneof![Just(0.0f32), Just(1e-40), 1e-45f32..GREEDY_BELOW],
                row in prop::collection::vec(logit(), 1..48),
            ) {
                let params = SamplingParams { temperature, ..unpenalized(params) };
                let mut s = Sampler::new(params, None, &[]);
                let expect = argmax(&row.iter().map(|&l| l.min(f32::MAX)).collect::<Vec<_>>());
                prop_assert_eq!(s.sample(&mut row.clone()).token, expect);
            }
        }
    }
}
