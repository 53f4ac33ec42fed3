#!/usr/bin/env python3
"""Agent runs against any OpenAI-compatible server on this machine (standard library only).

The same workload as `swarmgate loadgen --scenario tool-agents`: RUNS agent runs start together;
each makes TURNS streamed chat calls one after another: a call with tools (tool_choice auto, as
agent frameworks send it), a tool pause drawn from a log-normal distribution (median --pause-median-secs, spread
--pause-sigma), then the next call with the tool's result appended; the last call answers in
text. Prints job completion time and follow-up time-to-first-token percentiles, the prefix-cache
hit ratio and the tokens follow-ups computed again, as JSON.

    python3 loadtests/tool_agents.py --base-url http://127.0.0.1:8080 --runs 24 --turns 6
"""

import argparse
import json
import math
import random
import threading
import time
import urllib.parse
import http.client

TASKS = [
    "Find why the nightly build of the billing service fails and propose a fix.",
    "Check which customers were charged twice in March and draft a refund plan.",
    "Locate the slow query behind the dashboard timeouts and suggest an index.",
    "Review the retry logic in the upload client and list what could lose data.",
]
SYSTEM = ("You are a software agent. Work step by step: call one tool at a time, read its result, "
          "then decide the next step. When you have enough, answer briefly.")
WORDS = "service request latency error deploy commit query index cache timeout retry customer".split()
TOOLS = [{"type": "function", "function": {
    "name": name, "description": description,
    "parameters": {"type": "object", "properties": {param: {"type": "string"}}, "required": [param],
                   "additionalProperties": False}}}
    for name, description, param in [
        ("search_code", "Search the repository for a text.", "query"),
        ("read_logs", "Read the service's recent logs.", "service"),
        ("run_query", "Run a read-only SQL query.", "sql")]]


def local(url):
    host = urllib.parse.urlsplit(url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"refusing to load {host}: only a server on this machine")
    return urllib.parse.urlsplit(url)


def call(target, key, run_id, body, timeout):
    """One streamed chat call: (ttft_s, e2e_s, usage, cached, content, calls)."""
    conn = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=timeout)
    headers = {"content-type": "application/json", "x-swarmgate-run-id": run_id}
    if key:
        headers["authorization"] = f"Bearer {key}"
    sent = time.monotonic()
    conn.request("POST", target.path.rstrip("/") + "/v1/chat/completions", json.dumps(body), headers)
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {response.read()[:300]!r}")
    ttft, usage, cache_n, content, calls, done = None, None, None, "", {}, False
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        cache_n = (chunk.get("timings") or {}).get("cache_n", cache_n)
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if (delta.get("content") or delta.get("tool_calls")) and ttft is None:
                ttft = time.monotonic() - sent
            content += delta.get("content") or ""
            for c in delta.get("tool_calls") or []:
                entry = calls.setdefault(c.get("index", 0), ["", "", ""])
                entry[0] = c.get("id") or entry[0]
                function = c.get("function") or {}
                entry[1] += function.get("name") or ""
                entry[2] += function.get("arguments") or ""
    conn.close()
    if not done or usage is None:
        raise RuntimeError("the stream ended without [DONE] or usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cache_n or 0)
    e2e = time.monotonic() - sent
    return ttft or e2e, e2e, usage, cached, content, [calls[i] for i in sorted(calls)]


def run(args, i, results):
    rng = random.Random(args.seed * 1_000_003 + i)
    run_id = f"tool-agents-py-{args.seed}-{i}"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASKS[i % len(TASKS)]}]
    started, turns = time.monotonic(), []
    try:
        for t in range(args.turns):
            last = t + 1 == args.turns
            body = {"model": args.model, "messages": messages, "tools": TOOLS,
                    "tool_choice": "none" if last else "auto", "max_tokens": args.max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            if args.speculative_prefill and not last:
                body["swarmgate"] = {"speculative_prefill": True}
            ttft, e2e, usage, cached, content, calls = call(args.target, args.api_key, run_id, body, args.timeout)
            turns.append({"ttft": ttft, "prompt": usage["prompt_tokens"],
                          "completion": usage["completion_tokens"], "cached": cached})
            if last:
                break
            result = lambda: " ".join(rng.choice(WORDS) for _ in range(args.tool_result_words))
            if calls:
                messages.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": c[0], "type": "function", "function": {"name": c[1], "arguments": c[2]}}
                    for c in calls]})
                messages += [{"role": "tool", "tool_call_id": c[0], "content": result()} for c in calls]
            else:
                messages += [{"role": "assistant", "content": content}, {"role": "user", "content": result()}]
            time.sleep(min(600.0, args.pause_median_secs * math.exp(args.pause_sigma * rng.gauss(0, 1))))
        results[i] = {"jct": time.monotonic() - started, "turns": turns}
    except Exception as e:  # a failed run is reported, not fatal
        results[i] = {"error": f"turn {len(turns) + 1}: {e}", "turns": turns}


def percentile(values, p):
    values = sorted(values)
    return values[max(1, math.ceil(p / 100 * len(values))) - 1] if values else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8080")
    p.add_argument("--api-key")
    p.add_argument("--model", default="default")
    p.add_argument("--runs", type=int, default=24)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--pause-median-secs", type=float, default=1.0)
    p.add_argument("--pause-sigma", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--tool-result-words", type=int, default=120)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--speculative-prefill", action="store_true",
                   help="ask swarmgate to prefill each follow-up while the tools run")
    args = p.parse_args()
    args.target = local(args.base_url)
    results = [None] * args.runs
    threads = [threading.Thread(target=run, args=(args, i, results)) for i in range(args.runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in results if "error" not in r]
    turns = [t for r in results for t in r["turns"]]
    follow = [t["ttft"] for r in results for t in r["turns"][1:]]
    recomputed = sum(max(0, a["prompt"] + a["completion"] - b["cached"])
                     for r in results for a, b in zip(r["turns"], r["turns"][1:]))
    prompt = sum(t["prompt"] for t in turns)
    print(json.dumps({
        "completed_runs": len(done), "failed_runs": args.runs - len(done),
        "errors": [r["error"] for r in results if "error" in r][:3],
        "jct_s": {"p50": percentile([r["jct"] for r in done], 50), "p95": percentile([r["jct"] for r in done], 95)},
        "followup_ttft_s": {"p50": percentile(follow, 50), "p95": percentile(follow, 95)},
        "prefix_hit_ratio": sum(t["cached"] for t in turns) / prompt if prompt else 0.0,
        "recomputed_tokens": recomputed,
    }, indent=2))


if __name__ == "__main__":
    main()
