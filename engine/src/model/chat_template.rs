//! Renders a conversation into the prompt text a chat model was trained on, using the Jinja
//! template the model ships in `tokenizer.chat_template`.
//!
//! The template is compiled once, when the [`ChatTemplate`] is built; rendering only evaluates
//! it. The environment mimics Hugging Face's: `trim_blocks` and `lstrip_blocks` on, Python string
//! methods (`.strip()`, `.startswith()`...) through minijinja-contrib's pycompat, loop controls,
//! and a `raise_exception(message)` function whose message becomes the render error.
//!
//! The output is text, not tokens: control tokens such as `<|im_start|>` appear literally.
//! [`ChatTemplate::render_segments`] also says which bytes of that text the template wrote and
//! which came from messages' contents, so that only the template's own markup becomes control
//! tokens (see [`super::chat_prompt`]). It renders twice, once with each content replaced by a
//! placeholder, and trusts the split only when putting the contents back into the placeholders
//! gives exactly the real rendering: a template that inspects or transforms a content (`trim`,
//! `startswith`, a length) renders differently around a placeholder, and is reported as not
//! segmentable rather than split wrongly.

use std::ops::Range;

use candle_core::quantized::gguf_file::{Content, Value};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::{EngineError, Result};

/// Gemma 3's chat format, for a Gemma 3 GGUF that ships no template (the base model's):
/// `<bos>`, then each turn as `<start_of_turn>ROLE\n` + content + `<end_of_turn>\n`, the
/// assistant's role named `model`, a system message folded into the first turn after a blank
/// line (Gemma has no system role), and `<start_of_turn>model\n` to ask for an answer. Unlike
/// Google's template it neither trims contents nor refuses roles out of alternation: contents
/// pass through verbatim, so the split between markup and content stays known (see
/// [`ChatTemplate::render_segments`]).
const GEMMA3_TEMPLATE: &str = "\
{{- bos_token -}}
{%- if messages and messages[0].role == 'system' -%}
  {%- set first_prefix = messages[0].content ~ '\n\n' -%}
  {%- set turns = messages[1:] -%}
{%- else -%}
  {%- set first_prefix = '' -%}
  {%- set turns = messages -%}
{%- endif -%}
{%- for m in turns -%}
  {{- '<start_of_turn>' ~ ('model' if m.role == 'assistant' else m.role) ~ '\n' -}}
  {{- first_prefix if loop.first else '' -}}
  {{- m.content ~ '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\n' -}}
{%- endif -%}";

/// The name the one compiled template is stored under in the environment.
const TEMPLATE_NAME: &str = "chat_template";

/// Brackets of the placeholder that stands for message `i`'s content while segmenting: two
/// private-use characters around the index, which no template writes and no control token holds.
const PLACEHOLDER_OPEN: char = '\u{E000}';
const PLACEHOLDER_CLOSE: char = '\u{E001}';

/// A rendered prompt, and which of its bytes came from messages' contents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderedChat {
    pub text: String,
    /// The byte ranges of `text` that are message content, in order and disjoint; everything
    /// else is the template's markup. `None` when the template does not pass contents through
    /// verbatim, so the split is unknown.
    pub contents: Option<Vec<Range<usize>>>,
}

/// One turn of a conversation, as the template sees it (`message['role']`,
/// `message['content']`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (templates may accept others, such as `tool`).
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template and the special-token strings it may refer to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Reads `tokenizer.chat_template` and the text of the BOS and EOS tokens from a GGUF's
    /// metadata. A missing BOS or EOS id leaves that string empty, as Hugging Face does for
    /// models without one; an id outside the vocabulary is an error.
    pub fn from_gguf(content: &Content) -> Result<Self> {
        let architecture = content.metadata.get("general.architecture");
        let template = match content.metadata.get("tokenizer.chat_template") {
            Some(Value::String(template)) => template,
            Some(_) => return Err(template_error("tokenizer.chat_template is not a string")),
            None if matches!(architecture, Some(Value::String(a)) if a == "gemma3") => {
                GEMMA3_TEMPLATE
            }
            None => return Err(template_error("GGUF has no tokenizer.chat_template")),
        };
        let bos_token = token_text(content, "tokenizer.ggml.bos_token_id")?;
        let eos_token = token_text(content, "tokenizer.ggml.eos_token_id")?;
        Self::new(template, &bos_token, &eos_token)
    }

    /// Compiles `template`; a syntax error is reported here, not at the first render.
    pub fn new(template: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, template.to_owned())
            .map_err(|e| template_error(format!("does not compile: {e}")))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// The prompt for `messages`; with `add_generation_prompt` it ends with the header that
    /// opens the assistant's reply, so generation continues as the assistant.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| template_error(e.to_string()))
    }

    /// [`render`](Self::render), with the byte ranges that messages' contents fill (see the
    /// module docs). Empty contents get no placeholder: they add no bytes, and templates often
    /// test a content for emptiness.
    pub fn render_segments(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<RenderedChat> {
        let text = self.render(messages, add_generation_prompt)?;
        let placeholders: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage {
                role: m.role.clone(),
                content: if m.content.is_empty() {
                    String::new()
                } else {
                    format!("{PLACEHOLDER_OPEN}{i}{PLACEHOLDER_CLOSE}")
                },
            })
            .collect();
        // A template may refuse a placeholder where it accepts the real content.
        let contents = self
            .render(&placeholders, add_generation_prompt)
            .ok()
            .and_then(|skeleton| fill(&skeleton, messages))
            .filter(|(filled, _)| *filled == text)
            .map(|(_, ranges)| ranges);
        Ok(RenderedChat { text, contents })
    }

    /// The text of the beginning-of-sequence token (empty when the model has none).
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The text of the end-of-sequence token (empty when the model has none).
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }
}

/// `skeleton` with every placeholder replaced by its message's content, and the ranges the
/// contents took; `None` when a placeholder is malformed or names no message.
fn fill(skeleton: &str, messages: &[ChatMessage]) -> Option<(String, Vec<Range<usize>>)> {
    let mut text = String::with_capacity(skeleton.len());
    let mut ranges = Vec::new();
    let mut rest = skeleton;
    while let Some(open) = rest.find(PLACEHOLDER_OPEN) {
        text.push_str(&rest[..open]);
        let after = &rest[open + PLACEHOLDER_OPEN.len_utf8()..];
        let close = after.find(PLACEHOLDER_CLOSE)?;
        let index: usize = after[..close].parse().ok()?;
        let content = &messages.get(index)?.content;
        ranges.push(text.len()..text.len() + content.len());
        text.push_str(content);
        rest = &after[close + PLACEHOLDER_CLOSE.len_utf8()..];
    }
    text.push_str(rest);
    Some((text, ranges))
}

/// Templates call this to reject conversations they cannot format (e.g. roles that do not
/// alternate); the message must reach the caller intact.
fn raise_exception(message: String) -> std::result::Result<minijinja::Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// The vocabulary entry for the token id stored under `key`, or "" when the key is absent.
fn token_text(content: &Content, key: &str) -> Result<String> {
    let Some(id) = content.metadata.get(key) else {
        return Ok(String::new());
    };
    let id = id
        .to_u32()
        .map_err(|_| template_error(format!("{key} is not a u32")))?;
    let tokens = content
        .metadata
        .get("tokenizer.ggml.tokens")
        .and_then(|tokens| tokens.to_vec().ok())
        .ok_or_else(|| template_error("GGUF has no tokenizer.ggml.tokens array"))?;
    match tokens.get(id as usize).map(Value::to_string) {
        Some(Ok(text)) => Ok(text.clone()),
        Some(Err(_)) => Err(template_error(format!("token {id} is not a string"))),
        None => Err(template_error(format!(
            "{key} = {id} is outside the vocabulary of {} tokens",
            tokens.len()
        ))),
    }
}

fn template_error(message: impl Into<String>) -> EngineError {
    EngineError::ChatTemplate(message.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{smollm2_content, smollm2_tokenizer};

    fn smollm2() -> ChatTemplate {
        ChatTemplate::from_gguf(smollm2_content()).expect("SmolLM2 ships a chat template")
    }

    fn render_err(template: &str, messages: &[ChatMessage]) -> String {
        let template = ChatTemplate::new(template, "<s>", "</s>").expect("compiles");
        match template.render(messages, false) {
            Err(EngineError::ChatTemplate(message)) => message,
            Err(other) => panic!("expected a chat template error, got {other}"),
            Ok(text) => panic!("expected an error, rendered {text:?}"),
        }
    }

    #[test]
    fn renders_system_and_user_with_generation_prompt() {
        let messages = [
            ChatMessage::new("system", "You are a helpful assistant."),
            ChatMessage::new("user", "What is 2+2?"),
        ];
        assert_eq!(
            smollm2().render(&messages, true).unwrap(),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn inserts_default_system_prompt_when_none_is_given() {
        let messages = [ChatMessage::new("user", "Hi")];
        assert_eq!(
            smollm2().render(&messages, true).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn multi_turn_without_generation_prompt() {
        let messages = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello!"),
            ChatMessage::new("user", "Bye"),
        ];
        assert_eq!(
            smollm2().render(&messages, false).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello!<|im_end|>\n\
             <|im_start|>user\nBye<|im_end|>\n"
        );
    }

    #[test]
    fn bos_and_eos_come_from_the_vocabulary() {
        let template = smollm2();
        assert_eq!(template.bos_token(), "<|im_start|>");
        assert_eq!(template.eos_token(), "<|im_end|>");
        let template = ChatTemplate::new("{{ bos_token }}|{{ eos_token }}", "<s>", "</s>").unwrap();
        assert_eq!(template.render(&[], false).unwrap(), "<s>|</s>");
    }

    #[test]
    fn rendered_prompt_tokenizes_to_control_ids() {
        let prompt = smollm2()
            .render(&[ChatMessage::new("user", "Hi")], true)
            .unwrap();
        let ids = smollm2_tokenizer()
            .encode(prompt.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(ids[0], 1, "<|im_start|> opens the prompt");
        assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 3);
        assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 2);
    }

    #[test]
    fn python_string_methods_and_loop_controls_work() {
        let template = ChatTemplate::new(
            "{% for m in messages %}{% if m.content.startswith('skip') %}{% continue %}{% endif %}\
             [{{ m.role.upper() }}:{{ m.content.strip() }}]{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let messages = [
            ChatMessage::new("user", "  padded  "),
            ChatMessage::new("user", "skip me"),
            ChatMessage::new("assistant", "ok\n"),
        ];
        assert_eq!(
            template.render(&messages, false).unwrap(),
            "[USER:padded][ASSISTANT:ok]"
        );
    }

    #[test]
    fn trims_block_lines_like_hugging_face() {
        let template = ChatTemplate::new(
            "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let messages = [
            ChatMessage::new("user", "a"),
            ChatMessage::new("system", "x"),
            ChatMessage::new("user", "b"),
        ];
        assert_eq!(template.render(&messages, false).unwrap(), "a\nb\n");
    }

    #[test]
    fn raise_exception_reports_its_message() {
        let message = render_err(
            "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with a user turn') }}{% endif %}",
            &[ChatMessage::new("assistant", "hi")],
        );
        assert!(
            message.contains("Conversation must start with a user turn"),
            "{message}"
        );
    }

    #[test]
    fn syntax_errors_are_reported_at_construction() {
        match ChatTemplate::new("{% for m in messages %}{{ m.content }}", "", "") {
            Err(EngineError::ChatTemplate(message)) => {
                assert!(message.contains("does not compile"), "{message}")
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }

    #[test]
    fn missing_template_is_an_error() {
        let mut content = crate::test_support::read_smollm2_content();
        content.metadata.remove("tokenizer.chat_template");
        assert!(matches!(
            ChatTemplate::from_gguf(&content),
            Err(EngineError::ChatTemplate(_))
        ));
    }

    #[test]
    fn chat_message_wire_form() {
        let message: ChatMessage =
            serde_json::from_str(r#"{"role":"user","content":"hi"}"#).unwrap();
        assert_eq!(message, ChatMessage::new("user", "hi"));
        assert_eq!(
            serde_json::to_string(&message).unwrap(),
            r#"{"role":"user","content":"hi"}"#
        );
    }
}
