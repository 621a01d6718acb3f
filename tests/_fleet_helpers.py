"""Real helper processes for the fleet tests: redis-server, kvchat serve, the routers.

A test that needs a binary the machine lacks is skipped with the reason, unless
$KVCHAT_REQUIRE_FLEET is set (CI sets it, after installing them): then it fails, so a missing
install step cannot pass as a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REQUIRED = bool(os.environ.get("KVCHAT_REQUIRE_FLEET"))
BIN = Path(sys.executable).parent


def need(what: str, found: object) -> None:
    """Skip (or fail, where required) when `found` is falsy."""
    if found:
        return
    message = f"{what} is not installed here (.ci/run installs it)"
    if REQUIRED:
        pytest.fail(f"{message}; KVCHAT_REQUIRE_FLEET is set")
    pytest.skip(message)


def redis_binary() -> str:
    path = shutil.which("redis-server") or shutil.which("valkey-server")
    need("redis-server", path)
    assert path is not None
    return path


def router_binary(name: str) -> Path:
    """sglang-router's launcher module or vllm-router's script, in this venv."""
    if name == "sglang":
        with contextlib.suppress(ImportError):
            import sglang_router  # noqa: F401

            return Path(sys.executable)
        need("sglang-router (pip install sglang-router)", False)
    path = BIN / "vllm-router"
    need("vllm-router (pip install vllm-router)", path.exists())
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(check, timeout: float = 60.0, what: str = "it") -> None:  # noqa: ANN001
    """Poll `check()` until it is truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout:g} s")


@contextlib.contextmanager
def redis_server(tmp: Path, port: int | None = None,
                 extra: tuple[str, ...] = ()) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A fresh redis-server on loopback (no persistence); yields its URL and the process."""
    port = port or free_port()
    proc = subprocess.Popen([redis_binary(), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: socket.create_connection(("127.0.0.1", port), 0.2).close() is None,
                   30, "redis-server's start")
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:  # type: ignore[type-arg]
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def get_json(url: str, token: str | None = None) -> dict:  # type: ignore[type-arg]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    reply = httpx.get(url, headers=headers, timeout=10)
    reply.raise_for_status()
    return reply.json()


TOKEN = "fleet-admin-token"
KEYS = ("fleet-tenant-a", "fleet-tenant-b")
SECRET = "f" * 64  # $KVCHAT_SERVER_SECRET: the same on every instance


def start_instance(model_dir: Path, root: Path, name: str, store: str,
                   *extra: str) -> tuple[str, subprocess.Popen[str]]:
    """`kvchat serve` on the tiny model, its own sessions dir, the fleet's store; returns its URL
    once /health answers."""
    port = free_port()
    env = {**os.environ, "KVCHAT_SERVER_SECRET": SECRET, "KVCHAT_TOKEN": TOKEN}
    args = [str(BIN / "kvchat"), "serve", "--model", str(model_dir), "--device", "cpu",
            "--port", str(port), "--sessions-dir", str(root / name), "--store", store,
            "--block-size", "4", "--cache-mb", "8", "--batch-size", "4", "--max-tokens", "4",
            *(a for key in KEYS for a in ("--api-key", key)), *extra]
    log = open(root / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, (root / f"{name}.log").read_text()
        return httpx.get(f"{url}/health", timeout=2).status_code == 200

    wait_until(up, 120, f"{name}'s start")
    return url, proc


@contextlib.contextmanager
def router(kind: str, workers: list[str], policy: str,
           root: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """sglang-router or vllm-router on loopback in front of `workers`, ready to route."""
    port, metrics = free_port(), free_port()
    exe = router_binary(kind)
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
              "--policy", policy, "--prometheus-port", str(metrics),
              "--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
    if kind == "sglang":
        args = [str(exe), "-m", "sglang_router.launch_router", *common,
                "--prometheus-host", "127.0.0.1", "--log-level", "warn",
                "--worker-startup-check-interval", "1"]
    else:
        args = [str(exe), *common, "--log-level", "warning"]
    log = open(root / f"{kind}-router.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, (root / f"{kind}-router.log").read_text()
            reply = httpx.post(f"{url}/v1/completions", timeout=30,
                               headers={"Authorization": f"Bearer {TOKEN}"},
                               json={"model": "kvchat", "prompt": "warm up", "max_tokens": 1})
            return reply.status_code == 200

        wait_until(ready, 60, f"{kind}-router's start")
        yield url, proc
    finally:
        stop(proc)
        log.close()
