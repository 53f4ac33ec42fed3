//! The fuzz targets on stable, without libFuzzer: each replays its corpus (`corpus/NAME/`),
//! then feeds it mutations (bit flips, cuts, repeats, splices between inputs, edge values
//! spliced in) for a bounded time: `SWARMGATE_FUZZ_SECS` seconds per target (default 2; CI's
//! bounded run uses 30), from the seed `SWARMGATE_FUZZ_SEED` (default: the clock; printed, so a
//! run can be repeated). An input that fails is written under `target/fuzz-failures/` for
//! `cargo fuzz run NAME FILE` or this test to replay, and the test fails naming it.

use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Text the mutator splices in: edge values and JSON fragments a byte flip rarely reaches.
const DICTIONARY: &[&str] = &[
    "0",
    "-0",
    "1e-40",
    "-1e-40",
    "1e308",
    "-1e308",
    "1e999",
    "\"NaN\"",
    "NaN",
    "-1",
    "2147483648",
    "9223372036854775807",
    "18446744073709551616",
    "null",
    "true",
    "[]",
    "{}",
    "\"\"",
    "\"\\ud800\"",
    "\"\\u0000\"",
    "[[[[[[[[",
    "]]]]]]]]",
    "{\"type\":\"json_schema\"",
    "\"temperature\":",
    "\"top_p\":",
    "\"min_p\":",
    "\"max_tokens\":",
    "\"n\":",
    "\"stop\":",
    "\"logprobs\":",
    "\"top_logprobs\":",
    "\"tools\":",
    "\"tool_choice\":",
    "\"messages\":",
    "\"role\":\"tool\"",
    "\"content\":",
    "<|im_start|>",
    "{\"tool_calls\": [",
    "{\"response\": ",
    "{\"name\": \"",
    "\", \"arguments\": ",
    "\\\"",
    "\u{10ffff}",
];

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a corpus entry").path())
        .collect();
    paths.sort();
    let inputs: Vec<Vec<u8>> = paths
        .iter()
        .map(|p| std::fs::read(p).expect("a corpus file"))
        .collect();
    assert!(!inputs.is_empty(), "{} holds no input", dir.display());
    inputs
}

fn mutate(rng: &mut StdRng, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut data = inputs[rng.random_range(0..inputs.len())].clone();
    for _ in 0..rng.random_range(1..=4) {
        let at = rng.random_range(0..=data.len());
        match rng.random_range(0..7) {
            0 if !data.is_empty() => {
                let i = rng.random_range(0..data.len());
                data[i] ^= 1 << rng.random_range(0..8);
            }
            1 => data.insert(at, rng.random()),
            2 if at < data.len() => {
                let end = rng.random_range(at..=data.len().min(at + 16));
                data.drain(at..end);
            }
            3 if at < data.len() => {
                let end = rng.random_range(at..=data.len().min(at + 64));
                let repeated = data[at..end].repeat(rng.random_range(2..64));
                data.splice(at..at, repeated);
            }
            4 => {
                let other = &inputs[rng.random_range(0..inputs.len())];
                let from = rng.random_range(0..=other.len());
                data.truncate(at);
                data.extend_from_slice(&other[from..]);
            }
            5 if !data.is_empty() => data[0] = rng.random(),
            _ => {
                let word = DICTIONARY[rng.random_range(0..DICTIONARY.len())];
                data.splice(at..at, word.bytes());
            }
        }
    }
    data
}

/// Runs `target` on `input`; on a panic, keeps the input and fails naming its file.
fn run_one(name: &str, target: fn(&[u8]), input: &[u8]) {
    if panic::catch_unwind(AssertUnwindSafe(|| target(input))).is_ok() {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fuzz-failures");
    std::fs::create_dir_all(&dir).expect("a failures directory");
    let path = dir.join(format!("{name}-{:016x}", fnv(input)));
    std::fs::write(&path, input).expect("the failing input is kept");
    panic!(
        "fuzz target {name} failed on {} ({:?})",
        path.display(),
        String::from_utf8_lossy(input)
    );
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf29ce484222325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x100000001b3)
    })
}

fn fuzz(name: &str, target: fn(&[u8])) {
    let inputs = corpus(name);
    for input in &inputs {
        run_one(name, target, input);
    }
    let secs: f64 = std::env::var("SWARMGATE_FUZZ_SECS")
        .ok()
        .map(|s| {
            s.parse()
                .expect("SWARMGATE_FUZZ_SECS is a number of seconds")
        })
        .unwrap_or(2.0);
    let seed: u64 = std::env::var("SWARMGATE_FUZZ_SEED")
        .ok()
        .map(|s| s.parse().expect("SWARMGATE_FUZZ_SEED is an integer"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
    let mut rng = StdRng::seed_from_u64(seed);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut runs = 0u64;
    while Instant::now() < deadline {
        run_one(name, target, &mutate(&mut rng, &inputs));
        runs += 1;
    }
    eprintln!(
        "fuzz {name}: {} corpus inputs, {runs} mutations in {secs} s, SWARMGATE_FUZZ_SEED={seed}",
        inputs.len()
    );
}

#[test]
fn requests() {
    fuzz("requests", swarmgate_fuzz::requests);
}

#[test]
fn envelope() {
    fuzz("envelope", swarmgate_fuzz::envelope);
}
