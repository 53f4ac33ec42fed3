//! Fuzz targets: what a client controls, up to the point where the engine takes over.
//!
//! - [`requests`]: a body as the HTTP handlers read it ([`gateway::http::json::parse`]), then
//!   the route's validator (chat, text completions, embeddings, swarm routing, verification),
//!   against the real SmolLM2 tokenizer and chat template. The first byte picks the route; the
//!   rest is the body. Invariant: nothing panics, and every refusal is a 4xx (a client's input
//!   never maps to a server error).
//! - [`envelope`]: model output read back as tool calls by
//!   [`gateway::tool_calls::EnvelopeReader`]. Invariant: nothing panics, and the text read in
//!   pieces gives the same answer as read whole (call ids aside, which are random), with calls
//!   numbered from 0 and arguments only for calls that began.
//!
//! Each target runs under libFuzzer (`cargo +nightly fuzz run NAME --features libfuzzer`, with
//! its corpus in `corpus/NAME/`) and, on stable, in `tests/corpus.rs`, which replays the corpus
//! and mutates it for a bounded time.

use std::path::PathBuf;
use std::sync::OnceLock;

use engine::ModelInfo;
use gateway::api::embeddings::EmbeddingRequest;
use gateway::api::swarm::RouteRequest;
use gateway::api::verify::VerifyRequest;
use gateway::api::{completions::CompletionRequest, ChatCompletionRequest};
use gateway::http::json::parse;
use gateway::tool_calls::{EnvelopeReader, Piece};
use gateway::validate::completion::validate_completion;
use gateway::validate::embeddings::validate_embeddings;
use gateway::validate::structured::StructuredLimits;
use gateway::validate::swarm::validate_route;
use gateway::validate::validate_chat;
use gateway::validate::verify::validate_verify;
use gateway::ApiError;

/// The GGUF whose tokenizer and chat template the validators use (`make models` fetches it).
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The embedding model's id and width, as `swarmgate serve` reports them.
const EMBEDDING_MODEL: &str = "all-MiniLM-L6-v2";
const EMBEDDING_DIMENSIONS: usize = 384;

/// The routes [`requests`] exercises, in the order of the first byte (modulo their number).
pub const ROUTES: [&str; 5] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/swarm/route",
    "/v1/swarm/verify",
];

fn model() -> &'static ModelInfo {
    static MODEL_INFO: OnceLock<ModelInfo> = OnceLock::new();
    MODEL_INFO.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../models")
            .join(MODEL);
        assert!(
            path.is_file(),
            "{} is missing: run `make models`",
            path.display()
        );
        ModelInfo::load(&path).expect("the GGUF's metadata loads")
    })
}

/// One body on one route: parsed, then validated.
pub fn requests(data: &[u8]) {
    let Some((&route, body)) = data.split_first() else {
        return;
    };
    let limits = StructuredLimits::default();
    let outcome = match route as usize % ROUTES.len() {
        0 => parse::<ChatCompletionRequest>(body)
            .and_then(|r| validate_chat(r, model(), &limits).map(drop)),
        1 => parse::<CompletionRequest>(body)
            .and_then(|r| validate_completion(r, model(), &limits).map(drop)),
        2 => parse::<EmbeddingRequest>(body)
            .and_then(|r| validate_embeddings(r, EMBEDDING_MODEL, EMBEDDING_DIMENSIONS).map(drop)),
        3 => parse::<RouteRequest>(body).and_then(|r| validate_route(r).map(drop)),
        _ => parse::<VerifyRequest>(body).and_then(|r| validate_verify(r).map(drop)),
    };
    if let Err(error) = outcome {
        assert_client_error(&error, route, body);
    }
}

fn assert_client_error(error: &ApiError, route: u8, body: &[u8]) {
    assert!(
        error.status().is_client_error(),
        "{} answered {} to {:?}: {error:?}",
        ROUTES[route as usize % ROUTES.len()],
        error.status(),
        String::from_utf8_lossy(body),
    );
}

/// One answer read back as a tool-call envelope, whole and in pieces. The first byte holds the
/// reader's mode (bit 0: the response alternative is JSON; bit 1: the answer completed) and the
/// pieces' length in chars (bits 2-4, plus one); the rest is the answer's text.
pub fn envelope(data: &[u8]) {
    let Some((&flags, text)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(text);
    let json_response = flags & 1 == 1;
    let complete = flags & 2 == 2;
    let step = 1 + usize::from((flags >> 2) & 7);

    let whole = read(json_response, complete, [text.as_ref()]);
    let chars: Vec<char> = text.chars().collect();
    let pieces: Vec<String> = chars.chunks(step).map(|c| c.iter().collect()).collect();
    let pieced = read(json_response, complete, pieces.iter().map(String::as_str));
    assert_eq!(
        whole, pieced,
        "{text:?} read in pieces of {step} differs from read whole"
    );
    check_calls(&whole);
}

/// Everything a reader gives for `pieces`, neighbours of one kind joined and call ids blanked
/// after checking their shape.
fn read<'a>(
    json_response: bool,
    complete: bool,
    pieces: impl IntoIterator<Item = &'a str>,
) -> Vec<Piece> {
    let mut reader = EnvelopeReader::new(json_response);
    let mut out = Vec::new();
    for piece in pieces {
        out.extend(reader.push(piece));
    }
    out.extend(reader.finish(complete));
    normalise(out)
}

fn normalise(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for piece in pieces {
        match (out.last_mut(), piece) {
            (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
            (
                Some(Piece::Arguments { index, fragment }),
                Piece::Arguments {
                    index: next,
                    fragment: more,
                },
            ) if *index == next => fragment.push_str(&more),
            (_, Piece::Call { index, id, name }) => {
                assert!(
                    id.starts_with("call_") && id.len() > 5,
                    "call id {id:?} is not OpenAI's shape"
                );
                out.push(Piece::Call {
                    index,
                    id: String::new(),
                    name,
                });
            }
            (_, piece) => out.push(piece),
        }
    }
    out
}

/// Calls are numbered 0, 1, 2...; arguments belong to the latest call.
fn check_calls(pieces: &[Piece]) {
    let mut calls = 0;
    for piece in pieces {
        match piece {
            Piece::Call { index, .. } => {
                assert_eq!(*index, calls, "call numbered out of order in {pieces:?}");
                calls += 1;
            }
            Piece::Arguments { index, .. } => assert_eq!(
                *index + 1,
                calls,
                "arguments for a call that is not the latest in {pieces:?}"
            ),
            Piece::Content(_) => {}
        }
    }
}
