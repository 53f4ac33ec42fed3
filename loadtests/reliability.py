#!/usr/bin/env python3
"""Reliability probes: try a running Swarmgate server as a hostile or unlucky client would.

    python3 loadtests/reliability.py --base-url http://127.0.0.1:8080 --api-key KEY \
        [--pid PID] [--quick] [--admission-bound N] [--kill-pid PID] [PROBE ...]

Probes (default: every one that applies; `worker-loss` only with `--kill-pid`):

- disconnects: streams cut at random points (before the answer, mid-stream, mid-body); the KV
  blocks in use and the running and waiting sequences must come back to their baseline.
- overload: ten times the admission bound (`--admission-bound`: the server's
  `--max-concurrent-requests` plus `--max-queued-requests`) at once; only 200, 429 and 503, and
  every 200 complete; RSS flat.
- fuzz: mutated bodies on every POST route of the server's `/openapi.json` (a sweep of edge
  values over every numeric property, then random mutations: wrong types, huge lists, deep
  nesting, invalid UTF-8, broken JSON); no 5xx but 503 and 504, no dropped connection, no hang,
  and a normal request is answered afterwards.
- slowloris: sockets trickling a request's headers; `/health` stays fast (p50/p99) and the
  server closes every trickling socket within the probe's window (`--slowloris-secs`).
- auth: every operation of the OpenAPI document with no key, wrong keys and malformed
  `Authorization` headers; 401 with an error envelope, except the operations the document
  declares public (no `security`), which must not fail with 5xx.
- worker-loss: gateway mode; streams under load while the worker `--kill-pid` is SIGKILLed;
  nothing hangs, and only requests that had already streamed may end in error.

Each probe prints one verdict line on stdout (`NAME PASS|FAIL|SKIP key=value ...`); examples of
failures go to stderr. The exit code is 1 when any probe failed. Every request has a timeout and
every probe a bounded count, so a run always ends. Figures read from `/metrics`:
`swarmgate_kv_blocks{tier="device",state="used"}`, `swarmgate_running_sequences`,
`swarmgate_waiting_sequences`; RSS from /proc/PID/status with `--pid`. Only loopback addresses
are accepted. Standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import resource
import signal
import socket
import statistics
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Callable

from reliability_cases import Case, edge_sweep, mutate, operations, post_routes
from reliability_client import (
    Dropped,
    Exchange,
    Reply,
    Snapshot,
    SseReader,
    StreamOutcome,
    Target,
    complete_answer,
    fmt,
    parse_metrics,
    post_json,
    request,
    rss_mb,
    KV_USED,
    RUNNING,
    WAITING,
)


@dataclass
class Verdict:
    name: str
    passed: bool | None  # None: the probe does not apply
    figures: dict[str, object]
    examples: list[str] = field(default_factory=list)

    def line(self) -> str:
        word = "SKIP" if self.passed is None else "PASS" if self.passed else "FAIL"
        return " ".join([self.name, word] + [f"{k}={v}" for k, v in self.figures.items()])


@dataclass
class Probes:
    target: Target
    pid: int | None
    quick: bool
    rng: random.Random
    admission_bound: int
    slowloris_secs: float
    kill_pid: int | None
    rss_slack_mb: float
    model: str = "default"
    spec: dict | None = None

    def size(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    async def snapshot(self) -> Snapshot:
        kv = running = waiting = None
        try:
            reply = await request(self.target, "GET", "/metrics", timeout=10)
            if reply.status == 200:
                series = parse_metrics(reply.body.decode("utf-8", "replace"))

                def get(name_labels):
                    name, labels = name_labels
                    return series.get((name, frozenset(labels.items())))

                kv, running, waiting = get(KV_USED), get(RUNNING), get(WAITING)
        except (Dropped, asyncio.TimeoutError):
            pass
        return Snapshot(rss_mb(self.pid), kv, running, waiting)

    async def settle(self, baseline: Snapshot, bound: float) -> tuple[Snapshot, float | None]:
        """Polls until the gauges are back to `baseline`; the last snapshot and the time taken
        (None when they never came back within `bound`)."""
        start = time.monotonic()
        while True:
            now = await self.snapshot()
            if now.settled_to(baseline):
                return now, time.monotonic() - start
            if time.monotonic() - start > bound:
                return now, None
            await asyncio.sleep(0.25)

    def gauges(self, before: Snapshot, after: Snapshot) -> dict[str, str]:
        return {
            "rss_mb": f"{fmt(before.rss_mb)}->{fmt(after.rss_mb)}",
            "kv_used": f"{fmt(before.kv_used)}->{fmt(after.kv_used)}",
            "running": f"{fmt(before.running)}->{fmt(after.running)}",
            "waiting": f"{fmt(before.waiting)}->{fmt(after.waiting)}",
        }

    def rss_flat(self, before: Snapshot, after: Snapshot) -> bool:
        if before.rss_mb is None or after.rss_mb is None:
            return True
        return after.rss_mb - before.rss_mb <= self.rss_slack_mb

    def chat(self, stream: bool, max_tokens: int, text: str = "Count from one to twenty.") -> dict:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
        }
        if stream:
            body["stream"] = True
        return body

    async def engine_answers(self) -> int | str:
        """The status of one ordinary chat request, or how it failed."""
        try:
            reply = await post_json(self.target, "/v1/chat/completions", self.chat(False, 4), timeout=60)
        except Dropped as e:
            return f"dropped({e})"
        except asyncio.TimeoutError:
            return "timeout"
        return reply.status if reply.status != 200 or complete_answer(reply, False) else "incomplete"

    # ---------------------------------------------------------------------------- disconnects

    async def disconnects(self) -> Verdict:
        total = self.size(300, 48)
        # Within the admission bound, so that the cut streams are running ones, not refusals.
        concurrency = self.admission_bound
        body = json.dumps(self.chat(True, 64)).encode()
        before = await self.snapshot()
        cuts = {"mid_body": 0, "before_head": 0, "after_head": 0, "mid_stream": 0}
        statuses: dict[str, int] = {}
        refused = 0
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            nonlocal refused
            async with gate:
                kind = self.rng.choice(list(cuts))
                try:
                    exchange = await Exchange.open(self.target)
                except OSError:
                    refused += 1
                    return
                try:
                    if kind == "mid_body":
                        await exchange.send(self.target, "POST", "/v1/chat/completions", body,
                                            body_cut=self.rng.randrange(1, len(body)))
                        await asyncio.sleep(self.rng.uniform(0, 0.2))
                    else:
                        await exchange.send(self.target, "POST", "/v1/chat/completions", body)
                        if kind == "before_head":
                            await asyncio.sleep(self.rng.uniform(0, 0.3))
                        else:
                            await asyncio.wait_for(self.cut_stream(exchange, kind), 60)
                            statuses[str(exchange.status)] = statuses.get(str(exchange.status), 0) + 1
                except (Dropped, asyncio.TimeoutError):
                    pass
                finally:
                    cuts[kind] += 1
                    exchange.close()

        start = time.monotonic()
        await asyncio.gather(*(one() for _ in range(total)))
        after, settle = await self.settle(before, bound=30)
        passed = settle is not None and refused == 0
        figures = {
            "streams": total,
            "refused_connections": refused,
            "cuts": ",".join(f"{k}:{v}" for k, v in cuts.items()),
            "cut_statuses": ",".join(f"{k}:{v}" for k, v in sorted(statuses.items())),
            "wall_s": f"{time.monotonic() - start:.1f}",
            "settled_s": "never(30s)" if settle is None else f"{settle:.1f}",
        }
        figures.update(self.gauges(before, after))
        return Verdict("disconnects", passed, figures)

    async def cut_stream(self, exchange: Exchange, kind: str) -> None:
        await exchange.read_head()
        if kind == "after_head":
            return
        stop_after = self.rng.randrange(1, 40)
        events = 0
        sse = SseReader()
        async for piece in exchange.pieces():
            events += len(sse.feed(piece))
            if events >= stop_after:
                return

    # ---------------------------------------------------------------------------- overload

    async def overload(self) -> Verdict:
        count = 10 * self.admission_bound
        before = await self.snapshot()
        statuses: dict[str, int] = {}
        incomplete = 0
        examples = []
        start_line = asyncio.Event()

        async def one(i: int) -> None:
            nonlocal incomplete
            stream = i % 2 == 0
            body = json.dumps(self.chat(stream, 16)).encode()
            try:
                exchange = await Exchange.open(self.target)
            except OSError as e:
                statuses["refused"] = statuses.get("refused", 0) + 1
                examples.append(f"connect: {e}")
                return
            try:
                await start_line.wait()
                await exchange.send(self.target, "POST", "/v1/chat/completions", body)
                await asyncio.wait_for(exchange.read_head(), 120)
                reply = Reply(exchange.status, exchange.headers, await asyncio.wait_for(exchange.read_body(), 120))
                key = str(reply.status)
                if reply.status == 200 and not complete_answer(reply, stream):
                    incomplete += 1
                    examples.append(f"incomplete 200 (stream={stream}): {reply.body[-200:]!r}")
            except Dropped as e:
                key = "dropped"
                examples.append(f"dropped: {e}")
            except asyncio.TimeoutError:
                key = "timeout"
            finally:
                exchange.close()
            statuses[key] = statuses.get(key, 0) + 1

        start = time.monotonic()
        tasks = [asyncio.create_task(one(i)) for i in range(count)]
        await asyncio.sleep(0.5)  # every connection open before any request goes out
        start_line.set()
        await asyncio.gather(*tasks)
        after, settle = await self.settle(before, bound=30)
        allowed = {"200", "429", "503"}
        bad = sum(n for status, n in statuses.items() if status not in allowed)
        passed = bad == 0 and incomplete == 0 and statuses.get("200", 0) > 0 and self.rss_flat(before, after)
        figures = {
            "requests": count,
            "statuses": ",".join(f"{k}:{v}" for k, v in sorted(statuses.items())),
            "incomplete_200": incomplete,
            "failures": bad + incomplete,
            "wall_s": f"{time.monotonic() - start:.1f}",
            "settled_s": "never(30s)" if settle is None else f"{settle:.1f}",
        }
        figures.update(self.gauges(before, after))
        return Verdict("overload", passed, figures, examples[:5])

    # ---------------------------------------------------------------------------- fuzz

    async def fuzz(self) -> Verdict:
        spec = await self.openapi()
        if spec is None:
            return Verdict("fuzz", False, {"error": "no /openapi.json"})
        routes = post_routes(spec)
        cases = list(edge_sweep(routes))
        total = max(self.size(3000, 600), len(cases))
        while len(cases) < total:
            path, base, _ = self.rng.choice(routes)
            cases.append(mutate(self.rng, path, base))
        # Within the admission bound, so that the bodies reach the validators and the engine
        # instead of a 503 at the door.
        concurrency = min(8, self.admission_bound)
        timeout = self.size(30, 20)
        before = await self.snapshot()
        counts: dict[str, int] = {}
        failures: list[str] = []
        gate = asyncio.Semaphore(concurrency)

        async def one(case: Case) -> None:
            async with gate:
                try:
                    reply = await request(self.target, "POST", case.path, case.body, timeout=timeout)
                    key = str(reply.status)
                    bad = reply.status >= 500 and reply.status not in (503, 504)
                    detail = reply.body[:160]
                except Dropped as e:
                    key, bad, detail = "dropped", True, str(e).encode()
                except asyncio.TimeoutError:
                    key, bad, detail = "timeout", True, f"no answer in {timeout}s".encode()
                counts[key] = counts.get(key, 0) + 1
                if bad:
                    failures.append(f"{key} {case.path} {case.what}: {detail!r}")

        start = time.monotonic()
        await asyncio.gather(*(one(case) for case in cases))
        engine = await self.engine_answers()
        after, settle = await self.settle(before, bound=30)
        passed = not failures and engine == 200
        figures = {
            "requests": len(cases),
            "routes": len(routes),
            "failures": len(failures),
            "statuses": ",".join(f"{k}:{v}" for k, v in sorted(counts.items())),
            "engine_after": engine,
            "wall_s": f"{time.monotonic() - start:.1f}",
            "settled_s": "never(30s)" if settle is None else f"{settle:.1f}",
        }
        figures.update(self.gauges(before, after))
        return Verdict("fuzz", passed, figures, failures[:10])

    async def openapi(self) -> dict | None:
        if self.spec is None:
            try:
                reply = await request(self.target, "GET", "/openapi.json", timeout=10)
                if reply.status == 200:
                    self.spec = reply.json()
            except (Dropped, asyncio.TimeoutError, json.JSONDecodeError):
                return None
        return self.spec

    # ---------------------------------------------------------------------------- slowloris

    async def slowloris(self) -> Verdict:
        sockets = self.size(300, 100)
        window = self.slowloris_secs
        closed_at: list[float | None] = [None] * sockets
        opened = 0
        latencies: list[float] = []
        health_failures = 0
        start = time.monotonic()
        stop = asyncio.Event()

        async def trickle(i: int) -> None:
            nonlocal opened
            try:
                reader, writer = await asyncio.open_connection(self.target.host, self.target.port)
            except OSError:
                return
            opened += 1
            try:
                writer.write(f"GET /health HTTP/1.1\r\nHost: {self.target.host}\r\n".encode())
                await writer.drain()
                while not stop.is_set():
                    # One byte of a never-ending header a second; a read that ends means the
                    # server closed the socket.
                    writer.write(b"X")
                    await writer.drain()
                    try:
                        data = await asyncio.wait_for(reader.read(4096), 1.0)
                        if not data:
                            closed_at[i] = time.monotonic() - start
                            return
                        # An answer (408, 400) then close is a close too: read on to the end.
                    except asyncio.TimeoutError:
                        pass
            except (ConnectionError, OSError):
                closed_at[i] = time.monotonic() - start
            finally:
                writer.close()

        async def watch_health() -> None:
            nonlocal health_failures
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    reply = await request(self.target, "GET", "/health", timeout=10)
                    if reply.status != 200:
                        health_failures += 1
                except (Dropped, asyncio.TimeoutError):
                    health_failures += 1
                latencies.append((time.monotonic() - t0) * 1000)
                await asyncio.sleep(0.1)

        async def all_closed() -> None:
            while any(c is None for c in closed_at[:opened]) or opened < sockets:
                await asyncio.sleep(0.25)

        tasks = [asyncio.create_task(trickle(i)) for i in range(sockets)]
        health = asyncio.create_task(watch_health())
        try:
            await asyncio.wait_for(all_closed(), window)
        except asyncio.TimeoutError:
            pass
        stop.set()
        await asyncio.gather(*tasks, health)
        closed = [c for c in closed_at if c is not None]
        p50 = statistics.median(latencies) if latencies else None
        p99 = percentile(latencies, 0.99)
        health_ok = health_failures == 0 and p99 is not None and p99 < 500
        passed = opened == sockets and len(closed) == sockets and health_ok
        figures = {
            "sockets": sockets,
            "opened": opened,
            "closed_by_server": f"{len(closed)}/{sockets}",
            "close_s_max": f"{max(closed):.1f}" if closed else "n/a",
            "window_s": f"{window:.0f}",
            "health_requests": len(latencies),
            "health_failures": health_failures,
            "health_p50_ms": fmt(p50),
            "health_p99_ms": fmt(p99),
        }
        return Verdict("slowloris", passed, figures)

    # ---------------------------------------------------------------------------- auth

    async def auth(self) -> Verdict:
        key = self.target.api_key
        if not key:
            return Verdict("auth", None, {"reason": "no --api-key: the server's keys are unknown"})
        spec = await self.openapi()
        if spec is None:
            return Verdict("auth", False, {"error": "no /openapi.json with the key"})
        try:
            control = (await request(self.target, "GET", "/v1/models", timeout=10)).status
        except (Dropped, asyncio.TimeoutError):
            control = 0
        if control != 200:
            return Verdict("auth", False, {"error": f"the given key gets {control} on /v1/models"})
        variants: list[tuple[str, list[tuple[str, str]]]] = [
            ("none", []),
            ("wrong", [("Authorization", "Bearer sk-not-a-key")]),
            ("prefix", [("Authorization", f"Bearer {key[:-1]}")]),
            ("suffix", [("Authorization", f"Bearer {key}x")]),
            ("empty_bearer", [("Authorization", "Bearer")]),
            ("bearer_space", [("Authorization", "Bearer ")]),
            ("basic", [("Authorization", "Basic dXNlcjpwYXNz")]),
            ("no_scheme", [("Authorization", "sk-not-a-key")]),
            ("long", [("Authorization", "Bearer " + "k" * 8000)]),
            ("non_ascii", [("Authorization", "Bearer \udcff\udcfe-key")]),
            ("twice", [("Authorization", "Bearer sk-not-a-key"), ("Authorization", "Bearer sk-not-a-key-2")]),
        ]
        tried = failures = public = 0
        examples = []
        for path, method, operation in operations(spec):
            is_public = operation.get("security", spec.get("security")) in (None, [])
            concrete = "/".join("probe" if p.startswith("{") else p for p in path.split("/"))
            body = b"{}" if method in ("post", "put", "patch") else None
            for name, headers in variants:
                tried += 1
                try:
                    reply = await request(self.target, method.upper(), concrete, body, headers=headers, timeout=10)
                    status = reply.status
                    envelope = status == 401 and is_error_envelope(reply)
                except (Dropped, asyncio.TimeoutError) as e:
                    status, envelope = type(e).__name__, False
                if is_public:
                    public += 1
                    ok = isinstance(status, int) and status < 500 or status == 503
                else:
                    ok = envelope
                if not ok:
                    failures += 1
                    examples.append(f"{method.upper()} {path} ({name}): {status}")
        figures = {
            "requests": tried,
            "operations": len(list(operations(spec))),
            "public_checked": public,
            "failures": failures,
        }
        return Verdict("auth", failures == 0, figures, examples[:10])

    # ---------------------------------------------------------------------------- worker-loss

    async def worker_loss(self) -> Verdict:
        if self.kill_pid is None:
            return Verdict("worker-loss", None, {"reason": "no --kill-pid"})
        total = self.size(200, 60)
        concurrency = 16
        kill_after = total // 4
        body = json.dumps(self.chat(True, 32)).encode()
        finished = 0
        killed_at: float | None = None
        results: list[tuple[str, float | None, float]] = []  # outcome, first content, sent
        gate = asyncio.Semaphore(concurrency)
        bound = 90.0

        async def one() -> None:
            nonlocal finished, killed_at
            async with gate:
                sent = time.monotonic()
                first: float | None = None
                outcome = "complete"
                try:
                    exchange = await Exchange.open(self.target)
                except OSError:
                    results.append(("refused", None, sent))
                    return
                try:

                    async def read() -> str:
                        nonlocal first
                        await exchange.send(self.target, "POST", "/v1/chat/completions", body)
                        await exchange.read_head()
                        if exchange.status != 200:
                            return f"http_{exchange.status}"
                        stream = StreamOutcome()
                        sse = SseReader()
                        async for piece in exchange.pieces():
                            for data in sse.feed(piece):
                                stream.take(data)
                                if stream.content_chunks and first is None:
                                    first = time.monotonic()
                        return "complete" if stream.complete else "stream_error"

                    outcome = await asyncio.wait_for(read(), bound)
                except Dropped:
                    outcome = "dropped"
                except asyncio.TimeoutError:
                    outcome = "hung"
                finally:
                    exchange.close()
                results.append((outcome, first, sent))
                finished += 1
                if finished == kill_after and killed_at is None:
                    os.kill(self.kill_pid, signal.SIGKILL)
                    killed_at = time.monotonic()

        start = time.monotonic()
        await asyncio.gather(*(one() for _ in range(total)))
        counts: dict[str, int] = {}
        unstarted_failed = 0
        for outcome, first, sent in results:
            counts[outcome] = counts.get(outcome, 0) + 1
            # Content already out cannot be taken back, so such a request may end in error; the
            # dead worker's last batches can reach the client just after the kill, so "out"
            # means received before the failure, not before the kill.
            if outcome != "complete" and first is None:
                unstarted_failed += 1
        hung = counts.get("hung", 0)
        passed = killed_at is not None and hung == 0 and unstarted_failed == 0
        figures = {
            "requests": total,
            "killed": self.kill_pid if killed_at is not None else "no",
            "outcomes": ",".join(f"{k}:{v}" for k, v in sorted(counts.items())),
            "hung": hung,
            "failed_not_started": unstarted_failed,
            "wall_s": f"{time.monotonic() - start:.1f}",
        }
        return Verdict("worker-loss", passed, figures)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def is_error_envelope(reply: Reply) -> bool:
    try:
        error = reply.json().get("error")
    except (json.JSONDecodeError, AttributeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str)


# --------------------------------------------------------------------------------------------


def parse_target(base_url: str, api_key: str | None) -> Target:
    url = urllib.parse.urlsplit(base_url)
    if url.scheme != "http" or not url.hostname:
        raise SystemExit(f"--base-url must be http://HOST:PORT, not {base_url!r}")
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(url.hostname)).is_loopback
    except (OSError, ValueError):
        loopback = False
    if not loopback:
        raise SystemExit(f"reliability probes run against this machine only, not {url.hostname}")
    return Target(url.hostname, url.port or 80, api_key)


PROBE_NAMES = ["auth", "fuzz", "disconnects", "overload", "slowloris", "worker-loss"]


async def main_async(args) -> int:
    target = parse_target(args.base_url, args.api_key)
    probes = Probes(
        target=target,
        pid=args.pid,
        quick=args.quick,
        rng=random.Random(args.seed),
        admission_bound=args.admission_bound,
        slowloris_secs=args.slowloris_secs or (20 if args.quick else 60),
        kill_pid=args.kill_pid,
        rss_slack_mb=args.rss_slack_mb,
    )
    try:
        models = (await request(target, "GET", "/v1/models", timeout=10)).json()
        probes.model = models["data"][0]["id"]
    except (Dropped, asyncio.TimeoutError, json.JSONDecodeError, KeyError, IndexError, TypeError):
        pass
    run: dict[str, Callable] = {
        "auth": probes.auth,
        "fuzz": probes.fuzz,
        "disconnects": probes.disconnects,
        "overload": probes.overload,
        "slowloris": probes.slowloris,
        "worker-loss": probes.worker_loss,
    }
    chosen = args.probes or [p for p in PROBE_NAMES if p != "worker-loss" or args.kill_pid is not None]
    failed = False
    for name in chosen:
        verdict = await run[name]()
        print(verdict.line(), flush=True)
        for example in verdict.examples:
            print(f"  {name}: {example}", file=sys.stderr)
        failed |= verdict.passed is False
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probes", nargs="*", metavar="PROBE",
                        help=f"probes to run, in order: {', '.join(PROBE_NAMES)}")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080")
    parser.add_argument("--api-key", default=os.environ.get("SWARMGATE_PROBE_API_KEY"))
    parser.add_argument("--pid", type=int, help="the server's process id, for its RSS")
    parser.add_argument("--quick", action="store_true", help="short versions (about a minute in all, when nothing hangs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--admission-bound", type=int, default=8,
                        help="the server's --max-concurrent-requests plus --max-queued-requests")
    parser.add_argument("--slowloris-secs", type=float,
                        help="how long trickling sockets may stay open (default 60, quick 20)")
    parser.add_argument("--kill-pid", type=int, help="worker-loss: the worker process to SIGKILL")
    parser.add_argument("--rss-slack-mb", type=float, default=64, help="RSS growth still called flat")
    args = parser.parse_args()
    unknown = [p for p in args.probes if p not in PROBE_NAMES]
    if unknown:
        parser.error(f"unknown probe {', '.join(unknown)} (known: {', '.join(PROBE_NAMES)})")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
