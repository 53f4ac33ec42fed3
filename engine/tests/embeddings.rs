//! Sentence embeddings on the real all-MiniLM-L6-v2 against sentence-transformers' own output
//! (`tests/fixtures/minilm_reference.json`, written by `scripts/embeddings-reference.py`), and
//! the properties callers rely on: similar sentences land close, and neither batching nor
//! padding changes a result.

use std::path::PathBuf;
use std::sync::LazyLock;

use engine::{Embedder, EmbedderConfig};
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    model: String,
    max_seq_length: usize,
    items: Vec<ReferenceItem>,
}

#[derive(Deserialize)]
struct ReferenceItem {
    text: String,
    tokens: usize,
    embedding: Vec<f32>,
}

fn embedder() -> &'static Embedder {
    static EMBEDDER: LazyLock<Embedder> = LazyLock::new(|| {
        let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/all-MiniLM-L6-v2");
        assert!(
            model.is_dir(),
            "{} is missing: run `make models`",
            model.display()
        );
        Embedder::load(&EmbedderConfig {
            model,
            threads: Some(1),
            ..EmbedderConfig::default()
        })
        .expect("the embedder loads")
    });
    &EMBEDDER
}

fn reference() -> Reference {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minilm_reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn embed(texts: &[&str]) -> Vec<Vec<f32>> {
    embedder()
        .embed(texts)
        .unwrap()
        .into_iter()
        .map(|e| e.vector)
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| p * q).sum::<f32>();
    dot(a, b) / (dot(a, a).sqrt() * dot(b, b).sqrt())
}

#[test]
fn matches_sentence_transformers() {
    let reference = reference();
    let embedder = embedder();
    assert_eq!(embedder.id(), reference.model);
    assert_eq!(embedder.dimensions(), 384);
    assert_eq!(embedder.max_tokens(), reference.max_seq_length);
    let texts: Vec<&str> = reference.items.iter().map(|i| i.text.as_str()).collect();
    // All at once: the short inputs are padded to the long one's 256 tokens.
    let ours = embedder.embed(&texts).unwrap();
    for (item, ours) in reference.items.iter().zip(&ours) {
        assert_eq!(ours.tokens, item.tokens, "word pieces of {:?}", item.text);
        let diff = max_abs_diff(&ours.vector, &item.embedding);
        eprintln!(
            "max |ours - sentence-transformers| = {diff:.2e} ({} tokens)",
            item.tokens
        );
        assert!(diff < 1e-4, "{diff} for {:?}", item.text);
    }
    assert_eq!(
        reference.items[2].tokens, reference.max_seq_length,
        "the long sentence is truncated"
    );
}

#[test]
fn truncation_drops_what_follows_the_limit() {
    let long = &reference().items[2].text;
    let longer = format!("{long} Whatever comes after the limit is never read.");
    let embeddings = embedder().embed(&[long.as_str(), &longer]).unwrap();
    assert_eq!(embeddings[1].tokens, embedder().max_tokens());
    assert!(max_abs_diff(&embeddings[0].vector, &embeddings[1].vector) < 1e-6);
}

#[test]
fn paraphrases_are_closer_than_unrelated_sentences() {
    let v = embed(&[
        "A man is playing a guitar.",
        "Someone is strumming a guitar.",
        "The central bank raised interest rates again.",
    ]);
    for vector in &v {
        let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "unit length, got {norm}");
    }
    let paraphrase = cosine(&v[0], &v[1]);
    let unrelated = cosine(&v[0], &v[2]);
    assert!(
        paraphrase > unrelated + 0.3,
        "paraphrase {paraphrase} vs unrelated {unrelated}"
    );
}

#[test]
fn a_batch_equals_each_input_alone() {
    let long = reference().items[2].text.clone();
    let texts = [
        "Route this question to the billing agent.",
        "hi",
        long.as_str(),
        "Ünïcödé and emoji 🚀 survive batching.",
        "Which agent knows about Kubernetes deployments and Helm charts?",
    ];
    let together = embedder().embed(&texts).unwrap();
    assert_eq!(together.len(), texts.len());
    for (text, batched) in texts.iter().zip(&together) {
        let alone = embedder().embed(&[*text]).unwrap().remove(0);
        assert_eq!(alone.tokens, batched.tokens);
        let diff = max_abs_diff(&alone.vector, &batched.vector);
        assert!(diff < 1e-5, "{diff} for {text:?}");
    }
    assert!(embedder().embed::<&str>(&[]).unwrap().is_empty());
}
