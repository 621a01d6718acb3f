"""Helpers for tests that start `kvchat serve` as a process."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_healthy(url: str, deadline: float, proc: subprocess.Popen[str] | None = None) -> None:
    """Poll GET /healthz until it answers 200; fail at `deadline` (time.monotonic()), or at
    once with its output when `proc` has exited."""
    while True:
        if proc is not None:
            assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)
