//! The verifier: whether an answer may reach the user. It returns a [`Verdict`]: passed or not,
//! a score in 0..=1, and the reasons for a failure.
//!
//! Three kinds of check, cheapest first; a failure skips the costlier kinds, since one reason is
//! enough to reject:
//! 1. Deterministic checks on the text ([`Verifier::check`]): empty, truncated, degenerate
//!    repetition, refusal, invalid JSON when JSON was asked for, wrong language, a regex the
//!    answer must match. Pure functions of the text, microseconds.
//! 2. Relevance, in two steps. First the cosine of the question's and the answer's sentence
//!    embeddings: under [`VerifierConfig::min_relevance`] the answer is off topic. The caller
//!    computes the embeddings (it owns the embedder's threads and decides where to block) and
//!    hands the similarity in. An answer that a sentence model cannot place (a short one, "36"
//!    or "Paris.", has no topic of its own) or places only near the question (an answer about
//!    the snake to a question about the Python language shares its words) then gets its
//!    grounding ([`Verifier::grounding`]): how much more likely the generative model finds the
//!    answer after this question than after a neutral one, per answer token. An answer written
//!    for the question gains (it picks up the question's names, numbers and task); one written
//!    for another question gains nothing. Under [`VerifierConfig::min_grounding`] the answer is
//!    off topic. Two prefills of the answer; skipped when the embeddings already put the
//!    answer at [`VerifierConfig::confident_relevance`] or above.
//! 3. The judge ([`Verifier::judge`]): the verifier agent's system prompt, the question and the
//!    answer, and one forward pass of the generative model. The verdict is read from the
//!    log-probabilities of "yes" and "no" as the next token (`score_tokens`), never from sampled
//!    text, so it is deterministic and costs one step beyond the prompt.
//!
//! Reasons start with the check's code (`empty`, `truncated`, `repetition`, `refusal`,
//! `invalid_json`, `wrong_language`, `regex`, `off_topic`, `judge`), then a colon and the detail.
//!
//! The verifier never edits an answer and never generates one; what to do with a failed answer
//! is the agent's [`crate::OnFailure`].

mod language;

use engine::{
    ChatMessage, Event, FinishReason, Generate, GenerateRequest, ModelInfo, Prompt, SamplingParams,
};

use crate::agent::VerifierChecks;
use crate::{Result, RouterError};

pub use language::guess as guess_language;

/// The verifier's thresholds.
#[derive(Clone, Debug, PartialEq)]
pub struct VerifierConfig {
    /// Least cosine similarity between the question's and the answer's embeddings. With
    /// all-MiniLM-L6-v2, answers on topic mostly score above 0.45 and unrelated text under 0.2;
    /// an answer from a neighbouring topic, and a short answer, land between, where the
    /// grounding decides; this catches only what is plainly about something else.
    pub min_relevance: f32,
    /// Least P(yes) / (P(yes) + P(no)) from the judge. Low: with SmolLM2-135M as the verifier
    /// model the judge's scores of good and bad answers overlap (mostly 0.2 to 0.6), so it only
    /// vetoes the clearest "no"; a larger verifier model earns a higher threshold.
    pub min_judge_score: f32,
    /// Most share of repeated word 4-grams in an answer.
    pub max_repetition: f32,
    /// Answers of fewer words are never called repetitive: a short answer has too few n-grams
    /// to measure.
    pub min_repetition_words: usize,
    /// Characters of the question, and of the answer, the judge reads; the rest is cut, so a
    /// long text can neither push the judge's prompt past the context window nor make its
    /// encoding long work.
    pub judge_answer_chars: usize,
    /// Least grounding (mean log-probability gain per answer token, in nats) of an answer on
    /// topic. On the shared development set, with SmolLM2-135M, the good answers whose grounding
    /// is measured (those under `confident_relevance`) gain 0.49 to 4.1, and the off-topic ones
    /// -0.42 to 0.34 (one JSON answer in the asked format about the wrong product, 0.67, is
    /// left to the embeddings). The threshold sits low in that gap, near "the question told the
    /// model nothing": a small model's gain on a correct answer also depends on whether it knows
    /// the answer itself, so only an answer the question does not explain is rejected.
    pub min_grounding: f32,
    /// Embedding similarity at and above which the answer is taken as on topic without its
    /// grounding. The development set's off-topic answers reach 0.42.
    pub confident_relevance: f32,
    /// Characters of the question, and of the answer, the grounding reads.
    pub grounding_chars: usize,
    /// Answers of fewer words are not judged by their embedding's similarity (see
    /// [`Verifier::verify`]).
    pub min_relevance_words: usize,
}

impl Default for VerifierConfig {
    fn default() -> Self {
        Self {
            min_relevance: 0.2,
            min_judge_score: 0.05,
            max_repetition: 0.25,
            min_repetition_words: 24,
            judge_answer_chars: 4000,
            min_grounding: 0.15,
            confident_relevance: 0.6,
            grounding_chars: 1500,
            min_relevance_words: 4,
        }
    }
}

/// An answer to check, with what is known about how it was produced.
#[derive(Clone, Copy, Debug)]
pub struct Candidate<'a> {
    pub question: &'a str,
    pub answer: &'a str,
    /// Why generation ended, when known; `Length` means the answer was cut.
    pub finish_reason: Option<FinishReason>,
}

/// What the verifier decided about one answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub passed: bool,
    /// 0..=1, higher is better: the judge's P(yes) when it ran, else 1 for a pass and 0 for a
    /// failure.
    pub score: f32,
    /// Why the answer failed; empty when it passed.
    pub reasons: Vec<String>,
    /// The answer's grounding in the question, when it was measured (see the module header).
    pub grounding: Option<f32>,
    /// The tokens the judge and the grounding read and wrote; zero when neither ran.
    pub usage: engine::Usage,
}

/// The judge's reading of one answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Judgement {
    /// P(yes) / (P(yes) + P(no)).
    pub score: f32,
    /// The judge's prompt and its one scored step.
    pub usage: engine::Usage,
}

/// Phrases that open a refusal. Matched, lowercase, in the answer's first sentences: a refusal
/// says so at once, while a helpful answer may mention "I cannot" deep inside.
const REFUSALS: &[&str] = &[
    "i can't help",
    "i cannot help",
    "i can't assist",
    "i cannot assist",
    "i can't provide",
    "i cannot provide",
    "i'm unable to",
    "i am unable to",
    "i'm not able to",
    "i am not able to",
    "i won't be able to",
    "i can't do that",
    "i cannot do that",
    "i must decline",
    "i'm sorry, but i can",
    "i am sorry, but i can",
    "i don't feel comfortable",
    "i do not feel comfortable",
    // The other languages the verifier tells apart: a user who writes in French is refused in
    // French.
    "je ne peux pas vous aider",
    "je ne peux pas t'aider",
    "je ne suis pas en mesure de",
    "je ne peux pas répondre",
    "no puedo ayudarte",
    "no puedo ayudarle",
    "no puedo ayudar con",
    "no estoy en condiciones de",
    "ich kann dir dabei nicht helfen",
    "ich kann ihnen dabei nicht helfen",
    "ich kann dabei nicht helfen",
    "ich bin nicht in der lage",
    "non posso aiutarti",
    "non posso aiutarla",
    "não posso ajudar",
    "não consigo ajudar",
    "não estou em condições de",
    "i'm not allowed",
    "i am not allowed",
];
/// How far into the answer a refusal is looked for.
const REFUSAL_WINDOW_CHARS: usize = 160;

/// Words the judge's verdict may start with; each is scored when the tokenizer has it as one
/// token.
const YES: &[&str] = &["yes", " yes", "Yes", " Yes", "YES"];
const NO: &[&str] = &["no", " no", "No", " No", "NO"];

/// Checks answers for one swarm: holds the verifier agent's prompt and what the judge reads.
/// The judge runs on the engine each call names: the caller's own, under the limits of the
/// request it serves.
pub struct Verifier {
    /// The verifier agent's name, which the judge's engine calls run as; `None` for the
    /// shipped prompt outside any swarm.
    agent: Option<String>,
    system_prompt: String,
    config: VerifierConfig,
    yes: Vec<u32>,
    no: Vec<u32>,
}

impl Verifier {
    /// A verifier judging with `system_prompt` (the verifier agent's) on `model`.
    pub fn new(model: &ModelInfo, system_prompt: String, config: VerifierConfig) -> Self {
        let single_tokens = |words: &[&str]| {
            let tokenizer = &model.tokenizer;
            let mut ids: Vec<u32> = words
                .iter()
                .filter_map(|w| {
                    let encoding = tokenizer.encode(*w, false).ok()?;
                    match encoding.get_ids() {
                        [id] => Some(*id),
                        _ => None,
                    }
                })
                .collect();
            ids.sort_unstable();
            ids.dedup();
            ids
        };
        let yes = single_tokens(YES);
        let no = single_tokens(NO);
        Self {
            agent: None,
            system_prompt,
            config,
            yes,
            no,
        }
    }

    /// The same verifier, as the agent `name`.
    pub fn as_agent(mut self, name: impl Into<String>) -> Self {
        self.agent = Some(name.into());
        self
    }

    /// The verifier agent's name, when it is one.
    pub fn agent(&self) -> Option<&str> {
        self.agent.as_deref()
    }

    pub fn config(&self) -> &VerifierConfig {
        &self.config
    }

    /// Runs `checks` on `candidate`: the deterministic ones, whose failures the caller passes
    /// as `failures` (what [`Verifier::check`] gave for this candidate: they read the whole
    /// answer, so callers run them off the async threads), then relevance when `similarity`
    /// (the question's and answer's cosine) is given and `checks.relevance` asks for it, and the
    /// grounding when relevance is asked for and the similarity is absent or short of
    /// [`VerifierConfig::confident_relevance`], then the judge when `checks.judge` asks for it.
    /// Stops at the first kind that fails.
    pub async fn verify(
        &self,
        engine: &dyn Generate,
        candidate: &Candidate<'_>,
        checks: &VerifierChecks,
        failures: Vec<String>,
        similarity: Option<f32>,
    ) -> Result<Verdict> {
        let mut reasons = failures;
        let mut grounding = None;
        let mut usage = engine::Usage::default();
        if reasons.is_empty() && checks.relevance {
            // A sentence model places an answer of a few words nowhere ("29.", "[]"): its
            // grounding alone decides.
            let words = candidate
                .answer
                .split_whitespace()
                .take(self.config.min_relevance_words)
                .count();
            let similarity = similarity.filter(|_| words >= self.config.min_relevance_words);
            if let Some(similarity) = similarity {
                reasons.extend(self.relevance(similarity));
            }
            let confident = similarity.is_some_and(|s| s >= self.config.confident_relevance);
            if reasons.is_empty() && !confident {
                let measured = self
                    .grounding(engine, candidate.question, candidate.answer)
                    .await?;
                match measured {
                    // Text the tokenizer drops entirely (control characters): nothing to judge.
                    None => reasons.push("empty: the answer has no text the model reads".into()),
                    Some(measured) => {
                        usage = measured.usage;
                        grounding = Some(measured.gain);
                        if measured.gain < self.config.min_grounding {
                            reasons.push(format!(
                        "off_topic: the answer gains {:.3} nats per token from the question, \
                         under {}",
                        measured.gain, self.config.min_grounding
                    ));
                        }
                    }
                }
            }
        }
        if !reasons.is_empty() {
            return Ok(Verdict {
                passed: false,
                score: 0.0,
                reasons,
                grounding,
                usage,
            });
        }
        if !checks.judge {
            return Ok(Verdict {
                passed: true,
                score: 1.0,
                reasons,
                grounding,
                usage,
            });
        }
        let judgement = self
            .judge(engine, candidate.question, candidate.answer)
            .await?;
        let score = judgement.score;
        if score < self.config.min_judge_score {
            reasons.push(format!(
                "judge: the verifier agent's score {score:.3} is under {}",
                self.config.min_judge_score
            ));
        }
        Ok(Verdict {
            passed: reasons.is_empty(),
            score,
            reasons,
            grounding,
            usage: add_usage(usage, judgement.usage),
        })
    }

    /// The deterministic checks that `checks` enables; the reasons of those that fail.
    pub fn check(&self, candidate: &Candidate<'_>, checks: &VerifierChecks) -> Vec<String> {
        deterministic(candidate, checks, &self.config)
    }

    /// The reason an answer whose embedding's cosine with the question's is `similarity` is off
    /// topic, if it is.
    pub fn relevance(&self, similarity: f32) -> Option<String> {
        (similarity < self.config.min_relevance).then(|| {
            format!(
                "off_topic: the answer's similarity to the question is {similarity:.3}, under {}",
                self.config.min_relevance
            )
        })
    }

    /// The verifier agent's P(yes) / (P(yes) + P(no)) that `answer` answers `question`, read from
    /// one greedy step's log-probabilities, and what that step cost.
    pub async fn judge(
        &self,
        engine: &dyn Generate,
        question: &str,
        answer: &str,
    ) -> Result<Judgement> {
        if self.yes.is_empty() || self.no.is_empty() {
            return Err(RouterError::Judge(
                "the model's tokenizer has no single token for yes or no".into(),
            ));
        }
        let chars = self.config.judge_answer_chars;
        let (question, answer) = (head(question, chars), head(answer, chars));
        let messages = [
            ChatMessage::new("system", self.system_prompt.as_str()),
            ChatMessage::new(
                "user",
                format!(
                    "Question:\n{question}\n\nAnswer:\n{answer}\n\n\
                     Is this a good answer to the question? Reply yes or no."
                ),
            ),
        ];
        // The question and the answer are content: a control token in either stays text, so an
        // answer cannot close the user's turn and write the judge's verdict itself. Both are cut
        // to `judge_answer_chars`, so encoding them is short work even on an I/O thread.
        let prompt = engine.model().encode_chat(&messages, true)?.tokens;
        let mut score_tokens = self.yes.clone();
        score_tokens.extend(&self.no);
        // The engine gives the judge the priority of the request it serves.
        let mut events = engine
            .submit(GenerateRequest {
                sampling: SamplingParams::greedy(),
                max_tokens: 1,
                score_tokens,
                ..GenerateRequest::new(Prompt::Tokens(prompt))
            })
            .await?;
        let mut score = None;
        while let Some(event) = events.next().await {
            match event {
                Event::Delta { logprobs, .. } => {
                    if let Some(step) = logprobs.first() {
                        score.get_or_insert_with(|| yes_share(&step.scored, &self.yes));
                    }
                }
                Event::Finished {
                    error,
                    reason,
                    usage,
                } => {
                    return match (score, error) {
                        (Some(score), None) => Ok(Judgement { score, usage }),
                        (_, error) => Err(RouterError::Judge(error.unwrap_or_else(|| {
                            format!("the judge ended ({}) before scoring", reason.as_str())
                        }))),
                    };
                }
                Event::PromptLogprobs(_) => {}
            }
        }
        Err(RouterError::Judge("the engine dropped the judge".into()))
    }
}

/// The question a neutral prompt asks, against which [`Verifier::grounding`] measures the gain.
const NEUTRAL_QUESTION: &str = "Hi";

/// One answer's grounding in its question (see the module header).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Grounding {
    /// The answer's mean log-probability per token after the question, less that after
    /// [`NEUTRAL_QUESTION`], in nats.
    pub gain: f32,
    /// The two prefills.
    pub usage: engine::Usage,
}

impl Verifier {
    /// How much more likely the generative model finds `answer` as the reply to `question` than
    /// as the reply to a neutral message: the mean log-probability per answer token of the two
    /// chats, one prefill each (the prompt's log-probabilities, no sampling). `None` when the
    /// answer encodes to no tokens.
    pub async fn grounding(
        &self,
        engine: &dyn Generate,
        question: &str,
        answer: &str,
    ) -> Result<Option<Grounding>> {
        let chars = self.config.grounding_chars;
        let (question, answer) = (head(question, chars), head(answer, chars));
        let Some((asked, asked_usage)) = answer_logprob(engine, question, answer).await? else {
            return Ok(None);
        };
        let Some((neutral, neutral_usage)) =
            answer_logprob(engine, NEUTRAL_QUESTION, answer).await?
        else {
            return Ok(None);
        };
        let gain = asked - neutral;
        if !gain.is_finite() {
            return Err(RouterError::Judge(format!(
                "the grounding prefills scored the answer {asked} and {neutral}"
            )));
        }
        Ok(Some(Grounding {
            gain,
            usage: add_usage(asked_usage, neutral_usage),
        }))
    }
}

/// The mean log-probability of `answer`'s tokens as the assistant's reply to `question`, and
/// what the prefill cost; `None` when the answer encodes to no tokens. The texts are contents:
/// a control token in either stays text.
async fn answer_logprob(
    engine: &dyn Generate,
    question: &str,
    answer: &str,
) -> Result<Option<(f32, engine::Usage)>> {
    let model = engine.model();
    let user = ChatMessage::new("user", question);
    let chat = |answer: &str| {
        model.encode_chat(
            &[user.clone(), ChatMessage::new("assistant", answer)],
            false,
        )
    };
    let header = model.encode_chat(std::slice::from_ref(&user), true)?.tokens;
    let (full, empty) = (chat(answer)?.tokens, chat("")?.tokens);
    // The answer starts where the chat leaves the prompt with its reply header, and ends where
    // the markup that closes the turn (what an empty reply ends with too) begins.
    let start = common_prefix(&header, &full).max(1);
    let end = full.len() - common_suffix(&empty, &full).min(full.len() - start);
    if start >= end {
        return Ok(None);
    }
    let mut events = engine
        .submit(GenerateRequest {
            sampling: SamplingParams::greedy(),
            max_tokens: 1,
            prompt_logprobs: Some(0),
            ..GenerateRequest::new(Prompt::Tokens(full))
        })
        .await?;
    let mut mean = None;
    while let Some(event) = events.next().await {
        match event {
            // Entry `i` scores prompt token `i + 1`.
            Event::PromptLogprobs(scored) => {
                let answer = scored.get(start - 1..end - 1).unwrap_or_default();
                if !answer.is_empty() {
                    let sum: f32 = answer.iter().map(|t| t.logprob).sum();
                    mean = Some(sum / answer.len() as f32);
                }
            }
            Event::Delta { .. } => {}
            Event::Finished {
                error,
                reason,
                usage,
            } => {
                return match (mean, error) {
                    (Some(mean), None) => Ok(Some((mean, usage))),
                    (_, error) => Err(RouterError::Judge(error.unwrap_or_else(|| {
                        format!(
                            "the grounding prefill ended ({}) before scoring",
                            reason.as_str()
                        )
                    }))),
                };
            }
        }
    }
    Err(RouterError::Judge(
        "the engine dropped the grounding prefill".into(),
    ))
}

/// How many leading items `a` and `b` share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How many trailing items `a` and `b` share.
fn common_suffix(a: &[u32], b: &[u32]) -> usize {
    a.iter()
        .rev()
        .zip(b.iter().rev())
        .take_while(|(x, y)| x == y)
        .count()
}

/// Two calls' tokens together.
fn add_usage(a: engine::Usage, b: engine::Usage) -> engine::Usage {
    engine::Usage {
        prompt_tokens: a.prompt_tokens + b.prompt_tokens,
        completion_tokens: a.completion_tokens + b.completion_tokens,
        cached_tokens: a.cached_tokens + b.cached_tokens,
    }
}

/// The first `chars` characters of `text`.
pub(crate) fn head(text: &str, chars: usize) -> &str {
    match text.char_indices().nth(chars) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

/// The deterministic checks that `checks` enables, under `config`'s thresholds.
fn deterministic(
    candidate: &Candidate<'_>,
    checks: &VerifierChecks,
    config: &VerifierConfig,
) -> Vec<String> {
    let answer = candidate.answer;

    let mut reasons = Vec::new();
    if answer.trim().is_empty() {
        if checks.non_empty {
            reasons.push("empty: the answer has no visible text".to_owned());
        }
        // Nothing else can be judged of no text.
        return reasons;
    }
    if checks.not_truncated {
        if candidate.finish_reason == Some(FinishReason::Length) {
            reasons.push("truncated: generation stopped at max_tokens".to_owned());
        } else if let Some(cut) = (!checks.json).then(|| cut_off(answer)).flatten() {
            reasons.push(format!("truncated: the answer stops {cut}"));
        }
    }
    if checks.no_degenerate_repetition {
        let share = repetition(answer, config.min_repetition_words);
        if share > config.max_repetition {
            reasons.push(format!(
                "repetition: {:.0}% of the answer's word sequences repeat",
                share * 100.0
            ));
        }
    }
    if let Some(phrase) = refusal(answer) {
        reasons.push(format!("refusal: the answer declines (\"{phrase}\")"));
    }
    if checks.json {
        if let Err(e) = serde_json::from_str::<serde_json::Value>(answer.trim()) {
            reasons.push(format!("invalid_json: {e}"));
        }
    }
    let wanted = match &checks.language {
        Some(code) => Some(code.as_str()),
        // A translation is meant to be in another language than the request.
        None if asks_for_translation(candidate.question) => None,
        None => language::guess_question(candidate.question),
    };
    if let Some(wanted) = wanted {
        if let Some(found) = language::mismatch(wanted, answer) {
            reasons.push(format!(
                "wrong_language: the answer reads as `{found}`, `{wanted}` was expected"
            ));
        }
    }
    if let Some(pattern) = &checks.regex {
        // The policy's regex was compiled when the agent was validated.
        match regex::Regex::new(pattern) {
            Ok(re) if re.is_match(answer) => {}
            Ok(_) => reasons.push(format!("regex: the answer does not match `{pattern}`")),
            Err(e) => reasons.push(format!("regex: `{pattern}` does not compile: {e}")),
        }
    }
    reasons
}

/// Word stems that ask for a translation, in the languages the verifier guesses: "translate",
/// "traduis", "traduce", "traduci", "traduza", "übersetze" and their forms.
const TRANSLATION_STEMS: &[&str] = &["translat", "tradu", "übersetz", "ubersetz"];

/// Whether `question` asks for a translation.
fn asks_for_translation(question: &str) -> bool {
    let lower = question.to_lowercase();
    TRANSLATION_STEMS.iter().any(|stem| lower.contains(stem))
}

/// The answer's first sentences (at most `max`, each of a few words at least), to measure
/// relevance on: a long answer's whole embedding is diluted by its details, while a relevant
/// answer has at least one sentence close to the question.
pub fn passages(answer: &str, max: usize) -> Vec<&str> {
    answer
        .split_inclusive(['.', '?', '!', '\n'])
        .map(str::trim)
        .filter(|s| s.split_whitespace().count() >= 4)
        .take(max)
        .collect()
}

/// The prose of an answer for embedding: a JSON answer's string values, keys and numbers joined
/// as sentences (a sentence model reads braces and quotes as noise), any other answer as it is.
pub fn prose(answer: &str) -> String {
    fn collect(value: &serde_json::Value, out: &mut Vec<String>) {
        match value {
            serde_json::Value::String(s) => out.push(s.clone()),
            serde_json::Value::Number(n) => out.push(n.to_string()),
            serde_json::Value::Array(items) => items.iter().for_each(|v| collect(v, out)),
            serde_json::Value::Object(map) => {
                for (key, v) in map {
                    out.push(key.replace('_', " "));
                    collect(v, out);
                }
            }
            _ => {}
        }
    }
    match serde_json::from_str::<serde_json::Value>(answer.trim()) {
        Ok(value @ (serde_json::Value::Object(_) | serde_json::Value::Array(_))) => {
            let mut parts = Vec::new();
            collect(&value, &mut parts);
            parts.join(". ")
        }
        _ => answer.to_owned(),
    }
}

/// Cosine similarity of two vectors; 0 when either is zero.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let denominator = norm(a) * norm(b);
    if denominator == 0.0 {
        0.0
    } else {
        dot / denominator
    }
}

/// P(yes) / (P(yes) + P(no)) from the scored tokens' log-probabilities.
fn yes_share(scored: &[(u32, f32)], yes: &[u32]) -> f32 {
    let (mut p_yes, mut p_no) = (0.0f32, 0.0f32);
    for &(token, logprob) in scored {
        if yes.contains(&token) {
            p_yes += logprob.exp();
        } else {
            p_no += logprob.exp();
        }
    }
    if p_yes + p_no == 0.0 {
        0.5
    } else {
        p_yes / (p_yes + p_no)
    }
}

/// Whether prose stops mid-sentence: the last line is a sentence (several words, not a list
/// item, heading or code) and ends on a word or a comma rather than closing punctuation.
fn ends_mid_sentence(answer: &str) -> bool {
    let trimmed = answer.trim_end();
    if trimmed.ends_with("```") {
        return false;
    }
    let last_line = trimmed.lines().last().unwrap_or("").trim();
    let is_item = last_line.starts_with(['-', '*', '#', '|', '>'])
        || last_line
            .split_once(['.', ')'])
            .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
    if is_item || last_line.split_whitespace().count() < 6 {
        return false;
    }
    let Some(last) = last_line.chars().last() else {
        return false;
    };
    last.is_alphanumeric() || matches!(last, ',' | ';' | '-' | '(' | '\'' | '/')
}

/// Where an answer that did not end on its own stops, if it shows: inside a code block (a fence
/// opened and never closed), inside a table row (a row that never reaches its closing `|`), or
/// in the middle of a sentence ([`ends_mid_sentence`]).
fn cut_off(answer: &str) -> Option<&'static str> {
    // A fence is a line of its own: three backticks and an optional language, not inline code.
    let fences = answer
        .lines()
        .filter(|line| {
            let line = line.trim();
            line.starts_with("```") && !line[3..].contains('`')
        })
        .count();
    if fences % 2 == 1 {
        return Some("inside a code block");
    }
    // A table row that stops short of the closing `|` its table's rows have.
    let mut lines = answer.trim_end().lines().rev().map(str::trim);
    let last_line = lines.next().unwrap_or("");
    let closed_table = lines
        .next()
        .is_some_and(|row| row.starts_with('|') && row.ends_with('|'));
    if closed_table && last_line.starts_with('|') && !last_line.ends_with('|') {
        return Some("inside a table row");
    }
    ends_mid_sentence(answer).then_some("in the middle of a sentence")
}

/// Share of the answer's word 4-grams that repeat an earlier one; 0 for answers shorter than
/// `min_words`. Loops ("the best is the best is the best ...") score near 1, prose near 0.
fn repetition(answer: &str, min_words: usize) -> f32 {
    let words: Vec<String> = answer
        .split_whitespace()
        .map(|w| {
            w.trim_matches(|c: char| !c.is_alphanumeric())
                .to_lowercase()
        })
        .filter(|w| !w.is_empty())
        .collect();
    if words.len() < min_words.max(4) {
        return 0.0;
    }
    let grams: Vec<&[String]> = words.windows(4).collect();
    let mut seen = std::collections::HashSet::with_capacity(grams.len());
    let repeats = grams.iter().filter(|g| !seen.insert(**g)).count();
    repeats as f32 / grams.len() as f32
}

/// The refusal phrase the answer opens with, if any.
fn refusal(answer: &str) -> Option<&'static str> {
    let head: String = answer
        .chars()
        .take(REFUSAL_WINDOW_CHARS)
        .collect::<String>()
        .to_lowercase()
        .replace('’', "'");
    REFUSALS.iter().copied().find(|p| head.contains(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate<'a>(question: &'a str, answer: &'a str) -> Candidate<'a> {
        Candidate {
            question,
            answer,
            finish_reason: Some(FinishReason::Stop),
        }
    }

    /// The deterministic checks need no model: this runs them on a stand-alone config.
    fn check(candidate: &Candidate<'_>, checks: &VerifierChecks) -> Vec<String> {
        deterministic(candidate, checks, &VerifierConfig::default())
    }

    fn codes(reasons: &[String]) -> Vec<&str> {
        reasons
            .iter()
            .map(|r| r.split(':').next().unwrap())
            .collect()
    }

    const Q: &str = "How do I list the files in a directory on Linux?";
    const GOOD: &str = "Use the ls command: `ls -la /path/to/dir` lists every file, hidden \
                        ones included, with their sizes and permissions.";

    #[test]
    fn a_good_answer_passes() {
        assert!(check(&candidate(Q, GOOD), &VerifierChecks::default()).is_empty());
    }

    #[test]
    fn empty_and_blank_answers_fail() {
        for answer in ["", "   \n\t "] {
            let reasons = check(&candidate(Q, answer), &VerifierChecks::default());
            assert_eq!(codes(&reasons), ["empty"]);
        }
    }

    #[test]
    fn length_stops_and_cut_sentences_are_truncated() {
        let cut = Candidate {
            finish_reason: Some(FinishReason::Length),
            ..candidate(Q, GOOD)
        };
        assert_eq!(
            codes(&check(&cut, &VerifierChecks::default())),
            ["truncated"]
        );
        let mid = "Use the ls command, which lists the files of the directory you give it and";
        assert_eq!(
            codes(&check(&candidate(Q, mid), &VerifierChecks::default())),
            ["truncated"]
        );
        // A code block never closed, a table row never finished.
        for (cut, place) in [
            ("Run:\n```sh\nls -la\nfind . -name", "inside a code block"),
            (
                "| command | lists |\n|---|---|\n| ls | files |\n| find | fi",
                "inside a table row",
            ),
        ] {
            let reasons = check(&candidate(Q, cut), &VerifierChecks::default());
            assert_eq!(codes(&reasons), ["truncated"], "{cut}");
            assert!(reasons[0].ends_with(place), "{reasons:?}");
        }
        // Lists, code blocks, tables and short lines end without a full stop and are not cut.
        for whole in [
            "Options:\n- ls\n- find . -maxdepth 1",
            "Run:\n```sh\nls -la\n```",
            "Run:\n```sh\nls -la\n```\nor\n```\nfind .\n```",
            "```ls``` lists the files; `ls -a` the hidden ones too.",
            "command | lists\n--- | ---\nls | files",
            "| command | lists |\n|---|---|\n| ls | files |",
            "ls -la",
        ] {
            assert!(
                check(&candidate(Q, whole), &VerifierChecks::default()).is_empty(),
                "{whole}"
            );
        }
    }

    #[test]
    fn loops_are_degenerate_repetition() {
        let looped = "The ls command lists files. ".repeat(12);
        assert_eq!(
            codes(&check(&candidate(Q, &looped), &VerifierChecks::default())),
            ["repetition"]
        );
        assert!(repetition(GOOD, 4) < 0.1);
        assert_eq!(
            repetition("ls ls ls ls ls", 24),
            0.0,
            "too short to measure"
        );
    }

    #[test]
    fn refusals_fail() {
        for refused in [
            "I'm sorry, but I can't help with that request.",
            "As an AI, I don't feel comfortable giving advice on that.",
        ] {
            assert_eq!(
                codes(&check(&candidate(Q, refused), &VerifierChecks::default())),
                ["refusal"]
            );
        }
        for refused in [
            "Désolé, je ne peux pas vous aider avec cette demande.",
            "Lo siento, no puedo ayudarte con eso.",
            "Tut mir leid, ich kann dir dabei nicht helfen.",
        ] {
            assert!(
                codes(&check(&candidate(Q, refused), &VerifierChecks::default()))
                    .contains(&"refusal"),
                "{refused}"
            );
        }
        // A disclaimer that goes on to help is not a refusal.
        let helps = "As an AI I have no favourite film, but many people love Spirited Away: \
                     a girl's journey through a spirit world, drawn by Studio Ghibli.";
        assert!(check(&candidate(Q, helps), &VerifierChecks::default()).is_empty());
    }

    #[test]
    fn json_is_checked_only_when_asked() {
        let json = VerifierChecks {
            json: true,
            ..VerifierChecks::default()
        };
        assert!(check(&candidate(Q, r#"{"command": "ls -la"}"#), &json).is_empty());
        let broken = r#"{"command": "ls -la""#;
        assert_eq!(
            codes(&check(&candidate(Q, broken), &json)),
            ["invalid_json"]
        );
        assert!(check(&candidate(Q, GOOD), &VerifierChecks::default()).is_empty());
    }

    #[test]
    fn the_answer_keeps_the_question_or_policy_language() {
        let french = "Utilisez la commande ls : elle affiche les fichiers du dossier, et \
                      l'option -a montre aussi ceux qui sont cachés.";
        assert_eq!(
            codes(&check(&candidate(Q, french), &VerifierChecks::default())),
            ["wrong_language"]
        );
        let policy = VerifierChecks {
            language: Some("fr".into()),
            ..VerifierChecks::default()
        };
        assert!(check(&candidate(Q, french), &policy).is_empty());
        // A translation is in another language by request.
        let translate = "Translate into French: 'Use ls to list the files, and -a for the hidden \
                         ones.'";
        assert!(check(&candidate(translate, french), &VerifierChecks::default()).is_empty());
        assert_eq!(
            codes(&check(&candidate(Q, GOOD), &policy)),
            ["wrong_language"]
        );
    }

    #[test]
    fn a_policy_regex_must_match() {
        let checks = VerifierChecks {
            regex: Some(r"`ls[^`]*`".into()),
            ..VerifierChecks::default()
        };
        assert!(check(&candidate(Q, GOOD), &checks).is_empty());
        let other = "Open the file manager and look at the folder.";
        assert_eq!(codes(&check(&candidate(Q, other), &checks)), ["regex"]);
    }

    #[test]
    fn disabled_checks_do_not_run() {
        let none = VerifierChecks {
            non_empty: false,
            not_truncated: false,
            no_degenerate_repetition: false,
            ..VerifierChecks::default()
        };
        assert!(check(&candidate(Q, ""), &none).is_empty());
        let looped = "The ls command lists files. ".repeat(12);
        assert!(check(&candidate(Q, &looped), &none).is_empty());
    }

    #[test]
    fn yes_share_normalises_over_the_scored_tokens() {
        let scored = [(1, 0.5f32.ln()), (2, 0.1f32.ln()), (3, 0.1f32.ln())];
        assert!((yes_share(&scored, &[1]) - 0.5 / 0.7).abs() < 1e-6);
        assert!((yes_share(&scored, &[1, 2]) - 0.6 / 0.7).abs() < 1e-6);
        assert_eq!(yes_share(&[], &[1]), 0.5);
    }

    #[test]
    fn passages_are_the_first_real_sentences() {
        let answer = "Sure! Use ls to list them. It takes -a for hidden files.\nls -la\nDone.";
        assert_eq!(
            passages(answer, 8),
            ["Use ls to list them.", "It takes -a for hidden files."]
        );
        assert_eq!(passages(answer, 1), ["Use ls to list them."]);
    }

    #[test]
    fn json_answers_are_read_as_their_values() {
        assert_eq!(
            prose(r#"{"city": "Paris", "first_year": 508, "tags": ["capital"]}"#),
            "city. Paris. first year. 508. tags. capital"
        );
        assert_eq!(prose("Paris."), "Paris.");
    }

    #[test]
    fn cosine_of_parallel_orthogonal_and_zero_vectors() {
        assert!((cosine(&[1.0, 2.0], &[2.0, 4.0]) - 1.0).abs() < 1e-6);
        assert_eq!(cosine(&[1.0, 0.0], &[0.0, 1.0]), 0.0);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 1.0]), 0.0);
    }
}
