#!/usr/bin/env python3
"""Writes the table of llama.cpp's tokenizations that engine/tests/gemma_tokenizer.rs compares
Swarmgate's Gemma 3 tokenizer (SentencePiece-style, built from the GGUF's vocabulary and scores)
against: for each text below, the token ids llama.cpp gives (`/tokenize`, special tokens parsed,
no BOS) and the text its `/detokenize` makes of them.

Run by hand when the model or the texts change, never by `make test` (it needs llama.cpp's
`llama-server`, built by `../shared/peer/build-llama-server.sh` or any llama.cpp build):

    python3 scripts/llamacpp-tokens.py PATH/TO/llama-server > engine/tests/fixtures/gemma3_tokens.json

It serves the model on 127.0.0.1 only, CPU, 2 threads.
"""

import json
import pathlib
import sys

from llamacpp_server import Server, version

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
PORT = 18092

TEXTS = [
    "Hello, world!",
    "What is the capital of France?",
    " leading space",
    "two  spaces and   three",
    "trailing spaces   ",
    "line one\nline two\n\nparagraph\n\n\n\nfour newlines",
    "\ttab\t\tthen two",
    "def square(x):\n    return x * x\n",
    "fn main() {\n\tlet v = vec![1, 2, 3];\n\tprintln!(\"{v:?}\");\n}\n",
    '{"name": "search_code", "arguments": {"query": "fn main"}}',
    "Prices: 3.14, 1,000,000 and 2026-12-07 at 09:30.",
    "Ünïcödé façade, naïve café, Straße, ½ ≠ ∞",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji: 🙂🚀👩‍💻 and a rare one: 𓀀",
    "control\u0001bytes\u007fand\u200bzero width",
    "<start_of_turn>user\nWhat is 12 times 7?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a literal bos<eos>",
    "not special: <start_of_turn without the bracket, [multimodal] and <unused0>",
    "A" * 40 + " " + "ab" * 30,
    "The quick brown fox jumps over the lazy dog. " * 4,
    "",
]


def main():
    binary = sys.argv[1]
    server = Server(binary, MODEL, PORT, ["-c", "1024", "-np", "1"])
    try:
        table = []
        for text in TEXTS:
            body = {"content": text, "add_special": False, "parse_special": True}
            tokens = server.post("/tokenize", body)["tokens"]
            decoded = server.post("/detokenize", {"tokens": tokens})["content"]
            table.append({"text": text, "tokens": tokens, "decoded": decoded})
    finally:
        server.stop()
    json.dump(
        {"llama_cpp": version(binary), "model": MODEL.name, "texts": table},
        sys.stdout,
        indent=1,
        ensure_ascii=False,
    )
    print()


if __name__ == "__main__":
    main()
