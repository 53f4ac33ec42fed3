"""Fixtures for the real-client suite: `swarmgate serve` as a separate process, and official
OpenAI SDK clients pointed at it.

The binary comes from SWARMGATE_BIN (scripts/sdk-tests.sh builds it and sets it). Each server
listens on free loopback ports, needs the API key `sk-test`, reads an empty configuration file
(so neither a local swarmgate.toml nor SWARMGATE_* variables change what is tested) and runs
from the repository root, where `models/` is. It is stopped when the session ends, whether the
tests passed or not; its log is printed when it fails to start.
"""

import ctypes
import importlib
import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
API_KEY = "sk-test"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
# Seconds one request may take; far above what any test asks for (a few dozen tokens).
REQUEST_TIMEOUT = 60.0
STARTUP_TIMEOUT = 120.0


class Server:
    """A running `swarmgate serve`: its address, and the means to stop it."""

    def __init__(self, name: str, extra_args: list[str], kv_cache_mb: int = 128):
        binary = os.environ.get("SWARMGATE_BIN")
        if not binary or not os.access(binary, os.X_OK):
            pytest.exit(
                "SWARMGATE_BIN must name the swarmgate binary (scripts/sdk-tests.sh sets it)",
                returncode=2,
            )
        self.scratch = tempfile.TemporaryDirectory(prefix=f"swarmgate-{name}-")
        config = pathlib.Path(self.scratch.name, "swarmgate.toml")
        config.write_text("")
        self.log_path = pathlib.Path(self.scratch.name, "server.log")
        self.port = free_port()
        self.origin = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.origin}/v1"
        args = [
            binary, "serve",
            "--config", str(config),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--grpc-port", str(free_port()),
            "--api-key", API_KEY,
            "--kv-cache-mb", str(kv_cache_mb),
            "--host-kv-cache-mb", "64",
            "--shutdown-grace-secs", "2",
            *extra_args,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMGATE_")}
        env["SWARMGATE_LOG"] = os.environ.get("SWARMGATE_LOG", "warn")
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            args,
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        try:
            self.wait_until_healthy()
        except BaseException:
            self.stop()
            raise

    def wait_until_healthy(self) -> None:
        url = f"http://127.0.0.1:{self.port}/health"
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(
                    f"swarmgate exited with {self.process.returncode} before answering "
                    f"/health:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        pytest.fail(f"swarmgate did not answer /health in {STARTUP_TIMEOUT} s:\n{self.log_tail()}")

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        # No retries: a 429 or 5xx must reach the test at once, not after the SDK's back-off.
        return openai.OpenAI(
            base_url=self.base_url,
            api_key=api_key,
            max_retries=0,
            timeout=REQUEST_TIMEOUT,
        )

    def log_tail(self, lines: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        self.scratch.cleanup()


def die_with_parent() -> None:
    """Runs in the child before exec: on Linux, the kernel sends it SIGTERM when pytest dies,
    however it dies, so no server outlives a killed run."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def pytest_configure(config):
    # `timeout` (scripts/sdk-tests.sh) ends a run with SIGTERM: make that an interrupt, so that
    # pytest reports what ran and the fixtures stop their servers.
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def framework(module: str):
    """The agent framework a test file drives, imported. Each framework has its own virtual
    environment (tests/python/frameworks/); in any other the file's tests are skipped, except
    where SDK_TESTS_FRAMEWORKS names the module (scripts/sdk-tests.sh sets it for each
    framework's run), where a missing framework is an error rather than a silent skip."""
    required = os.environ.get("SDK_TESTS_FRAMEWORKS", "").split()
    if module in required:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is installed in its own environment")


def free_port() -> int:
    """A loopback port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server():
    """The server most tests share: the chat model and the embedding model, no rate limits."""
    server = Server("main", [])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def limited_server():
    """A second server allowing 2 requests per minute (the limit applies to every key), so the
    rate-limit test cannot disturb the others. It serves no embeddings: only chat is asked of
    it."""
    server = Server("limited", ["--rpm", "2", "--embedding-model", "/nonexistent"])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def small_server():
    """A server whose KV cache holds about 80 tokens (2 MiB of f16 blocks), so that any
    request, however long it asks to generate, ends within seconds: for fuzzing."""
    server = Server("small", [], kv_cache_mb=2)
    try:
        yield server
    finally:
        server.stop()
