"""A server whose snapshot cannot be written at shutdown (a full disk, a read-only folder, an
I/O error) answers every request, then says so in one paragraph and exits cleanly: no
traceback, and the last good snapshot on disk byte for byte as it was."""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _server_helpers import wait_healthy
from fastapi import FastAPI

from kvchat.config import CacheConfig
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.server import create_app, serving

# `kvchat serve` whose os.write fails, as a full disk does, on files under FAIL_UNDER whose
# path holds FAIL_MATCH, once the file FAIL_FLAG exists (so the server can start first)
FAILING_SERVE = """
import os, sys
flag, under, match, code = (os.environ[k] for k in
                            ("FAIL_FLAG", "FAIL_UNDER", "FAIL_MATCH", "FAIL_ERRNO"))
real = os.write
def write(fd, data):
    path = os.readlink(f"/proc/self/fd/{fd}")
    if os.path.exists(flag) and path.startswith(under) and match in path:
        raise OSError(int(code), os.strerror(int(code)))
    return real(fd, data)
os.write = write
from kvchat.cli import app
app(prog_name="kvchat")
"""


def snapshot_files(sessions: Path) -> dict[str, bytes]:
    """Every file of the cache's snapshot: its index, exact entries and disk-tier blocks."""
    return {str(p.relative_to(sessions)): p.read_bytes()
            for p in sorted((sessions / "cache").rglob("*")) if p.is_file()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_once(model_dir: Path, sessions: Path, prompt: str, full: bool) -> str:
    """Start `kvchat serve`, fill the disk once it answers (if `full`), send one request,
    SIGTERM it; its whole output."""
    port, flag = _free_port(), sessions.parent / "disk-full"
    env = {**os.environ, "KVCHAT_TOKEN": "t", "FAIL_FLAG": str(flag),
           "FAIL_UNDER": str(sessions), "FAIL_MATCH": "", "FAIL_ERRNO": str(errno.ENOSPC)}
    proc = subprocess.Popen(
        [sys.executable, "-c", FAILING_SERVE, "serve", "--model", str(model_dir), "--device",
         "cpu", "--port", str(port), "--block-size", "4", "--cache-mb", "4",
         "--sessions-dir", str(sessions)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, time.monotonic() + 60, proc)
        if full:
            flag.touch()
        reply = httpx.post(f"{url}/generate", json={"prompt": prompt, "max_tokens": 4},
                           headers={"Authorization": "Bearer t"}, timeout=60)
        assert reply.status_code == 200, reply.text
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    return output


def test_a_full_disk_at_shutdown_is_one_paragraph_and_keeps_the_last_snapshot(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    sessions = tmp_path / "sessions"
    first = serve_once(tiny_model_dir, sessions, "Remember me.", full=False)
    assert "Saved the cache snapshot" in first, first
    before = snapshot_files(sessions)
    output = serve_once(tiny_model_dir, sessions, "Something else entirely, a new prompt.",
                        full=True)
    assert "Traceback" not in output and "shutdown failed" not in output, output
    [line] = [ln for ln in output.splitlines() if "snapshot" in ln and "not saved" in ln]
    assert line.startswith("ERROR:") and "the disk is full. Free some space" in line, output
    assert f"The last good snapshot ({sessions / 'cache' / 'index.json'}" in line
    assert "is unchanged: the next start restores it" in line
    assert "Application shutdown complete" in output and "Saved the cache" not in output
    assert snapshot_files(sessions) == before


@pytest.mark.parametrize(("code", "match", "says"), [
    (errno.EROFS, "", "the folder is not writable"),
    (errno.EIO, "", "Input/output error"),
    (errno.ENOSPC, "/store/", "blocks into the disk tier"),  # the index itself would fit
], ids=["read-only", "EIO", "blocks-only"])
def test_other_write_failures_at_shutdown_keep_the_last_snapshot(
    code: int, match: str, says: str, tiny_model_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sessions = tmp_path / "sessions"

    def open_app() -> FastAPI:
        runtime = Runtime.open(RuntimeOptions(model=str(tiny_model_dir), device="cpu",
                                              sessions_dir=sessions,
                                              cache=CacheConfig(4, cache_mb=4)))
        return create_app(runtime, batch_size=2, max_tokens=4)

    with serving(open_app()) as (url, _):
        assert httpx.post(f"{url}/generate", json={"prompt": "Remember me."}).status_code == 200
    before = snapshot_files(sessions)
    real = os.write

    def write(fd: int, data: bytes) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(str(sessions)) and match in path:
            raise OSError(code, os.strerror(code))
        return real(fd, data)

    app = open_app()
    with caplog.at_level(logging.INFO, logger="kvchat.server"), serving(app) as (url, _):
        monkeypatch.setattr(os, "write", write)
        reply = httpx.post(f"{url}/generate", json={"prompt": "A new prompt, not cached."})
        assert reply.status_code == 200
    monkeypatch.setattr(os, "write", real)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.name for r in errors] == ["kvchat.server.worker"], caplog.text
    message = errors[0].getMessage()
    assert message.startswith("The cache snapshot was not saved.") and says in message
    assert "\n" not in message and "The last good snapshot" in message
    assert snapshot_files(sessions) == before
