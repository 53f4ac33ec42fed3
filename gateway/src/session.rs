//! Conversation sessions: the gateway keeps a chat's history, so that a client sends only its
//! new turn.
//!
//! A chat request belongs to a session when it carries an `x-session-id` header; an id is 1 to
//! [`MAX_ID_BYTES`] bytes. OpenAI's `user` field names an end user for abuse monitoring, not a
//! conversation, so it opens no session: two chats of one user are two conversations. A
//! session is also its caller's: its history is stored under the [`Caller`] and the id
//! together, so a request with another API key never reads it, whatever id it sends. The
//! response carries `x-session-id` back ([`Echo`]): its request was answered in its session.
//!
//! A request in a session ([`Sessions::open`]):
//! 1. reads the history (which keeps it for another TTL) and puts it before the request's
//!    messages, unless they already begin with it: a client that resends the whole
//!    conversation is not repeated. What goes before is trimmed to fit the model's context:
//!    its oldest turns go, never the opening system messages, until the prompt leaves room for
//!    the answer (`max_tokens`, else a quarter of the context). A long session thus never
//!    reaches a state where every turn is refused as too long;
//! 2. is validated and answered as any chat request;
//! 3. once answered ([`Turn::commit`]; a stream once its choice finished with `stop` or
//!    `length`, before `[DONE]`, [`Turn::record`]), appends one turn: its new messages and the
//!    answer. A refused, failed or cancelled request appends nothing. The system messages the
//!    first turn began with are the history's opening, which no trim drops.
//!
//! Each turn's prompt is the previous turn's prompt, then the previous answer and the new
//! messages: the stored answer is the text the model generated, and the chat template renders
//! it right where the generation prompt left off. So the engine's prefix cache finds the whole
//! history in the previous turn's KV blocks, and only the new turn is prefilled (until the
//! history passes its cap and its oldest turns go, which changes the prompt's start once).
//!
//! A session keeps one conversation: `n` above 1 is refused (400 naming `n`), as there would be
//! no one answer to keep. Requests of one session are meant to follow one another; concurrent
//! ones each see the history as it was when they started, and append in the order they finish.
//! Sessions are the HTTP chat API's, plain and swarm.
//!
//! The histories live in the [`StateStore`]: in this process without Redis, in Redis with
//! `--redis`, where every replica sees them. A store that does not answer fails the request
//! with 503 `state_store_unavailable` before it generates; a turn that cannot be stored after
//! the answer fails a whole answer the same way, and ends a stream with an error chunk before
//! `[DONE]`: either way the client knows the turn was not kept.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponseParts, ResponseParts};
use engine::{ChatMessage, ModelInfo};
use futures::stream::{self, BoxStream};
use futures::{Stream, StreamExt};

use crate::api::{self, ChatCompletionChunk, ChatCompletionRequest, Frame, MessageContent};
use crate::auth::Caller;
use crate::config::ServeConfig;
use crate::error::ApiError;
use crate::state::{HistoryLimit, StateStore};
use crate::validate;

/// The request header that names a session, echoed on its answers.
pub const SESSION_HEADER: &str = "x-session-id";

/// The longest session id, in bytes.
pub const MAX_ID_BYTES: usize = 256;

/// The server's sessions: where their histories live and for how long.
pub struct Sessions {
    store: Arc<dyn StateStore>,
    /// `None`: sessions are off.
    limit: Option<HistoryLimit>,
}

impl Sessions {
    /// The sessions `config` sets, with histories in `store`. `config` must have passed
    /// [`ServeConfig::validate`].
    pub fn new(config: &ServeConfig, store: Arc<dyn StateStore>) -> Self {
        let limit = (config.session_ttl_secs > 0).then(|| HistoryLimit {
            ttl: Duration::from_secs(config.session_ttl_secs),
            max_bytes: config.session_max_bytes,
        });
        Self { store, limit }
    }

    /// `request`'s turn in its session, with the stored history put before its messages (as
    /// much of it as fits `model`'s context); a turn of no session when the request names none.
    pub async fn open(
        &self,
        caller: Caller,
        headers: &HeaderMap,
        model: &ModelInfo,
        request: &mut ChatCompletionRequest,
    ) -> Result<Turn, ApiError> {
        let Some(id) = header_id(headers, SESSION_HEADER)? else {
            return Ok(Turn(None));
        };
        let Some(limit) = self.limit else {
            return Err(ApiError::invalid(
                SESSION_HEADER,
                "conversation sessions are turned off on this server (--session-ttl-secs 0)",
            ));
        };
        if request.options.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid(
                "n",
                "a session keeps one answer per turn: n must be 1 in a session",
            ));
        }
        let sent = validate::messages(request.messages.clone())?;
        let name = format!("{caller}:{id}");
        let entries = self.store.history(&name, limit.ttl).await?;
        let history = parse(&entries)?;
        let Spliced {
            mut before,
            opening,
            new,
        } = splice(history, sent.clone());
        let room = request
            .max_completion_tokens
            .or(request.options.max_tokens)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(model.context_length / 4);
        fit(model, &mut before, &sent, room)?;
        if !before.is_empty() {
            request.messages.splice(0..0, before.into_iter().map(wire));
        }
        Ok(Turn(Some(Open {
            store: self.store.clone(),
            name,
            limit,
            opening,
            new,
            echo: HeaderValue::from_str(&id).ok(),
        })))
    }
}

/// The id a request names in `header` (printable ASCII, 1 to [`MAX_ID_BYTES`] bytes); `None`
/// when there is none.
pub(crate) fn header_id(headers: &HeaderMap, header: &str) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(header) else {
        return Ok(None);
    };
    let id = value
        .to_str()
        .map_err(|_| ApiError::invalid(header, format!("{header} must be printable ASCII")))?;
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Err(ApiError::invalid(
            header,
            format!(
                "{header} must be 1 to {MAX_ID_BYTES} bytes; got {}",
                id.len()
            ),
        ));
    }
    Ok(Some(id.to_owned()))
}

/// Template tokens a message costs besides its content (`<|im_start|>`, the role, newlines,
/// `<|im_end|>`), with room to spare for templates that say more: the fit errs on the short
/// side.
const MESSAGE_OVERHEAD_TOKENS: usize = 8;

/// Drops the oldest turns of `before` (whole turns, from a user message to the next; never
/// the opening system messages) until `before` and then `sent` leave `room` tokens of the
/// model's window for the answer, or nothing is left to drop.
fn fit(
    model: &ModelInfo,
    before: &mut Vec<ChatMessage>,
    sent: &[ChatMessage],
    room: usize,
) -> Result<(), ApiError> {
    let tokens = |text: &str| -> Result<usize, ApiError> {
        Ok(model
            .tokenizer
            .encode(text, false)
            .map_err(|e| ApiError::Internal(format!("tokenizing a session's history: {e}")))?
            .len()
            + MESSAGE_OVERHEAD_TOKENS)
    };
    let costs = before
        .iter()
        .map(|m| tokens(&m.content))
        .collect::<Result<Vec<_>, _>>()?;
    let sent_cost = sent
        .iter()
        .map(|m| tokens(&m.content))
        .sum::<Result<usize, _>>()?;
    let window = model.context_length.min(model.kv_capacity_tokens);
    // The generation prompt after the last message costs about one more message.
    let mut total = costs.iter().sum::<usize>() + sent_cost + MESSAGE_OVERHEAD_TOKENS + room;
    let opening = before.iter().take_while(|m| m.role == "system").count();
    let mut cut = opening;
    while total > window && cut < before.len() {
        let end = cut
            + 1
            + before[cut + 1..]
                .iter()
                .take_while(|m| m.role != "user")
                .count();
        total -= costs[cut..end].iter().sum::<usize>();
        cut = end;
    }
    before.drain(opening..cut);
    Ok(())
}

/// The stored entries as messages: the opening's, then every turn's.
fn parse(entries: &[String]) -> Result<Vec<ChatMessage>, ApiError> {
    let mut history = Vec::new();
    for entry in entries {
        let messages: Vec<ChatMessage> = serde_json::from_str(entry)
            .map_err(|e| ApiError::Internal(format!("a stored session entry is not valid: {e}")))?;
        history.extend(messages);
    }
    Ok(history)
}

/// A request's messages against its session's history.
#[derive(Debug, PartialEq)]
struct Spliced {
    /// What goes before the request's messages.
    before: Vec<ChatMessage>,
    /// The history's opening, when this turn starts it: the system messages it begins with.
    opening: Vec<ChatMessage>,
    /// The messages this turn adds, besides its answer.
    new: Vec<ChatMessage>,
}

/// Splices `sent` (the request's messages, validated) onto `history`, as the module header
/// says.
fn splice(history: Vec<ChatMessage>, mut sent: Vec<ChatMessage>) -> Spliced {
    if history.is_empty() {
        let system = sent.iter().take_while(|m| m.role == "system").count();
        let opening = sent.drain(..system).collect();
        return Spliced {
            before: Vec::new(),
            opening,
            new: sent,
        };
    }
    if sent.starts_with(&history) {
        sent.drain(..history.len());
        return Spliced {
            before: Vec::new(),
            opening: Vec::new(),
            new: sent,
        };
    }
    Spliced {
        before: history,
        opening: Vec::new(),
        new: sent,
    }
}

/// A stored message as the wire carries it.
fn wire(message: ChatMessage) -> api::ChatMessage {
    api::ChatMessage {
        role: message.role,
        content: Some(MessageContent::Text(message.content)),
        ..api::ChatMessage::default()
    }
}

/// One request's turn in its session, or nothing when the request is in none: then committing
/// and recording do nothing.
pub struct Turn(Option<Open>);

struct Open {
    store: Arc<dyn StateStore>,
    name: String,
    limit: HistoryLimit,
    opening: Vec<ChatMessage>,
    new: Vec<ChatMessage>,
    /// The id as a header value; `None` for a `user` that is not one.
    echo: Option<HeaderValue>,
}

impl Turn {
    /// The session's name in the store (its caller's and its id), when the request is in one.
    pub fn session(&self) -> Option<&str> {
        self.0.as_ref().map(|open| open.name.as_str())
    }

    /// What the response carries to say the request was in a session.
    pub fn echo(&self) -> Echo {
        Echo(self.0.as_ref().and_then(|open| open.echo.clone()))
    }

    /// Appends the turn, answered with `answer`, to its session's history.
    pub async fn commit(self, answer: &str) -> Result<(), ApiError> {
        let Some(open) = self.0 else {
            return Ok(());
        };
        let mut turn = open.new;
        turn.push(ChatMessage::new("assistant", answer));
        // Messages are strings only: they always serialize.
        let json = |messages: &[ChatMessage]| {
            serde_json::to_string(messages).expect("messages serialize to JSON")
        };
        Ok(open
            .store
            .append_turn(&open.name, &json(&open.opening), &json(&turn), open.limit)
            .await?)
    }

    /// `frames`, a chat answer's stream of one choice, committing the turn before `[DONE]` when
    /// the choice finished with `stop` or `length`; if that fails, an error chunk precedes
    /// `[DONE]`.
    pub fn record<S>(self, frames: S) -> BoxStream<'static, Frame<ChatCompletionChunk>>
    where
        S: Stream<Item = Frame<ChatCompletionChunk>> + Send + 'static,
    {
        if self.0.is_none() {
            return frames.boxed();
        }
        let mut recording = Recording {
            turn: Some(self),
            text: String::new(),
            finished: false,
            failed: false,
            first: None,
        };
        frames
            .then(move |frame| {
                let commit = match &frame {
                    Frame::Chunk(chunk) => {
                        recording.observe(chunk);
                        None
                    }
                    Frame::Done => recording.take(),
                };
                async move {
                    let Some((turn, text, first)) = commit else {
                        return vec![frame];
                    };
                    match turn.commit(&text).await {
                        Ok(()) => vec![frame],
                        Err(error) => {
                            tracing::error!(%error, "the session's turn was not stored");
                            let failed = ChatCompletionChunk {
                                choices: Vec::new(),
                                usage: None,
                                error: Some(error.body()),
                                swarm: None,
                                ..first
                            };
                            vec![Frame::Chunk(failed), frame]
                        }
                    }
                }
            })
            .flat_map(stream::iter)
            .boxed()
    }
}

/// What a streamed answer has shown so far.
struct Recording {
    turn: Option<Turn>,
    text: String,
    finished: bool,
    failed: bool,
    /// The first chunk, whose id, model and time (every chunk's) an error chunk takes.
    first: Option<ChatCompletionChunk>,
}

impl Recording {
    fn observe(&mut self, chunk: &ChatCompletionChunk) {
        self.failed |= chunk.error.is_some();
        for choice in &chunk.choices {
            if let Some(text) = &choice.delta.content {
                self.text.push_str(text);
            }
            match choice.finish_reason {
                Some(
                    api::FinishReason::Stop
                    | api::FinishReason::Length
                    | api::FinishReason::ToolCalls,
                ) => self.finished = true,
                Some(api::FinishReason::Error) => self.failed = true,
                None => {}
            }
        }
        if self.first.is_none() {
            self.first = Some(chunk.clone());
        }
    }

    /// The turn to commit, its answer and the first chunk, once, if the answer finished well.
    fn take(&mut self) -> Option<(Turn, String, ChatCompletionChunk)> {
        if !self.finished || self.failed {
            return None;
        }
        let text = std::mem::take(&mut self.text);
        Some((self.turn.take()?, text, self.first.take()?))
    }
}

/// The `x-session-id` a response carries when its request was in a session.
pub struct Echo(Option<HeaderValue>);

impl IntoResponseParts for Echo {
    type Error = Infallible;

    fn into_response_parts(self, mut parts: ResponseParts) -> Result<ResponseParts, Infallible> {
        if let Some(id) = self.0 {
            parts.headers_mut().insert(SESSION_HEADER, id);
        }
        Ok(parts)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::state::MemoryStore;
    use crate::test_support::model_info;

    fn request(body: serde_json::Value) -> ChatCompletionRequest {
        serde_json::from_value(body).unwrap()
    }

    fn headers(id: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(SESSION_HEADER, HeaderValue::from_str(id).unwrap());
        headers
    }

    fn user(text: &str) -> ChatMessage {
        ChatMessage::new("user", text)
    }

    fn assistant(text: &str) -> ChatMessage {
        ChatMessage::new("assistant", text)
    }

    fn system(text: &str) -> ChatMessage {
        ChatMessage::new("system", text)
    }

    /// The served model, its window the model's context.
    fn model() -> &'static ModelInfo {
        static MODEL: std::sync::LazyLock<ModelInfo> =
            std::sync::LazyLock::new(|| model_info(usize::MAX));
        &MODEL
    }

    fn sessions() -> Sessions {
        Sessions::new(&ServeConfig::default(), Arc::new(MemoryStore::new()))
    }

    fn param(error: ApiError) -> String {
        error.body().param.expect("a 400 names its field")
    }

    #[test]
    fn only_the_header_names_a_session() {
        assert_eq!(
            header_id(&headers("s-1"), SESSION_HEADER)
                .unwrap()
                .as_deref(),
            Some("s-1")
        );
        assert_eq!(header_id(&HeaderMap::new(), SESSION_HEADER).unwrap(), None);
        assert_eq!(
            param(header_id(&headers(""), SESSION_HEADER).unwrap_err()),
            SESSION_HEADER
        );
        let long = "s".repeat(MAX_ID_BYTES + 1);
        assert_eq!(
            param(header_id(&headers(&long), SESSION_HEADER).unwrap_err()),
            SESSION_HEADER
        );
    }

    #[tokio::test]
    async fn the_user_field_opens_no_session() {
        let sessions = sessions();
        let by_user =
            || request(json!({"messages": [{"role": "user", "content": "Hi"}], "user": "u"}));
        let turn = sessions
            .open(
                Caller::Anonymous,
                &HeaderMap::new(),
                model(),
                &mut by_user(),
            )
            .await
            .unwrap();
        assert!(turn.0.is_none());
        // Had it opened one, this commit would show in the next request.
        let _ = turn.commit("Hello.").await;
        let mut next = by_user();
        let _ = sessions
            .open(Caller::Anonymous, &HeaderMap::new(), model(), &mut next)
            .await
            .unwrap();
        assert_eq!(next.messages.len(), 1);
    }

    #[tokio::test]
    async fn a_long_history_is_trimmed_to_fit_keeping_the_opening_and_the_newest_turns() {
        let sessions = sessions();
        let model = model();
        let window = model.context_length.min(model.kv_capacity_tokens);
        // Each turn is about a fifth of the window: ten of them cannot all fit.
        let long = "word ".repeat(window / 5);
        let mut first = request(json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": format!("0 {long}")}
        ]}));
        let turn = sessions
            .open(Caller::Anonymous, &headers("s"), model, &mut first)
            .await
            .unwrap();
        turn.commit("ok").await.unwrap();
        for i in 1..10 {
            let mut body =
                request(json!({"messages": [{"role": "user", "content": format!("{i} {long}")}]}));
            let turn = sessions
                .open(Caller::Anonymous, &headers("s"), model, &mut body)
                .await
                .unwrap();
            turn.commit("ok").await.unwrap();
        }
        let mut last = request(
            json!({"messages": [{"role": "user", "content": "Which numbers?"}],
            "max_tokens": 100}),
        );
        let _ = sessions
            .open(Caller::Anonymous, &headers("s"), model, &mut last)
            .await
            .unwrap();
        let sent = validate::messages(last.messages).unwrap();
        assert_eq!(sent[0], system("Be brief."), "the opening stays");
        assert_eq!(sent.last().unwrap(), &user("Which numbers?"));
        assert_eq!(sent[1].role, "user", "whole turns go");
        assert!(
            sent[sent.len() - 3].content.starts_with("9 "),
            "the newest turns stay"
        );
        assert!(sent.len() < 2 + 2 * 10, "old turns went: {}", sent.len());
        let tokens = model.encode_chat(&sent, true).unwrap().tokens.len();
        assert!(
            tokens + 100 <= window,
            "{tokens} tokens leave no room in {window}"
        );
    }

    #[test]
    fn a_first_turn_keeps_its_system_messages_as_the_opening() {
        let spliced = splice(Vec::new(), vec![system("Be brief."), user("Hi")]);
        assert_eq!(
            spliced,
            Spliced {
                before: Vec::new(),
                opening: vec![system("Be brief.")],
                new: vec![user("Hi")],
            }
        );
    }

    #[test]
    fn later_turns_go_after_the_history_unless_they_resend_it() {
        let history = vec![system("Be brief."), user("Hi"), assistant("Hello.")];
        let spliced = splice(history.clone(), vec![user("Bye")]);
        assert_eq!(spliced.before, history);
        assert_eq!(
            (spliced.opening, spliced.new),
            (Vec::new(), vec![user("Bye")])
        );
        let mut resent = history.clone();
        resent.push(user("Bye"));
        let spliced = splice(history, resent);
        assert!(spliced.before.is_empty(), "the history is not repeated");
        assert_eq!(spliced.new, vec![user("Bye")]);
    }

    #[tokio::test]
    async fn turns_build_the_conversation_under_the_caller_and_id() {
        let sessions = sessions();
        let body = |text: &str| request(json!({"messages": [{"role": "user", "content": text}]}));
        let mut first = request(json!({"messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "I am Ada."}
        ]}));
        let turn = sessions
            .open(Caller::Anonymous, &headers("s"), model(), &mut first)
            .await
            .unwrap();
        assert_eq!(first.messages.len(), 2, "nothing stored yet");
        turn.commit("Hello, Ada.").await.unwrap();

        let mut second = body("Who am I?");
        let turn = sessions
            .open(Caller::Anonymous, &headers("s"), model(), &mut second)
            .await
            .unwrap();
        let sent = validate::messages(second.messages).unwrap();
        assert_eq!(
            sent,
            [
                system("Be brief."),
                user("I am Ada."),
                assistant("Hello, Ada."),
                user("Who am I?")
            ]
        );
        // Not committed: the failed or cancelled turn leaves the history as it was.
        drop(turn);
        let mut again = body("Who am I?");
        let _ = sessions
            .open(Caller::Anonymous, &headers("s"), model(), &mut again)
            .await
            .unwrap();
        assert_eq!(again.messages.len(), 4);

        let mut other = body("Who am I?");
        let _ = sessions
            .open(Caller::Anonymous, &headers("t"), model(), &mut other)
            .await
            .unwrap();
        assert_eq!(other.messages.len(), 1, "another id is another session");
    }

    #[tokio::test]
    async fn sessions_refuse_n_above_one_and_can_be_off() {
        let sessions = sessions();
        let mut many = request(json!({"messages": [{"role": "user", "content": "Hi"}], "n": 2}));
        let error = sessions
            .open(Caller::Anonymous, &headers("s"), model(), &mut many)
            .await
            .err()
            .unwrap();
        assert_eq!(param(error), "n");

        let off = Sessions::new(
            &ServeConfig {
                session_ttl_secs: 0,
                ..ServeConfig::default()
            },
            Arc::new(MemoryStore::new()),
        );
        let error = off
            .open(Caller::Anonymous, &headers("s"), model(), &mut many)
            .await
            .err()
            .unwrap();
        assert_eq!(param(error), SESSION_HEADER, "the header is refused");
    }

    fn chunk(
        content: Option<&str>,
        finish: Option<api::FinishReason>,
    ) -> Frame<ChatCompletionChunk> {
        Frame::Chunk(ChatCompletionChunk {
            id: "chatcmpl-1".into(),
            object: "chat.completion.chunk",
            created: 1,
            model: "m".into(),
            choices: vec![api::ChunkChoice {
                index: 0,
                delta: api::ChunkDelta {
                    role: None,
                    content: content.map(str::to_owned),
                    tool_calls: None,
                },
                logprobs: None,
                finish_reason: finish,
            }],
            usage: None,
            error: None,
            swarm: None,
        })
    }

    /// A turn of session "s" with the question "Q?", and the request as it then reads.
    async fn ask(sessions: &Sessions) -> (Turn, ChatCompletionRequest) {
        let mut body = request(json!({"messages": [{"role": "user", "content": "Q?"}]}));
        let turn = sessions
            .open(Caller::Anonymous, &headers("s"), model(), &mut body)
            .await
            .unwrap();
        (turn, body)
    }

    /// Streams `frames` through a turn of session "s", then reads back the history's messages
    /// before the next question: how many frames were sent, and the next request's messages.
    async fn streamed(frames: Vec<Frame<ChatCompletionChunk>>) -> (usize, Vec<ChatMessage>) {
        let sessions = sessions();
        let (turn, _) = ask(&sessions).await;
        let sent: Vec<_> = turn.record(stream::iter(frames)).collect().await;
        let (_, next) = ask(&sessions).await;
        (sent.len(), validate::messages(next.messages).unwrap())
    }

    #[tokio::test]
    async fn a_stream_that_finishes_stores_its_text_before_done() {
        let frames = vec![
            chunk(Some(""), None),
            chunk(Some("An"), None),
            chunk(Some("swer."), None),
            chunk(None, Some(api::FinishReason::Length)),
            Frame::Done,
        ];
        let (sent, history) = streamed(frames).await;
        assert_eq!(sent, 5, "the frames pass unchanged");
        assert_eq!(history, [user("Q?"), assistant("Answer."), user("Q?")]);
    }

    #[tokio::test]
    async fn a_failed_or_unfinished_stream_stores_nothing() {
        let failed = vec![
            chunk(Some("An"), None),
            chunk(None, Some(api::FinishReason::Error)),
            Frame::Done,
        ];
        assert_eq!(streamed(failed).await.1, [user("Q?")]);
        // The client left before the end.
        let cut = vec![chunk(Some("An"), None)];
        assert_eq!(streamed(cut).await.1, [user("Q?")]);
    }
}
