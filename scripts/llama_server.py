#!/usr/bin/env python3
"""Build llama.cpp's llama-server once, for kvchat's integration tests against a third-party
OpenAI-compatible engine, and print where it is.

The llama-cpp-python sdist on PyPI carries the whole llama.cpp tree (vendor/llama.cpp); only its
server target is built (cmake + a C++ compiler; ~9 min on 2 cores), statically linked, into
<kvchat cache dir>/llama-server/<version>/bin/llama-server. Later runs find it there and return
at once. Standard library only: CI runs it before (or while) kvchat's venv is made.

    python scripts/llama_server.py            # build if absent, print the binary's path
    python scripts/llama_server.py --where    # print where it goes, build nothing
    python scripts/llama_server.py --bench    # llama-bench too, beside it (`kvchat bench
                                              # decode --llama-cpp <the bin folder's parent>`)

Exit codes: 0 built or found, 3 no cmake or compiler (the tests then skip, saying so), 1 the
download or the build failed (the log's tail is printed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release")
NO_TOOLS = 3


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


def runs(path: Path) -> bool:
    """The binary is there and starts (`--version`)."""
    if not path.is_file():
        return False
    env = {**os.environ, "LD_LIBRARY_PATH": str(path.parent)}
    try:
        done = subprocess.run([str(path), "--version"], capture_output=True, timeout=30,
                              env=env)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


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
    """Build `targets` into the cache dir (atomically: a killed build leaves nothing
    half-made)."""
    target = binary(root)
    dest = install_dir(root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log = dest.parent / f"build-{VERSION}.log"
    log.write_text("")
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
        _run(["cmake", "-S", str(tree), "-B", str(out), *CMAKE_FLAGS], log)
        _run(["cmake", "--build", str(out), "-j", str(jobs or os.cpu_count() or 2),
              "--target", *targets], log)
        staged = work / "install" / "bin"
        staged.mkdir(parents=True)
        for name in targets:
            shutil.copy2(out / "bin" / name, staged / name)
        for lib in (out / "bin").glob("*.so*"):  # none when linked statically
            shutil.copy2(lib, staged / lib.name, follow_symlinks=True)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(work / "install", dest)
    if not runs(target):
        raise SystemExit(f"the built {target} does not start (see {log})")
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--where", action="store_true", help="print the path; build nothing")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel build jobs")
    parser.add_argument("--bench", action="store_true", help="build llama-bench too")
    args = parser.parse_args()
    target = binary()
    targets = ("llama-server", "llama-bench") if args.bench else ("llama-server",)
    have = all((target.parent / name).is_file() for name in targets)
    if args.where or (runs(target) and have):
        print(target)
        return 0
    why = missing_tools()
    if why is not None:
        print(f"llama-server cannot be built here: {why}.", file=sys.stderr)
        return NO_TOOLS
    print(f"building llama-server from {PACKAGE}=={VERSION} into {install_dir()} "
          "(about 9 minutes on 2 cores) ...", file=sys.stderr, flush=True)
    print(build(jobs=args.jobs, targets=targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
