//! One request, timed: send a chat completion, read the answer (one JSON body, or a stream of
//! server-sent events chunk by chunk) and say how long each part took, or why it failed.
//!
//! Times run from just before the request is sent. A streamed answer's first token is its first
//! chunk with non-empty content (role-only and usage-only chunks carry none); the token count is
//! the server's `usage.completion_tokens` where it sends one, else the number of content chunks.
//! A stream must end with `data: [DONE]`: one that stops short failed, however much it carried.

use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::header::CONTENT_TYPE;
use reqwest::{StatusCode, Url};
use serde::Deserialize;

use super::sse::SseParser;

/// What one completed request measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Sent to the first content chunk; the whole exchange when not streaming.
    pub ttft: Duration,
    /// Sent to the answer's end.
    pub e2e: Duration,
    /// Between consecutive content chunks (streaming only).
    pub gaps: Vec<Duration>,
    pub output_tokens: usize,
    /// Time per output token after the first, `(e2e - ttft) / (tokens - 1)`: only for a stream
    /// whose server counted its tokens, at least two of them.
    pub tpot: Option<Duration>,
}

/// Why a request failed.
#[derive(Clone, Debug, PartialEq)]
pub enum Failure {
    /// The server answered with an error status.
    Status { code: StatusCode, message: String },
    /// No answer: connection refused or reset, or the body cut off.
    Transport(String),
    /// No complete answer within `--timeout-secs`.
    Timeout,
    /// The server reported an error inside the stream.
    Stream(String),
    /// The answer is not what the OpenAI API says it is.
    InvalidResponse(String),
}

impl Failure {
    /// The key this failure is counted under in the report: `http_503`, `transport`, ...
    pub fn kind(&self) -> String {
        match self {
            Self::Status { code, .. } => format!("http_{}", code.as_u16()),
            Self::Transport(_) => "transport".into(),
            Self::Timeout => "timeout".into(),
            Self::Stream(_) => "stream_error".into(),
            Self::InvalidResponse(_) => "invalid_response".into(),
        }
    }

    pub fn message(&self) -> String {
        match self {
            Self::Status { code, message } => format!("{code}: {message}"),
            Self::Transport(m) | Self::Stream(m) | Self::InvalidResponse(m) => m.clone(),
            Self::Timeout => "no complete answer in time".into(),
        }
    }
}

impl From<reqwest::Error> for Failure {
    fn from(e: reqwest::Error) -> Self {
        if e.is_timeout() {
            Self::Timeout
        } else {
            // reqwest's own message leaves out the cause (refused, reset, ...).
            Self::Transport(format!("{:#}", anyhow::Error::from(e)))
        }
    }
}

/// Where requests go and how: the endpoint, the key, the time limit, streaming or not.
pub struct Target {
    client: reqwest::Client,
    url: Url,
    api_key: Option<String>,
    timeout: Duration,
    stream: bool,
}

impl Target {
    pub fn new(url: Url, api_key: Option<String>, timeout: Duration, stream: bool) -> Self {
        Self {
            client: reqwest::Client::new(),
            url,
            api_key,
            timeout,
            stream,
        }
    }

    /// Sends `body` and reads the answer to its end.
    pub async fn send(&self, body: String) -> Result<Sample, Failure> {
        let sent = Instant::now();
        tokio::time::timeout(self.timeout, self.exchange(body, sent))
            .await
            .unwrap_or(Err(Failure::Timeout))
    }

    async fn exchange(&self, body: String, sent: Instant) -> Result<Sample, Failure> {
        let mut request = self
            .client
            .post(self.url.clone())
            .header(CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await?;
        let code = response.status();
        if !code.is_success() {
            let body = response.text().await.unwrap_or_default();
            return Err(Failure::Status {
                code,
                message: error_message(&body),
            });
        }
        if self.stream {
            read_stream(response, sent).await
        } else {
            let body = response.bytes().await?;
            let completion: Completion = serde_json::from_slice(&body).map_err(|e| {
                Failure::InvalidResponse(format!("the answer is not a chat completion: {e}"))
            })?;
            if completion.choices.is_empty() {
                return Err(Failure::InvalidResponse("the answer has no choices".into()));
            }
            let e2e = sent.elapsed();
            Ok(Sample {
                ttft: e2e,
                e2e,
                gaps: Vec::new(),
                output_tokens: completion.usage.map_or(0, |u| u.completion_tokens),
                tpot: None,
            })
        }
    }
}

async fn read_stream(response: reqwest::Response, sent: Instant) -> Result<Sample, Failure> {
    let mut parser = SseParser::default();
    let mut body = response.bytes_stream();
    let mut first: Option<Instant> = None;
    let mut last = sent;
    let mut gaps = Vec::new();
    let mut chunks = 0;
    let mut usage = None;
    while let Some(bytes) = body.next().await {
        for data in parser.push(&bytes?) {
            if data == "[DONE]" {
                return Ok(stream_sample(sent, first, gaps, chunks, usage));
            }
            let chunk: Chunk = serde_json::from_str(&data).map_err(|e| {
                Failure::InvalidResponse(format!("a stream chunk is not a completion chunk: {e}"))
            })?;
            if let Some(error) = chunk.error {
                return Err(Failure::Stream(error_text(&error)));
            }
            let has_content = chunk
                .choices
                .iter()
                .any(|c| c.delta.content.as_deref().is_some_and(|t| !t.is_empty()));
            if has_content {
                let now = Instant::now();
                match first {
                    None => first = Some(now),
                    Some(_) => gaps.push(now - last),
                }
                last = now;
                chunks += 1;
            }
            if let Some(u) = chunk.usage {
                usage = Some(u.completion_tokens);
            }
        }
    }
    Err(Failure::InvalidResponse(
        "the stream ended without `data: [DONE]`".into(),
    ))
}

fn stream_sample(
    sent: Instant,
    first: Option<Instant>,
    gaps: Vec<Duration>,
    chunks: usize,
    usage: Option<usize>,
) -> Sample {
    let e2e = sent.elapsed();
    let ttft = first.map_or(e2e, |t| t - sent);
    let tpot = usage
        .filter(|&tokens| tokens > 1)
        .map(|tokens| (e2e - ttft) / (tokens - 1) as u32);
    Sample {
        ttft,
        e2e,
        gaps,
        output_tokens: usage.unwrap_or(chunks),
        tpot,
    }
}

/// The message of an OpenAI error envelope, else the start of the body as it came.
fn error_message(body: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(body) {
        Ok(value) if value.get("error").is_some() => error_text(&value["error"]),
        _ => body.chars().take(200).collect(),
    }
}

/// An error object's `message`, else the object itself.
fn error_text(error: &serde_json::Value) -> String {
    match error.get("message").and_then(|m| m.as_str()) {
        Some(message) => message.to_owned(),
        None => error.to_string(),
    }
}

/// The parts of OpenAI's answers read here; anything else in them is ignored, so any
/// compatible server's answers parse.
#[derive(Deserialize)]
struct Completion {
    choices: Vec<serde::de::IgnoredAny>,
    usage: Option<CompletionUsage>,
}

/// A streamed chunk (shared with the tool-agents scenario, which reads calls and cache hits).
#[derive(Deserialize)]
pub(super) struct Chunk {
    #[serde(default)]
    pub choices: Vec<ChunkChoice>,
    pub usage: Option<CompletionUsage>,
    pub error: Option<serde_json::Value>,
    /// llama.cpp's: `cache_n` is the prompt tokens it reused.
    pub timings: Option<Timings>,
}

#[derive(Deserialize)]
pub(super) struct ChunkChoice {
    #[serde(default)]
    pub delta: Delta,
}

#[derive(Default, Deserialize)]
pub(super) struct Delta {
    pub content: Option<String>,
    #[serde(default)]
    pub tool_calls: Vec<CallDelta>,
}

/// A piece of a streamed tool call.
#[derive(Deserialize)]
pub(super) struct CallDelta {
    #[serde(default)]
    pub index: usize,
    pub id: Option<String>,
    pub function: Option<FunctionDelta>,
}

#[derive(Deserialize)]
pub(super) struct FunctionDelta {
    pub name: Option<String>,
    pub arguments: Option<String>,
}

#[derive(Deserialize)]
pub(super) struct CompletionUsage {
    #[serde(default)]
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize)]
pub(super) struct PromptDetails {
    #[serde(default)]
    pub cached_tokens: usize,
}

#[derive(Deserialize)]
pub(super) struct Timings {
    pub cache_n: Option<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_counted_by_kind() {
        let status = Failure::Status {
            code: StatusCode::SERVICE_UNAVAILABLE,
            message: "overloaded".into(),
        };
        assert_eq!(status.kind(), "http_503");
        assert_eq!(status.message(), "503 Service Unavailable: overloaded");
        assert_eq!(Failure::Timeout.kind(), "timeout");
        assert_eq!(Failure::Transport("reset".into()).kind(), "transport");
    }

    #[test]
    fn error_bodies_yield_their_message() {
        let envelope =
            r#"{"error": {"message": "invalid api key", "type": "authentication_error"}}"#;
        assert_eq!(error_message(envelope), "invalid api key");
        assert_eq!(error_message("Bad Gateway"), "Bad Gateway");
        assert_eq!(error_message(r#"{"error": "nope"}"#), r#""nope""#);
    }

    #[test]
    fn time_per_token_needs_the_servers_count() {
        let sent = Instant::now();
        let first = sent + Duration::from_millis(10);
        std::thread::sleep(Duration::from_millis(20));
        let counted = stream_sample(sent, Some(first), vec![], 3, Some(5));
        assert_eq!(counted.ttft, Duration::from_millis(10));
        assert_eq!(counted.output_tokens, 5);
        assert_eq!(counted.tpot, Some((counted.e2e - counted.ttft) / 4));
        let uncounted = stream_sample(sent, Some(first), vec![], 3, None);
        assert_eq!((uncounted.output_tokens, uncounted.tpot), (3, None));
        let empty = stream_sample(sent, None, vec![], 0, Some(0));
        assert_eq!(empty.ttft, empty.e2e);
    }
}
