//! Server-sent events, as OpenAI-compatible servers stream chat completions: the `data` of each
//! event, from a byte stream that arrives in pieces of any size.
//!
//! Lines end in LF or CRLF; a blank line ends an event; several `data` lines in one event join
//! with `\n`; comments (`:` lines) and the other fields (`event`, `id`, `retry`) are skipped,
//! since the OpenAI stream carries everything in `data`. An event cut off by the end of the
//! stream is dropped, as the SSE specification says.

/// Turns pushed bytes into the `data` of each complete event.
#[derive(Debug, Default)]
pub struct SseParser {
    /// The current line, until its LF arrives (bytes: a UTF-8 character may straddle pieces).
    line: Vec<u8>,
    /// The current event's data so far; `None` until a `data` line arrives.
    data: Option<String>,
}

impl SseParser {
    /// Feeds the next piece of the stream; returns the data of every event it completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut events = Vec::new();
        for &byte in bytes {
            if byte == b'\n' {
                let mut line = std::mem::take(&mut self.line);
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                self.end_line(&line, &mut events);
            } else {
                self.line.push(byte);
            }
        }
        events
    }

    fn end_line(&mut self, line: &[u8], events: &mut Vec<String>) {
        if line.is_empty() {
            events.extend(self.data.take());
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => (&line[..colon], &line[colon + 1..]),
            None => (line, &[][..]),
        };
        if field != b"data" {
            return;
        }
        let value = String::from_utf8_lossy(value.strip_prefix(b" ").unwrap_or(value));
        match &mut self.data {
            Some(data) => {
                data.push('\n');
                data.push_str(&value);
            }
            None => self.data = Some(value.into_owned()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SseParser;

    #[test]
    fn events_split_across_pieces_arrive_whole() {
        let stream = "data: {\"a\":1}\n\ndata: {\"b\":\"é\"}\n\ndata: [DONE]\n\n".as_bytes();
        for piece in 1..stream.len() {
            let mut parser = SseParser::default();
            let events: Vec<String> = stream
                .chunks(piece)
                .flat_map(|bytes| parser.push(bytes))
                .collect();
            assert_eq!(events, ["{\"a\":1}", "{\"b\":\"é\"}", "[DONE]"], "{piece}");
        }
    }

    #[test]
    fn crlf_multi_line_data_and_comments() {
        let mut parser = SseParser::default();
        let events =
            parser.push(b": keep-alive\r\n\r\nevent: x\r\ndata:one\r\ndata: two\r\nid: 3\r\n\r\n");
        assert_eq!(events, ["one\ntwo"]);
    }

    #[test]
    fn an_unfinished_event_is_not_emitted() {
        let mut parser = SseParser::default();
        assert!(parser.push(b"data: [DONE]\n").is_empty());
        assert!(parser.push(b"data: more").is_empty());
    }
}
