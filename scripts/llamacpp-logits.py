#!/usr/bin/env python3
"""Writes the table of llama.cpp's next-token log-probabilities that engine/tests/llamacpp_logits.rs
compares Swarmgate's against: for 20 chat prompts on SmolLM2-135M-Instruct.Q4_1.gguf, llama.cpp's
prompt tokens, its greedy continuation (12 tokens) and its top-5 log-probabilities at each step,
with its attention run both ways (flash attention on, its default here, and off): the spread
between the two is llama.cpp's own numerical noise, the yardstick for the test's tolerance.

With `gemma3` after the server's path it writes the same table for gemma-3-270m-q4_k_m.gguf
(engine/tests/gemma3_logits.rs): a base model whose GGUF has no chat template, so its prompts
are plain texts, tokenized by llama.cpp with BOS.

Run by hand when the model or the prompts change, never by `make test` (it needs llama.cpp's
`llama-server`, built by `../shared/peer/build-llama-server.sh` or any llama.cpp build):

    python3 scripts/llamacpp-logits.py PATH/TO/llama-server > engine/tests/fixtures/llamacpp_logits.json
    python3 scripts/llamacpp-logits.py PATH/TO/llama-server gemma3 > engine/tests/fixtures/llamacpp_gemma3_logits.json

It serves the model on 127.0.0.1 only, CPU, 2 threads, `--no-repack` (the repacked AMX path dies
with an illegal instruction on some VMs), no prompt cache.
"""

import json
import pathlib
import sys

from llamacpp_server import Server, version

ROOT = pathlib.Path(__file__).resolve().parent.parent
GEMMA3 = len(sys.argv) > 2 and sys.argv[2] == "gemma3"
MODEL = ROOT / "models" / ("gemma-3-270m-q4_k_m.gguf" if GEMMA3 else "SmolLM2-135M-Instruct.Q4_1.gguf")
PORT = 18091
STEPS = 12

PROMPTS = [
    [("user", "Hi!")],
    [("user", "What is the capital of France?")],
    [("system", "You are a terse assistant. Answer in one line."), ("user", "Name three primary colours.")],
    [("user", "Write a haiku about the sea.")],
    [("user", "How many legs does a spider have?")],
    [("user", "Translate 'good morning' into Spanish.")],
    [("user", "What is 12 times 7?")],
    [("user", "Give me a synonym for 'happy'.")],
    [("user", "Write a Python function that returns the square of a number.")],
    [("user", "Explain in one sentence what photosynthesis is.")],
    [("system", "You reply only with JSON."), ("user", "Return an object with a field name set to Ada.")],
    [("user", "List the days of the week.")],
    [("user", "Who wrote Romeo and Juliet?")],
    [("user", "What should I pack for a weekend hiking trip?")],
    [("user", "Summarise: The meeting moved from Tuesday to Thursday because the room was booked.")],
    [("user", "Is a tomato a fruit or a vegetable?")],
    [("user", "Suggest a name for a grey cat.")],
    [("user", "What does HTTP stand for?")],
    [
        ("user", "Write a haiku about the sea."),
        ("assistant", "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."),
        ("user", "Now one about mountains."),
    ],
    [("user", "My order #4471 has not arrived after ten days. Draft a two-line polite complaint.")],
]

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: How many legs does a spider have?\nAnswer:",
    "The three primary colours are red,",
    "<start_of_turn>user\nWhat is 12 times 7?<end_of_turn>\n<start_of_turn>model\n",
    "Photosynthesis is the process by which",
    '{"name": "Ada", "born": 1815, "known_for": "',
    "Translate to Spanish: good morning ->",
    "Here is a note from a customer: I ordered a blue kettle on Monday, paid for express shipping, "
    "and it still has not arrived. The tracking page has said label created for four days. "
    "A polite reply:",
    # Over 1,000 tokens: the sliding-window layers (512 positions) no longer see the start.
    "".join(f"Day {i}: the market sold {i * 7 % 13} apples and {i * 5 % 11} pears. " for i in range(1, 61))
    + "Day 61: the market sold",
]


def serve(server, flash_attn):
    return Server(server, MODEL, PORT, ["--no-repack", "-c", "4096", "-np", "1", "--jinja", "-fa", flash_attn])


def steps(server, tokens, forced=None):
    """Top-5 log-probabilities at each of STEPS greedy steps; along `forced` tokens if given."""
    out = []
    context = list(tokens)
    for i in range(STEPS):
        body = {"prompt": context, "n_predict": 1, "n_probs": 5, "temperature": 0, "cache_prompt": False}
        prob = server.post("/completion", body)["completion_probabilities"][0]
        top = [[t["id"], t["logprob"]] for t in prob["top_logprobs"]]
        token = forced[i] if forced else prob["id"]
        out.append({"token": token, "top": top})
        context.append(token)
    return out


def main():
    binary = sys.argv[1]
    table = []
    server = serve(binary, "on")
    try:
        for item in TEXTS if GEMMA3 else PROMPTS:
            if GEMMA3:
                entry = {"text": item}
                body = {"content": item, "add_special": True, "parse_special": True}
            else:
                entry = {"messages": [{"role": r, "content": c} for r, c in item]}
                text = server.post("/apply-template", entry)["prompt"]
                body = {"content": text, "parse_special": True}
            entry["tokens"] = server.post("/tokenize", body)["tokens"]
            entry["steps"] = steps(server, entry["tokens"])
            table.append(entry)
    finally:
        server.stop()
    server = serve(binary, "off")
    try:
        for entry in table:
            forced = [s["token"] for s in entry["steps"]]
            entry["steps_flash_attn_off"] = steps(server, entry["tokens"], forced)
    finally:
        server.stop()
    json.dump(
        {
            "llama_cpp": version(binary),
            "model": MODEL.name,
            "flags": "-t 2 --no-repack -c 4096 -np 1 --jinja; steps with -fa on, steps_flash_attn_off with -fa off",
            "prompts": table,
        },
        sys.stdout,
        indent=1,
    )
    print()


if __name__ == "__main__":
    main()
