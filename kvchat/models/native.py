"""The output head's native kernel (int8_head.c): built with the machine's C compiler on first
use, once per source and compiler, into the kvchat cache dir, and loaded with ctypes.

torch's own int8 kernel reads a 262,144 x 640 head (Gemma 3) at a fraction of what the memory
gives; this one reads the head's int8 groups once per step and computes each logit in a fixed
order, so a row's logits are bitwise the same alone, in a batch, under any thread count, and on
AVX-512, AVX2 or portable C (tests check all three against each other and against the float
definition). Where no compiler is found, or KVCHAT_NATIVE=0, `int8_head_mm` computes the same
sum in torch (float32, one row at a time, a fixed chunk of weight rows at a time): slower, and
its bits are its own.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.errors import KvchatError
from kvchat.files import private_dir
from kvchat.models.gguf import cache_dir

if TYPE_CHECKING:
    import torch

# torch-free at import, like `kvchat.models.precision`: `kvchat models` names the kernel
SOURCE = Path(__file__).with_name("int8_head.c")
ENV_VAR = "KVCHAT_NATIVE"  # 0: never build or load it
ISAS = ("portable C", "AVX2", "AVX-512")
_FLAGS = ["-O2", "-shared", "-fPIC", "-ffp-contract=off", "-fopenmp"]
_FALLBACK_ROWS = 16384  # weight rows de-quantized at a time by the torch path


@cache
def _compiler() -> tuple[str, str] | None:
    """(the C compiler's path, its version line), or None."""
    name = os.environ.get("CC") or "cc"
    path = shutil.which(name) or shutil.which("gcc")
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return path, (out.stdout.splitlines() or [""])[0]


def _build(target: Path, compiler: str) -> None:
    """Compile into a temporary file beside `target`, then rename it over: a reader never sees
    a half-written library, and two processes building at once both end with a whole one."""
    private_dir(target.parent, "the native kernel folder")
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, str(SOURCE), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise OSError(done.stderr.strip()[-2000:] or f"exit {done.returncode}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, built first if needed; None where it cannot be (see `reason`)."""
    if os.environ.get(ENV_VAR, "1") == "0" or not SOURCE.is_file():
        return None
    found = _compiler()
    if found is None:
        return None
    compiler, version = found
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(_FLAGS).encode())
    target = cache_dir() / "native" / f"int8_head-{key.hexdigest()[:16]}.so"
    try:
        if not target.is_file():
            _build(target, compiler)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError, KvchatError):
        return None
    lib.kvchat_int8_head_mm.restype = ctypes.c_int
    lib.kvchat_int8_head_mm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4 + \
        [ctypes.c_int, ctypes.c_int]
    lib.kvchat_int8_head_isa.restype = ctypes.c_int
    return lib


def kernel_name() -> str:
    """What computes the head here, for `kvchat models` and the tests."""
    lib = library()
    if lib is None:
        return "torch (no native kernel: " + ("KVCHAT_NATIVE=0" if os.environ.get(ENV_VAR) == "0"
                                              else "no C compiler found") + ")"
    return f"native {ISAS[lib.kvchat_int8_head_isa()]}"


def int8_head_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int,
                 isa: int = -1) -> torch.Tensor:
    """(M, K) activations times the (N, K) int8 weight whose groups of `group` columns share a
    float32 scale ((N, K / group)): (M, N) float32. `isa` caps the instruction set (tests)."""
    import torch

    xf = x.float().contiguous()
    m, k = xf.shape
    n = q.shape[0]
    lib = library() if x.device.type == "cpu" else None
    if lib is None:
        return _torch_mm(xf, q, scales, group)
    out = torch.empty(m, n, dtype=torch.float32)
    rc = lib.kvchat_int8_head_mm(q.data_ptr(), scales.data_ptr(), xf.data_ptr(),
                                 out.data_ptr(), m, n, k, group, torch.get_num_threads(), isa)
    if rc != 0:
        raise ValueError(f"int8 head: no kernel for K={k}, group={group}")
    return out


def _torch_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
              group: int) -> torch.Tensor:
    """The same sum in torch, each row alone so that no row's bits depend on the others."""
    import torch

    n, k = q.shape
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for lo in range(0, n, _FALLBACK_ROWS):
        hi = min(n, lo + _FALLBACK_ROWS)
        w = (q[lo:hi].view(hi - lo, k // group, group).float()
             * scales[lo:hi, :, None]).view(hi - lo, k)
        for row in range(x.shape[0]):
            out[row, lo:hi] = torch.mv(w, x[row])
    return out
