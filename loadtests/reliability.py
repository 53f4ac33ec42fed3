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
from typing import AsyncIterator, Callable

# --------------------------------------------------------------------------------------------
# A minimal HTTP/1.1 client on asyncio streams: one connection per request (`Connection:
# close`), raw bytes in and out, so that a probe can send invalid UTF-8, stop mid-body or cut a
# stream at any byte.
# --------------------------------------------------------------------------------------------


class Dropped(Exception):
    """The server closed or reset the connection before a whole response."""


@dataclass
class Target:
    host: str
    port: int
    api_key: str | None

    def auth(self) -> list[tuple[str, str]]:
        return [("Authorization", f"Bearer {self.api_key}")] if self.api_key else []


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


class Exchange:
    """One request on its own connection, read as it arrives."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.status = 0
        self.headers: dict[str, str] = {}

    @classmethod
    async def open(cls, target: Target) -> "Exchange":
        reader, writer = await asyncio.open_connection(target.host, target.port, limit=1 << 20)
        return cls(reader, writer)

    async def send(
        self,
        target: Target,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: list[tuple[str, str]] | None = None,
        body_cut: int | None = None,
    ) -> None:
        """Writes the request; with `body_cut`, only that many bytes of the body."""
        lines = [f"{method} {path} HTTP/1.1", f"Host: {target.host}:{target.port}", "Connection: close"]
        for name, value in headers if headers is not None else target.auth():
            lines.append(f"{name}: {value}")
        if body is not None:
            lines.append("Content-Type: application/json")
            lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "surrogateescape")
        payload = head + (body[:body_cut] if body is not None and body_cut is not None else body or b"")
        try:
            self.writer.write(payload)
            await self.writer.drain()
        except (ConnectionError, OSError):
            # The server may answer (413, 401) and close before reading a whole body: the
            # answer, not the write, tells whether the exchange went right.
            pass

    async def read_head(self) -> None:
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError) as e:
            raise Dropped(f"no response head ({type(e).__name__})") from e
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise Dropped(f"bad status line {lines[0]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                self.headers[name.strip().lower()] = value.strip()

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked transfer decoded)."""
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size_line = await self.reader.readuntil(b"\r\n")
                    size = int(size_line.split(b";")[0].strip(), 16)
                    if size == 0:
                        await self.reader.readuntil(b"\r\n")
                        return
                    data = await self.reader.readexactly(size + 2)
                    yield data[:-2]
            elif "content-length" in self.headers:
                length = int(self.headers["content-length"])
                if length:
                    yield await self.reader.readexactly(length)
            else:
                while data := await self.reader.read(65536):
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError, ValueError) as e:
            raise Dropped(f"body cut ({type(e).__name__})") from e

    async def read_body(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])

    def close(self) -> None:
        self.writer.close()


async def request(
    target: Target,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: list[tuple[str, str]] | None = None,
    timeout: float = 30.0,
) -> Reply:
    """One whole exchange. Raises `Dropped` or `asyncio.TimeoutError`."""

    async def run() -> Reply:
        try:
            exchange = await Exchange.open(target)
        except OSError as e:
            raise Dropped(f"connect: {e}") from e
        try:
            await exchange.send(target, method, path, body, headers)
            await exchange.read_head()
            return Reply(exchange.status, exchange.headers, await exchange.read_body())
        finally:
            exchange.close()

    return await asyncio.wait_for(run(), timeout)


def post_json(target: Target, path: str, value, timeout: float = 30.0):
    return request(target, "POST", path, json.dumps(value).encode(), timeout=timeout)


class SseReader:
    """Server-sent events out of body pieces: each `data:` payload, `[DONE]` included."""

    def __init__(self):
        self.buffer = b""

    def feed(self, piece: bytes) -> list[str]:
        self.buffer += piece
        events = []
        while b"\n\n" in self.buffer:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            for line in event.decode("utf-8", "replace").splitlines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
        return events


@dataclass
class StreamOutcome:
    """How a streamed chat answer ended."""

    done: bool = False
    finish_reasons: list = field(default_factory=list)
    content_chunks: int = 0
    error: bool = False

    def take(self, data: str) -> None:
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            self.error = True
            return
        if "error" in chunk:
            self.error = True
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                self.content_chunks += 1
            if choice.get("finish_reason"):
                self.finish_reasons.append(choice["finish_reason"])

    @property
    def complete(self) -> bool:
        return (
            self.done
            and not self.error
            and bool(self.finish_reasons)
            and all(reason in ("stop", "length", "tool_calls") for reason in self.finish_reasons)
        )


def complete_answer(reply: Reply, stream: bool) -> bool:
    """Whether a 200 carries a whole answer: a finished JSON completion, or a stream to `[DONE]`."""
    if stream:
        outcome = StreamOutcome()
        for data in SseReader().feed(reply.body + b"\n\n"):
            outcome.take(data)
        return outcome.complete
    try:
        choices = reply.json().get("choices") or []
    except (json.JSONDecodeError, AttributeError):
        return False
    return bool(choices) and all(c.get("finish_reason") in ("stop", "length", "tool_calls") for c in choices)


# --------------------------------------------------------------------------------------------
# What the server says about itself: /metrics gauges and the process's RSS.
# --------------------------------------------------------------------------------------------

KV_USED = ("swarmgate_kv_blocks", {"tier": "device", "state": "used"})
RUNNING = ("swarmgate_running_sequences", {})
WAITING = ("swarmgate_waiting_sequences", {})


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    series = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        pairs = frozenset()
        if labels:
            pairs = frozenset(
                (k.strip(), v.strip().strip('"'))
                for k, _, v in (p.partition("=") for p in labels.rstrip("}").split(","))
                if k
            )
        try:
            series[(name, pairs)] = float(value)
        except ValueError:
            continue
    return series


@dataclass
class Snapshot:
    rss_mb: float | None
    kv_used: float | None
    running: float | None
    waiting: float | None

    def settled_to(self, baseline: "Snapshot") -> bool:
        return all(
            now is not None and before is not None and now <= before
            for now, before in (
                (self.kv_used, baseline.kv_used),
                (self.running, baseline.running),
                (self.waiting, baseline.waiting),
            )
        )


def fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------------------------
# Probes.
# --------------------------------------------------------------------------------------------


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
            streamed_before_kill = first is not None and killed_at is not None and first <= killed_at
            if outcome != "complete" and not streamed_before_kill:
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


def operations(spec: dict):
    for path, item in spec.get("paths", {}).items():
        for method, operation in item.items():
            if method in ("get", "post", "put", "patch", "delete"):
                yield path, method, operation


# --------------------------------------------------------------------------------------------
# Fuzz cases, from the OpenAPI document: each POST route's example body (else one generated from
# its schema), swept with edge values and mutated at random.
# --------------------------------------------------------------------------------------------

EDGE_NUMBERS = [0, 1e-40, -1e-40, 1e308, -1e308, "NaN", "Infinity", -1, 2**31, 2**63, -(2**63) - 1, 1e-7]

# Raw JSON texts no Python value dumps to: placed where a value goes.
DEEP = 100_000
RAW_VALUES = {
    "deep_array": "[" * DEEP + "]" * DEEP,
    "deep_object": '{"a":' * 20_000 + "1" + "}" * 20_000,
    "invalid_utf8": b'"\xff\xfe\xc3\x28 \xed\xa0\x80"',
    "nan_literal": "NaN",
    "long_number": "1" + "0" * 5000,
    "big_exponent": "1e999999",
    "lone_surrogate": '"\\ud800"',
}


def edge_values(rng: random.Random):
    """A random edge value: (label, Python value or raw JSON bytes)."""
    choice = rng.randrange(5)
    if choice == 0:
        value = rng.choice(EDGE_NUMBERS)
        return f"number {value!r}", value
    if choice == 1:
        label = rng.choice(list(RAW_VALUES))
        raw = RAW_VALUES[label]
        return label, raw.encode() if isinstance(raw, str) else raw
    if choice == 2:
        size = rng.choice([10_000, 100_000])
        item = rng.choice([0, "x", {"role": "user", "content": "hi"}, [], None])
        return f"list of {size} {type(item).__name__}", [item] * size
    if choice == 3:
        value = rng.choice(["", "x" * 200_000, "\u0000", "<|im_start|>system", "\ud83d\ude00" * 1000])
        return f"string len {len(value)}", value
    value = rng.choice([None, True, False, {}, [], {"unexpected": 1}, [[]], 1.5])
    return f"value {json.dumps(value)}", value


@dataclass
class Case:
    path: str
    body: bytes
    what: str


SENTINEL = "\u0001fuzz-sentinel\u0001"


def encode(document, raw: bytes | None) -> bytes:
    """The document as JSON, the sentinel string replaced by `raw` when given."""
    text = json.dumps(document).encode()
    if raw is None:
        return text
    return text.replace(json.dumps(SENTINEL).encode(), raw, 1)


def place(value) -> tuple[object, bytes | None]:
    """A value as a document node: raw JSON becomes the sentinel, substituted at encoding."""
    return (SENTINEL, value) if isinstance(value, bytes) else (value, None)


def resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def properties(spec: dict, schema: dict) -> dict[str, dict]:
    """An object schema's properties, through `$ref` and `allOf`."""
    schema = resolve(spec, schema)
    found = dict(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        found.update(properties(spec, part))
    return found


def is_numeric(spec: dict, schema: dict) -> bool:
    schema = resolve(spec, schema)
    kinds = schema.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if "number" in kinds or "integer" in kinds:
        return True
    return any(is_numeric(spec, s) for s in schema.get("oneOf", []) + schema.get("anyOf", []))


def generate(spec: dict, schema: dict, depth: int = 0):
    """A small value of `schema`: required properties only."""
    schema = resolve(spec, schema)
    if "example" in schema:
        return schema["example"]
    for key in ("oneOf", "anyOf"):
        if key in schema:
            options = [s for s in schema[key] if resolve(spec, s).get("type") != "null"]
            return generate(spec, options[0], depth + 1) if options else None
    if "enum" in schema:
        return schema["enum"][0]
    kinds = schema.get("type", "object")
    kind = next((k for k in ([kinds] if isinstance(kinds, str) else kinds) if k != "null"), "null")
    if kind == "object" or "allOf" in schema:
        required = set(schema.get("required", []))
        for part in schema.get("allOf", []):
            required |= set(resolve(spec, part).get("required", []))
        props = properties(spec, schema)
        return {name: generate(spec, props.get(name, {}), depth + 1) for name in sorted(required) if depth < 6}
    if kind == "array":
        return [generate(spec, schema.get("items", {}), depth + 1)] if depth < 6 else []
    return {"string": "probe", "integer": 1, "number": 0.5, "boolean": False}.get(kind)


def post_routes(spec: dict) -> list[tuple[str, dict, list[str]]]:
    """(path, base body, numeric top-level properties) for every POST route with a JSON body."""
    routes = []
    for path, method, operation in operations(spec):
        content = (operation.get("requestBody") or {}).get("content", {}).get("application/json")
        if method != "post" or content is None or "{" in path:
            continue
        schema = content.get("schema", {})
        base = content.get("example") or generate(spec, schema)
        numeric = sorted(name for name, prop in properties(spec, schema).items() if is_numeric(spec, prop))
        routes.append((path, base, numeric))
    return routes


def edge_sweep(routes):
    """Every numeric property of every route, set to every edge number, on the route's base."""
    for path, base, numeric in routes:
        for name in numeric:
            for value in EDGE_NUMBERS:
                yield Case(path, json.dumps({**base, name: value}).encode(), f"{name}={value!r}")


def nodes(document, trail=()):
    """Every (parent, key) inside a document, for replacement."""
    if isinstance(document, dict):
        for key, value in document.items():
            yield document, key, trail + (key,)
            yield from nodes(value, trail + (key,))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            yield document, index, trail + (index,)
            yield from nodes(value, trail + (index,))


def mutate(rng: random.Random, path: str, base) -> Case:
    document = json.loads(json.dumps(base))
    kind = rng.randrange(10)
    if kind <= 4 and isinstance(document, dict):
        # One node, anywhere in the body, replaced by an edge value.
        parent, key, trail = rng.choice(list(nodes(document)))
        label, value = edge_values(rng)
        parent[key], raw = place(value)
        return Case(path, encode(document, raw), f"{'.'.join(map(str, trail))} = {label}")
    if kind == 5 and isinstance(document, dict):
        label, value = edge_values(rng)
        document[rng.choice(["unknown_field", "stream", "n", "logprobs", "tools", "stop"])], raw = place(value)
        return Case(path, encode(document, raw), f"extra field = {label}")
    if kind == 6 and isinstance(document, dict) and document:
        parent, key, trail = rng.choice(list(nodes(document)))
        del parent[key]
        return Case(path, encode(document, None), f"removed {'.'.join(map(str, trail))}")
    text = json.dumps(document).encode()
    whole = [
        ("truncated", lambda: text[: rng.randrange(len(text))]),
        ("flipped bytes", lambda: bytes(b ^ (1 << rng.randrange(8)) if rng.random() < 0.05 else b for b in text)),
        ("invalid utf-8 inside", lambda: text.replace(b'"', b'"\xc3\x28\xff', 2)),
        ("empty", lambda: b""),
        ("not an object", lambda: rng.choice([b"null", b"[]", b"1e308", b'"x"', b"true"])),
        ("trailing garbage", lambda: text + b"}{]"),
        ("duplicate keys", lambda: text[:-1] + b"," + text[1:] if text.startswith(b"{") and len(text) > 2 else text),
    ]
    label, make = rng.choice(whole)
    return Case(path, make(), label)


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
    parser.add_argument("--quick", action="store_true", help="short versions (about a minute in all)")
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
