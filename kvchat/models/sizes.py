"""How big a model is, without loading it where that can be helped: its parameters from a
loaded model, from its config on the meta device, or from a folder's safetensors headers, and a
folder's bytes on disk. For `kvchat models` and the load report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.models.gguf import quiet_transformers

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def count_parameters(model: Any) -> int:
    # parameters() yields a tied embedding / LM head once, as the checkpoint stores it.
    return sum(p.numel() for p in model.parameters())


def meta_parameter_count(config: PretrainedConfig) -> int | None:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"), quiet_transformers():
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception:
        # Only a display number; an exotic config must not stop `kvchat models`.
        return None
    return count_parameters(skeleton)


def safetensors_parameter_count(folder: Path) -> int | None:
    """Parameters stored in a folder's safetensors files, from their JSON headers alone (no
    weights read, no model class imported). A tied embedding is stored, and counted, once."""
    import math
    import struct

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    try:
        for path in files:
            with open(path, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
            total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
