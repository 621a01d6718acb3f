"""llama.cpp's llama-server for the integration tests: found where scripts/llama_server.py builds
it (the kvchat cache dir, read once at import, before any test points KVCHAT_CACHE_DIR
elsewhere), started on a free port with the embedded GGUF, stopped or killed."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

SCRIPT = Path(__file__).parent.parent / "scripts" / "llama_server.py"
_spec = importlib.util.spec_from_file_location("llama_server_script", SCRIPT)
assert _spec is not None and _spec.loader is not None
build_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_script)

BINARY: Path = build_script.binary()
REQUIRED = os.environ.get("KVCHAT_REQUIRE_LLAMA_SERVER") == "1"  # CI: missing is a failure


def unavailable() -> str | None:
    """Why the tests cannot run here, or None."""
    if build_script.runs(BINARY):
        return None
    why = build_script.missing_tools()
    if why is not None:
        return f"llama-server is not built and cannot be here: {why}"
    return (f"llama-server is not built yet: `python {SCRIPT.relative_to(SCRIPT.parent.parent)}`"
            f" builds it once into {BINARY.parent} (about 8 CPU-minutes)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One llama-server process: -t 2 -c 16384 --parallel N --no-webui, and `extra`."""

    def __init__(self, gguf: Path, log: Path, parallel: int = 2, extra: tuple[str, ...] = ()
                 ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [str(BINARY), "-m", str(gguf), "-t", "2", "-c", "16384", "--parallel",
                     str(parallel), "--no-webui", "--host", "127.0.0.1", "--port",
                     str(self.port), *extra]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> LlamaServer:
        env = {**os.environ, "LD_LIBRARY_PATH": str(BINARY.parent)}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text(errors="replace")[-2000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"llama-server did not come up; see {self.log}")

    def kill(self) -> None:
        """SIGKILL: the server dies mid-request, as a crashed or OOM-killed engine does."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
