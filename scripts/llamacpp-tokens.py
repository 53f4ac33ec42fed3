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
import subprocess
import sys
import time
import urllib.request

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


def post(path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{PORT}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


def main():
    server = sys.argv[1]
    proc = subprocess.Popen(
        [server, "-m", str(MODEL), "--host", "127.0.0.1", "--port", str(PORT), "-t", "2", "-c", "1024", "-np", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            sys.exit("llama-server did not start")
        table = []
        for text in TEXTS:
            tokens = post("/tokenize", {"content": text, "add_special": False, "parse_special": True})["tokens"]
            decoded = post("/detokenize", {"tokens": tokens})["content"]
            table.append({"text": text, "tokens": tokens, "decoded": decoded})
    finally:
        proc.kill()
        proc.wait()
    version = subprocess.run([server, "--version"], capture_output=True, text=True)
    json.dump(
        {
            "llama_cpp": (version.stdout + version.stderr).strip().splitlines()[-2:],
            "model": MODEL.name,
            "texts": table,
        },
        sys.stdout,
        indent=1,
        ensure_ascii=False,
    )
    print()


if __name__ == "__main__":
    main()
