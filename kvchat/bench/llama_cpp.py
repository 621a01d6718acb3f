"""llama.cpp as a peer in the benches: `llama-bench` for single-stream decode and prefill, and a
`llama-server` for whole request files, run on the same GGUF file in the same sitting.

The binaries come from a folder the user names (`--llama-cpp DIR`: DIR/bin/llama-bench or
DIR/llama-bench, with its shared libraries beside them; `python scripts/llama_server.py --bench`
builds both into ~/.cache/kvchat/llama-server/<version>). Prompts are sent as token ids, so both
runners read the same tokens whatever llama.cpp's tokenizer would make of the text. Its worker
threads spin on a barrier, so it is measured on the same 2 threads as kvchat and never at the
same time as kvchat.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvchat.errors import KvchatError

THREADS = 2


class LlamaCppError(KvchatError):
    """A llama.cpp binary is missing or did not run."""


@dataclass(frozen=True)
class BenchFigures:
    prefill_tps: float  # pp<N>: prompt tokens per second
    decode_tps: float  # tg<N>: generated tokens per second, one stream


@dataclass(frozen=True)
class Served:
    wall_s: float
    tokens: int  # generated, all requests
    cached: int  # prompt tokens the server reported as reused (timings.cache_n)
    prompt: int  # prompt tokens sent
    decode_tps: float  # the requests' own decode rates (timings.predicted_per_second), summed


class LlamaCpp:
    def __init__(self, folder: Path) -> None:
        if not folder.is_dir():
            raise LlamaCppError(f"--llama-cpp {folder}: no such folder.")
        self.folder = folder

    @property
    def bench_bin(self) -> Path:
        return self._find("llama-bench")

    @property
    def server_bin(self) -> Path:
        return self._find("llama-server")

    def _find(self, name: str) -> Path:
        for candidate in (self.folder / "bin" / name, self.folder / name):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
        raise LlamaCppError(
            f"No {name} in {self.folder} (looked in {self.folder}/bin and {self.folder}). "
            "--llama-cpp takes llama.cpp's build folder: `python scripts/llama_server.py "
            "--bench` in the kvchat repository builds llama-server and llama-bench (from the "
            "llama-cpp-python sdist) into ~/.cache/kvchat/llama-server/<version>.")

    def _env(self, binary: Path) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = f"{binary.parent}:{env.get('LD_LIBRARY_PATH', '')}"
        return env

    def bench(self, gguf: Path, prompt: int, generate: int, reps: int = 1) -> BenchFigures:
        """`llama-bench -p prompt -n generate` on THREADS threads: prefill and decode rates."""
        cmd = [str(self.bench_bin), "-m", str(gguf), "-t", str(THREADS), "-p", str(prompt),
               "-n", str(generate), "-r", str(reps), "-o", "json"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                                 env=self._env(self.bench_bin), check=True).stdout
            rows = json.loads(out)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            raise LlamaCppError(f"llama-bench failed: {exc}") from exc
        pp = next(r["avg_ts"] for r in rows if r.get("n_prompt") == prompt and not r["n_gen"])
        tg = next(r["avg_ts"] for r in rows if r.get("n_gen") == generate and not r["n_prompt"])
        return BenchFigures(float(pp), float(tg))

    @contextmanager
    def server(self, gguf: Path, parallel: int, context: int = 16384) -> Iterator[str]:
        """A llama-server on a free loopback port with `parallel` slots; yields its URL."""
        port = _free_port()
        cmd = [str(self.server_bin), "-m", str(gguf), "-t", str(THREADS), "-c", str(context),
               "--parallel", str(parallel), "--host", "127.0.0.1", "--port", str(port),
               "--no-webui"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=self._env(self.server_bin))
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def serve_requests(url: str, prompts: Sequence[Sequence[int]], new_tokens: int,
                   concurrency: int, ignore_eos: bool = True) -> Served:
    """Send every prompt (token ids) to a llama-server's /completion, `concurrency` at a time,
    greedy, `new_tokens` each (fewer if it stops at EOS, unless `ignore_eos`); wall time of the
    whole file."""
    import httpx

    lock = threading.Lock()
    pending = list(enumerate(prompts))
    totals = {"tokens": 0, "cached": 0, "tps": 0.0}

    def worker(client: httpx.Client) -> None:
        while True:
            with lock:
                if not pending:
                    return
                _, ids = pending.pop(0)
            body = {"prompt": list(ids), "n_predict": new_tokens, "temperature": 0.0,
                    "cache_prompt": True, "ignore_eos": ignore_eos}
            reply = client.post(f"{url}/completion", json=body, timeout=600).json()
            timings = reply.get("timings", {})
            with lock:
                totals["tokens"] += int(reply.get("tokens_predicted", 0))
                totals["cached"] += int(timings.get("cache_n", 0))
                totals["tps"] += float(timings.get("predicted_per_second", 0.0))

    started = time.perf_counter()
    with httpx.Client() as client:
        threads = [threading.Thread(target=worker, args=(client,)) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - started
    return Served(wall, int(totals["tokens"]), int(totals["cached"]), sum(map(len, prompts)),
                  float(totals["tps"]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LlamaCppError(f"llama-server exited with code {proc.returncode} at start")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise LlamaCppError(f"llama-server at {url} was not healthy after {timeout:.0f} s")
