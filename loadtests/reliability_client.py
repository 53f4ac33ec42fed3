"""The reliability probes' client side: a minimal HTTP/1.1 client on asyncio streams, server-sent
events, and what a server says about itself (/metrics gauges, the process's RSS).

One connection per request (`Connection: close`), raw bytes in and out, so that a probe can send
invalid UTF-8, stop mid-body or cut a stream at any byte. Standard library only.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import AsyncIterator

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
