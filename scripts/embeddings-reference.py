#!/usr/bin/env python3
"""Writes the reference embeddings that engine/tests/embeddings.rs compares Swarmgate's against:
sentence-transformers' own output for all-MiniLM-L6-v2 on a few sentences, as JSON on stdout.

Run by hand when the model or the sentences change, never by `make test` (it needs torch):

    python3 -m venv /tmp/st-venv
    /tmp/st-venv/bin/pip install sentence-transformers
    /tmp/st-venv/bin/python scripts/embeddings-reference.py > engine/tests/fixtures/minilm_reference.json

It reads the model from models/all-MiniLM-L6-v2 (`make models`) and never goes online. The
sentences: a short plain one, one with accents, an emoji and Japanese (normalisation and
word-piece splitting beyond ASCII), and one longer than the model's 256 word pieces (truncation).
"""

import json
import os
import pathlib
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import sentence_transformers  # noqa: E402
import torch  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "all-MiniLM-L6-v2"

LONG = " ".join(
    [
        "The gateway receives requests from many agents at once, each with its own system",
        "prompt, its own tools and its own budget of tokens.",
    ]
    + [
        f"Step {i}: the scheduler admits waiting sequences while the key-value cache has free"
        " blocks, prefills their prompts in chunks, and decodes every running sequence by one"
        " token, so that short answers are never stuck behind long ones."
        for i in range(1, 9)
    ]
)

SENTENCES = [
    "A man is playing a guitar on stage.",
    "Die Größe des Cafés überrascht: naïve Gäste bestellen Crème brûlée 🍮 und 東京の夜景はきれいです。",
    LONG,
]


def main() -> None:
    model = SentenceTransformer(str(MODEL), device="cpu")
    torch.set_num_threads(1)
    embeddings = model.encode(SENTENCES, convert_to_numpy=True, batch_size=1)
    tokens = [
        int(model.preprocess([s])["attention_mask"].sum()) for s in SENTENCES
    ]
    json.dump(
        {
            "model": MODEL.name,
            "produced_by": {
                "script": "scripts/embeddings-reference.py",
                "sentence_transformers": sentence_transformers.__version__,
                "torch": torch.__version__,
            },
            "max_seq_length": model.max_seq_length,
            "items": [
                {
                    "text": text,
                    "tokens": count,
                    # float() widens each float32 exactly; JSON then prints every digit it needs.
                    "embedding": [float(x) for x in vector],
                }
                for text, count, vector in zip(SENTENCES, tokens, embeddings)
            ],
        },
        sys.stdout,
        ensure_ascii=False,
        indent=1,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
