//! Reading a tool-call envelope back into OpenAI's shapes, as it streams.
//!
//! With tools, the answer is constrained to one of two layouts
//! ([`crate::validate::structured`]), byte for byte:
//! - `{"tool_calls": [{"name": "NAME", "arguments": ARGS}, {"name": ...}]}`
//! - `{"response": VALUE}`, VALUE a JSON string (its text is the content) or a JSON value (its
//!   JSON is the content).
//!
//! [`EnvelopeReader`] takes the text in whatever pieces the engine releases and gives
//! [`Piece`]s: content text, the start of a call (its id and name, once the name is complete),
//! and fragments of a call's arguments. Nothing of the envelope's own markup ever reaches the
//! content. Text that does not follow the layout (it cannot, under the grammar, but a reader
//! must not trust that) is given out as content from that point on.

use crate::api::tools::{FunctionCall, ToolCall};

/// What an envelope's text adds to the answer.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Content(String),
    /// A call begins.
    Call {
        index: usize,
        id: String,
        name: String,
    },
    /// A fragment of call `index`'s arguments (JSON text).
    Arguments {
        index: usize,
        fragment: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
enum State {
    /// Before the envelope's opening.
    Start,
    /// Expecting `{"name": "` (a call) at the top of the call list.
    CallOpen,
    /// Inside a call's name.
    Name,
    /// Expecting `, "arguments": `.
    ArgumentsOpen { name: String },
    /// Inside a call's arguments.
    Arguments(JsonScan),
    /// After a call's arguments: `}` then `, ` (another call) or `]}`.
    CallEnd,
    /// Inside the response's string value.
    ResponseString,
    /// Inside the response's JSON value: everything but the final `}`.
    ResponseJson,
    /// The envelope is closed.
    Done,
    /// The text left the layout: the rest is content.
    Raw,
}

/// Where a JSON value's scan is.
#[derive(Clone, Debug, Default, PartialEq)]
struct JsonScan {
    depth: usize,
    in_string: bool,
    escaped: bool,
    started: bool,
}

impl JsonScan {
    /// Feeds one char; true once the value is complete (after its closing bracket).
    fn feed(&mut self, c: char) -> bool {
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == '"' {
                self.in_string = false;
            }
            return false;
        }
        match c {
            '"' => self.in_string = true,
            '{' | '[' => {
                self.depth += 1;
                self.started = true;
            }
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                return self.started && self.depth == 0;
            }
            _ => {}
        }
        false
    }
}

/// Reads one answer's envelope.
#[derive(Debug)]
pub struct EnvelopeReader {
    /// Text received and not yet read.
    pending: String,
    state: State,
    /// The response alternative is a JSON value, not a string.
    json_response: bool,
    calls: usize,
}

impl EnvelopeReader {
    pub fn new(json_response: bool) -> Self {
        Self {
            pending: String::new(),
            state: State::Start,
            json_response,
            calls: 0,
        }
    }

    /// Whether the response alternative is a JSON value rather than a string.
    pub fn json_response(&self) -> bool {
        self.json_response
    }

    /// How many calls have begun.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Reads `text`, the answer's next piece.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        merge(out)
    }

    /// The answer ended (`complete`: not cut short): whatever is held back that belongs to the
    /// content.
    pub fn finish(&mut self, complete: bool) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            // The final `}` of a complete answer is markup; a cut one keeps its text.
            State::ResponseJson if complete => content(rest.strip_suffix('}').unwrap_or(&rest)),
            State::ResponseJson => content(&rest),
            State::Raw => content(&rest),
            _ => Vec::new(),
        }
    }

    /// Reads what it can; false when it must wait for more text.
    fn step(&mut self, out: &mut Vec<Piece>) -> bool {
        use crate::validate::structured::{CALLS_OPEN, RESPONSE_OPEN};
        match std::mem::replace(&mut self.state, State::Done) {
            State::Start => {
                if self.expect(CALLS_OPEN) {
                    self.state = State::CallOpen;
                } else if self.json_response && self.expect(RESPONSE_OPEN) {
                    self.state = State::ResponseJson;
                } else if !self.json_response && self.expect(&format!("{RESPONSE_OPEN}\"")) {
                    self.state = State::ResponseString;
                } else {
                    let response = format!("{RESPONSE_OPEN}\"");
                    let waiting = CALLS_OPEN.starts_with(self.pending.as_str())
                        || response.starts_with(self.pending.as_str());
                    self.state = if waiting { State::Start } else { State::Raw };
                    return !waiting;
                }
                true
            }
            State::CallOpen => self.literal("{\"name\": \"", State::Name, State::CallOpen),
            State::Name => match self.pending.find('"') {
                Some(end) => {
                    let name = self.pending[..end].to_owned();
                    self.pending.drain(..=end);
                    self.state = State::ArgumentsOpen { name };
                    true
                }
                None => {
                    self.state = State::Name;
                    false
                }
            },
            State::ArgumentsOpen { name } => {
                if self.expect(", \"arguments\": ") {
                    let index = self.calls;
                    self.calls += 1;
                    out.push(Piece::Call {
                        index,
                        id: format!("call_{}", uuid::Uuid::new_v4().simple()),
                        name,
                    });
                    self.state = State::Arguments(JsonScan::default());
                    true
                } else {
                    self.wait_or_raw(", \"arguments\": ", State::ArgumentsOpen { name })
                }
            }
            State::Arguments(mut scan) => {
                let index = self.calls - 1;
                let mut end = None;
                for (i, c) in self.pending.char_indices() {
                    if scan.feed(c) {
                        end = Some(i + c.len_utf8());
                        break;
                    }
                }
                let taken = end.unwrap_or(self.pending.len());
                let fragment: String = self.pending.drain(..taken).collect();
                if !fragment.is_empty() {
                    out.push(Piece::Arguments { index, fragment });
                }
                self.state = match end {
                    Some(_) => State::CallEnd,
                    None => State::Arguments(scan),
                };
                end.is_some()
            }
            State::CallEnd => {
                if self.expect("}, ") {
                    self.state = State::CallOpen;
                    true
                } else if self.expect("}]}") {
                    self.state = State::Done;
                    true
                } else {
                    let waiting = "}, ".starts_with(self.pending.as_str())
                        || "}]}".starts_with(self.pending.as_str());
                    self.state = if waiting { State::CallEnd } else { State::Raw };
                    !waiting
                }
            }
            State::ResponseString => {
                let (text, closed) = self.read_string();
                out.extend(content(&text));
                self.state = if closed {
                    State::Done
                } else {
                    State::ResponseString
                };
                false
            }
            State::ResponseJson => {
                // Everything but the last char, which may be the envelope's closing `}`.
                let keep = self.pending.chars().last().map_or(0, char::len_utf8);
                let text: String = self.pending.drain(..self.pending.len() - keep).collect();
                out.extend(content(&text));
                self.state = State::ResponseJson;
                false
            }
            State::Done => {
                self.pending.clear();
                self.state = State::Done;
                false
            }
            State::Raw => {
                let text = std::mem::take(&mut self.pending);
                out.extend(content(&text));
                self.state = State::Raw;
                false
            }
        }
    }

    /// Consumes `prefix` if the pending text starts with it.
    fn expect(&mut self, prefix: &str) -> bool {
        if self.pending.starts_with(prefix) {
            self.pending.drain(..prefix.len());
            true
        } else {
            false
        }
    }

    fn literal(&mut self, prefix: &str, next: State, same: State) -> bool {
        if self.expect(prefix) {
            self.state = next;
            true
        } else {
            self.wait_or_raw(prefix, same)
        }
    }

    /// Waits in `same` while the pending text may still become `prefix`; else goes raw.
    fn wait_or_raw(&mut self, prefix: &str, same: State) -> bool {
        if prefix.starts_with(self.pending.as_str()) {
            self.state = same;
            false
        } else {
            self.state = State::Raw;
            true
        }
    }

    /// Decodes the response string's pending text up to its closing quote (true when
    /// reached), holding back an escape that is not complete yet.
    fn read_string(&mut self) -> (String, bool) {
        let mut text = String::new();
        let bytes = self.pending.as_bytes();
        let mut i = 0;
        let mut closed = false;
        while i < bytes.len() {
            match bytes[i] {
                b'"' => {
                    closed = true;
                    i += 1;
                    break;
                }
                b'\\' => match unescape(&self.pending[i..]) {
                    Some((decoded, used)) => {
                        text.push_str(&decoded);
                        i += used;
                    }
                    None => break,
                },
                _ => {
                    let c = self.pending[i..].chars().next().expect("within the text");
                    text.push(c);
                    i += c.len_utf8();
                }
            }
        }
        self.pending.drain(..i);
        if closed {
            self.pending.clear();
        }
        (text, closed)
    }
}

/// The text of the JSON escape `s` starts with and its length, or `None` while incomplete.
fn unescape(s: &str) -> Option<(String, usize)> {
    let b = s.as_bytes();
    let simple = match *b.get(1)? {
        b'n' => '\n',
        b't' => '\t',
        b'r' => '\r',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'u' => {
            let unit =
                |at: usize| -> Option<u32> { u32::from_str_radix(s.get(at..at + 4)?, 16).ok() };
            let high = unit(2)?;
            if (0xD800..0xDC00).contains(&high) {
                // A surrogate pair: the low half follows as another escape.
                if s.len() < 12 {
                    return None;
                }
                let low = unit(8)?;
                let c = 0x10000 + ((high - 0xD800) << 10) + (low.wrapping_sub(0xDC00) & 0x3FF);
                return Some((char::from_u32(c).unwrap_or('\u{fffd}').to_string(), 12));
            }
            return Some((char::from_u32(high).unwrap_or('\u{fffd}').to_string(), 6));
        }
        // Not an escape JSON knows: the character after the backslash stands for itself, whole
        // (it may take several bytes).
        _ => {
            let c = s[1..].chars().next()?;
            return Some((c.to_string(), 1 + c.len_utf8()));
        }
    };
    Some((simple.to_string(), 2))
}

fn content(text: &str) -> Vec<Piece> {
    if text.is_empty() {
        Vec::new()
    } else {
        vec![Piece::Content(text.to_owned())]
    }
}

/// Joins neighbouring pieces of the same kind: one delta per kind and call.
fn merge(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for piece in pieces {
        match (out.last_mut(), piece) {
            (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
            (
                Some(Piece::Arguments { index: i, fragment }),
                Piece::Arguments {
                    index: j,
                    fragment: more,
                },
            ) if *i == j => fragment.push_str(&more),
            (_, piece) => out.push(piece),
        }
    }
    out
}

/// A whole answer read at once: its content and its calls (id, name, arguments).
pub fn read_all(
    text: &str,
    json_response: bool,
    complete: bool,
) -> (String, Vec<(String, String, String)>) {
    let mut reader = EnvelopeReader::new(json_response);
    let mut pieces = reader.push(text);
    pieces.extend(reader.finish(complete));
    let mut content_text = String::new();
    let mut calls: Vec<(String, String, String)> = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Content(t) => content_text.push_str(&t),
            Piece::Call { id, name, .. } => calls.push((id, name, String::new())),
            Piece::Arguments { index, fragment } => calls[index].2.push_str(&fragment),
        }
    }
    (content_text, calls)
}

/// Calls as [`read_all`] gives them, in OpenAI's shape.
pub fn api_calls(calls: Vec<(String, String, String)>) -> Vec<ToolCall> {
    let call = |(id, name, arguments)| ToolCall {
        id,
        kind: "function".into(),
        function: FunctionCall { name, arguments },
    };
    calls.into_iter().map(call).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` in pieces of `size` chars and gathers content and calls.
    fn read(text: &str, json: bool, size: usize) -> (String, Vec<(String, String)>) {
        let mut reader = EnvelopeReader::new(json);
        let chars: Vec<char> = text.chars().collect();
        let mut pieces = Vec::new();
        for chunk in chars.chunks(size) {
            pieces.extend(reader.push(&chunk.iter().collect::<String>()));
        }
        pieces.extend(reader.finish(true));
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for p in pieces {
            match p {
                Piece::Content(t) => content.push_str(&t),
                Piece::Call { index, id, name } => {
                    assert_eq!(index, calls.len());
                    assert!(id.starts_with("call_"));
                    calls.push((name, String::new()));
                }
                Piece::Arguments { index, fragment } => calls[index].1.push_str(&fragment),
            }
        }
        (content, calls)
    }

    #[test]
    fn calls_come_back_whole_however_the_text_is_split() {
        let text = r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa}ris \"x\"", "n": [1, {"a": 2}]}}, {"name": "t2", "arguments": {}}]}"#;
        for size in [1, 2, 3, 7, 1000] {
            let (content, calls) = read(text, false, size);
            assert_eq!(content, "", "size {size}");
            assert_eq!(
                calls,
                vec![
                    (
                        "get_weather".into(),
                        r#"{"city": "Pa}ris \"x\"", "n": [1, {"a": 2}]}"#.into()
                    ),
                    ("t2".into(), "{}".into())
                ],
                "size {size}"
            );
        }
    }

    #[test]
    fn a_string_response_is_unescaped_content() {
        let text = r#"{"response": "Hi \"you\"\n\u00e9\ud83d\ude00 done"}"#;
        for size in [1, 2, 5, 1000] {
            assert_eq!(
                read(text, false, size),
                ("Hi \"you\"\né😀 done".into(), vec![])
            );
        }
    }

    #[test]
    fn a_backslash_before_a_wide_character_keeps_the_character() {
        // Off the grammar, which the reader does not trust: the character is taken whole.
        let text = "{\"response\": \"a\\é\\😀 b\"}";
        for size in [1, 2, 1000] {
            assert_eq!(read(text, false, size), ("aé😀 b".into(), vec![]));
        }
    }

    #[test]
    fn a_json_response_is_its_json_without_the_envelope() {
        let text = r#"{"response": {"a": [1, "}"]}}"#;
        for size in [1, 3, 1000] {
            assert_eq!(
                read(text, true, size),
                (r#"{"a": [1, "}"]}"#.into(), vec![])
            );
        }
    }

    #[test]
    fn text_off_the_layout_is_content() {
        assert_eq!(
            read("Hello there", false, 2),
            ("Hello there".into(), vec![])
        );
        let (content, calls) = read(r#"{"tool_calls": [{"nom": 1}]}"#, false, 4);
        assert!(calls.is_empty());
        assert_eq!(content, r#"{"nom": 1}]}"#);
    }

    #[test]
    fn a_cut_answer_keeps_what_came() {
        let (content, calls) = read(
            r#"{"tool_calls": [{"name": "f", "arguments": {"x": "#,
            false,
            3,
        );
        assert_eq!(content, "");
        assert_eq!(calls, vec![("f".into(), r#"{"x": "#.into())]);
        assert_eq!(read(r#"{"response": "Hel"#, false, 2).0, "Hel");
        let (content, _) = read_all(r#"{"response": {"a": {}}"#, true, false);
        assert_eq!(
            content, r#"{"a": {}}"#,
            "a cut JSON response keeps its last brace"
        );
    }
}
