"""scripts/llama_server.py, the llama-server build the integration tests use: where it puts the
server (the kvchat cache dir), and what it says where it cannot build one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "llama_server.py"


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_it_goes_in_the_kvchat_cache_dir(tmp_path: Path) -> None:
    done = run("--where", env={**os.environ, "KVCHAT_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0
    assert done.stdout.strip() == str(tmp_path / "llama-server" / "0.3.36" / "bin" /
                                      "llama-server")


def test_without_cmake_it_says_so_and_exits_3(tmp_path: Path) -> None:
    env = {**os.environ, "KVCHAT_CACHE_DIR": str(tmp_path), "PATH": str(tmp_path)}
    done = run(env=env)
    assert done.returncode == 3
    assert "llama-server cannot be built here: cmake is not installed" in done.stderr
    assert not (tmp_path / "llama-server").exists()  # nothing half-made
