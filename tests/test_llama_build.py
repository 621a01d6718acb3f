"""scripts/llama_server.py, the llama-server build the integration tests use: where it puts the
server (the kvchat cache dir), what it says where it cannot build one, the instruction sets it
builds for (the CPU's, never AMX), and the smoke test that sends a build that dies at start (or
a cached binary that does) back to be built with fewer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from _llama_server import build_script

SCRIPT = Path(__file__).parent.parent / "scripts" / "llama_server.py"


def run(*args: str, env: dict[str, str], timeout: float = 60
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


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


# A stand-in llama.cpp tree: its "llama-server" is a Python script, built in a second. Built
# with AVX512 (or -march=native) it dies of SIGILL at start, as ggml's AMX code did on a VM that
# advertised AMX; without, it answers /health and /completion like llama-server.
FAKE_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(fake NONE)
option(GGML_NATIVE "" OFF)
option(GGML_AVX512 "" OFF)
option(GGML_AMX_TILE "" OFF)
if(GGML_AVX512 OR GGML_NATIVE OR GGML_AMX_TILE)
  set(SERVER ${CMAKE_SOURCE_DIR}/crash.py)
else()
  set(SERVER ${CMAKE_SOURCE_DIR}/serve.py)
endif()
add_custom_target(llama-server ALL
  COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_BINARY_DIR}/bin
  COMMAND ${CMAKE_COMMAND} -E copy ${SERVER} ${CMAKE_BINARY_DIR}/bin/llama-server)
"""
CRASH = """import os, signal, sys
if "--version" in sys.argv:
    print("version: 1 (fake)")
    sys.exit(0)
print("llama threadpool init", flush=True)
os.kill(os.getpid(), signal.SIGILL)
"""
SERVE = """import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
if "--version" in sys.argv:
    print("version: 1 (fake)")
    sys.exit(0)
class Handler(BaseHTTPRequestHandler):
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.reply({"status": "ok"})
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.reply({"content": " hi"})
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
"""
AMX_VM = ("fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl avx512dq avx512bw "
          "avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16")


def script(source: str) -> str:
    return f"#!{sys.executable}\n{source}"


@pytest.fixture
def fake_tree(tmp_path: Path) -> dict[str, str]:
    """An environment whose build takes the stand-in sdist, smoke-tests with a stand-in GGUF
    and reads the CPU flags of an Intel VM that advertises AMX."""
    return stand_in(tmp_path, SERVE)


def stand_in(tmp_path: Path, serve: str) -> dict[str, str]:
    tree = tmp_path / "src" / "llama_cpp_python-0.0.0" / "vendor" / "llama.cpp"
    tree.mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text(FAKE_CMAKE)
    for name, source in (("crash.py", CRASH), ("serve.py", serve)):
        (tree / name).write_text(script(source))
        (tree / name).chmod(0o755)
    archive = tmp_path / "llama_cpp_python-0.0.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src" / "llama_cpp_python-0.0.0", "llama_cpp_python-0.0.0")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return {**os.environ, "KVCHAT_CACHE_DIR": str(tmp_path / "cache"),
            "KVCHAT_LLAMA_SDIST": str(archive), "KVCHAT_LLAMA_SMOKE_GGUF": str(gguf),
            "KVCHAT_LLAMA_CPU_FLAGS": AMX_VM}


def test_the_isa_comes_from_the_cpu_flags_and_never_includes_amx() -> None:
    ladder = build_script.isa_ladder(frozenset(AMX_VM.split()))
    flags = build_script.isa_cmake_flags(ladder[0])
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX512=ON" in flags
    assert "-DGGML_AVX512_BF16=ON" in flags and "-DGGML_AVX512_VBMI=OFF" in flags
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert not any("AMX" in option and option.endswith("=ON") for rung in ladder
                   for option in build_script.isa_cmake_flags(rung))
    # fewer instruction sets on each rung, down to none
    assert [len(r) for r in ladder] == sorted((len(r) for r in ladder), reverse=True)
    assert ladder[1] == build_script.X86_64_V3 and ladder[-1] == frozenset()
    amd = frozenset("sse4_2 avx avx2 fma f16c bmi2".split())
    assert build_script.isa_ladder(amd)[0] == build_script.X86_64_V3
    assert build_script.isa_ladder(frozenset(), x86=False)[0] == {build_script.NATIVE}


def test_a_build_that_dies_at_start_is_built_again_with_fewer_instruction_sets(
        fake_tree: dict[str, str], tmp_path: Path) -> None:
    done = run(env=fake_tree, timeout=240)
    assert done.returncode == 0, done.stderr
    server = Path(done.stdout.strip())
    assert "killed by SIGILL" in done.stderr and "fewer instruction sets" in done.stderr
    assert "SIGILL" not in server.read_text() and "HTTPServer" in server.read_text()
    stamp = json.loads((server.parent.parent / "build.json").read_text())
    assert "-DGGML_AVX512=OFF" in stamp["cmake_flags"]
    assert "-DGGML_AVX2=ON" in stamp["cmake_flags"]  # the x86-64-v3 rung, not the bottom one
    log = (server.parent.parent.parent / "build-0.3.36.log").read_text()
    assert "-DGGML_AVX512=ON" in log and "smoke test" in log and "passed" in log
    # a later run trusts the stamp: no build, no server started
    again = run(env=fake_tree)
    assert again.returncode == 0 and again.stdout == done.stdout and again.stderr == ""


def test_a_cached_binary_that_fails_its_smoke_test_is_rebuilt(fake_tree: dict[str, str],
                                                              tmp_path: Path) -> None:
    server = tmp_path / "cache" / "llama-server" / "0.3.36" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text(script(CRASH))  # `--version` works; loading a model dies of SIGILL
    server.chmod(0o755)
    done = run(env=fake_tree, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "the cached llama-server failed its smoke test on this CPU" in done.stderr
    assert "SIGILL" in done.stderr
    assert "HTTPServer" in server.read_text()
    assert build_script.smoke(server, tmp_path / "model.gguf") is None


def test_a_build_that_fails_its_smoke_test_without_a_signal_is_not_built_again(
        tmp_path: Path) -> None:
    """Fewer instruction sets cure only a CPU fault: a server that exits (a bad GGUF, a port in
    use) fails the build after one smoke test, not after the whole ladder."""
    env = stand_in(tmp_path, "import sys\nprint('error loading model')\nsys.exit(1)\n")
    env["KVCHAT_LLAMA_CPU_FLAGS"] = "sse4_2 avx avx2 fma f16c bmi2"  # the first rung serves
    done = run(env=env, timeout=240)
    assert done.returncode == 1
    assert "exited with status 1" in done.stderr and "error loading model" in done.stderr
    log = (tmp_path / "cache" / "llama-server" / "build-0.3.36.log").read_text()
    assert log.count("smoke test (") == 1 and "fewer instruction sets" not in done.stderr
    assert not (tmp_path / "cache" / "llama-server" / "0.3.36").exists()


def test_the_smoke_test_says_why_a_server_did_not_come_up(tmp_path: Path) -> None:
    crash = tmp_path / "crash"
    crash.write_text(script(CRASH))
    crash.chmod(0o755)
    why = build_script.smoke(crash, tmp_path / "model.gguf")
    assert why is not None and "killed by SIGILL" in why and "llama threadpool init" in why
