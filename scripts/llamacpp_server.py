"""Starting llama.cpp's `llama-server` on 127.0.0.1 and calling it: shared by the scripts that
write tables of llama.cpp's outputs for the tests (`llamacpp-logits.py`, `llamacpp-tokens.py`)."""

import json
import subprocess
import sys
import time
import urllib.request


class Server:
    """A `llama-server` serving `model` on 127.0.0.1:`port`, 2 threads, started with `args`."""

    def __init__(self, binary, model, port, args):
        self.port = port
        self.proc = subprocess.Popen(
            [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "2", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        sys.exit("llama-server did not start")

    def post(self, path, body):
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.load(resp)

    def stop(self):
        self.proc.kill()
        self.proc.wait()


def version(binary):
    """The last two lines `llama-server --version` prints (version and build)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True)
    return (out.stdout + out.stderr).strip().splitlines()[-2:]
