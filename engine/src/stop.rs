//! Turns one sequence's generated tokens into text chunks for streaming, and ends the text at the
//! first stop string.
//!
//! Detokenization uses the prefix/read offset technique over a short window of recent ids:
//! `ids[..read_offset]` are tokens whose text was already handed on and serve only as decoding
//! context, `ids[read_offset..]` are tokens whose text is not complete yet. Each step decodes the
//! window with and without the undecided tokens and hands on the difference. Once the window ends
//! on a character boundary, the old context is dropped and the decided tokens become the new
//! context (the prefix offset is always the window's start), so the cost of a step does not grow
//! with the length of the generation.
//!
//! Invariants:
//! - no emitted chunk ends inside a UTF-8 character: byte-level BPE can split one character over
//!   several tokens, and a partial character decodes to U+FFFD, which is held back until the
//!   character is complete (or the generation ends; or, for malformed output, until
//!   `MAX_UNDECIDED_TOKENS` tokens have passed without a character boundary);
//! - no emitted text could still be the start of a stop string: the longest suffix of the
//!   undelivered text that is a prefix of some stop string is held back;
//! - once a stop string appears, only the text before it is emitted, and nothing after;
//! - without a stop match, the concatenation of every chunk plus [`TextStream::flush`] equals
//!   `tokenizer.decode(all_ids, true)`. Special tokens are skipped, as in that decode.
//!
//! Stop strings are compiled once per sequence into Aho-Corasick automata ([`StopSet`]), so each
//! token costs time in proportion to the text it adds and to the longest stop string, not to
//! their number: one leftmost search finds the earliest stop, one walk over the held text finds
//! the longest suffix that could still grow into one. Stop strings are at most
//! [`MAX_STOP_BYTES`] long, which bounds both that walk and the text held back.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use aho_corasick::automaton::Automaton;
use aho_corasick::nfa::contiguous;
use aho_corasick::{AhoCorasick, Anchored, MatchKind};
use tokenizers::Tokenizer;

use crate::{EngineError, Result};

/// What a partial UTF-8 character (or an invalid byte) decodes to.
const REPLACEMENT: char = '\u{FFFD}';

/// A character is at most 4 bytes, so valid text reaches a character boundary at a token boundary
/// within a few tokens. A window still undecided after this many tokens is malformed output (or a
/// long run of tokens that each end mid-character); it is then released as decoded, U+FFFD and
/// all, to keep the window short.
const MAX_UNDECIDED_TOKENS: usize = 32;

/// The longest stop string a request may set, in bytes. Text that could be the start of a stop
/// string is held back from the stream, so this also bounds how far the stream may lag.
pub const MAX_STOP_BYTES: usize = 512;

/// The most stop strings one sequence may have: far above OpenAI's 4, and small enough that the
/// automata (a state per byte) are tiny.
pub const MAX_STOP_STRINGS: usize = 32;

/// Whether `stop` is within [`MAX_STOP_STRINGS`] strings of [`MAX_STOP_BYTES`] each; the reason
/// when it is not.
pub fn check_stop_strings(stop: &[String]) -> Result<()> {
    if stop.len() > MAX_STOP_STRINGS {
        return Err(EngineError::InvalidRequest(format!(
            "at most {MAX_STOP_STRINGS} stop strings are allowed; got {}",
            stop.len()
        )));
    }
    match stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        Some(long) => Err(EngineError::InvalidRequest(format!(
            "stop strings must be at most {MAX_STOP_BYTES} bytes long; got one of {}",
            long.len()
        ))),
        None => Ok(()),
    }
}

/// The text a token released, and whether generation must stop because a stop string appeared.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TextStep {
    /// Text to append to the output; often empty while a character or a stop string is pending.
    pub text: String,
    /// A stop string was found: `text` ends just before it and the sequence is finished.
    pub stopped: bool,
}

/// Where the stream is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Running,
    /// A stop string matched; later tokens are ignored.
    Stopped,
    /// `flush` handed out the rest; later tokens are ignored.
    Flushed,
}

/// Incremental detokenizer with stop strings for one sequence.
pub struct TextStream {
    tokenizer: Arc<Tokenizer>,
    /// Ids that decoding skips; they never enter the window.
    special_ids: HashSet<u32>,
    /// `None` without stop strings.
    stop: Option<StopSet>,
    /// The window: decoding context, then tokens not yet fully decided.
    ids: Vec<u32>,
    /// Where the undecided tokens start in `ids`.
    read_offset: usize,
    /// Bytes of the window's text past `decode(ids[..read_offset])` already moved to `pending`:
    /// whole characters before a trailing partial one.
    read_emitted: usize,
    /// What the window decodes to after `read_emitted`, not yet released because it is a partial
    /// character (U+FFFD); `flush` hands it out as is, matching a full decode.
    partial: String,
    /// Decoded text held back because it may be the start of a stop string.
    pending: String,
    state: State,
}

impl TextStream {
    /// A stream decoding with `tokenizer`, stopping at any of `stop` (empty strings are ignored:
    /// they would match before any text). The stop strings are within [`MAX_STOP_STRINGS`] of
    /// [`MAX_STOP_BYTES`] each ([`crate::ModelInfo::check`] refuses more).
    pub fn new(tokenizer: Arc<Tokenizer>, stop: Vec<String>) -> Self {
        let special_ids = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        let mut stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
        stop.sort();
        stop.dedup();
        let stop = StopSet::new(stop);
        Self {
            tokenizer,
            special_ids,
            stop,
            ids: Vec::new(),
            read_offset: 0,
            read_emitted: 0,
            partial: String::new(),
            pending: String::new(),
            state: State::Running,
        }
    }

    /// Feeds the next generated token; returns the text it releases. After a stop (or a
    /// [`flush`](Self::flush)) tokens are ignored and the step is empty.
    pub fn push(&mut self, token: u32) -> Result<TextStep> {
        match self.state {
            State::Running => {}
            State::Stopped => {
                return Ok(TextStep {
                    text: String::new(),
                    stopped: true,
                })
            }
            State::Flushed => return Ok(TextStep::default()),
        }
        if self.special_ids.contains(&token) {
            return Ok(TextStep::default());
        }
        self.ids.push(token);
        let fresh = self.decode_fresh()?;
        self.pending.push_str(&fresh);
        Ok(self.release())
    }

    /// Ends the stream for a reason other than a stop string (length, EOS, cancel) and returns the
    /// text still held back: a possible stop-string start, or a character left incomplete (as
    /// U+FFFD, as a full decode shows it). Empty after a stop or a previous flush.
    pub fn flush(&mut self) -> String {
        if self.state != State::Running {
            return String::new();
        }
        self.state = State::Flushed;
        self.ids.clear();
        let mut rest = std::mem::take(&mut self.pending);
        rest.push_str(&std::mem::take(&mut self.partial));
        // The released partial character is U+FFFD, which a stop string could (oddly) end with.
        if let Some(at) = self.first_stop(&rest) {
            rest.truncate(at);
        }
        rest
    }

    /// Decodes the window and returns its newly complete text, advancing the offsets when the
    /// window ends on a character boundary.
    fn decode_fresh(&mut self) -> Result<String> {
        let context = self.decode(&self.ids[..self.read_offset])?;
        let text = self.decode(&self.ids)?;
        if !text.starts_with(&context) {
            return Err(EngineError::Tokenizer(
                "decoding is not prefix-stable: adding a token changed earlier text".into(),
            ));
        }
        let undecided = self.ids.len() - self.read_offset;
        let complete = !text.ends_with(REPLACEMENT);
        let give_up = !complete && undecided >= MAX_UNDECIDED_TOKENS;
        let end = if complete || give_up {
            text.len()
        } else {
            text.len() - REPLACEMENT.len_utf8()
        };
        let done = context.len() + self.read_emitted;
        let fresh = text.get(done..end).ok_or_else(|| {
            EngineError::Tokenizer(format!(
                "decoding is not prefix-stable: {done} bytes already emitted, {end} now complete"
            ))
        })?;
        let fresh = fresh.to_owned();

        if complete {
            // The window ends on a character boundary: the decided tokens become the context.
            self.ids.drain(..self.read_offset);
            self.read_offset = self.ids.len();
            self.read_emitted = 0;
            self.partial.clear();
        } else if give_up {
            // No character boundary to keep as context: decoding restarts from nothing.
            self.ids.clear();
            self.read_offset = 0;
            self.read_emitted = 0;
            self.partial.clear();
        } else {
            self.read_emitted = end - context.len();
            self.partial = text[end..].to_owned();
        }
        Ok(fresh)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| EngineError::Tokenizer(format!("decoding {ids:?}: {e}")))
    }

    /// Moves the releasable part of `pending` into a step: all of it up to a stop string, or all
    /// but the longest suffix that could still grow into one.
    fn release(&mut self) -> TextStep {
        if let Some(at) = self.first_stop(&self.pending) {
            let mut text = std::mem::take(&mut self.pending);
            text.truncate(at);
            self.state = State::Stopped;
            self.ids.clear();
            self.partial.clear();
            return TextStep {
                text,
                stopped: true,
            };
        }
        let hold = self.stop_prefix_len();
        let release = self.pending.len() - hold;
        TextStep {
            text: self.pending.drain(..release).collect(),
            stopped: false,
        }
    }

    /// Where the earliest stop string in `text` starts.
    fn first_stop(&self, text: &str) -> Option<usize> {
        self.stop.as_ref()?.first(text)
    }

    /// Length in bytes of the longest suffix of `pending` that some stop string starts with.
    /// `pending` contains no whole stop string here, so only proper prefixes can match.
    fn stop_prefix_len(&self) -> usize {
        self.stop
            .as_ref()
            .map_or(0, |stop| stop.open_suffix_len(&self.pending))
    }
}

/// One sequence's stop strings, compiled.
struct StopSet {
    strings: Vec<String>,
    /// Finds the match that starts first (leftmost-first semantics).
    leftmost: AhoCorasick,
    /// The same strings with standard semantics: after a walk over a text, its state stands for
    /// the longest suffix of the text that is a prefix of some stop string (the classic
    /// Aho-Corasick invariant, kept by following failure transitions).
    prefixes: contiguous::NFA,
    /// How many bytes of prefix each state stands for; the start state, absent, is 0.
    depth: HashMap<usize, usize>,
    longest: usize,
}

impl StopSet {
    /// `None` for no stop strings.
    ///
    /// Building fails only past 2^31 states (a state per byte of the strings) and an unanchored
    /// start always exists; bounded strings ([`check_stop_strings`]) stay far below that.
    fn new(strings: Vec<String>) -> Option<Self> {
        if strings.is_empty() {
            return None;
        }
        let leftmost = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostFirst)
            .build(&strings)
            .expect("bounded stop strings compile");
        let prefixes = contiguous::NFA::builder()
            .match_kind(MatchKind::Standard)
            .build(&strings)
            .expect("bounded stop strings compile");
        let start = prefixes
            .start_state(Anchored::No)
            .expect("an unanchored automaton has an unanchored start");
        // Walking a stop string's first `n` bytes ends on the state of that very prefix: it is
        // its own longest suffix that is a prefix.
        let mut depth = HashMap::new();
        for string in &strings {
            let mut state = start;
            for (n, &byte) in string.as_bytes().iter().enumerate() {
                state = prefixes.next_state(Anchored::No, state, byte);
                depth.insert(state.as_usize(), n + 1);
            }
        }
        let longest = strings.iter().map(String::len).max().unwrap_or(0);
        Some(Self {
            strings,
            leftmost,
            prefixes,
            depth,
            longest,
        })
    }

    /// Where the earliest stop string in `text` starts.
    fn first(&self, text: &str) -> Option<usize> {
        self.leftmost.find(text).map(|found| found.start())
    }

    /// Length of the longest suffix of `text` that is a prefix of some stop string. Only the
    /// last `longest` bytes can hold one. Such a suffix starts with a stop string's first byte,
    /// never a UTF-8 continuation byte, so it starts on a character boundary.
    fn open_suffix_len(&self, text: &str) -> usize {
        let tail = &text.as_bytes()[text.len().saturating_sub(self.longest)..];
        let mut state = self
            .prefixes
            .start_state(Anchored::No)
            .expect("an unanchored automaton has an unanchored start");
        for &byte in tail {
            state = self.prefixes.next_state(Anchored::No, state, byte);
        }
        self.depth.get(&state.as_usize()).copied().unwrap_or(0)
    }
}

impl fmt::Debug for TextStream {
    // The tokenizer is left out: its vocabulary would swamp the output.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TextStream")
            .field("stop", &self.stop.as_ref().map(|stop| &stop.strings))
            .field("ids", &self.ids)
            .field("read_offset", &self.read_offset)
            .field("read_emitted", &self.read_emitted)
            .field("partial", &self.partial)
            .field("pending", &self.pending)
            .field("state", &self.state)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{encode, smollm2_tokenizer};
    use proptest::prelude::*;

    fn stream(stop: &[&str]) -> TextStream {
        TextStream::new(
            smollm2_tokenizer(),
            stop.iter().map(|s| s.to_string()).collect(),
        )
    }

    /// Feeds every token, returning each step's text and whether (and where) it stopped.
    fn run(stream: &mut TextStream, ids: &[u32]) -> (Vec<String>, Option<usize>) {
        let mut texts = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let step = stream.push(id).expect("push");
            texts.push(step.text);
            if step.stopped {
                return (texts, Some(i));
            }
        }
        (texts, None)
    }

    /// The id of the vocabulary token holding the single byte `b`, found through GPT-2's
    /// byte-to-character table: printable Latin-1 bytes stand for themselves, the others are
    /// shifted to U+0100 and up in byte order.
    fn byte_token(b: u8) -> u32 {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable(b) {
            char::from(b)
        } else {
            let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
            char::from_u32(256 + rank).unwrap()
        };
        smollm2_tokenizer()
            .token_to_id(&c.to_string())
            .unwrap_or_else(|| panic!("byte {b:#04x} ({c:?}) has a token"))
    }

    #[test]
    fn streams_plain_text_token_by_token() {
        let text = "The quick brown fox jumps over the lazy dog.";
        let ids = encode(text);
        let mut s = stream(&[]);
        let (texts, stopped) = run(&mut s, &ids);
        assert_eq!(stopped, None);
        // ASCII words are complete in every token, so nothing is held back.
        assert!(texts.iter().all(|t| !t.is_empty()), "{texts:?}");
        assert_eq!(texts.concat(), text);
        assert_eq!(s.flush(), "");
    }

    #[test]
    fn stop_string_spanning_two_tokens_is_cut_before_it() {
        let text = "The capital of France is Paris, of course.";
        let stop = "s Par";
        let ids = encode(text);
        let tokenizer = smollm2_tokenizer();
        let is_id = ids
            .iter()
            .position(|&id| id == tokenizer.token_to_id("Ġis").unwrap())
            .expect("' is' is one token");
        assert_eq!(ids[is_id + 1], tokenizer.token_to_id("ĠParis").unwrap());

        let mut s = stream(&[stop]);
        let (texts, stopped) = run(&mut s, &ids);
        assert_eq!(stopped, Some(is_id + 1), "stops on the token completing it");
        // " is": the "s" might start "s Par", so only " i" goes out.
        assert_eq!(texts[is_id], " i");
        assert_eq!(texts[is_id + 1], "");
        assert_eq!(texts.concat(), "The capital of France i");
        // Nothing after the stop, and flush has nothing either.
        let after = s.push(ids[is_id + 2]).unwrap();
        assert_eq!(
            after,
            TextStep {
                text: String::new(),
                stopped: true
            }
        );
        assert_eq!(s.flush(), "");
    }

    #[test]
    fn among_many_stops_the_one_starting_first_wins_across_tokens() {
        let ids = encode("The capital of France is Paris, of course.");
        // "France is P" spans three tokens and starts before "s Par", which ends first.
        let mut s = stream(&["s Par", "zzz", "France is P", "course"]);
        let (texts, stopped) = run(&mut s, &ids);
        assert!(stopped.is_some());
        assert_eq!(texts.concat(), "The capital of ");
        assert_eq!(s.flush(), "");
    }

    #[test]
    fn many_long_stop_strings_hold_back_only_a_possible_start() {
        // The longest allowed strings, all sharing a long prefix with the text: each token's
        // text stays held back while some string could still match, then goes out whole.
        let text = "abc ".repeat(200);
        let stops: Vec<String> = (0..MAX_STOP_STRINGS)
            .map(|i| {
                let mut stop = "abc ".repeat(MAX_STOP_BYTES / 4 - 1);
                stop.push_str(&format!("{i:03}"));
                stop.truncate(MAX_STOP_BYTES);
                stop
            })
            .collect();
        assert!(check_stop_strings(&stops).is_ok());
        let mut s = TextStream::new(smollm2_tokenizer(), stops.clone());
        let ids = encode(&text);
        let (texts, stopped) = run(&mut s, &ids);
        assert_eq!(stopped, None);
        let released = texts.concat();
        // Held back: the longest suffix that is still a prefix of a stop string.
        let held = s.pending.len();
        assert!(held < MAX_STOP_BYTES && held > MAX_STOP_BYTES - 8, "{held}");
        assert_eq!(released.len() + held, text.len());
        assert_eq!(released + &s.flush(), text);

        // One of them, completed, stops the stream right before it.
        let mut s = TextStream::new(smollm2_tokenizer(), stops.clone());
        let stopping = format!("xyz {}", stops[7]);
        let (texts, stopped) = run(&mut s, &encode(&format!("{stopping} tail")));
        assert!(stopped.is_some());
        assert_eq!(texts.concat(), "xyz ");
    }

    #[test]
    fn stop_strings_are_bounded_in_number_and_length() {
        let long = vec!["x".repeat(MAX_STOP_BYTES + 1)];
        assert!(matches!(
            check_stop_strings(&long),
            Err(EngineError::InvalidRequest(m)) if m.contains("bytes")
        ));
        let many = vec!["x".to_string(); MAX_STOP_STRINGS + 1];
        assert!(check_stop_strings(&many).is_err());
        assert!(check_stop_strings(&["x".repeat(MAX_STOP_BYTES)]).is_ok());
    }

    #[test]
    fn emoji_split_over_byte_tokens_is_never_emitted_half() {
        let mut ids = encode("Hi ");
        ids.extend("😀".bytes().map(byte_token));
        ids.extend(encode("!"));
        let mut s = stream(&[]);
        let (texts, _) = run(&mut s, &ids);
        let n = texts.len();
        assert_eq!(&texts[n - 5..], ["", "", "", "😀", "!"]);
        assert!(texts.iter().all(|t| !t.contains(REPLACEMENT)), "{texts:?}");
        assert_eq!(texts.concat(), "Hi 😀!");
    }

    #[test]
    fn multi_token_characters_from_real_encodings_stay_whole() {
        for text in ["👨‍👩‍👧 family", "🇫🇷 drapeau", "中文文本和日本語", "👍🏽👍🏽"]
        {
            let ids = encode(text);
            let mut s = stream(&[]);
            let (texts, _) = run(&mut s, &ids);
            assert!(texts.iter().all(|t| !t.contains(REPLACEMENT)), "{texts:?}");
            assert_eq!(texts.concat() + &s.flush(), text);
        }
        // At least one of them really splits a character over tokens.
        let ids = encode("👍🏽");
        let pieces: Vec<String> = ids
            .iter()
            .map(|&id| smollm2_tokenizer().decode(&[id], true).unwrap())
            .collect();
        assert!(pieces.iter().any(|p| p.contains(REPLACEMENT)), "{pieces:?}");
    }

    #[test]
    fn held_back_text_is_released_when_no_stop_follows() {
        let ids = encode("hello there");
        assert_eq!(ids.len(), 2);
        // The whole first token could start the stop string.
        let mut s = stream(&["hello world"]);
        assert_eq!(
            run(&mut s, &ids),
            (vec!["".into(), "hello there".into()], None)
        );
        // Only its tail could.
        let mut s = stream(&["lo w"]);
        assert_eq!(
            run(&mut s, &ids),
            (vec!["hel".into(), "lo there".into()], None)
        );
    }

    #[test]
    fn flush_releases_held_text_and_partial_characters() {
        let mut s = stream(&["hello world"]);
        assert_eq!(run(&mut s, &encode("hello")).0, [""]);
        assert_eq!(s.flush(), "hello");
        assert_eq!(s.flush(), "");
        assert_eq!(s.push(encode("x")[0]).unwrap(), TextStep::default());

        // Generation cut inside a character: a full decode shows U+FFFD, so does the stream.
        let ids: Vec<u32> = "😀".bytes().take(2).map(byte_token).collect();
        let mut s = stream(&[]);
        assert_eq!(run(&mut s, &ids).0, ["", ""]);
        let full = smollm2_tokenizer().decode(&ids, true).unwrap();
        assert_eq!(s.flush(), full);
        assert_eq!(full, "\u{FFFD}");
    }

    #[test]
    fn earliest_stop_wins_and_stops_inside_one_token() {
        let ids = encode("hello world");
        let mut s = stream(&["world", "lo"]);
        assert_eq!(run(&mut s, &ids), (vec!["hel".into()], Some(0)));
        let mut s = stream(&["ell"]);
        assert_eq!(run(&mut s, &ids), (vec!["h".into()], Some(0)));
    }

    #[test]
    fn stop_string_with_a_multibyte_character() {
        let mut ids = encode("price: 5");
        ids.extend("€".bytes().map(byte_token));
        ids.extend(encode(" only"));
        let mut s = stream(&["5€"]);
        let (texts, stopped) = run(&mut s, &ids);
        assert!(stopped.is_some());
        assert_eq!(texts.concat(), "price: ");
    }

    #[test]
    fn special_tokens_are_skipped_and_empty_stops_ignored() {
        let mut ids = encode("Hi");
        ids.push(2); // <|im_end|>
        ids.extend(encode(" there"));
        let mut s = stream(&["", ""]);
        let (texts, stopped) = run(&mut s, &ids);
        assert_eq!(stopped, None);
        assert_eq!(texts, ["Hi", "", " there"]);
    }

    #[test]
    fn window_stays_short() {
        let text = "Tokens stream by one at a time, 中文 and 🙂 included. ".repeat(40);
        let ids = encode(&text);
        let mut s = stream(&["never appears"]);
        let mut longest = 0;
        for &id in &ids {
            s.push(id).unwrap();
            longest = longest.max(s.ids.len());
        }
        assert!(longest <= 8, "window grew to {longest} ids");
        assert!(ids.len() > 400);
    }

    #[test]
    fn undecided_window_is_released_after_the_limit() {
        // Lead bytes only: never a character boundary.
        let lead = byte_token(0xE4);
        let mut s = stream(&[]);
        let mut out = String::new();
        for _ in 0..MAX_UNDECIDED_TOKENS * 3 {
            out.push_str(&s.push(lead).unwrap().text);
            assert!(s.ids.len() <= MAX_UNDECIDED_TOKENS);
        }
        out.push_str(&s.flush());
        assert_eq!(out.chars().count(), MAX_UNDECIDED_TOKENS * 3);
        assert!(out.chars().all(|c| c == REPLACEMENT));
    }

    /// Text mixing the scripts and whitespace that stress byte-level BPE.
    fn text_strategy() -> impl Strategy<Value = String> {
        let pieces = prop::sample::select(vec![
            "the",
            " quick",
            " brown",
            "fox",
            " ",
            "  ",
            "\n",
            "\n\n",
            "\t",
            "é",
            "ü",
            "ñ",
            "ç",
            "Straße",
            "中文",
            "日本語",
            "한국어",
            "🙂",
            "👍🏽",
            "👨‍👩‍👧",
            "🇫🇷",
            "12",
            "3.5",
            "!",
            "?",
            "'s",
            "fn(x)",
            "{",
            "}",
            "<|im_end|>",
            "\u{FFFD}",
        ]);
        let piece = prop_oneof![
            4 => pieces.prop_map(str::to_string),
            1 => any::<char>().prop_map(|c| c.to_string()),
        ];
        prop::collection::vec(piece, 0..40).prop_map(|pieces| pieces.concat())
    }

    proptest! {
        #[test]
        fn chunks_concatenate_to_the_full_decode(text in text_strategy()) {
            let tokenizer = smollm2_tokenizer();
            let ids = encode(&text);
            let mut s = stream(&[]);
            let (texts, stopped) = run(&mut s, &ids);
            prop_assert_eq!(stopped, None);
            let streamed = texts.concat() + &s.flush();
            let full = tokenizer.decode(&ids, true).unwrap();
            prop_assert_eq!(&streamed, &full);
            // Characters split over tokens never show up as U+FFFD.
            if !full.contains(REPLACEMENT) {
                prop_assert!(texts.iter().all(|t| !t.contains(REPLACEMENT)), "{:?}", texts);
            }
        }

        #[test]
        fn random_ids_concatenate_to_the_full_decode(
            ids in prop::collection::vec(0u32..49152, 0..64),
        ) {
            let mut s = stream(&[]);
            let (texts, _) = run(&mut s, &ids);
            let streamed = texts.concat() + &s.flush();
            prop_assert_eq!(streamed, smollm2_tokenizer().decode(&ids, true).unwrap());
        }

        #[test]
        fn output_ends_right_before_the_first_stop(
            text in text_strategy(),
            start in any::<prop::sample::Index>(),
            len in 1usize..6,
        ) {
            let ids = encode(&text);
            let decoded = smollm2_tokenizer().decode(&ids, true).unwrap();
            let chars: Vec<(usize, char)> = decoded.char_indices().collect();
            prop_assume!(!chars.is_empty());
            let from = start.index(chars.len());
            let to = chars.get(from + len).map_or(decoded.len(), |&(at, _)| at);
            let stop = &decoded[chars[from].0..to];
            let expected = &decoded[..decoded.find(stop).unwrap()];

            let mut s = stream(&[stop]);
            let (texts, stopped) = run(&mut s, &ids);
            prop_assert_eq!(texts.concat() + &s.flush(), expected);
            // A trailing U+FFFD is held as a possibly partial character until the end, so a
            // stop string ending in one can only be found by `flush`.
            prop_assert!(stopped.is_some() || stop.ends_with(REPLACEMENT));
        }

        #[test]
        fn several_stops_end_the_output_at_the_first_one_complete(
            text in text_strategy(),
            picks in prop::collection::vec((any::<prop::sample::Index>(), 1usize..8), 1..6),
            others in prop::collection::vec(text_strategy(), 0..3),
        ) {
            let ids = encode(&text);
            let tokenizer = smollm2_tokenizer();
            let decoded = tokenizer.decode(&ids, true).unwrap();
            let chars: Vec<(usize, char)> = decoded.char_indices().collect();
            prop_assume!(!chars.is_empty() && !decoded.contains(REPLACEMENT));
            let mut stops: Vec<String> = picks
                .iter()
                .map(|(start, len)| {
                    let from = start.index(chars.len());
                    let to = chars.get(from + len).map_or(decoded.len(), |&(at, _)| at);
                    decoded[chars[from].0..to].to_string()
                })
                .collect();
            stops.extend(others.into_iter().filter(|o| !o.is_empty()));
            // A plain search, token by token: the answer ends at the first token after which the
            // text holds a stop string, before the earliest one it holds then (a later token
            // cannot move the end back to a longer stop string that starts earlier).
            let expected = (1..=ids.len())
                .find_map(|k| {
                    let seen = tokenizer.decode(&ids[..k], true).unwrap();
                    // A character still incomplete shows as U+FFFD, which `decoded` lacks.
                    let seen = seen.trim_end_matches(REPLACEMENT);
                    let first = stops.iter().filter_map(|stop| seen.find(stop.as_str())).min()?;
                    Some(seen[..first].to_string())
                })
                .unwrap_or(decoded.clone());

            let mut s = TextStream::new(smollm2_tokenizer(), stops);
            let (texts, _) = run(&mut s, &ids);
            prop_assert_eq!(texts.concat() + &s.flush(), expected);
        }
    }
}
