//! The shared-prefix scenario: what automatic prefix caching saves on an agent workload.
//!
//! The workload is what a gateway for agents sees: a few agents, each behind a long system
//! prompt of its own, answering many short single-turn questions, plus multi-turn conversations
//! in which every turn resends the whole history (system prompt, earlier questions and the
//! answers the model actually gave) with the new question. Single-turn requests cycle through
//! the agents; conversations start spread among them. A conversation's turns run in order on one
//! client; `--concurrency` clients run sessions (a single-turn request or a whole conversation)
//! closed loop, as the sweep does.
//!
//! The same workload, in the same order, runs twice in one invocation: on an engine with prefix
//! caching on, then on a fresh one with it off. Decoding is greedy, so both runs generate the
//! same answers (a difference is reported: it would mean the cache changes what the model says).
//!
//! Reported per run: time to first token p50/p95, prompt tokens the engine computed (cached ones
//! are not), prompt tokens served from the prefix cache, prefix hits copied back from the host
//! tier (tokens), and blocks swapped out to the host tier and back by preemption.

mod roles;

use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, ensure, Result};
use engine::{
    ChatMessage, EngineConfig, EngineHandle, GenerateRequest, KvSnapshot, Prompt, SamplingParams,
};
use indicatif::ProgressBar;
use serde::Serialize;

use self::roles::{AgentScript, AGENTS};
use super::{closed_loop, stream_request, ttft_p50_p95, wait_until_idle, BenchArgs, Outcome};
use crate::commands::progress_bar;

const SCENARIO: &str = "shared-prefix";
const DEFAULT_CONCURRENCY: usize = 4;
/// Short answers keep the two runs to minutes on a CPU; prefill is what this scenario measures.
const DEFAULT_MAX_TOKENS: usize = 32;
const DEFAULT_SINGLE_TURNS: usize = 48;

pub(super) fn run(args: &BenchArgs) -> Result<()> {
    let concurrency = match args.concurrency[..] {
        [] => DEFAULT_CONCURRENCY,
        [c] => c,
        _ => bail!("--scenario shared-prefix runs at one concurrency level"),
    };
    let max_tokens = args.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let workload = Workload::build(
        args.agents,
        args.requests.unwrap_or(DEFAULT_SINGLE_TURNS),
        args.conversations.unwrap_or(args.agents),
    )?;
    let bar = progress_bar(2 * workload.num_requests(), "requests")?;
    let mut runs = Vec::with_capacity(2);
    let mut system_tokens = (0, 0);
    for prefix_cache in [true, false] {
        bar.set_message(format!("prefix cache {:<3}", on_off(prefix_cache)));
        let config = EngineConfig {
            prefix_cache,
            ..args.engine.clone()
        };
        // Dropped at the end of the iteration, before the next engine allocates its KV cache.
        let engine = EngineHandle::start(&config)?;
        // Either engine will do: both load the same model.
        system_tokens = workload.system_prompt_tokens(&engine)?;
        runs.push(run_once(
            &engine,
            prefix_cache,
            &workload,
            concurrency,
            max_tokens,
            &bar,
        )?);
    }
    bar.finish_and_clear();
    let [on, off] = &runs[..] else {
        unreachable!("two runs")
    };
    let differing = on
        .replies
        .iter()
        .zip(&off.replies)
        .filter(|(a, b)| a != b)
        .count();
    if differing > 0 {
        eprintln!(
            "note: {differing} of {} answers differ between the runs; greedy decoding should \
             not depend on the prefix cache",
            on.replies.len()
        );
    }
    if args.json {
        for run in &runs {
            println!("{}", serde_json::to_string(&run.report)?);
        }
        return Ok(());
    }
    let conversation_turns = workload.num_requests() - workload.num_single_turns();
    println!(
        "{SCENARIO}: {} agents (system prompts {}-{} tokens), {} single-turn requests and {} \
         conversations ({conversation_turns} turns), concurrency {concurrency}, at most \
         {max_tokens} tokens per answer",
        workload.agents.len(),
        system_tokens.0,
        system_tokens.1,
        workload.num_single_turns(),
        workload.num_conversations(),
    );
    print_table(&on.report, &off.report);
    Ok(())
}

/// One run's figures; the first eight JSON keys are part of the tool's interface.
#[derive(Debug, Serialize)]
struct RunReport {
    scenario: &'static str,
    prefix_cache: bool,
    ttft_p50_ms: f64,
    ttft_p95_ms: f64,
    /// Prompt tokens the engine computed; those served from the cache are not.
    prefill_tokens: u64,
    /// Prompt tokens whose cached KV blocks were copied back from the host tier.
    host_hits: u64,
    /// Blocks copied to the host tier by preemption, and back.
    swaps_out: u64,
    swaps_in: u64,
    /// Blocks copied between the tiers (host hits and swaps, either way), and their time.
    copied_blocks: u64,
    copy_ms: f64,
    requests: usize,
    prompt_tokens: u64,
    /// Prompt tokens served from the prefix cache, by the requests' own usage.
    cached_tokens: u64,
    /// Prompt tokens whose cached KV blocks were still on the device (the engine's count).
    device_hits: u64,
    wall_s: f64,
}

fn print_table(on: &RunReport, off: &RunReport) {
    println!(
        "{:>12} {:>11} {:>11} {:>14} {:>13} {:>18} {:>18} {:>17} {:>20}",
        "prefix cache",
        "TTFT p50 ms",
        "TTFT p95 ms",
        "prefill tokens",
        "cached tokens",
        "host hits (tokens)",
        "swaps out (blocks)",
        "swaps in (blocks)",
        "copies (blocks, ms)"
    );
    for r in [on, off] {
        println!(
            "{:>12} {:>11.1} {:>11.1} {:>14} {:>13} {:>18} {:>18} {:>17} {:>20}",
            on_off(r.prefix_cache),
            r.ttft_p50_ms,
            r.ttft_p95_ms,
            r.prefill_tokens,
            r.cached_tokens,
            r.host_hits,
            r.swaps_out,
            r.swaps_in,
            format!("{}, {:.1}", r.copied_blocks, r.copy_ms)
        );
    }
    println!(
        "on/off: TTFT p50 {:.2}x, prefill tokens {:.2}x",
        on.ttft_p50_ms / off.ttft_p50_ms,
        on.prefill_tokens as f64 / off.prefill_tokens as f64
    );
}

fn on_off(enabled: bool) -> &'static str {
    if enabled {
        "on"
    } else {
        "off"
    }
}

/// A run's report and every answer it generated, in workload order.
struct Run {
    report: RunReport,
    replies: Vec<String>,
}

fn run_once(
    engine: &EngineHandle,
    prefix_cache: bool,
    workload: &Workload,
    concurrency: usize,
    max_tokens: usize,
    bar: &ProgressBar,
) -> Result<Run> {
    let before = Counters::read(engine);
    let sessions = Mutex::new(Vec::with_capacity(workload.sessions.len()));
    let started = Instant::now();
    closed_loop(workload.sessions.len(), concurrency, |i| {
        let session = &workload.sessions[i];
        let agent = &workload.agents[session.agent];
        let outcomes = run_session(engine, agent, session, max_tokens, bar)?;
        sessions.lock().expect("not poisoned").push((i, outcomes));
        Ok(())
    })?;
    let wall_s = started.elapsed().as_secs_f64();
    wait_until_idle(engine);
    let after = Counters::read(engine);
    let mut sessions = sessions.into_inner().expect("not poisoned");
    sessions.sort_by_key(|&(i, _)| i);
    let outcomes: Vec<Outcome> = sessions.into_iter().flat_map(|(_, o)| o).collect();
    let (ttft_p50_ms, ttft_p95_ms) = ttft_p50_p95(&outcomes);
    let kv = |f: fn(&KvSnapshot) -> u64| f(&after.kv) - f(&before.kv);
    let report = RunReport {
        scenario: SCENARIO,
        prefix_cache,
        ttft_p50_ms,
        ttft_p95_ms,
        prefill_tokens: after.prefill_tokens - before.prefill_tokens,
        host_hits: kv(|s| s.counters.host_hit_tokens),
        swaps_out: kv(|s| s.counters.swapped_out_blocks),
        swaps_in: kv(|s| s.counters.swapped_in_blocks),
        copied_blocks: after.copied_blocks - before.copied_blocks,
        copy_ms: (after.copy_nanos - before.copy_nanos) as f64 / 1e6,
        requests: outcomes.len(),
        prompt_tokens: outcomes.iter().map(|o| o.usage.prompt_tokens as u64).sum(),
        cached_tokens: outcomes.iter().map(|o| o.usage.cached_tokens as u64).sum(),
        device_hits: kv(|s| s.counters.device_hit_tokens),
        wall_s,
    };
    let replies = outcomes.into_iter().map(|o| o.text).collect();
    Ok(Run { report, replies })
}

/// Runs a session's turns in order, each with the whole conversation so far.
fn run_session(
    engine: &EngineHandle,
    agent: &AgentScript,
    session: &Session,
    max_tokens: usize,
    bar: &ProgressBar,
) -> Result<Vec<Outcome>> {
    let mut transcript = Transcript::new(agent.system);
    let mut outcomes = Vec::with_capacity(session.turns.len());
    for turn in &session.turns {
        let prompt = engine
            .model()
            .encode_chat(transcript.ask(turn), true)?
            .tokens;
        let request = GenerateRequest {
            sampling: SamplingParams::greedy(),
            max_tokens,
            ..GenerateRequest::new(Prompt::Tokens(prompt))
        };
        let outcome = stream_request(engine, request, |_| {})?;
        transcript.answer(&outcome.text);
        bar.inc(1);
        outcomes.push(outcome);
    }
    Ok(outcomes)
}

/// The engine's cumulative counters that a run reports the change of.
struct Counters {
    prefill_tokens: u64,
    copied_blocks: u64,
    copy_nanos: u64,
    kv: KvSnapshot,
}

impl Counters {
    fn read(engine: &EngineHandle) -> Self {
        use std::sync::atomic::Ordering::Relaxed;
        let stats = engine.stats();
        Self {
            prefill_tokens: stats.prefill_tokens.load(Relaxed),
            copied_blocks: stats.copied_blocks.load(Relaxed),
            copy_nanos: stats.copy_nanos.load(Relaxed),
            kv: stats.kv(),
        }
    }
}

/// A client's unit of work: user turns sent to one agent in order. A single-turn request is a
/// session of one turn.
#[derive(Debug)]
struct Session {
    /// Index into [`Workload::agents`].
    agent: usize,
    turns: Vec<&'static str>,
}

/// The whole scenario, in the order clients take it.
struct Workload {
    agents: &'static [AgentScript],
    sessions: Vec<Session>,
}

impl Workload {
    /// `single_turns` questions cycling through the first `agents` agents, and the scripted
    /// conversations of the first `conversations` agents, spread evenly among the questions so
    /// that they overlap with them rather than run back to back.
    fn build(agents: usize, single_turns: usize, conversations: usize) -> Result<Self> {
        ensure!(
            (1..=AGENTS.len()).contains(&agents),
            "--agents must be between 1 and {}",
            AGENTS.len()
        );
        ensure!(
            conversations <= agents,
            "--conversations: at most one per agent ({agents})"
        );
        ensure!(
            single_turns + conversations > 0,
            "nothing to run: --requests and --conversations are both 0"
        );
        let agents = &AGENTS[..agents];
        let conversation = |k: usize| Session {
            agent: k,
            turns: agents[k].conversation.to_vec(),
        };
        let mut sessions = Vec::with_capacity(single_turns + conversations);
        let mut started = 0;
        for i in 0..single_turns {
            while started < conversations && started * single_turns / conversations <= i {
                sessions.push(conversation(started));
                started += 1;
            }
            let agent = i % agents.len();
            let questions = agents[agent].questions;
            sessions.push(Session {
                agent,
                turns: vec![questions[(i / agents.len()) % questions.len()]],
            });
        }
        sessions.extend((started..conversations).map(conversation));
        Ok(Self { agents, sessions })
    }

    /// Requests in all: one per turn.
    fn num_requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }

    fn num_single_turns(&self) -> usize {
        self.sessions.iter().filter(|s| s.turns.len() == 1).count()
    }

    fn num_conversations(&self) -> usize {
        self.sessions.len() - self.num_single_turns()
    }

    /// The shortest and the longest system prompt, in the model's tokens.
    fn system_prompt_tokens(&self, engine: &EngineHandle) -> Result<(usize, usize)> {
        let tokenizer = &engine.model().tokenizer;
        let mut lengths = Vec::with_capacity(self.agents.len());
        for agent in self.agents {
            let encoding = tokenizer
                .encode(agent.system, false)
                .map_err(anyhow::Error::msg)?;
            lengths.push(encoding.len());
        }
        let min = lengths.iter().copied().min().unwrap_or(0);
        Ok((min, lengths.into_iter().max().unwrap_or(0)))
    }
}

/// A conversation as the client keeps it: every request carries all of it.
struct Transcript {
    messages: Vec<ChatMessage>,
}

impl Transcript {
    fn new(system: &str) -> Self {
        Self {
            messages: vec![ChatMessage::new("system", system)],
        }
    }

    /// Adds the user's turn; returns the messages to send.
    fn ask(&mut self, question: &str) -> &[ChatMessage] {
        self.messages.push(ChatMessage::new("user", question));
        &self.messages
    }

    /// Adds the answer the model gave, for the next turn to resend.
    fn answer(&mut self, reply: &str) {
        self.messages.push(ChatMessage::new("assistant", reply));
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::{Transcript, Workload, AGENTS};

    #[test]
    fn default_workload_has_the_documented_shape() {
        let w = Workload::build(4, 48, 4).unwrap();
        assert_eq!(w.agents.len(), 4);
        assert_eq!(w.sessions.len(), 52);
        assert_eq!(w.num_single_turns(), 48);
        assert_eq!(w.num_conversations(), 4);
        let conversation_turns: usize = AGENTS[..4].iter().map(|a| a.conversation.len()).sum();
        assert_eq!(w.num_requests(), 48 + conversation_turns);
    }

    #[test]
    fn single_turns_cycle_through_the_agents_without_repeating_a_question() {
        let w = Workload::build(4, 48, 0).unwrap();
        let agents: Vec<usize> = w.sessions.iter().map(|s| s.agent).collect();
        assert_eq!(agents, (0..48).map(|i| i % 4).collect::<Vec<_>>());
        let questions: HashSet<&str> = w.sessions.iter().map(|s| s.turns[0]).collect();
        assert_eq!(questions.len(), 48);
        for s in &w.sessions {
            assert!(AGENTS[s.agent].questions.contains(&s.turns[0]));
        }
    }

    #[test]
    fn conversations_keep_their_turn_order_and_start_spread_out() {
        let w = Workload::build(4, 48, 4).unwrap();
        let positions: Vec<usize> = (0..w.sessions.len())
            .filter(|&i| w.sessions[i].turns.len() > 1)
            .collect();
        assert_eq!(positions, [0, 13, 26, 39]);
        for (k, &p) in positions.iter().enumerate() {
            let s = &w.sessions[p];
            assert_eq!(s.agent, k);
            assert_eq!(s.turns, AGENTS[k].conversation);
        }
    }

    #[test]
    fn conversations_without_single_turns_still_run() {
        let w = Workload::build(2, 0, 2).unwrap();
        assert_eq!(w.num_conversations(), 2);
        assert_eq!(w.num_single_turns(), 0);
    }

    #[test]
    fn out_of_range_sizes_are_refused() {
        assert!(Workload::build(0, 48, 0).is_err());
        assert!(Workload::build(AGENTS.len() + 1, 48, 0).is_err());
        assert!(Workload::build(2, 48, 3).is_err());
        assert!(Workload::build(2, 0, 0).is_err());
    }

    #[test]
    fn agents_have_distinct_long_system_prompts_and_multi_turn_conversations() {
        let prompts: HashSet<&str> = AGENTS.iter().map(|a| a.system).collect();
        assert_eq!(prompts.len(), AGENTS.len());
        for a in &AGENTS {
            // A few hundred tokens: roughly 250 to 400 English words.
            let words = a.system.split_whitespace().count();
            assert!((250..=400).contains(&words), "{words} words");
            assert!(a.questions.len() >= 12);
            assert!((3..=4).contains(&a.conversation.len()));
        }
    }

    #[test]
    fn each_turn_resends_the_whole_conversation() {
        let mut t = Transcript::new("be brief");
        assert_eq!(t.ask("first?").len(), 2);
        t.answer("one");
        let sent: Vec<(&str, &str)> = t
            .ask("second?")
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(
            sent,
            [
                ("system", "be brief"),
                ("user", "first?"),
                ("assistant", "one"),
                ("user", "second?")
            ]
        );
    }
}
