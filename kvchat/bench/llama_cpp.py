"""llama.cpp as a peer in the benches: `llama-bench` for single-stream decode and prefill, and a
`llama-server` for whole request files, run on the same GGUF file in the same sitting.

The binaries come from a folder the user names (`--llama-cpp DIR`: DIR/bin/llama-bench or
DIR/llama-bench, with its shared libraries beside them; `python scripts/llama_server.py --bench`
builds both into ~/.cache/kvchat/llama-server/<version>, `python scripts/synthetic_gguf.py
--tools` llama-bench and llama-quantize into ~/.cache/kvchat/llama-tools/<version>, with the
cached llama-server linked beside them). Besides rates, it reports what each costs in memory:
llama-bench's peak RSS (wait4's rusage of that child alone), llama-server's load time (its
start to /health answering), its RSS then and its high-water mark. Prompts are sent as token
ids, so both runners read the same tokens whatever llama.cpp's tokenizer would make of the
text. Its worker
threads spin on a barrier, so it is measured on the same 2 threads as kvchat and never at the
same time as kvchat.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvchat.bench.results import LoadCost
from kvchat.errors import KvchatError

THREADS = 2


class LlamaCppError(KvchatError):
    """A llama.cpp binary is missing or did not run."""


@dataclass(frozen=True)
class BenchFigures:
    prefill_tps: float  # pp<N>: prompt tokens per second
    decode_tps: float  # tg<N>: generated tokens per second, one stream
    peak_rss: int | None = None  # bytes: the llama-bench process's high-water mark (wait4)
    model_bytes: int | None = None  # its weights, as llama-bench reports them (model_size)


# ---- resident memory, from /proc ----------------------------------------------------------


def memory_of(pid: int | str = "self") -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of a process in bytes: resident now and its high-water mark; None where
    /proc has no such process (or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024  # "123456 kB"
    if len(found) < 2:
        return None
    return found["VmRSS"], found["VmHWM"]


def reset_peak() -> bool:
    """Set this process's VmHWM to its VmRSS (Linux 4.0+: "5" into /proc/self/clear_refs), so the
    next peak read covers only what runs after; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakWatch:
    """A child process's high-water mark (VmHWM), read every 20 ms until `stop()`: its own, from
    after its exec. (Not wait4's ru_maxrss: a child spawned from this process counts the memory
    of this one it started from, vfork sharing it until exec.) Only growth in the last 20 ms of
    its life is missed."""

    peak: int | None

    def __init__(self, pid: int, every: float = 0.02) -> None:
        self.pid, self.peak = pid, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(every,), daemon=True)
        self._thread.start()

    def _watch(self, every: float) -> None:
        while True:
            memory = memory_of(self.pid)  # None once it exited (a zombie has no memory)
            if memory is not None:
                self.peak = max(self.peak or 0, memory[1])
            if self._stop.wait(every):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class ServerProcess:
    """A running llama-server: its URL, and `started` (the LoadCost of its start, set once it
    answered /health)."""

    url: str
    pid: int
    started: LoadCost

    def peak_rss(self) -> int | None:
        memory = memory_of(self.pid)
        return None if memory is None else memory[1]


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

    def bench(self, gguf: Path, prompt: int, generate: int, reps: int = 1,
              timeout: float = 900.0) -> BenchFigures:
        """`llama-bench -p prompt -n generate` on THREADS threads: prefill and decode rates, and
        the process's peak RSS (its VmHWM, watched while it runs)."""
        cmd = [str(self.bench_bin), "-m", str(gguf), "-t", str(THREADS), "-p", str(prompt),
               "-n", str(generate), "-r", str(reps), "-o", "json"]
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(cmd, stdout=out, stderr=err,
                                        env=self._env(self.bench_bin))
            except OSError as exc:
                raise LlamaCppError(f"llama-bench failed: {exc}") from exc
            watch = PeakWatch(proc.pid)
            killed = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                killed = True
                proc.kill()
                proc.wait()
            finally:
                watch.stop()
            out.seek(0)
            err.seek(0)
            if proc.returncode != 0:
                why = (f"killed after {timeout:.0f} s" if killed
                       else f"exit status {proc.returncode}")
                tail = err.read().decode(errors="replace").strip().splitlines()[-3:]
                raise LlamaCppError(f"llama-bench failed ({why}): " + " / ".join(tail))
            try:
                rows = json.loads(out.read().decode(errors="replace"))
            except ValueError as exc:
                raise LlamaCppError(f"llama-bench printed no JSON: {exc}") from exc
        pp = next(r["avg_ts"] for r in rows if r.get("n_prompt") == prompt and not r["n_gen"])
        tg = next(r["avg_ts"] for r in rows if r.get("n_gen") == generate and not r["n_prompt"])
        size = next((r["model_size"] for r in rows if "model_size" in r), None)
        return BenchFigures(float(pp), float(tg), watch.peak,
                            None if size is None else int(size))

    @contextmanager
    def server(self, gguf: Path, parallel: int, context: int = 16384) -> Iterator[str]:
        """A llama-server on a free loopback port with `parallel` slots; yields its URL."""
        with self.serve(gguf, parallel, context) as running:
            yield running.url

    @contextmanager
    def serve(self, gguf: Path, parallel: int, context: int = 16384) -> Iterator[ServerProcess]:
        """`server`, yielding the running process: its URL, how long it took from its start to
        answering /health, and its memory then."""
        port = _free_port()
        cmd = [str(self.server_bin), "-m", str(gguf), "-t", str(THREADS), "-c", str(context),
               "--parallel", str(parallel), "--host", "127.0.0.1", "--port", str(port),
               "--no-webui"]
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=self._env(self.server_bin))
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc)
            seconds = time.perf_counter() - started
            memory = memory_of(proc.pid)
            yield ServerProcess(url, proc.pid, LoadCost(
                seconds, None, None if memory is None else memory[0],
                None if memory is None else memory[1]))
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
        time.sleep(0.05)  # its load time is read from this loop
    raise LlamaCppError(f"llama-server at {url} was not healthy after {timeout:.0f} s")
