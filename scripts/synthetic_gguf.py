#!/usr/bin/env python3
"""Random-weight GGUFs at real model shapes, made without the Hugging Face hub: for measuring how
load time, memory and decode speed grow with model size (`kvchat bench decode --model FILE`).
The texts they write are nonsense; their load time, memory and speed are a real model's.

Per shape: a transformers config at the real model's shape (Qwen2.5 0.5B / 1.5B / 3B, Llama 3.2
1B / 3B, a Llama at 0.5B), the embedded SmolLM2's tokenizer (49,152 tokens, read from its GGUF
as kvchat reads it; the config keeps the real model's vocabulary, the ids past the tokenizer's
are padding), random weights (seed 0) saved in bfloat16, then the llama-cpp-python sdist's
`convert_hf_to_gguf.py --outtype f16` and `llama-quantize F16 OUT Q4_K_M`. Only the Q4_K_M file
is kept: <kvchat cache dir>/synthetic/<shape>-Q4_K_M.gguf. Everything is made in a temp folder
beside it and renamed into place, so a killed run leaves no half file (its temp folder is removed
by the next run); a file already there is not made again.

llama-quantize and llama-bench are built once from the same sdist (the flags and instruction
sets of scripts/llama_server.py; ~7 min on 2 cores) into <kvchat cache dir>/llama-tools/<version>,
whose bin/ also holds llama-server (a link to the one scripts/llama_server.py built, or built
here when there is none): that folder is what `kvchat bench decode --llama-cpp DIR` takes.

    python scripts/synthetic_gguf.py --list
    python scripts/synthetic_gguf.py --shape qwen2-0.5b --shape llama-0.5b   # prints the paths
    python scripts/synthetic_gguf.py --tools                                 # the tools only

Exit codes: 0 made or found, 3 no cmake or compiler, 1 a step failed (its output's tail shown).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_server  # noqa: E402  (scripts/ is not a package)

QUANT = "Q4_K_M"
TOOLS = ("llama-quantize", "llama-bench")
STAMP = "tools.json"
THREADS = 2


@dataclass(frozen=True)
class Shape:
    """A real model's shape; `nominal` is its published parameter count."""

    name: str
    model: str  # the model it copies
    arch: str  # "qwen2", "llama", "qwen3" or "phi3"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    nominal: float  # parameters, as the model's card gives them
    tied: bool = True
    head_dim: int = 0  # 0: hidden / heads


SHAPES = {s.name: s for s in (
    Shape("qwen2-0.5b", "Qwen2.5-0.5B", "qwen2", 896, 24, 14, 2, 4864, 151_936, 0.49e9),
    Shape("qwen2-1.5b", "Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 8960, 151_936, 1.54e9),
    Shape("qwen2-3b", "Qwen2.5-3B", "qwen2", 2048, 36, 16, 2, 11008, 151_936, 3.09e9),
    # no 0.5B Llama exists: Llama 3.2's vocabulary and head size with 24 layers of 1,024
    # (16 layers would make 0.38B, most of it the embedding)
    Shape("llama-0.5b", "a Llama 3.2-like 0.5B", "llama", 1024, 24, 16, 8, 4096, 128_256, 0.5e9),
    Shape("llama-1b", "Llama-3.2-1B", "llama", 2048, 16, 32, 8, 8192, 128_256, 1.24e9),
    Shape("llama-3b", "Llama-3.2-3B", "llama", 3072, 28, 24, 8, 8192, 128_256, 3.21e9),
    Shape("qwen3-0.6b", "Qwen3-0.6B", "qwen3", 1024, 28, 16, 8, 3072, 151_936, 0.6e9,
          head_dim=128),
    # Phi-3's smallest real model is 3.8B, longer to build and bench than a sitting allows:
    # its architecture (fused qkv and gate_up) at Llama 3.2 1B's width and depth, with
    # SmolLM2's vocabulary (Phi-3's own, 32,064, is smaller than the tokenizer). Mistral has
    # none here: llama.cpp writes it as a "llama" GGUF, which transformers loads as Llama.
    Shape("phi3-1b", "a Phi-3-architecture 1B", "phi3", 2048, 16, 32, 32, 8192, 49_152, 1.1e9,
          tied=False),
)}


class Failed(Exception):
    """A step failed; the message says which and why."""


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- configs ------------------------------------------------------------------------------


def build_config(shape: Shape, tokenizer_size: int = 49_152, bos: int = 1, eos: int = 2) -> Any:
    """The transformers config of `shape`, for a tokenizer of `tokenizer_size` ids."""
    from transformers import LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config

    if shape.vocab < tokenizer_size:
        raise Failed(f"{shape.name}: vocabulary {shape.vocab} is smaller than the tokenizer's "
                     f"{tokenizer_size}")
    common: dict[str, Any] = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, tie_word_embeddings=shape.tied,
        bos_token_id=bos, eos_token_id=eos, torch_dtype="bfloat16")
    head_dim = shape.head_dim or shape.hidden // shape.heads
    if shape.arch == "qwen2":
        return Qwen2Config(**common, max_position_embeddings=32_768, rope_theta=1_000_000.0,
                           rms_norm_eps=1e-6, use_sliding_window=False)
    if shape.arch == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim, max_position_embeddings=40_960,
                           rope_theta=1_000_000.0, rms_norm_eps=1e-6, use_sliding_window=False)
    if shape.arch == "phi3":
        return Phi3Config(**common, max_position_embeddings=4096,
                          original_max_position_embeddings=4096, rope_theta=10_000.0,
                          rms_norm_eps=1e-5, pad_token_id=eos)
    # Llama 3.2's rope_scaling ("llama3", for contexts past 8k) is left out: it does not change
    # the cost of a step at the contexts the benches use
    return LlamaConfig(**common, head_dim=head_dim,
                       max_position_embeddings=131_072, rope_theta=500_000.0, rms_norm_eps=1e-5)


def parameter_count(config: Any) -> int:
    """Parameters of a Qwen2 / Llama decoder with `config`'s shape (embedding counted once when
    tied)."""
    h, v = config.hidden_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    attn = h * q + 2 * h * kv + q * h
    if config.model_type == "qwen2" or getattr(config, "attention_bias", False):
        attn += q + 2 * kv  # q, k and v biases
    layer = attn + 3 * h * config.intermediate_size + 2 * h  # two RMSNorms
    return v * h * (1 if config.tie_word_embeddings else 2) + config.num_hidden_layers * layer + h


# ---- the tokenizer and the Hugging Face folder ----------------------------------------------


def embedded_tokenizer() -> Any:
    """The embedded SmolLM2's tokenizer, from its GGUF as kvchat converts it (no download)."""
    from transformers import AutoTokenizer

    from kvchat.models.gguf import quiet_transformers
    from kvchat.models.loading import resolve_model, weights_location

    folder = weights_location(resolve_model(None))
    with quiet_transformers():
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def write_hf_model(shape: Shape, out: Path, tokenizer: Any) -> None:
    """Config, tokenizer and random weights (seed 0, bfloat16) as a Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvchat.models.gguf import quiet_transformers

    config = build_config(shape, len(tokenizer), tokenizer.bos_token_id or 0,
                          tokenizer.eos_token_id or 0)
    torch.manual_seed(0)
    with quiet_transformers():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    if shape.arch == "phi3":  # the convert script reads a BPE vocabulary for Phi-3 by this name
        path = out / "tokenizer_config.json"
        settings = json.loads(path.read_text())
        settings["tokenizer_class"] = "GPT2Tokenizer"
        path.write_text(json.dumps(settings, indent=2))
    del model


# ---- the llama.cpp tools ------------------------------------------------------------------


def tools_dir(root: Path | None = None) -> Path:
    return (root or llama_server.cache_root()) / "llama-tools" / llama_server.VERSION


def tools_ready(folder: Path) -> bool:
    """The tools of a finished build are there, and its stamp says they ran on this CPU."""
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return False
    names = (*TOOLS, "llama-server")
    return (stamp.get("cpu") == llama_server.cpu_signature()
            and all((folder / "bin" / n).is_file() for n in names)
            and (folder / "convert" / "convert_hf_to_gguf.py").is_file())


def _run(args: Sequence[str], log: Path, what: str, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> None:
    with open(log, "ab") as out:
        out.write(("$ " + " ".join(args) + "\n").encode())
        out.flush()
        done = subprocess.run(list(args), cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-20:]
        raise Failed(f"{what} failed (exit {done.returncode}):\n  " + "\n  ".join(tail)
                     + f"\n(the whole log: {log})")


def _smoke_bench(bench: Path, gguf: Path) -> str | None:
    """None when llama-bench runs a few tokens of `gguf` on this CPU, else why not."""
    try:
        done = subprocess.run([str(bench), "-m", str(gguf), "-t", str(THREADS), "-p", "8",
                               "-n", "4", "-r", "1", "-o", "json"], capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"llama-bench did not run: {exc}"
    if done.returncode != 0:
        tail = "\n  ".join(done.stderr.strip().splitlines()[-6:])
        return f"llama-bench {llama_server._died(done.returncode)}:\n  {tail}"
    try:
        json.loads(done.stdout)
    except ValueError:
        return f"llama-bench printed no JSON: {done.stdout[:200]!r}"
    return None


def _flag_sets() -> list[list[str]]:
    """cmake flags to try, best first: those the cached llama-server passed its smoke test
    with on this CPU, then scripts/llama_server.py's ladder."""
    ladder = [[*llama_server.CMAKE_FLAGS, *llama_server.isa_cmake_flags(rung)]
              for rung in llama_server.isa_ladder(llama_server.cpu_flags(),
                                                  llama_server.is_x86())]
    stamp = llama_server.read_stamp(llama_server.install_dir())
    known = stamp.get("cmake_flags")
    if stamp.get("cpu") == llama_server.cpu_signature() and isinstance(known, list) and known:
        first = [str(f) for f in known]
        return [first, *(f for f in ladder if f != first)]
    return ladder


def _remove_dead_temps(folder: Path, prefix: str) -> None:
    """Temp folders "<prefix><pid>-..." of runs that are gone (killed) are deleted."""
    for entry in folder.glob(f"{prefix}*"):
        pid = entry.name[len(prefix):].split("-", 1)[0]
        if entry.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def build_tools(root: Path | None = None, jobs: int | None = None) -> Path:
    """llama-quantize and llama-bench (and llama-server where none is cached) in tools_dir(),
    with the convert script and gguf-py beside them; returns the folder."""
    dest = tools_dir(root)
    if tools_ready(dest):
        return dest
    why = llama_server.missing_tools()
    if why is not None:
        raise SystemExit(f"llama.cpp's tools cannot be built here: {why}.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_temps(dest.parent, ".build-")
    log = dest.parent / f"build-{llama_server.VERSION}.log"
    log.write_text("")
    server = llama_server.binary(root)
    have_server = llama_server.runs(server)
    targets = TOOLS if have_server else (*TOOLS, "llama-server")
    gguf = llama_server.smoke_gguf(root)
    assert gguf is not None
    say(f"building {', '.join(targets)} from {llama_server.PACKAGE}=={llama_server.VERSION} into "
        f"{dest} (about {7 if have_server else 10} minutes on 2 cores; log {log})")
    failures = []
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".build-{os.getpid()}-") as tmp:
        work = Path(tmp)
        with tarfile.open(llama_server.sdist(work, log)) as tar:
            tar.extractall(work, filter="data")
        src = next(p for p in work.iterdir() if p.is_dir() and (p / "vendor").is_dir())
        tree, out = src / "vendor" / "llama.cpp", work / "B"
        for flags in _flag_sets():
            _run(["cmake", "-S", str(tree), "-B", str(out), *flags], log, "cmake (configure)")
            _run(["cmake", "--build", str(out), "-j", str(jobs or os.cpu_count() or 2),
                  "--target", *targets], log, "cmake --build")
            staged = work / "install"
            shutil.rmtree(staged, ignore_errors=True)
            (staged / "bin").mkdir(parents=True)
            for name in targets:
                shutil.copy2(out / "bin" / name, staged / "bin" / name)
            if have_server:
                (staged / "bin" / "llama-server").symlink_to(server)
            why = _smoke_bench(staged / "bin" / "llama-bench", gguf)
            with open(log, "a") as f:
                f.write(f"smoke test ({' '.join(flags)}): {why or 'passed'}\n")
            if why is None:
                convert = staged / "convert"
                convert.mkdir()
                shutil.copy2(tree / "convert_hf_to_gguf.py", convert)
                shutil.copytree(tree / "conversion", convert / "conversion")
                shutil.copytree(tree / "gguf-py", convert / "gguf-py")
                stamp = {"version": llama_server.VERSION, "cmake_flags": flags,
                         "cpu": llama_server.cpu_signature(), "targets": list(targets)}
                (staged / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
                if dest.exists():
                    shutil.rmtree(dest)
                os.replace(staged, dest)
                say(f"built {dest}/bin: {', '.join(sorted(os.listdir(dest / 'bin')))}")
                return dest
            failures.append(why)
            if llama_server.KILLED not in why:
                break
            say(f"the build failed its smoke test ({why.splitlines()[0]}); building again with "
                "fewer instruction sets")
    raise Failed("no build of llama.cpp's tools passed its smoke test here:\n"
                 + "\n".join(failures) + f"\n(the whole log: {log})")


# ---- one synthetic GGUF -------------------------------------------------------------------


def out_path(shape: Shape, out_dir: Path) -> Path:
    return out_dir / f"{shape.name}-{QUANT}.gguf"


def _converter_env(tools: Path) -> dict[str, str]:
    """PYTHONPATH for the convert script: the sdist's gguf-py first (it must match the script),
    and sentencepiece, which it imports for Llama-family models, installed beside the tools
    (pip install --target) when this Python has none."""
    paths = [str(tools / "convert" / "gguf-py")]
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        deps = tools / "pydeps"
        if not (deps / "sentencepiece").is_dir():
            say(f"installing sentencepiece (the convert script needs it) into {deps}")
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target",
                                   str(deps), "sentencepiece"], capture_output=True, text=True)
            if done.returncode != 0:
                raise Failed("pip install sentencepiece failed: "
                             + done.stderr.strip()[-600:]) from None
        paths.append(str(deps))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


# The convert script names a BPE pre-tokenizer from a hash of the ids its tokenizer gives a test
# text; transformers loads a qwen2 folder's tokenizer as Qwen2Tokenizer (Qwen's own pre-tokenizer,
# another hash), so the name is given instead: the vocabulary is SmolLM2's, whose name is
# "smollm" (the embedded GGUF's tokenizer.ggml.pre). The benches send token ids either way.
_CONVERT = """import sys
sys.path.insert(0, sys.argv.pop(1))
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def convert_command(tools: Path, hf: Path, out: Path) -> list[str]:
    """convert_hf_to_gguf.py --outtype f16, with SmolLM2's pre-tokenizer named."""
    return [sys.executable, "-c", _CONVERT, str(tools / "convert"), str(hf), "--outtype", "f16",
            "--outfile", str(out)]


def make(shape: Shape, out_dir: Path, tools: Path, tokenizer: Any) -> Path:
    """The Q4_K_M GGUF of `shape` in `out_dir`, made unless it is there already."""
    final = out_path(shape, out_dir)
    if final.is_file():
        say(f"{shape.name}: have {final}")
        return final
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_dead_temps(out_dir, ".tmp-")
    params = parameter_count(build_config(shape, len(tokenizer)))
    with tempfile.TemporaryDirectory(dir=out_dir,
                                     prefix=f".tmp-{os.getpid()}-{shape.name}-") as tmp:
        work = Path(tmp)
        log = work / "log.txt"
        say(f"{shape.name}: random weights at {shape.model}'s shape ({params / 1e9:.2f} B "
            f"parameters), bfloat16")
        write_hf_model(shape, work / "hf", tokenizer)
        say(f"{shape.name}: convert_hf_to_gguf.py --outtype f16")
        f16 = work / "f16.gguf"
        try:
            _run(convert_command(tools, work / "hf", f16), log,
                 f"{shape.name}: convert_hf_to_gguf.py", env=_converter_env(tools))
            shutil.rmtree(work / "hf")  # disk: the f16 file holds the same numbers now
            say(f"{shape.name}: llama-quantize {QUANT}")
            quantized = work / final.name
            _run([str(tools / "bin" / "llama-quantize"), str(f16), str(quantized), QUANT,
                  str(THREADS)], log, f"{shape.name}: llama-quantize")
        except Failed as exc:
            # the log goes with the temp folder: its tail is in the message
            raise Failed(str(exc).rsplit("\n(the whole log", 1)[0]) from None
        f16.unlink()
        os.replace(quantized, final)
    say(f"{shape.name}: wrote {final} ({final.stat().st_size / 2**20:,.0f} MiB)")
    return final


def _terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the temp folders' cleanup


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=[], metavar="NAME",
                        help=f"a shape to make (repeatable): {', '.join(SHAPES)}")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the GGUFs go (default: <kvchat cache dir>/synthetic)")
    parser.add_argument("--list", action="store_true", help="list the shapes and exit")
    parser.add_argument("--tools", action="store_true",
                        help="build llama-quantize and llama-bench only; print their folder")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel build jobs")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or llama_server.cache_root() / "synthetic"
    if args.list:
        for s in SHAPES.values():
            state = "made" if out_path(s, out_dir).is_file() else "not made"
            print(f"{s.name:11} {s.model:22} hidden {s.hidden}, {s.layers} layers, {s.heads} "
                  f"heads, {s.kv_heads} KV heads, MLP {s.mlp}, vocabulary {s.vocab:,}: "
                  f"{parameter_count(build_config(s)) / 1e9:.2f} B parameters ({state})")
        return 0
    unknown = [n for n in args.shape if n not in SHAPES]
    if unknown:
        parser.error(f"unknown --shape {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    if not args.shape and not args.tools:
        parser.error("name at least one --shape (or --list, or --tools)")
    signal.signal(signal.SIGTERM, _terminate)
    try:
        tools = build_tools(jobs=args.jobs)
        if args.tools:
            print(tools)
            return 0
        tokenizer = embedded_tokenizer() if any(
            not out_path(SHAPES[n], out_dir).is_file() for n in args.shape) else None
        for name in dict.fromkeys(args.shape):
            print(make(SHAPES[name], out_dir, tools, tokenizer), flush=True)
    except Failed as exc:
        print(f"synthetic_gguf: {exc}", file=sys.stderr)
        return 1
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return llama_server.NO_TOOLS if "cannot be built" in exc.code else 1
        raise
    except KeyboardInterrupt:
        print("synthetic_gguf: interrupted; nothing half-made was left behind", file=sys.stderr)
        return 130
    print(f"llama.cpp for `kvchat bench decode --llama-cpp`: {tools}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
