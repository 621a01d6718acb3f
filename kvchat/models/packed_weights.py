"""A GGUF's packed weights kept on disk, so that a later start reads them instead of packing again.

Loading a GGUF at int4 or int8 de-quantizes every tensor and packs it for the kernels
(`gguf_weights`): most of a start (Gemma 3 270M: about 8 of its 14 s; a 3B-shaped Q4_K_M:
minutes). The first load of a file at a precision writes what it packed into the file's folder in
the kvchat cache dir (`packed-<precision>-<compute>-<layout>.kvw`, readable by its owner only),
and every later load reads it back: the same tensors, bit for bit, in the same modules.

    offset 0   magic b"KVPW", version (u16), header length h (u32)     10 bytes, little-endian
    offset 10  header: JSON {key, modules, tensors, n_params, ...}, padded with spaces so that
               10 + h is a multiple of 64
    10 + h     payload: each tensor's bytes, each starting at a multiple of 64
    end - 32   BLAKE2b-256 of everything before it

The key names everything that decides the packed numbers: the GGUF (path, size, mtime, and
`gguf.gguf_sample`'s digest of its header and of windows spread over it, so that a rewrite
keeping the size and the mtime is not mistaken for the file packed before), its
converted config, the precision and compute dtype, the int4 layout (kvchat's kernel's, or torch's
with the CPU capability it follows), the versions of torch, transformers and gguf-py, and a
digest of the modules that pack. A reader checks the length, the key and the tensor records,
and the checksum over every byte once all are read, before it builds the model; a file that
fails is removed and the load packs afresh (one it cannot open now is left as it is).
The weights are packed, never a float copy: the file is the size of the
weights the model holds (Gemma 3 270M: 240 MiB, against 1.07 GB de-quantized to float32).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvchat.models import quant
from kvchat.models.block_head import BlockHeadLinear
from kvchat.models.heap import huge_empty
from kvchat.models.quant import QuantLinear
from kvchat.models.quant_embeddings import BlockEmbedding, TiedInt8Embedding

MAGIC = b"KVPW"
VERSION = 2  # 2: Q4_1 / Q4_K int4 layers are read from the GGUF, not kept
_PREFIX = struct.Struct("<4sHI")
CHECKSUM_BYTES = 32
ALIGN = 64
FREE_MARGIN = 512 << 20  # what a packed file never takes from the disk: sessions need room too
_MAX_HEADER = 1 << 26
_TMP_PREFIX = ".tmp-packed-"
_DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool)}
_CLASSES: dict[str, type[QuantLinear]] = {
    cls.__name__: cls for cls in (quant.Int4Linear, quant.Int8Linear, quant.Int8HeadLinear,
                                  BlockHeadLinear)}
# the modules whose code decides the packed numbers: an edit to any of them packs afresh
_PACKING_MODULES = ("quant.py", "quant_embeddings.py", "block_head.py", "gguf_weights.py",
                    "native.py", "precision.py", "footprint.py", "packed_weights.py",
                    "gguf_int4.py", "int4_grid.c", "gguf_blocks.c", "native_sums.h")


class PackedFileError(ValueError):
    """A packed-weights file that must not be read; the message says why in a few words."""


@dataclass(frozen=True)
class PackedLoad:
    """What reading a packed-weights file gave: its tensors, bytes and the parameters counted
    when it was packed."""

    tensors: int
    n_bytes: int
    n_params: int


def packed_path(folder: Path, precision: str, compute: str) -> Path:
    return folder / f"packed-{precision}-{compute}-{_layout()}.kvw"


NATIVE_LAYOUT = "native_tiles"  # kvchat's int4 kernel's tiles, the same on every CPU


def _remove_retired_layouts(path: Path) -> None:
    """Files beside `path` at its precision and compute in a layout this version never
    writes (`native`, before the kernel's tiles): an upgrade would keep them for good, beside
    the file that replaced them. torch's layouts stay: they follow the CPU, and another
    machine sharing the folder may read its own."""
    tail = f"{_layout()}.kvw"
    if not (path.name.startswith("packed-") and path.name.endswith(f"-{tail}")):
        return  # not a name packed_path gives
    head = path.name[: -len(tail)]
    for entry in path.parent.glob(f"{head}*.kvw"):
        layout = entry.name[len(head) : -len(".kvw")]
        if entry != path and layout != NATIVE_LAYOUT and not layout.startswith("torch_"):
            with contextlib.suppress(OSError):
                entry.unlink()


def packed_key(gguf: Path, precision: str, compute: str, architecture: str,
               config_json: str = "") -> dict[str, Any]:
    """Everything that decides the numbers a load packs from `gguf`."""
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    import kvchat
    from kvchat.models.gguf import gguf_sample

    try:
        gguf_py = version("gguf")
    except PackageNotFoundError:
        gguf_py = "unknown"
    stat = gguf.stat()
    return {
        "gguf": str(gguf.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "sample": gguf_sample(gguf),  # a same-size rewrite keeping the mtime too
        "precision": precision, "compute": compute, "architecture": architecture,
        "config": hashlib.sha256(config_json.encode()).hexdigest()[:16],
        "int4_layout": _layout(), "kvchat": kvchat.__version__, "code": _code_digest(),
        "torch": torch.__version__, "transformers": transformers.__version__, "gguf_py": gguf_py,
    }


def save_packed(model: nn.Module, path: Path, key: dict[str, Any], n_params: int) -> None:
    """Write `model`'s tensors and its kvchat-made modules to `path`: a temp file in the same
    folder, readable by its owner only, renamed into place once complete. Raises OSError (a
    full disk, a read-only folder) with nothing left behind."""
    header, payload = _layout_of(model, key, n_params)
    data = json.dumps(header, separators=(",", ":")).encode()
    start = _PREFIX.size + len(data)
    data += b" " * (-start % ALIGN)
    _remove_stale_temp_files(path.parent)
    size = len(data) + int(header["payload_bytes"]) + CHECKSUM_BYTES
    if shutil.disk_usage(path.parent).free < size + FREE_MARGIN:  # leave room for the rest
        raise OSError(errno.ENOSPC, f"{size / 2**20:,.0f} MiB would leave less than "
                      f"{FREE_MARGIN >> 20} MiB free")
    fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{os.getpid()}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as out, _Digest() as digest:
            for chunk in _chunks(_PREFIX.pack(MAGIC, VERSION, len(data)) + data, payload):
                digest.update(chunk)
                out.write(chunk)
            out.write(digest.digest())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _remove_retired_layouts(path)


def load_packed(path: Path, key: dict[str, Any], config: Any, dtype: torch.dtype
                ) -> tuple[Any, PackedLoad]:
    """The model of `config` (compute `dtype`) with the tensors and modules of the packed file
    at `path`, made for `key`. Raises FileNotFoundError when there is none, PackedFileError
    when it is damaged or made for something else."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from kvchat.models.gguf import quiet_transformers

    header, tensors = _read(path, key)
    with init_empty_weights(include_buffers=False), quiet_transformers():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    tied_embedding = tied_blocks = None
    names = {record["name"] for record in header["tensors"]}
    for entry in header["modules"]:
        if entry["class"] == TiedInt8Embedding.__name__:
            tied_embedding = entry
            continue
        if entry["class"] == BlockEmbedding.__name__ and entry["attrs"].get("tied"):
            tied_blocks = entry  # the head's blocks: made once the head has them
            continue
        if entry["class"] == BlockEmbedding.__name__:  # its blocks are among the tensors
            owner, attr = _owner(model, entry["path"])
            attrs = entry["attrs"]
            setattr(owner, attr, BlockEmbedding(  # a meta shell: "lacks" below if not filled
                getattr(owner, attr), torch.empty(0, 0, dtype=torch.uint8, device="meta"),
                int(attrs["ggml_type"]), int(attrs["embedding_dim"])))
            continue
        cls = _CLASSES.get(entry["class"])
        if cls is None:
            raise PackedFileError(f"an unknown module {entry['class']!r}")
        owner, attr = _owner(model, entry["path"])
        setattr(owner, attr, _shell(cls, entry["attrs"], f"{entry['path']}.bias" in names))
    for record, tensor in zip(header["tensors"], tensors, strict=True):
        owner, leaf = _owner(model, record["name"])
        if record["param"]:
            owner.register_parameter(leaf, nn.Parameter(tensor, requires_grad=False))
        else:
            owner.register_buffer(leaf, tensor)
    if tied_blocks is not None:
        head, attrs = model.get_output_embeddings(), tied_blocks["attrs"]
        if not isinstance(head, BlockHeadLinear) \
                or not isinstance(getattr(head, "blocks", None), torch.Tensor):
            raise PackedFileError("its embedding reads a head it lacks")
        model.set_input_embeddings(BlockEmbedding(
            model.get_input_embeddings(), None, int(attrs["ggml_type"]),
            int(attrs["embedding_dim"]), head=head))
    if any(isinstance(m, (BlockEmbedding, BlockHeadLinear)) and not m.whole()
           for m in model.modules()):
        raise PackedFileError("its blocks are not their layer's shape")
    again = {e["path"]: e["attrs"]["gguf_tensor"] for e in header["modules"]
             if isinstance(e["attrs"].get("gguf_tensor"), str)}
    if again:
        from kvchat.models.gguf_int4 import read_back

        try:
            read_back(model, again, Path(key["gguf"]), config)
        except (ValueError, KeyError) as exc:
            raise PackedFileError(str(exc)) from exc
    if tied_embedding is not None:
        head = model.get_output_embeddings()
        assert isinstance(head, quant.Int8HeadLinear)
        model.set_input_embeddings(TiedInt8Embedding(model.get_input_embeddings(), head))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type == "meta"]
    if left:
        raise PackedFileError(f"it lacks {', '.join(left[:3])}")
    n_bytes = sum(t.numel() * t.element_size() for t in tensors)
    return model, PackedLoad(len(tensors), n_bytes, int(header["n_params"]))


def _layout() -> str:
    """Which int4 layout this machine packs: kvchat's kernel's (the same on every CPU), or
    torch's, whose blocks and nibble order follow the CPU capability ATen runs at."""
    import platform

    from kvchat.models.native import int4_native

    if int4_native():
        return NATIVE_LAYOUT
    return f"torch_{platform.machine()}_{torch.backends.cpu.get_cpu_capability()}".lower()


@functools.cache  # the sources do not change under a running process
def _code_digest() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    try:
        for name in _PACKING_MODULES:
            digest.update((here / name).read_bytes())
    except OSError:  # an install without its sources: the version alone keys the file
        return "no-sources"
    return digest.hexdigest()[:16]


def _layout_of(model: nn.Module, key: dict[str, Any], n_params: int
               ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header (key, modules, tensor records) and the tensors in payload order."""
    modules = []
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            modules.append({"path": name, "class": type(module).__name__,
                            "attrs": _plain_attributes(module)})
        elif isinstance(module, TiedInt8Embedding):
            modules.append({"path": name, "class": type(module).__name__, "attrs": {}})
        elif isinstance(module, BlockEmbedding):
            modules.append({"path": name, "class": type(module).__name__,
                            "attrs": {"ggml_type": module.ggml_type,
                                      "embedding_dim": module.embedding_dim,
                                      "tied": module.tied}})
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    # int4 layers read from the GGUF as it holds them are read from it again (`read_back`)
    from_gguf = {f"{name}.{b}" for name, module in model.named_modules()
                 if getattr(module, "gguf_tensor", None) for b in ("qweight", "scales", "zeros")}
    records, payload, seen, offset = [], [], set(), 0
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in from_gguf:
            continue
        if tensor.data_ptr() in seen and tensor.numel():
            raise ValueError(f"{name} shares its storage with another tensor")
        seen.add(tensor.data_ptr())
        if tensor.dtype not in _DTYPES.values():
            raise ValueError(f"{name} is {tensor.dtype}, which a packed file does not hold")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        offset += -offset % ALIGN
        records.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                        "shape": list(tensor.shape), "offset": offset,
                        "bytes": flat.numel(), "param": name in params})
        payload.append(flat)
        offset += flat.numel()
    offset += -offset % ALIGN
    header = {"key": key, "modules": modules, "tensors": records, "n_params": n_params,
              "payload_bytes": offset}
    return header, payload


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and k != "training" and isinstance(v, (bool, int, str))}


def _chunks(head: bytes, payload: list[torch.Tensor]) -> Any:
    """The file's bytes before its checksum, each tensor at the next multiple of ALIGN."""
    yield head
    offset = 0
    for flat in payload:
        if offset % ALIGN:
            yield bytes(-offset % ALIGN)
            offset += -offset % ALIGN
        yield flat.numpy().data
        offset += flat.numel()
    if offset % ALIGN:
        yield bytes(-offset % ALIGN)


def _read(path: Path, key: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header and the tensors of the file at `path`, each in its own allocation (a stacked
    layer that later replaces some of them frees them), after the checks: the length the
    header gives, the key, and the checksum over every byte read."""
    with open(path, "rb") as fh, _Digest() as digest:
        size = os.fstat(fh.fileno()).st_size
        prefix = fh.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise PackedFileError("truncated")
        magic, version, length = _PREFIX.unpack(prefix)
        if magic != MAGIC or version != VERSION or length > _MAX_HEADER:
            raise PackedFileError("not a packed-weights file of this kvchat")
        raw = fh.read(length)
        digest.update(prefix + raw)
        try:
            header = json.loads(raw)
        except ValueError as exc:
            raise PackedFileError("its header is not JSON") from exc
        if not isinstance(header, dict) or _PREFIX.size + length + int(header.get(
                "payload_bytes", -1)) + CHECKSUM_BYTES != size:
            raise PackedFileError("its length is not the one its header gives")
        if header.get("key") != key:
            raise PackedFileError("made for another file, precision or version")
        tensors, at = [], 0
        for record in header["tensors"]:
            tensor = _empty(record, at)
            _read_into(fh, digest, bytearray(int(record["offset"]) - at))
            _read_into(fh, digest, tensor.reshape(-1).view(torch.uint8).numpy().data)
            tensors.append(tensor)
            at = int(record["offset"]) + int(record["bytes"])
        if at > int(header["payload_bytes"]):
            raise PackedFileError("its tensors overrun its payload")
        _read_into(fh, digest, bytearray(int(header["payload_bytes"]) - at))
        if digest.digest() != fh.read(CHECKSUM_BYTES):
            raise PackedFileError("its checksum does not match")
    return header, tensors


class _Digest:
    """The BLAKE2b-256 of the chunks given, in order, computed on a thread of its own while the
    caller reads or writes the next one (hashlib lets go of the GIL on large buffers): a load
    or a save takes the longer of the two instead of their sum. A chunk must not change until
    `digest()`."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._sum = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvchat-digest")  # in order
        self._done: list[Any] = []

    def __enter__(self) -> _Digest:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def update(self, chunk: Any) -> None:
        self._done.append(self._pool.submit(self._sum.update, chunk))

    def digest(self) -> bytes:
        self._pool.shutdown(wait=True)
        for done in self._done:
            done.result()  # an error in the thread is the caller's
        return self._sum.digest()


def _empty(record: dict[str, Any], at: int) -> torch.Tensor:
    """The tensor a record describes, unfilled, once its fields are consistent: a known dtype,
    its bytes those of its shape, starting at or after `at`."""
    try:
        dtype = _DTYPES[record["dtype"]]
        tensor = huge_empty(tuple(int(d) for d in record["shape"]), dtype)
        fits = int(record["offset"]) >= at and \
            tensor.numel() * tensor.element_size() == int(record["bytes"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise PackedFileError("a tensor record is malformed") from exc
    if not fits:
        raise PackedFileError("a tensor record is malformed")
    return tensor


def _read_into(fh: Any, digest: Any, view: Any) -> None:
    """Fill `view` from `fh` and add it to `digest`."""
    got, want = 0, len(memoryview(view).cast("B"))
    while got < want:
        n = fh.readinto(memoryview(view).cast("B")[got:])
        if not n:
            raise PackedFileError("truncated")
        got += n
    digest.update(view)


def _shell(cls: type[QuantLinear], attrs: dict[str, Any], bias: bool) -> QuantLinear:
    """A `cls` layer with its plain attributes and no tensors but a meta bias where it has
    one: the file's tensors fill it."""
    layer = cls.__new__(cls)
    QuantLinear.__init__(layer, nn.Linear(int(attrs["in_features"]), int(attrs["out_features"]),
                                          bias=bias, device="meta"))
    for name, value in attrs.items():
        setattr(layer, name, value)
    return layer


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def _remove_stale_temp_files(folder: Path) -> None:
    """Temp files of loads whose process is gone (killed while writing)."""
    from kvchat.models.gguf import pid_alive

    for entry in folder.glob(f"{_TMP_PREFIX}*"):
        pid = entry.name.removeprefix(_TMP_PREFIX).split(".", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                entry.unlink()
