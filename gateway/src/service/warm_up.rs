//! Speculative prefill (the agent hint `speculative_prefill`): once a turn's answer is complete,
//! the next turn's prefix (the conversation and this answer, rendered as the follow-up will
//! render them) is prefilled on the engine at the lowest priority, so that it runs only when
//! nothing else waits, and held for the run's next turn, which then finds all of it in the
//! prefix cache instead of computing it while its caller waits.
//!
//! It is best effort: a warm-up the engine cannot take now (its queue is full) is dropped, and
//! it is charged to no one (it computes nothing the follow-up would not compute anyway).

use std::time::{Duration, Instant};

use engine::{
    ChatMessage, Event, FinishReason, GenerateRequest, Prompt, Retention, RunTurn, SamplingParams,
};
use futures::StreamExt;

use crate::limits::Admission;
use crate::service::admission::Events;
use crate::service::AppState;
use crate::tool_calls;
use crate::validate::structured::{self, Reply};

/// Longest a warm-up may take before the engine drops it.
const WARM_UP_DEADLINE: Duration = Duration::from_secs(60);

/// What the follow-up's prompt starts with, before the answer is known.
enum Before {
    /// A chat conversation, as the template took it, and how the answer reads back.
    Chat {
        messages: Vec<ChatMessage>,
        reply: Reply,
    },
    /// A text completion's prompt: the follow-up continues its text.
    Text(String),
}

/// The warm-up of one request's next turn, started once its answer is complete.
pub struct WarmUp {
    state: AppState,
    before: Before,
    /// The request's engine fields the warm-up shares: its run, its cache salt, its hold.
    request: GenerateRequest,
    agent: Option<String>,
}

impl WarmUp {
    /// For a chat request: `messages` as the template took them, `turn` the engine request
    /// made of them (after its admission set its cache salt), `agent` the agent serving it.
    pub fn chat(
        state: &AppState,
        admission: &Admission,
        messages: Vec<ChatMessage>,
        reply: Reply,
        turn: &GenerateRequest,
        agent: Option<&str>,
    ) -> Self {
        let before = Before::Chat { messages, reply };
        Self::new(state, admission, before, turn, agent)
    }

    /// For a text completion whose prompt is `prompt`.
    pub fn text(
        state: &AppState,
        admission: &Admission,
        prompt: String,
        turn: &GenerateRequest,
    ) -> Self {
        Self::new(state, admission, Before::Text(prompt), turn, None)
    }

    fn new(
        state: &AppState,
        admission: &Admission,
        before: Before,
        turn: &GenerateRequest,
        agent: Option<&str>,
    ) -> Self {
        let limits = state.structured_limits(admission.caller).hints;
        let mut request = GenerateRequest::new(Prompt::Tokens(Vec::new()));
        // The turn's model: the follow-up's prefix is in its template and its blocks.
        request.model = turn.model.clone();
        request.sampling = SamplingParams::greedy();
        request.max_tokens = 1;
        // Runs only when nothing else waits, and is preempted first.
        request.priority = i32::MIN;
        request.cache_salt = admission.caller.cache_salt(admission.shared_prefix);
        request.run = turn.run.as_ref().map(|run| RunTurn {
            warm_up: true,
            ..run.clone()
        });
        // Held as a tool-call turn would be: for the follow-up, as long as it pays.
        let max_secs = turn
            .retention
            .as_ref()
            .map_or(limits.tool_kv_ttl_max_secs, |r| r.max_secs);
        request.retention = (max_secs > 0.0).then_some(Retention {
            if_answer_starts_with: None,
            max_secs,
            adaptive: true,
        });
        Self {
            state: state.clone(),
            before,
            request,
            agent: agent.map(str::to_owned),
        }
    }

    /// The follow-up's prefix with `answer` in it, as token ids.
    fn prefix(&self, answer: &str) -> Option<Vec<u32>> {
        let model = self.state.model_named(self.request.model.as_deref());
        match &self.before {
            Before::Chat { messages, reply } => {
                let mut messages = messages.clone();
                messages.push(ChatMessage::new("assistant", assistant_text(reply, answer)));
                model.encode_chat(&messages, false).ok().map(|p| p.tokens)
            }
            Before::Text(prompt) => model.encode_text(&format!("{prompt}{answer}")).ok(),
        }
    }

    /// Prefills the turn after `answer` in the background.
    pub fn start(mut self, answer: &str) {
        let Some(tokens) = self.prefix(answer) else {
            return;
        };
        self.request.prompt = Prompt::Tokens(tokens);
        self.request.deadline = Some(Instant::now() + WARM_UP_DEADLINE);
        tokio::spawn(async move {
            let submitted = self
                .state
                .transport()
                .submit(self.agent.as_deref(), self.request)
                .await;
            match submitted {
                // Read to the end: dropping the stream would cancel the warm-up.
                Ok(events) => events.for_each(|_| async {}).await,
                Err(e) => tracing::debug!(error = %e, "speculative prefill not taken"),
            }
        });
    }
}

/// `events`, starting `warm_up` with the answer once they end it normally.
pub fn after(events: Events, warm_up: Option<WarmUp>) -> Events {
    let Some(warm_up) = warm_up else {
        return events;
    };
    let mut pending = Some((warm_up, String::new()));
    Box::pin(events.inspect(move |event| match event {
        Ok(Event::Delta { text, .. }) => {
            if let Some((_, answer)) = &mut pending {
                answer.push_str(text);
            }
        }
        Ok(Event::Finished {
            reason: FinishReason::Stop | FinishReason::Length,
            ..
        }) => {
            if let Some((warm_up, answer)) = pending.take() {
                warm_up.start(&answer);
            }
        }
        _ => {}
    }))
}

/// The assistant message `answer` becomes in the conversation's history, as the chat template
/// will see it when the client sends it back: the text, or, in the envelope, its tool calls or
/// its response.
fn assistant_text(reply: &Reply, answer: &str) -> String {
    let Reply::Envelope { json_response } = *reply else {
        return answer.to_owned();
    };
    let (content, calls) = tool_calls::read_all(answer, json_response, true);
    match calls.is_empty() {
        true => structured::render_reply(&content, json_response),
        false => structured::render_calls(&tool_calls::api_calls(calls)),
    }
}
