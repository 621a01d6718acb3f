"""A quantized GGUF's packed weights are kept on disk after its first load, and a later load
reads them: the same tensors, bit for bit, in the same modules, with the same logits; a file
that is damaged or made for something else is never read, and one that cannot be written
costs nothing but the next start's packing."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest
import torch
from conftest import build_tiny_config, build_tiny_model, write_tiny_gguf

from kvchat.models import gguf_weights, native, packed_weights
from kvchat.models.block_head import BlockHeadLinear
from kvchat.models.footprint import footprint_of
from kvchat.models.gguf import converted_dir_for
from kvchat.models.loading import describe_model, load_config, load_model, resolve_model
from kvchat.models.quant import QuantLinear
from kvchat.models.quant_embeddings import TiedInt8Embedding


def _gguf(tiny_tokenizer, tmp_path, quant="Q4_K", tied=False):
    config = build_tiny_config(tiny_tokenizer, hidden_size=256, intermediate_size=256,
                               num_hidden_layers=2, tie_word_embeddings=tied)
    return write_tiny_gguf(build_tiny_model(config), tiny_tokenizer,
                           tmp_path / f"{quant}-{tied}.gguf", lambda name: quant)


class _Streams:
    """Counts the loads that stream the GGUF (de-quantize and pack) instead of reading."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = gguf_weights.load_gguf_weights

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(gguf_weights, "load_gguf_weights", counted)


def _same(a, b):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
    kinds = [type(m).__name__ for m in a.model.modules()]
    assert kinds == [type(m).__name__ for m in b.model.modules()]
    ids = torch.tensor([[5, 9, 2, 40, 7, 0, 3]])
    with torch.no_grad():
        assert torch.equal(a.model(ids).logits, b.model(ids).logits)
    assert (a.facts.n_params, a.step_bytes) == (b.facts.n_params, b.step_bytes)


def _packed_file(path, precision="int4"):
    return packed_weights.packed_path(converted_dir_for(path), precision, "bfloat16")


@pytest.mark.parametrize(("quant", "tied", "precision"), [
    ("Q4_K", False, "int4"), ("Q4_K", False, "int8"), ("Q8_0", True, "int4"),
    ("Q4_K", True, "int8"), ("Q6_K", False, "int4"), ("Q6_K", True, "int8")])
def test_a_later_load_reads_the_packed_weights_and_gets_the_same_bits(
        quant, tied, precision, tiny_tokenizer, tmp_path, monkeypatch):
    path = _gguf(tiny_tokenizer, tmp_path, quant, tied)
    monkeypatch.setattr(gguf_weights, "CHUNK_ROWS_BYTES", 4096)  # the embedding read by rows
    streams = _Streams(monkeypatch)
    first = load_model(str(path), dtype=precision)
    assert streams.calls == 1
    kept = _packed_file(path, precision)
    assert kept.is_file()
    second = load_model(str(path), dtype=precision)
    assert streams.calls == 1  # read, not packed again
    _same(first, second)
    assert sum(isinstance(m, QuantLinear) for m in second.model.modules()) > 0
    # a tied Q8_0 table is read from the int8 head in both (no table of its own)
    shared = isinstance(first.model.get_input_embeddings(), TiedInt8Embedding)
    assert shared == (quant == "Q8_0" and tied)
    assert isinstance(second.model.get_input_embeddings(), TiedInt8Embedding) == shared
    # a Q6_K head keeps the file's blocks in both, a tied one the embedding reads too
    block_head = isinstance(second.model.get_output_embeddings(), BlockHeadLinear)
    assert block_head == (quant == "Q6_K")
    assert getattr(second.model.get_input_embeddings(), "tied", False) == (block_head and tied)


@pytest.mark.skipif(not native.int4_native(), reason="the int4 layers run on torch's kernel here")
def test_int4_layers_read_as_the_gguf_holds_them_are_read_from_it_again(
        tiny_tokenizer, tmp_path, monkeypatch):
    """Q4_K layers at int4 are the file's own nibbles, scales and zeros: the packed file keeps
    none of them (what it keeps is what packing cost), and a later load reads them from the
    GGUF again, to the same bits."""
    from kvchat.models import gguf_int4

    path = _gguf(tiny_tokenizer, tmp_path)
    first = load_model(str(path), dtype="int4")
    direct = [n for n, m in first.model.named_modules() if getattr(m, "gguf_tensor", None)]
    assert len(direct) == 2 * 7  # every linear layer of both blocks; the head is int8
    raw = _packed_file(path).read_bytes()
    _, _, length = packed_weights._PREFIX.unpack(raw[: packed_weights._PREFIX.size])
    header = json.loads(raw[packed_weights._PREFIX.size : packed_weights._PREFIX.size + length])
    kept = {r["name"] for r in header["tensors"]}
    assert not any(name.startswith(tuple(direct)) for name in kept)
    assert {e["attrs"].get("gguf_tensor") for e in header["modules"]} >= {
        "blk.0.attn_q.weight", "blk.1.ffn_down.weight"}
    calls = []
    real = gguf_int4.read_back
    monkeypatch.setattr(gguf_int4, "read_back", lambda *a: calls.append(a) or real(*a))
    second = load_model(str(path), dtype="int4")
    assert len(calls) == 1
    _same(first, second)


def test_the_file_is_its_owners_only_and_far_smaller_than_the_float_weights(
        tiny_tokenizer, tmp_path):
    path = _gguf(tiny_tokenizer, tmp_path)
    loaded = load_model(str(path), dtype="int4")
    kept = _packed_file(path)
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert kept.stat().st_size < 4 * loaded.facts.n_params / 2
    assert not list(kept.parent.glob(".tmp-packed-*"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "key", "config"])
def test_a_damaged_or_foreign_file_is_never_read_and_is_packed_again(
        damage, tiny_tokenizer, tmp_path, monkeypatch):
    path = _gguf(tiny_tokenizer, tmp_path)
    first = load_model(str(path), dtype="int4")
    kept = _packed_file(path)
    data = bytearray(kept.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10  # one bit of a weight
        kept.write_bytes(bytes(data))
    elif damage == "truncate":
        kept.write_bytes(bytes(data[: len(data) - 100]))
    elif damage == "key":  # the packing code changed since: its digest is part of the key
        monkeypatch.setattr(packed_weights, "_code_digest", lambda: "another-version")
    else:  # the converted config was edited (any field: a model built from it may differ)
        config_file = converted_dir_for(path) / "config.json"
        fields = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**fields, "edited_by_hand": True}))
    config = load_config(resolve_model(str(path)))
    key = packed_weights.packed_key(path, "int4", "bfloat16", "LlamaForCausalLM",
                                    config.to_json_string())
    with pytest.raises(packed_weights.PackedFileError):
        packed_weights.load_packed(kept, key, config, torch.bfloat16)
    streams = _Streams(monkeypatch)
    again = load_model(str(path), dtype="int4")
    assert streams.calls == 1
    _same(first, again)
    # written afresh, and read by the next load
    load_model(str(path), dtype="int4")
    assert streams.calls == 1


def test_a_full_disk_costs_only_the_next_starts_packing(tiny_tokenizer, tmp_path, monkeypatch,
                                                        capsys):
    path = _gguf(tiny_tokenizer, tmp_path)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # (patches undone on their own: monkeypatch.undo() would also undo the test's private
    # KVCHAT_CACHE_DIR, and the rest would write into the user's cache dir)
    with monkeypatch.context() as patch:
        patch.setattr(packed_weights.os, "fsync", full)
        loaded = load_model(str(path), dtype="int4")
    assert "No space left on device" in capsys.readouterr().err
    folder = converted_dir_for(path)
    assert not _packed_file(path).exists()
    assert not list(folder.glob(".tmp-packed-*"))
    # nor is a file written that would leave the disk nearly full
    with monkeypatch.context() as patch:
        patch.setattr(packed_weights, "FREE_MARGIN", 1 << 60)
        load_model(str(path), dtype="int4")
    assert "would leave less than" in capsys.readouterr().err
    assert not _packed_file(path).exists()
    _same(loaded, load_model(str(path), dtype="int4"))
    assert str(_packed_file(path)).startswith(str(tmp_path))  # in the test's own cache dir
    assert _packed_file(path).is_file()


def test_a_dead_loads_temp_file_is_removed_and_a_float_precision_keeps_nothing(
        tiny_tokenizer, tmp_path):
    path = _gguf(tiny_tokenizer, tmp_path)
    folder = converted_dir_for(path)
    load_model(str(path), dtype="bfloat16")
    assert not list(folder.glob("packed-*"))  # a float copy is never written
    stale = folder / ".tmp-packed-999999999.abc"  # no such process
    stale.write_bytes(b"half a file")
    load_model(str(path), dtype="int4")
    assert not stale.exists()


def test_torchs_int4_layout_has_its_own_file(tiny_tokenizer, tmp_path, monkeypatch):
    from kvchat.models import native

    path = _gguf(tiny_tokenizer, tmp_path)
    native_load = load_model(str(path), dtype="int4")
    monkeypatch.setattr(native, "int4_native", lambda: False)
    torch_file = _packed_file(path)
    assert "-torch_" in torch_file.name  # torch's layout follows the CPU capability
    streams = _Streams(monkeypatch)
    first = load_model(str(path), dtype="int4")
    second = load_model(str(path), dtype="int4")
    assert streams.calls == 1 and torch_file.is_file()
    _same(first, second)
    assert all(not m.native for m in second.model.modules() if hasattr(m, "native"))
    assert native_load.model.state_dict().keys() != second.model.state_dict().keys()


def test_a_retired_layouts_file_goes_when_this_version_packs(tiny_tokenizer, tmp_path):
    """An upgrade from the untiled int4 layout left its file beside the new one for good; the
    next packing removes it, and keeps the other precision's file and torch's layouts (another
    CPU sharing the folder reads its own)."""
    path = _gguf(tiny_tokenizer, tmp_path)
    load_model(str(path), dtype="bfloat16")  # converts the config and tokenizer, packs nothing
    folder = converted_dir_for(path)
    retired = folder / "packed-int4-bfloat16-native.kvw"
    kept = [folder / "packed-int4-bfloat16-torch_x86_64_avx2.kvw",
            folder / "packed-int8-bfloat16-native.kvw", folder / "packed-int4-float32-native.kvw"]
    for f in [retired, *kept]:
        f.write_bytes(b"an older version's packed weights")
    load_model(str(path), dtype="int4")
    assert _packed_file(path).is_file() and not retired.exists()
    assert all(f.read_bytes() == b"an older version's packed weights" for f in kept)


def _loading_bytes(report) -> int:
    """The float32 copies `kvchat models` expects a load of `report`'s model to hold."""
    footprint = footprint_of(report.source, report.folder, report.precision.name,
                             report.tied_head, 0, None, packed=report.packed_ready)
    assert footprint is not None
    return footprint.loading


def test_kvchat_models_says_whether_a_load_reads_or_packs(tiny_tokenizer, tmp_path):
    path = _gguf(tiny_tokenizer, tmp_path)
    before = describe_model(str(path), dtype="int4")
    assert before.packed_weights is not None and before.packed_weights.startswith("none yet")
    assert not before.packed_ready and _loading_bytes(before) > 0
    load_model(str(path), dtype="int4")
    after = describe_model(str(path), dtype="int4")
    assert after.packed_weights is not None
    assert "reads them instead of packing" in after.packed_weights
    # reading the file holds no float32 copy of a tensor on the side
    assert after.packed_ready and _loading_bytes(after) == 0
    assert describe_model(str(path), dtype="bfloat16").packed_weights is None


@pytest.mark.parametrize("tied", [False, True])
def test_a_block_embedding_read_back_is_whole_and_becomes_a_table(
        tied, tiny_tokenizer, tmp_path, monkeypatch):
    """A K-quant embedding kept as blocks comes back from the packed file with all its rows
    (a GPU start turns it into a table from them), and a file whose blocks are not its shape
    is never read."""
    from kvchat.models.quant_embeddings import BlockEmbedding

    path = _gguf(tiny_tokenizer, tmp_path, "Q4_K", tied)
    first = load_model(str(path), dtype="int4")
    second = load_model(str(path), dtype="int4")  # read from the packed file
    embed = second.model.get_input_embeddings()
    assert isinstance(embed, BlockEmbedding) and embed.whole()
    assert embed.num_embeddings == len(tiny_tokenizer)
    ids = torch.arange(embed.num_embeddings)
    want = first.model.get_input_embeddings()(ids)
    embed.to_table(torch.device("cpu"))  # what place_on_gpu does, here on the CPU
    assert embed.table is not None and torch.equal(embed(ids), want)
    streams = _Streams(monkeypatch)
    real = packed_weights._read

    def cut(*args):  # the embedding's blocks one row short
        header, tensors = real(*args)
        at = [r["name"] for r in header["tensors"]].index("model.embed_tokens.blocks")
        tensors[at] = tensors[at][1:]
        return header, tensors

    monkeypatch.setattr(packed_weights, "_read", cut)
    load_model(str(path), dtype="int4")
    assert streams.calls == 1  # packed again


def test_a_same_size_rewrite_that_keeps_the_mtime_is_packed_afresh(
        tiny_tokenizer, tmp_path, monkeypatch):
    """Its path, size and mtime are the packed file's, its weights not: the key's sample of
    the file's bytes tells them apart, so the load packs the new weights (and the converted
    folder is made again) instead of reading the old ones beside the new file's Q4 layers."""
    path = _gguf(tiny_tokenizer, tmp_path)
    first = load_model(str(path), dtype="int4")
    config = build_tiny_config(tiny_tokenizer, hidden_size=256, intermediate_size=256,
                               num_hidden_layers=2)
    other = build_tiny_model(config)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.5)
    rewrite = write_tiny_gguf(other, tiny_tokenizer, tmp_path / "other.gguf", lambda n: "Q4_K")
    assert rewrite.stat().st_size == path.stat().st_size
    stamp = path.stat()
    os.replace(rewrite, path)
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert path.stat().st_mtime_ns == stamp.st_mtime_ns
    streams = _Streams(monkeypatch)
    second = load_model(str(path), dtype="int4")
    assert streams.calls == 1  # packed afresh, not read
    fresh = load_model(str(path), dtype="int4")  # and that packing is what later loads read
    assert streams.calls == 1
    _same(second, fresh)
    ids = torch.tensor([[5, 9, 2, 40, 7]])
    with torch.no_grad():
        assert not torch.equal(second.model(ids).logits, first.model(ids).logits)
