"""A GGUF's config read in a fraction of a second, for the first run's conversion.

transformers builds the config of most architectures (Llama, Qwen2, Gemma 3, ...) with its
legacy `load_gguf_checkpoint`, which opens the file with gguf-py's `GGUFReader`: that reader
makes a numpy view per element of every metadata array, and `AutoConfig` and `AutoTokenizer`
each run it once. A 128k-token vocabulary with 280k merges took 5.4 s a pass on a 2-core Xeon,
10.7 s of a first run's 26 s. Neither caller keeps more than the result's "config".

`fast_config_reads()` hands that function a reader with the same fields built from
transformers' own fast metadata reader (`read_gguf_metadata`, which walks the string arrays
without decoding them): every scalar and number array exactly as the file holds it, and the
long `tokenizer.*` string arrays as placeholders of the right length (their count is all a
config takes from them: the vocabulary size). Where this transformers lacks the fast reader,
nothing is replaced. The tests compare the config both ways on the GGUFs they build.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_BOOL, _INT, _FLOAT, _STRING, _ARRAY = 7, 5, 6, 8, 9  # gguf.GGUFValueType


@dataclass
class _Field:
    """What transformers reads of gguf-py's `ReaderField`: parts[i] for i in data, with types."""

    types: list[int]
    parts: list[Any] = field(default_factory=list)
    data: list[int] | range = field(default_factory=list)


@dataclass
class _Tensor:
    name: str


def _scalar_type(value: Any) -> int:
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, int):
        return _INT
    return _FLOAT


def _field(value: Any) -> _Field:
    if isinstance(value, str):
        return _Field([_STRING], [value.encode()], [0])
    if isinstance(value, list):  # numbers, decoded in full
        kind = _scalar_type(value[0]) if value else _INT
        return _Field([_ARRAY, kind], [[v] for v in value], range(len(value)))
    return _Field([_scalar_type(value)], [[value]], [0])


class MetadataReader:
    """`GGUFReader`'s `fields` and `tensors` as `load_gguf_checkpoint` reads them when it
    returns no tensors. A string array the fast reader left as a count (a vocabulary, a merge
    table) becomes that many empty strings."""

    def __init__(self, path: Any) -> None:
        from transformers.integrations.gguf.reader import read_gguf_metadata

        metadata, names = read_gguf_metadata(str(path))
        self.fields: dict[str, _Field] = {}
        for key, value in metadata.items():
            if isinstance(value, int) and not isinstance(value, bool) \
                    and key.startswith("tokenizer.") and _is_array_count(key):
                self.fields[key] = _Field([_ARRAY, _STRING], [b""], [0] * value)
            else:
                self.fields[key] = _field(value)
        self.tensors = [_Tensor(name) for name in names]


# the string arrays a GGUF's tokenizer holds; the fast reader gives their length
_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                  "tokenizer.ggml.added_tokens", "tokenizer.ggml.pre_tokens")


def _is_array_count(key: str) -> bool:
    return key in _STRING_ARRAYS


def available() -> bool:
    """Whether this transformers has the fast reader `MetadataReader` stands on, and builds a
    GGUF's tokenizer through it (so the legacy reader's result gives a config only)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: F401
            get_gguf_tokenizer,
        )
        from transformers.integrations.gguf.reader import read_gguf_metadata  # noqa: F401
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: F401
    except ImportError:
        return False
    return True


_LOCK = threading.RLock()  # one conversion at a time swaps transformers' reader


@contextlib.contextmanager
def fast_config_reads() -> Iterator[None]:
    """While inside, transformers' `load_gguf_checkpoint(path, return_tensors=False)` reads
    the file through `MetadataReader` (and, should that fail, as it did); anything that asks
    for tensors runs as it did."""
    if not available():
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as legacy

    with _LOCK:
        original = legacy.load_gguf_checkpoint

        def config_only(path: Any, return_tensors: bool = False, *args: Any,
                        **kwargs: Any) -> Any:
            if return_tensors or args or kwargs.get("model_to_load") is not None:
                return original(path, return_tensors, *args, **kwargs)
            import gguf

            with _LOCK:
                reader_class = gguf.GGUFReader
                gguf.GGUFReader = MetadataReader  # type: ignore[misc, assignment]
                try:
                    return original(path, return_tensors=False)
                except Exception:  # the fast reader could not: the legacy one reads it
                    gguf.GGUFReader = reader_class  # type: ignore[misc]
                    return original(path, return_tensors=False)
                finally:
                    gguf.GGUFReader = reader_class  # type: ignore[misc]

        legacy.load_gguf_checkpoint = config_only  # type: ignore[assignment]
        try:
            yield
        finally:
            legacy.load_gguf_checkpoint = original  # type: ignore[assignment]
