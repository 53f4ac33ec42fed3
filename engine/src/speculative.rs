//! Prompt-lookup (n-gram) speculative decoding: agents copy (tool arguments, JSON keys, code
//! being edited, quotes from their context), so the tokens that followed the last place the
//! sequence's latest few tokens appeared are a good guess at what comes next, and cost nothing to
//! find.
//!
//! A decode step then runs the sequence's last token and its draft together, one forward with a
//! logits row for each (the scheduler plans them, [`crate::scheduler`]), and the engine loop
//! samples the rows in order: row `i`'s token is taken, and row `i + 1` is read only when that
//! token is the draft's `i`-th, the one row `i + 1` was computed after. So the tokens are those
//! one-at-a-time decoding gives, for greedy and seeded sampling alike: each row is sampled with
//! the same sampler state (penalties, grammar, random stream) as it would have been, and the
//! kernels are batch-invariant, so a row's logits do not depend on the rows beside it. The keys
//! and values computed for rejected draft tokens stay behind the sequence's computed length, and
//! the next step writes over them; no block holding them is offered to the prefix cache.
//!
//! A draft is only worth its rows while a step is cheap to widen: [`DraftPolicy`] says how
//! wide a step drafting may make, and each sequence's draft length follows how much of its
//! drafts was accepted ([`Drafter`]).

/// How decode steps guess ahead.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Speculative {
    /// Drafts from the sequence's own tokens (prompt lookup), verified in one forward.
    #[default]
    Ngram,
    /// One token a step.
    Off,
}

/// Most tokens one draft holds.
pub const MAX_DRAFT: usize = 8;
/// The longest n-gram looked up; a match this long is taken at once.
const MAX_NGRAM: usize = 4;
/// The shortest n-gram whose earlier occurrence makes a draft: a single token repeats too often
/// to say what follows it.
const MIN_NGRAM: usize = 2;

/// When a step drafts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftPolicy {
    /// Drafts are added while the step holds at most this many tokens: a step that narrow costs
    /// about what one token does (its weights are read once for all of its rows), so a draft
    /// token costs little beside the token it may save. 0: no drafts.
    pub step_tokens: usize,
}

impl DraftPolicy {
    pub fn new(speculative: Speculative, step_tokens: usize) -> Self {
        Self {
            step_tokens: match speculative {
                Speculative::Ngram => step_tokens,
                Speculative::Off => 0,
            },
        }
    }
}

/// A sequence's drafting: how long its next draft may be, following its drafts' fate (longer
/// after a draft accepted whole, shorter after one rejected), how often the lookup has guessed
/// its next token right, and how far it may reach. While the lookup guesses poorly (text that
/// copies nothing) the sequence drafts nothing, and the lookup's guesses are still checked
/// against what it samples, at no cost, so that it drafts again once its output starts copying.
#[derive(Clone, Debug, PartialEq)]
pub struct Drafter {
    len: usize,
    /// How often the lookup's first token was the one sampled (an exponential moving average).
    hit_rate: f32,
    /// The lookup's guess at the next token when no draft was run, to check after sampling.
    guess: Option<u32>,
    /// The most tokens the sequence may hold (its prompt and its longest answer, within the
    /// context): a draft never reaches past what the sequence could generate.
    end: usize,
}

/// Below this hit rate a sequence does not draft: a draft of one token costs about half a
/// step's compute on a CPU (its row's share of the products), so it must be right about as often
/// to pay.
const MIN_HIT_RATE: f32 = 0.5;
/// The weight of the latest guess in the hit rate.
const HIT_RATE_WEIGHT: f32 = 0.2;

impl Drafter {
    pub fn new(end: usize) -> Self {
        Self {
            len: MAX_DRAFT / 2,
            hit_rate: MIN_HIT_RATE,
            guess: None,
            end,
        }
    }

    /// The draft for a sequence of `tokens` whose last one is still to be computed: at most
    /// `most` tokens, none past the sequence's end; none while the lookup guesses poorly (its
    /// guess is kept, for [`Drafter::sampled`] to check).
    pub fn propose<'a>(&mut self, tokens: &'a [u32], most: usize) -> &'a [u32] {
        // Computing `tokens` and a draft of `k` gives up to `k + 1` new tokens.
        let room = self.end.saturating_sub(tokens.len() + 1);
        let draft = lookup(tokens, self.len.min(most).min(room));
        if self.hit_rate >= MIN_HIT_RATE {
            return draft;
        }
        self.guess = draft.first().copied();
        &[]
    }

    /// The sequence sampled `token` after a step that ran no draft.
    pub fn sampled(&mut self, token: u32) {
        if let Some(guess) = self.guess.take() {
            self.hit(guess == token);
        }
    }

    /// A draft of `drafted` tokens had its first `accepted` taken.
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.hit(accepted > 0);
        self.len = match accepted == drafted {
            true => (self.len + 2).min(MAX_DRAFT),
            false => (accepted + 1).clamp(1, self.len),
        };
    }

    fn hit(&mut self, hit: bool) {
        let hit = if hit { 1.0 } else { 0.0 };
        self.hit_rate += HIT_RATE_WEIGHT * (hit - self.hit_rate);
    }
}

/// Up to `most` tokens that followed the latest earlier occurrence of the longest n-gram ending
/// `tokens` (see [`continuation`]); empty when it never occurred before.
pub fn lookup(tokens: &[u32], most: usize) -> &[u32] {
    match continuation(tokens) {
        Some(next) if most > 0 => &tokens[next..tokens.len().min(next + most)],
        _ => &[],
    }
}

/// Where the continuation of the longest n-gram ending `tokens` starts, at its latest earlier
/// occurrence (at least [`MIN_NGRAM`] tokens, at most [`MAX_NGRAM`]). One pass from the end,
/// stopping at the first full-length match: `O(len)`.
fn continuation(tokens: &[u32]) -> Option<usize> {
    let len = tokens.len();
    let mut best = (0, 0);
    // `next` is where a candidate's continuation starts: its n-gram ends just before it.
    for next in (1..len).rev() {
        let n = (1..=MAX_NGRAM.min(next))
            .take_while(|&k| tokens[next - k] == tokens[len - k])
            .count();
        if n > best.0 {
            best = (n, next);
            if n == MAX_NGRAM {
                break;
            }
        }
    }
    (best.0 >= MIN_NGRAM).then_some(best.1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_repeated_phrase_drafts_what_followed_it() {
        //            0  1  2  3  4  5  6  7  8  9
        let tokens = [5, 1, 2, 3, 4, 9, 7, 1, 2, 3];
        assert_eq!(lookup(&tokens, 3), &[4, 9, 7]);
        assert_eq!(lookup(&tokens, 10), &[4, 9, 7, 1, 2, 3]);
        assert_eq!(lookup(&tokens, 0), &[] as &[u32]);
    }

    #[test]
    fn the_longest_match_wins_over_a_later_shorter_one() {
        // "2 3" follows 1 at 1..3 (a 3-gram match) and 8 at 5..7 (a 2-gram match).
        let tokens = [1, 2, 3, 4, 8, 2, 3, 6, 1, 2, 3];
        assert_eq!(lookup(&tokens, 2), &[4, 8]);
        // Among equal lengths the latest wins.
        let tokens = [2, 3, 4, 2, 3, 5, 2, 3];
        assert_eq!(lookup(&tokens, 1), &[5]);
    }

    #[test]
    fn a_single_repeated_token_drafts_nothing() {
        assert!(lookup(&[7, 1, 8, 1], 4).is_empty());
        assert!(lookup(&[1, 2], 4).is_empty());
        assert!(lookup(&[], 4).is_empty());
    }

    #[test]
    fn a_draft_stops_at_the_sequence_end_and_follows_acceptance() {
        let tokens = [1, 2, 3, 4, 5, 6, 1, 2];
        let mut drafter = Drafter::new(10);
        // 8 tokens, the last to compute: 10 - 9 = 1 token of room.
        assert_eq!(drafter.propose(&tokens, 8), &[3]);
        drafter.end = 100;
        assert_eq!(drafter.propose(&tokens, 8).len(), MAX_DRAFT / 2);
        drafter.verified(4, 4);
        assert_eq!(drafter.propose(&tokens, 8).len(), 6);
        drafter.verified(6, 1);
        assert_eq!(drafter.propose(&tokens, 8).len(), 2);
        drafter.verified(2, 2);
        assert_eq!(drafter.propose(&tokens, 8).len(), 4);
    }

    #[test]
    fn a_sequence_whose_guesses_miss_stops_drafting_until_they_hit() {
        let tokens = [1, 2, 3, 4, 5, 6, 1, 2];
        let mut drafter = Drafter::new(100);
        assert!(!drafter.propose(&tokens, 8).is_empty());
        drafter.verified(4, 0);
        assert!(
            drafter.propose(&tokens, 8).is_empty(),
            "one miss below the bar"
        );
        // Its guesses are checked against what it samples: a few right ones and it drafts.
        let mut hits = 0;
        while drafter.propose(&tokens, 8).is_empty() {
            drafter.sampled(3);
            hits += 1;
            assert!(hits < 10);
        }
        assert!(hits >= 1);
        // A wrong guess counts too, and nothing is checked without a guess.
        drafter.verified(1, 0);
        let before = drafter.hit_rate;
        assert!(drafter.propose(&tokens, 8).is_empty());
        drafter.sampled(3);
        assert!(drafter.hit_rate > before);
        let at = drafter.hit_rate;
        drafter.sampled(9);
        assert_eq!(drafter.hit_rate, at, "no guess was pending");
    }

    proptest! {
        /// A continuation follows an earlier occurrence of the sequence's last tokens, and no
        /// later occurrence is as long.
        #[test]
        fn a_draft_continues_the_latest_longest_occurrence(
            tokens in prop::collection::vec(0u32..4, 0..60),
        ) {
            let len = tokens.len();
            let matched = |next: usize| {
                (1..=MAX_NGRAM.min(next))
                    .take_while(|&k| tokens[next - k] == tokens[len - k])
                    .count()
            };
            match continuation(&tokens) {
                Some(next) => {
                    prop_assert!(next < len);
                    let n = matched(next);
                    prop_assert!(n >= MIN_NGRAM);
                    prop_assert!((next + 1..len).all(|later| matched(later) < n));
                }
                None => prop_assert!((1..len).all(|next| matched(next) < MIN_NGRAM)),
            }
        }
    }
}
