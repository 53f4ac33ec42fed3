//! Our sentence-embedding forward against candle-transformers' `BertModel` on the real
//! all-MiniLM-L6-v2: the oracle (the engine's device path for embeddings, run on the CPU) runs
//! the padded batch with an attention mask, then mean pooling and normalisation as
//! sentence-transformers does them. Every component must agree within 1e-4,
//! for inputs alone and in one ragged batch, short and long (truncated), ASCII or not.

use std::path::PathBuf;
use std::sync::LazyLock;

use candle_core::Device;
use engine::model::SentenceBert;

fn model_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/all-MiniLM-L6-v2");
    assert!(
        dir.is_dir(),
        "{} is missing: run `make models`",
        dir.display()
    );
    dir
}

fn ours() -> &'static SentenceBert {
    static MODEL: LazyLock<SentenceBert> =
        LazyLock::new(|| SentenceBert::load(&model_dir(), None).expect("the model loads"));
    &MODEL
}

/// candle-transformers' `BertModel` on the CPU: the batch padded to its longest member with an
/// attention mask, masked mean, `F.normalize` (what `--embedding-device` runs on a GPU).
fn oracle() -> &'static SentenceBert {
    static MODEL: LazyLock<SentenceBert> = LazyLock::new(|| {
        SentenceBert::load(&model_dir(), Some(&Device::Cpu)).expect("the model loads")
    });
    &MODEL
}

fn oracle_embed(batch: &[&[u32]]) -> Vec<Vec<f32>> {
    oracle().embed(batch).expect("the oracle embeds")
}

fn texts() -> Vec<String> {
    let paragraph = "The gateway routes each conversation to the agent whose description is \
        closest to it, verifies the answer, and escalates to a larger model when the verifier \
        rejects it twice. ";
    vec![
        "hello".into(),
        "Which agent knows about Kubernetes deployments and Helm charts?".into(),
        paragraph.repeat(12),
        "Ünïcödé, 日本語のテキスト, and emoji 🚀 — all in one sentence.".into(),
        "Refund my order #1234, please.".into(),
    ]
}

fn assert_close(ours: &[f32], oracle: &[f32], what: &str) {
    assert_eq!(ours.len(), oracle.len(), "{what}: dimensions");
    let diff = ours
        .iter()
        .zip(oracle)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| p * q).sum::<f32>();
    let cosine = dot(ours, oracle) / (dot(ours, ours).sqrt() * dot(oracle, oracle).sqrt());
    eprintln!("{what}: max |ours - candle| = {diff:.2e}, cosine {cosine:.7}");
    assert!(diff <= 1e-4, "{what}: max abs difference {diff}");
    assert!(cosine >= 0.9999, "{what}: cosine {cosine}");
}

#[test]
fn embeddings_match_candle_alone_and_in_a_ragged_batch() {
    let model = ours();
    let texts = texts();
    let tokens: Vec<Vec<u32>> = texts.iter().map(|t| model.tokenize(t).unwrap()).collect();
    assert_eq!(tokens[0].len(), 3, "one word piece between [CLS] and [SEP]");
    assert_eq!(
        tokens[2].len(),
        model.max_tokens(),
        "the paragraph is truncated"
    );
    let batch: Vec<&[u32]> = tokens.iter().map(Vec::as_slice).collect();

    let together = model.embed(&batch).unwrap();
    let oracle_together = oracle_embed(&batch);
    assert_eq!(together.len(), texts.len());
    for (i, text) in texts.iter().enumerate() {
        let alone = model.embed(&batch[i..i + 1]).unwrap().remove(0);
        let oracle_alone = oracle_embed(&batch[i..i + 1]).remove(0);
        let head: String = text.chars().take(24).collect();
        let what = format!("{} tokens, {head:?}", tokens[i].len());
        assert_close(&alone, &oracle_alone, &format!("alone: {what}"));
        assert_close(&together[i], &oracle_together[i], &format!("batch: {what}"));
        assert_eq!(alone, together[i], "batching changes nothing: {what}");
    }
}

#[test]
fn malformed_batches_are_refused() {
    let model = ours();
    assert!(model.embed(&[]).unwrap().is_empty());
    assert!(
        model.embed(&[&[101, 102], &[]]).is_err(),
        "an empty sequence"
    );
    assert!(
        model.embed(&[&[101, 1_000_000, 102]]).is_err(),
        "an id past the vocabulary"
    );
    let too_long = vec![101u32; 513];
    assert!(
        model.embed(&[&too_long]).is_err(),
        "more tokens than positions"
    );
}
