"""Whether a start reads a GGUF's packed weights or packs them (`kvchat.models.packed_weights`
is the file): `load_gguf_packed` reads the file made for this GGUF, precision and kvchat, and
otherwise streams the GGUF (`gguf_weights`) and keeps what it packed for the next start;
`packed_status` says which a load will do, for `kvchat models`.
"""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from typing import Any

import torch

from kvchat.models.packed_weights import (
    _MAX_HEADER,
    _PREFIX,
    MAGIC,
    VERSION,
    load_packed,
    packed_key,
    packed_path,
    save_packed,
)


def load_gguf_packed(gguf: Path, folder: Path, config: Any, precision: str, dtype: torch.dtype,
                     label: str) -> tuple[Any, int, str]:
    """The model of `gguf` at `precision`: read from its packed-weights file in `folder` when
    one was made for it, else streamed from the GGUF and packed (`gguf_weights`), then saved
    there for the next start. Only int4 and int8 are kept: a float precision is the GGUF
    de-quantized, which is not written. Returns (model, parameters, what happened: "read",
    "packed", or "packed, not kept: <why>")."""
    from kvchat.models.gguf import spinner
    from kvchat.models.gguf_weights import load_gguf_weights

    if precision not in ("int4", "int8"):
        model, done = load_gguf_weights(gguf, config, precision, dtype)
        return model, done.n_params, "streamed"
    compute = str(dtype).removeprefix("torch.")
    architecture = _architecture(config)
    key = packed_key(gguf, precision, compute, architecture, config.to_json_string())
    path = packed_path(folder, precision, compute)
    try:
        model, read = load_packed(path, key, config, dtype)
        return model, read.n_params, "read"
    except OSError:  # none, or unreadable now: packed, and written again if it can be
        pass
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception:  # damaged, made for another version, or not this model's: packed again
        with contextlib.suppress(OSError):
            path.unlink()
    with spinner(f"Packing {label}'s weights to {precision} for this machine's kernels; later "
                 f"starts read them from {path.name} in {folder}…"):
        model, done = load_gguf_weights(gguf, config, precision, dtype)
        try:
            save_packed(model, path, key, done.n_params)
        except (OSError, ValueError) as exc:
            why = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
            _warn(f"kvchat: could not keep {label}'s packed weights in {folder} ({why}); the "
                  "next start packs them again.")
            return model, done.n_params, f"packed, not kept: {why}"
    return model, done.n_params, "packed"


def _architecture(config: Any) -> str:
    return str((getattr(config, "architectures", None) or ["?"])[0])


def _warn(line: str) -> None:
    import sys

    from rich.console import Console

    Console(file=sys.stderr, highlight=False).print(line, markup=False)


def packed_status(gguf: Path, folder: Path, config: Any, precision: str,
                  compute: str) -> tuple[str, bool]:
    """Whether a load will read packed weights (True) or pack them, and one line saying so for
    `kvchat models` (the header's key is read, not the whole file's checksum)."""
    path = packed_path(folder, precision, compute)
    architecture = _architecture(config)
    try:
        with open(path, "rb") as fh:
            magic, version, length = _PREFIX.unpack(fh.read(_PREFIX.size))
            header = json.loads(fh.read(min(length, _MAX_HEADER)))
        size = path.stat().st_size
    except (OSError, ValueError, struct.error):
        return "none yet: the first load packs them and keeps them in the converted folder", \
            False
    if magic != MAGIC or version != VERSION or not isinstance(header, dict) \
            or header.get("key") != packed_key(gguf, precision, compute, architecture,
                                               config.to_json_string()):
        return f"{path.name} was made by another version: the next load packs them again", \
            False
    return f"{path.name} ({size / 2**20:,.1f} MiB): a load reads them instead of packing", True
