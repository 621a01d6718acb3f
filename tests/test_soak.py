"""A bounded soak over loopback: a real `kvchat serve` process on the tiny model takes rounds of
mixed traffic (plain, streamed and OpenAI requests, session turns, replies hung up on, bodies
just under the 8 MiB limit, malformed bodies) from several clients at once; after each round,
once it is idle, its resident memory is back within 10% of what it was after a warm-up of the
same mix, and its request counters add up."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from _server_helpers import wait_healthy

TOKEN = "soak-token"
ROUNDS = 3
HUGE = json.dumps({"prompt": "word " * 1_600_000}).encode()  # 8 MB: just under the limit


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, int]]:
    if not Path("/proc/self/status").exists():
        pytest.skip("reads resident memory from /proc")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "serve", "--model", str(tiny_model_dir), "--device",
         "cpu", "--port", str(port), "--block-size", "4", "--cache-mb", "8", "--max-tokens",
         "6", "--sessions-dir", str(tmp_path / "sessions")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "KVCHAT_TOKEN": TOKEN})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, time.monotonic() + 120, proc)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def traffic(client: httpx.Client, round_no: int) -> list[Callable[[], int]]:
    """One round of the mix, as calls returning a status code."""
    def plain(i: int) -> Callable[[], int]:
        return lambda: client.post("/generate", json={"prompt": f"r{round_no} q{i} sea?"}
                                   ).status_code

    def session(i: int) -> Callable[[], int]:
        return lambda: client.post("/generate", json={
            "prompt": f"turn {round_no}", "session": f"soak-{i}", "create_session": True}
        ).status_code

    def openai(i: int) -> Callable[[], int]:
        return lambda: client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"r{round_no} chat {i}"}], "stream": True,
            "stream_options": {"include_usage": True}}).status_code

    def hang_up(i: int) -> Callable[[], int]:
        def call() -> int:
            body = {"prompt": f"r{round_no} story {i}", "max_tokens": 400, "stream": True}
            with client.stream("POST", "/generate", json=body) as reply:
                next(reply.iter_lines())
                return reply.status_code
        return call

    def huge() -> int:
        return client.post("/generate", content=HUGE,
                           headers={"Content-Type": "application/json"}).status_code

    def broken() -> int:
        return client.post("/generate", content=b'{"prompt": "\\ud800', headers={
            "Content-Type": "application/json"}).status_code

    calls: list[Callable[[], int]] = []
    for i in range(6):
        calls += [plain(i), session(i % 3), openai(i), hang_up(i), huge, broken]
    return calls


def settle(client: httpx.Client) -> dict[str, int]:
    deadline = time.monotonic() + 120
    while True:
        server = client.get("/cache/stats").json()["server"]
        if server["running"] == server["pending"] == 0:
            time.sleep(1.0)  # what a finished request frees, freed
            return dict(server)
        assert time.monotonic() < deadline, server
        time.sleep(0.1)


def test_memory_returns_after_bursts_of_mixed_traffic(server: tuple[str, int]) -> None:
    url, pid = server
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, headers=headers, timeout=300) as client, \
            ThreadPoolExecutor(max_workers=6) as pool:
        for call in traffic(client, 0):  # warm-up: every kind of request once, one at a time
            assert call() < 500
        settle(client)
        baseline = rss_mib(pid)
        for round_no in range(1, ROUNDS + 1):
            codes = list(pool.map(lambda call: call(), traffic(client, round_no)))
            assert all(code < 500 for code in codes), codes
            assert codes.count(200) >= 24  # plain, session, OpenAI and hung-up requests ran
            counters = settle(client)
            after = rss_mib(pid)
            assert after <= baseline * 1.10, (round_no, baseline, after)
            outcomes = counters["completed"] + counters["cancelled"] + counters["errors"]
            assert counters["requests"] == outcomes, counters
