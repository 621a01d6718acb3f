"""Sessions on disk, the cache snapshot (round trip, mismatch, damage), the lock, and chat turns
that extend a session's own token history."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import time
from pathlib import Path

import pytest
import torch
from conftest import cache_config, make_engine, make_runtime

from kvchat.config import SamplingParams
from kvchat.engine.sequence import Request
from kvchat.runtime import Runtime
from kvchat.session_lock import SessionsLocked, sessions_lock
from kvchat.sessions import Session, SessionError, SessionStore, validate_name
from kvchat.turns import next_prompt, prepare_turn


def runtime(model, tokenizer, root: Path, block_size: int = 4, policy: str = "lru") -> Runtime:
    return make_runtime(model, tokenizer, root, block_size=block_size, num_blocks=200,
                        policy=policy)


def fill(rt: Runtime, n: int = 3) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(250) for _ in range(13)]
    prompts = [shared + [rng.randrange(250) for _ in range(5 + i)] for i in range(n)]
    for p in prompts:
        rt.engine.generate(Request(p, SamplingParams(max_new_tokens=4)))
    return prompts


def test_a_restart_serves_the_cache_from_disk_bitwise(tiny_model, tiny_tokenizer, tmp_path):
    a = runtime(tiny_model, tiny_tokenizer, tmp_path)
    prompts = fill(a)
    a.save()
    b = runtime(tiny_model, tiny_tokenizer, tmp_path)
    assert b.notice is None and b.restored_tokens == a.cache.tree.num_tokens
    b.cache.check_integrity()
    assert b.cache.stats().tree_nodes == a.cache.stats().tree_nodes
    assert b.cache.manager.num_free == b.cache.manager.num_blocks  # nothing read at start-up
    for p in prompts:
        la, lb = a.cache.lookup(p), b.cache.lookup(p)
        assert (la.matched, la.source) == (lb.matched, lb.source)
        assert lb.source.value == "exact" and lb.disk_tokens > 0  # its tail loaded from disk
        assert torch.equal(la.logits, lb.logits)
        n = lb.matched
        for (ka, va), (kb, vb) in zip(a.cache.gather(la.blocks, n),
                                      b.cache.gather(lb.blocks, n), strict=True):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
        a.cache.release(la.blocks)
        b.cache.release(lb.blocks)
        b.cache.check_integrity()
    assert b.cache.stats().disk_hits >= 1
    # the restored cache keeps working: a new request hits and stores on top of it
    res = b.engine.generate(Request(prompts[0] + [7, 7], SamplingParams(max_new_tokens=3)))
    assert res.cache_hit_tokens == len(prompts[0])
    b.cache.check_integrity()
    for rt in (a, b):
        rt.close()


def test_fingerprint_mismatch_is_set_aside(tiny_model, tiny_tokenizer, tmp_path):
    a = runtime(tiny_model, tiny_tokenizer, tmp_path, block_size=4)
    fill(a)
    a.save()
    b = runtime(tiny_model, tiny_tokenizer, tmp_path, block_size=8)
    assert b.notice is not None and "block_size" in b.notice and "set aside" in b.notice
    assert b.cache.stats().tree_nodes == 0
    aside = list((tmp_path / "cache" / "set-aside").iterdir())
    assert len(aside) == 1 and (aside[0] / "index.json").exists()  # kept, not deleted
    assert not (tmp_path / "cache" / "index.json").exists()


def test_other_weights_or_numerics_set_the_snapshot_aside(tiny_model, tiny_tokenizer, tmp_path,
                                                          monkeypatch):
    """K/V and logits another file's weights, or other kernels, computed are not this
    process's: a hit on them could change an answer, so the snapshot is set aside."""
    from kvchat import runtime as runtime_module
    from kvchat.runtime import Runtime, RuntimeOptions

    def opened(weights: str) -> Runtime:
        engine = make_engine(tiny_model, tiny_tokenizer, block_size=4, num_blocks=200)
        options = RuntimeOptions(cache=cache_config(block_size=4, num_blocks=200),
                                 sessions_dir=tmp_path)
        rt = Runtime(engine, options, "tiny", weights)
        rt.restore()
        return rt

    a = opened("weights-1")
    fill(a)
    a.save()
    a.close()
    same = opened("weights-1")
    assert same.notice is None and same.cache.stats().tree_nodes > 0  # nothing changed: kept
    same.close()
    other = opened("weights-2")
    assert other.notice is not None and "weights" in other.notice and "set aside" in other.notice
    assert other.cache.stats().tree_nodes == 0
    fill(other)
    other.save()
    other.close()
    monkeypatch.setattr(runtime_module, "numerics", lambda: "other kernels")
    later = opened("weights-2")
    assert later.notice is not None and "numerics" in later.notice
    assert later.cache.stats().tree_nodes == 0
    fill(later)
    later.save()
    later.close()
    # another forward (here: H2O's tracked attention) wrote other K/V: set aside too
    h2o = make_runtime(tiny_model, tiny_tokenizer, tmp_path, block_size=4, num_blocks=200,
                       policy="h2o")
    assert h2o.notice is not None and "forward" in h2o.notice
    h2o.close()


def test_the_weights_digest_follows_the_bytes_of_each_weight_file(tmp_path):
    from types import SimpleNamespace

    from kvchat.models.loading import ModelSource
    from kvchat.runtime import weights_digest

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"a" * 1000)
    (folder / "config.json").write_text("{}")
    loaded = SimpleNamespace(source=ModelSource("folder", str(folder), "local folder model"),
                             folder=folder, model=None)
    first = weights_digest(loaded)
    (folder / "config.json").write_text('{"x": 1}')  # not a weight file: the same digest
    assert weights_digest(loaded) == first

    def rewrite(path: Path, data: bytes) -> None:
        """The same size, other bytes; the digest is recomputed when the file's times move,
        which a coarse clock may not show between two writes this close: move them."""
        path.write_bytes(data)
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))

    rewrite(folder / "model.safetensors", b"b" * 1000)
    assert weights_digest(loaded) != first
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"g" * 500)
    as_file = SimpleNamespace(source=ModelSource("gguf", str(gguf), "GGUF file m.gguf"),
                              folder=folder, model=None)
    before = weights_digest(as_file)
    rewrite(gguf, b"h" * 500)
    assert weights_digest(as_file) != before


def test_a_safetensors_shard_is_sampled_after_its_header_not_its_first_16_mib(tmp_path):
    """A folder's shards: the header (the tensor table) read whole, then the spaced windows;
    a folder of many shards must not read 16 MiB of each."""
    import struct

    from safetensors.torch import save_file

    from kvchat.runtime import _head_of

    shard = tmp_path / "model-00001-of-00002.safetensors"
    save_file({"w": torch.zeros(4 << 20, dtype=torch.uint8)}, str(shard))  # 4 MiB of weights
    size = struct.unpack("<Q", shard.read_bytes()[:8])[0]
    assert "w" in json.loads(shard.read_bytes()[8 : 8 + size])
    assert _head_of(shard) == 8 + size < 4096
    assert _head_of(tmp_path / "m.gguf") == 16 << 20


@pytest.mark.parametrize("damage", ["truncate-index", "garbage-index", "old-format"])
def test_damaged_index_is_set_aside(tiny_model, tiny_tokenizer, tmp_path, damage):
    a = runtime(tiny_model, tiny_tokenizer, tmp_path)
    fill(a)
    a.save()
    a.close()
    folder = tmp_path / "cache"
    index = folder / "index.json"
    if damage == "truncate-index":
        index.write_bytes(index.read_bytes()[:50])
    elif damage == "garbage-index":
        index.write_text('{"version": 2, "tree": [{"start": 0, "tokens": [1], "keys": ["x"], '
                         '"children": []}], "block_size": 4, "shape": [1, 1, 1], '
                         '"fingerprint": ' + json.dumps(a._fingerprint) + "}")
    else:  # a version 1 snapshot: one K/V file beside the index
        index.write_text('{"version": 1, "tree": [], "blocks": [], "kv_file": "kv-1.safetensors"}')
        (folder / "kv-1.safetensors").write_bytes(b"old")
    b = runtime(tiny_model, tiny_tokenizer, tmp_path)
    assert b.notice is not None and "set aside" in b.notice
    b.cache.check_integrity()
    assert b.cache.stats().tree_nodes == 0 and b.cache.stats().pool.used_blocks == 0
    assert any((tmp_path / "cache" / "set-aside").iterdir())
    assert not list(folder.glob("kv-*"))
    # and the next save works from a clean slate
    fill(b, 1)
    b.save()
    b.close()
    c = runtime(tiny_model, tiny_tokenizer, tmp_path)
    assert c.notice is None and c.restored_tokens > 0
    c.close()


def test_session_names_are_validated(tmp_path):
    for bad in ["", "../x", "a/b", "a\\b", ".hidden", "cache", "x" * 65, "a b"]:
        with pytest.raises(SessionError):
            validate_name(bad)
    assert validate_name("team-chat_2.v1") == "team-chat_2.v1"
    with pytest.raises(SessionError):
        SessionStore(tmp_path).path("../etc/passwd")


def test_session_file_round_trip_and_corrupt_file(tmp_path):
    store = SessionStore(tmp_path)
    s = Session("alpha", system="be brief", messages=[{"role": "user", "content": "hi"}],
                tokens=[1, 2, 3])
    store.save(s)
    assert store.load("alpha").to_json() == s.to_json()
    assert store.names() == ["alpha"]
    (tmp_path / "beta.json").write_text("{not json")
    with pytest.raises(SessionError, match="moved"):
        store.load("beta")
    assert not (tmp_path / "beta.json").exists()
    assert store.load("fresh").tokens == []


def _hold_lock(root: str, ready, release) -> None:
    with sessions_lock(Path(root), "kvchat chat"):
        ready.set()
        release.wait(10)


def test_lock_serialises_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready, release))
    proc.start()
    try:
        assert ready.wait(10)
        t = time.monotonic()
        with pytest.raises(SessionsLocked, match=r"pid \d+ \(kvchat chat"):
            with sessions_lock(tmp_path, "kvchat batch", wait_s=0.3):
                pass
        assert time.monotonic() - t >= 0.3
    finally:
        release.set()
        proc.join(10)
    with sessions_lock(tmp_path, "kvchat batch", wait_s=1):
        pass


def test_chat_turns_extend_the_history(tiny_model, tiny_tokenizer, tmp_path):
    rt = runtime(tiny_model, tiny_tokenizer, tmp_path)
    session = Session("s", system="You are terse.")
    params = SamplingParams(max_new_tokens=6)
    rates, before = [], []
    for text in ["hello there", "and again", "one more"]:
        before.append(len(session.tokens))
        prepared = prepare_turn(rt.engine.codec, [{"role": "user", "content": text}], params,
                                session)
        turn = prepared.commit(rt.engine.generate(prepared.request()))
        assert turn is not None
        rates.append(turn.hit_rate)
        rt.cache.check_integrity()
    assert rates[0] < 0.5
    # from turn 2 on, everything but the new user message is a hit
    assert all(r > 0.6 for r in rates[1:])
    # the whole previous history hits, except the last sampled token (never fed, so no K/V)
    assert [t.hit_tokens for t in session.turns[1:]] == [n - 1 for n in before[1:]]
    # the next prompt is the previous tokens plus the template's text for the new message
    nxt = next_prompt(rt.engine.codec, session, "last")
    assert nxt[: len(session.tokens)] == session.tokens
    tail = rt.engine.codec.decode(nxt[len(session.tokens):], skip_special_tokens=False)
    assert "last" in tail and tail.endswith("<|im_start|>assistant\n")


def test_the_vocabulary_is_read_in_chunks_as_the_tokenizer_holds_it(tiny_tokenizer):
    """`vocabulary` gives every (id, token) `get_vocab` holds, in id order, a chunk at a time;
    the fingerprint's tokenizer digest changes with one token, and with the template."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from kvchat.engine.codec import ChatCodec, vocabulary
    from kvchat.runtime import _tokenizer_digest

    chunks = list(vocabulary(tiny_tokenizer, size=100))
    assert [len(c) for c in chunks] == [100, 100, 59]
    pairs = [p for c in chunks for p in c]
    assert pairs == sorted((i, t) for t, i in tiny_tokenizer.get_vocab().items())
    assert ChatCodec(tiny_tokenizer).longest_token == max(map(len, tiny_tokenizer.get_vocab()))

    def fast(vocab: dict[str, int], template: str = "") -> PreTrainedTokenizerFast:
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab, [])),
                                       chat_template=template or None)

    base = {"a": 0, "b": 1, "c": 2}
    digest = _tokenizer_digest(fast(base))
    assert digest == _tokenizer_digest(fast(dict(base)))
    assert digest != _tokenizer_digest(fast({"a": 0, "b": 2, "c": 1}))  # two ids swapped
    assert digest != _tokenizer_digest(fast({**base, "d": 3}))
    assert digest != _tokenizer_digest(fast(base, "{{ messages }}"))
    # a vocabulary with holes: every token is read, the ids past them too
    holes = fast({"a": 0, "c": 2, "z": 1000})
    assert [p for c in vocabulary(holes, size=4) for p in c] == [(0, "a"), (2, "c"), (1000, "z")]
    assert _tokenizer_digest(holes) != _tokenizer_digest(fast({"a": 0, "c": 2, "z": 1001}))
