"""`kvchat bench fleet`: N `kvchat serve` instances behind a real router, on loopback.

Each setup starts fresh instances (their own sessions dirs; one shared block-store folder with
--shared-store, or a private store each) and, for N > 1, sglang-router with the policy, then
sends each workload kind's prompts as OpenAI completions, `concurrency` at a time in order (a
multi-turn chat's turn k+1 after its turn k), and reads the hit tokens from every reply's
usage. One instance without a router is the reference hit rate. The instances split the
machine's cores between them (torch threads), as N machines would not.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvchat.bench.fleet_results import FleetBench, FleetRun
from kvchat.errors import KvchatError

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Setup:
    name: str
    instances: int
    policy: str | None  # the router's; None: one instance, no router
    shared: bool


def setups(n: int) -> tuple[Setup, ...]:
    return (Setup("1 instance", 1, None, False),
            Setup(f"{n} cache_aware + shared", n, "cache_aware", True),
            Setup(f"{n} cache_aware", n, "cache_aware", False),
            Setup(f"{n} round_robin + shared", n, "round_robin", True),
            Setup(f"{n} round_robin", n, "round_robin", False))


@dataclass(frozen=True)
class FleetConfig:
    model: str | None
    instances: int = 2
    concurrency: int = 4
    new_tokens: int = 16
    cache_mb: float = 512.0
    start_timeout_s: float = 300.0


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError, KeyError):
            if check():
                return
        time.sleep(0.2)
    raise KvchatError(f"kvchat bench fleet: {what} did not happen within {timeout:g} s.")


def threads_for(instances: int) -> int:
    return max(1, (os.cpu_count() or 1) // instances)


def _instance(config: FleetConfig, root: Path, store: Path, shared: bool, threads: int,
              token: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = _port()
    args = [sys.executable, "-m", "kvchat", "serve", "--port", str(port), "--sessions-dir",
            str(root / "sessions"), "--store", str(store), "--cache-mb", str(config.cache_mb),
            "--max-tokens", str(config.new_tokens), "--batch-size", str(config.concurrency)]
    args += ["--shared-store"] if shared else []
    args += ["--model", config.model] if config.model else []
    env = {**os.environ, "KVCHAT_TOKEN": token, "OMP_NUM_THREADS": str(threads)}
    root.mkdir(parents=True, exist_ok=True)
    log = (root / "serve.log").open("wb")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return f"http://127.0.0.1:{port}", proc


def _router(policy: str, workers: Sequence[str], root: Path) -> tuple[str, subprocess.Popen[bytes]]:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise KvchatError("kvchat bench fleet needs sglang-router: pip install "
                          "sglang-router.") from None
    port = _port()
    args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", *workers, "--policy", policy,
            "--prometheus-port", str(_port()), "--prometheus-host", "127.0.0.1",
            "--log-level", "warn"]
    log = (root / "router.log").open("wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return f"http://127.0.0.1:{port}", proc


@contextlib.contextmanager
def fleet(config: FleetConfig, setup: Setup, root: Path,
          token: str) -> Iterator[tuple[str, list[str]]]:
    """The setup running: the URL to send requests to, and every instance's URL."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = []
        for i in range(setup.instances):
            store = root / "store" if setup.shared else root / f"i{i}" / "store"
            url, proc = _instance(config, root / f"i{i}", store, setup.shared,
                                  threads_for(setup.instances), token)
            urls.append(url)
            procs.append(proc)
        for url, proc in zip(urls, procs, strict=True):
            def up(url: str = url, proc: subprocess.Popen[bytes] = proc) -> bool:
                if proc.poll() is not None:
                    raise KvchatError(f"kvchat serve exited at start; see {root}/serve.log")
                return httpx.get(f"{url}/health", timeout=2).status_code == 200

            _wait(up, config.start_timeout_s, "an instance's start")
        if setup.policy is None:
            yield urls[0], urls
            return
        front, proc = _router(setup.policy, urls, root)
        procs.append(proc)
        _wait(lambda: sum(w["is_healthy"] for w in
                          httpx.get(f"{front}/workers", timeout=2).json()["workers"])
              == len(urls), 120, "the router's registration of every instance")
        yield front, urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _complete(client: httpx.Client, url: str, prompt: str, new_tokens: int) -> dict[str, Any]:
    reply = client.post(f"{url}/v1/completions", timeout=600, json={
        "model": "kvchat", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0})
    reply.raise_for_status()
    usage: dict[str, Any] = reply.json()["usage"]
    return usage


def run_kind(url: str, instances: list[str], token: str, prompts: Sequence[str],
             config: FleetConfig) -> tuple[list[dict[str, Any] | None], float, int]:
    """Send `prompts` in order, `concurrency` at a time; each reply's usage (None: failed),
    the wall time, and the shared-tier hit tokens the instances counted meanwhile."""
    headers = {"Authorization": f"Bearer {token}"}

    def shared() -> int:
        return sum(int(httpx.get(f"{u}/cache/stats", headers=headers, timeout=30)
                       .json()["shared_hit_tokens"]) for u in instances)

    before = shared()
    usages: list[dict[str, Any] | None] = []
    with httpx.Client(headers=headers) as client, \
            cf.ThreadPoolExecutor(config.concurrency) as pool:
        t0 = time.perf_counter()
        for at in range(0, len(prompts), config.concurrency):
            wave = [pool.submit(_complete, client, url, p, config.new_tokens)
                    for p in prompts[at : at + config.concurrency]]
            usages += [None if job.exception() else job.result() for job in wave]
        seconds = time.perf_counter() - t0
    return usages, seconds, shared() - before


def bench_fleet(config: FleetConfig, workloads: dict[str, list[str]],
                progress: Progress = lambda _: None) -> FleetBench:
    token = secrets.token_urlsafe(24)
    runs: list[FleetRun] = []
    with tempfile.TemporaryDirectory(prefix="kvchat-fleet-") as tmp:
        for n, setup in enumerate(setups(config.instances)):
            progress(f"{setup.name}: starting")
            with fleet(config, setup, Path(tmp) / f"setup{n}", token) as (url, urls):
                for kind, prompts in workloads.items():
                    progress(f"{setup.name}: {kind}")
                    usages, seconds, shared = run_kind(url, urls, token, prompts, config)
                    ok = [u for u in usages if u is not None]
                    runs.append(FleetRun(
                        setup.name, setup.instances, setup.policy, setup.shared, kind,
                        len(prompts), sum(u["prompt_tokens"] for u in ok),
                        sum(u["prompt_tokens_details"]["cached_tokens"] for u in ok), shared,
                        sum(u["completion_tokens"] for u in ok), seconds,
                        len(usages) - len(ok)))
    order = list(workloads)
    runs.sort(key=lambda r: order.index(r.kind))  # by kind, each in the order of the setups
    return FleetBench(config.instances, "sglang-router", config.concurrency, config.new_tokens,
                      {1: threads_for(1), config.instances: threads_for(config.instances)},
                      tuple(runs))
