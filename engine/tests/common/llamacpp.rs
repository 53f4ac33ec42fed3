//! Our logits against a table of llama.cpp's (`scripts/llamacpp-logits.py`): see
//! `llamacpp_logits.rs` for what the table holds and what is required of us.

use serde::Deserialize;

use super::reference::{log_softmax_f64, Ours};

/// One greedy step of llama.cpp's: the token it chose (or was made to take) and its top-5
/// log-probabilities.
#[derive(Deserialize)]
pub struct Step {
    pub token: u32,
    pub top: Vec<(u32, f32)>,
}

/// One prompt of a table: its tokens and llama.cpp's steps with its attention both ways (a
/// table's entries hold it flattened, beside what the prompt was made from).
#[derive(Deserialize)]
pub struct Case {
    pub tokens: Vec<u32>,
    pub steps: Vec<Step>,
    pub steps_flash_attn_off: Vec<Step>,
}

/// Differences of log-probability over the tokens both lists hold.
fn spread<'a>(a: &'a Step, b: &'a Step) -> impl Iterator<Item = f32> + 'a {
    a.top.iter().filter_map(move |&(t, lp)| {
        b.top
            .iter()
            .find(|&&(u, _)| u == t)
            .map(|&(_, other)| (lp - other).abs())
    })
}

/// How much further from llama.cpp than its own two attention paths are from each other we may
/// be, as factors of their spread.
pub struct Margins {
    /// On the steps whose top-1 differs from llama.cpp's: their number, and the largest lead
    /// llama.cpp's top-1 had there.
    pub top1: f32,
    /// On the top-5 log-probabilities' differences: mean and 95th percentile.
    pub logprobs: f32,
    /// On their maximum.
    pub max_logprob: f32,
}

/// Runs each case's prompt and llama.cpp's continuation through `ours` in one forward, and
/// requires llama.cpp's top-1 at every step except numerical ties and the top-5
/// log-probabilities close to llama.cpp's, both within `margins` of llama.cpp's own spread.
pub fn check<'a>(ours: &mut Ours, cases: impl IntoIterator<Item = &'a Case>, margins: Margins) {
    let (mut own, mut diffs, mut own_differ) = (Vec::new(), Vec::new(), Vec::new());
    let (mut agreed, mut differ) = (0, Vec::new());
    for (p, case) in cases.into_iter().enumerate() {
        let mut context = case.tokens.clone();
        context.extend(case.steps.iter().map(|s| s.token));
        context.pop();
        let logits = ours.all_logits(&context, 0);
        for (s, (step, off)) in case
            .steps
            .iter()
            .zip(&case.steps_flash_attn_off)
            .enumerate()
        {
            own.extend(spread(step, off));
            let gap = step.top[0].1 - step.top[1].1;
            if step.top[0].0 != off.top[0].0 {
                own_differ.push(gap);
            }
            let lp = log_softmax_f64(&logits[case.tokens.len() - 1 + s]);
            diffs.extend(step.top.iter().map(|&(t, l)| (lp[t as usize] - l).abs()));
            let ours_top = (0..lp.len())
                .max_by(|&a, &b| lp[a].total_cmp(&lp[b]))
                .unwrap();
            if ours_top as u32 == step.top[0].0 {
                agreed += 1;
            } else {
                differ.push((p, s, gap));
            }
        }
    }
    let max = |v: &[f32]| v.iter().copied().fold(0f32, f32::max);
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
    let p95 = |v: &[f32]| {
        let mut v = v.to_vec();
        v.sort_by(f32::total_cmp);
        v[v.len() * 95 / 100]
    };
    let gaps: Vec<f32> = differ.iter().map(|d| d.2).collect();
    eprintln!(
        "vs llama.cpp: top-1 differs at {} of {} steps, at gaps up to {:.3} (llama.cpp's own two \
         paths: {}, up to {:.3}); top-5 log-probability difference mean {:.4} p95 {:.3} max {:.3} \
         (llama.cpp's own: {:.4} {:.3} {:.3})",
        differ.len(),
        agreed + differ.len(),
        max(&gaps),
        own_differ.len(),
        max(&own_differ),
        mean(&diffs),
        p95(&diffs),
        max(&diffs),
        mean(&own),
        p95(&own),
        max(&own)
    );
    for &(p, s, gap) in &differ {
        assert!(
            gap <= margins.top1 * max(&own_differ),
            "prompt {p} step {s}: llama.cpp's top-1 leads by {gap}"
        );
    }
    assert!(
        differ.len() as f32 <= margins.top1 * own_differ.len() as f32,
        "top-1 differs too often"
    );
    for (name, stat, margin) in [
        ("mean", &mean as &dyn Fn(&[f32]) -> f32, margins.logprobs),
        ("p95", &p95, margins.logprobs),
        ("max", &max, margins.max_logprob),
    ] {
        assert!(
            stat(&diffs) <= margin * stat(&own),
            "{name} difference beyond llama.cpp's own spread"
        );
    }
}
