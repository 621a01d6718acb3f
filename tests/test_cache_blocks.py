"""Block handles and the BlockManager: allocation bookkeeping and bitwise K/V traffic."""

from __future__ import annotations

import pytest
import torch
from _cache_helpers import (
    HEAD_DIM,
    N_KV_HEADS,
    N_LAYERS,
    assert_kv_equal,
    in_node,
    make_manager,
    ref_kv,
)

from kvchat.cache.blocks import Block, BlockManager


def _kv(n: int, seed: int, n_layers: int = N_LAYERS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, N_KV_HEADS, n, HEAD_DIM)
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(n_layers)
    ]


def _slice(kv: list[tuple[torch.Tensor, torch.Tensor]], lo: int, hi: int) -> list[
    tuple[torch.Tensor, torch.Tensor]
]:
    return [(k[:, :, lo:hi], v[:, :, lo:hi]) for k, v in kv]


# ---- Block -----------------------------------------------------------------------------------


def test_block_acquire_release_counts() -> None:
    b = Block(3, 8)
    assert (b.block_id, b.block_size, b.ref_count, b.num_tokens) == (3, 8, 0, 0)
    b.acquire()
    b.acquire()
    assert b.ref_count == 2
    b.release()
    assert b.ref_count == 1
    b.release()
    assert b.ref_count == 0


def test_block_release_below_zero_raises() -> None:
    b = Block(0, 4)
    with pytest.raises(RuntimeError, match="released more often"):
        b.release()
    b.acquire()
    b.release()
    with pytest.raises(RuntimeError):
        b.release()
    assert b.ref_count == 0


def test_block_clear_resets_every_field() -> None:
    b = Block(5, 4)
    in_node([b], [1, 2, 3])
    b.acquire()
    b.last_accessed = 17
    b.attn_score = 2.5
    assert (b.token_ids, b.num_tokens, b.is_first_block) == ([1, 2, 3], 3, True)
    b.clear()
    assert (b.node, b.token_ids, b.num_tokens) == (None, [], 0)
    assert (b.ref_count, b.last_accessed, b.is_first_block, b.attn_score) == (0, 0, False, 0.0)
    assert b.block_id == 5 and b.block_size == 4


def test_a_block_reads_its_tokens_from_its_node_and_holds_no_copy() -> None:
    b0, b1, b2 = Block(0, 4), Block(1, 4), Block(2, 4)
    node = in_node([b0, b1, b2], list(range(10)))
    assert [b.token_ids for b in (b0, b1, b2)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [b.num_tokens for b in (b0, b1, b2)] == [4, 4, 2]
    assert [b.is_first_block for b in (b0, b1, b2)] == [True, False, False]
    node.tokens.append(10)  # the edge grows: the block holding its end reads the new token
    assert b2.token_ids == [8, 9, 10]
    b1.token_ids[0] = 99  # a fresh slice: writing into it leaves the edge alone
    assert node.tokens[4] == 4
    with pytest.raises(AttributeError):
        b1.token_ids = [7]  # type: ignore[misc]
    with pytest.raises(AttributeError):
        b1.is_first_block = True  # type: ignore[misc]
    assert not hasattr(b1, "__dict__")  # no room for a stray copy either
    assert not in_node([b0], [1], start=4).blocks[0].is_first_block  # not at position 0


# ---- allocation bookkeeping ------------------------------------------------------------------


def test_allocate_gives_distinct_acquired_blocks_and_updates_stats() -> None:
    m = make_manager(num_blocks=10, block_size=4)
    s = m.stats()
    assert (s.total_blocks, s.used_blocks, s.free_blocks, s.utilisation) == (10, 0, 10, 0.0)
    assert s.capacity_tokens == 40
    blocks = m.allocate(4)
    assert [b.block_id for b in blocks] == [0, 1, 2, 3]  # the free list is FIFO
    assert all(b.ref_count == 1 for b in blocks)
    assert all(not m.is_free(b.block_id) for b in blocks)
    s = m.stats()
    assert (s.total_blocks, s.used_blocks, s.free_blocks) == (10, 4, 6)
    assert s.utilisation == pytest.approx(0.4)
    assert m.num_free == 6


def test_bytes_per_block() -> None:
    m = BlockManager(4, 16, n_layers=3, n_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    assert m.bytes_per_block == 2 * 3 * 2 * 16 * 8 * 2
    assert m.stats().bytes_per_block == m.bytes_per_block


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    m = make_manager(num_blocks=3)
    m.allocate(2)
    with pytest.raises(MemoryError):
        m.allocate(2)
    assert m.num_free == 1
    assert len(m.allocate(1)) == 1
    assert m.stats().utilisation == 1.0


def test_free_returns_blocks_and_clears_them() -> None:
    m = make_manager(num_blocks=4)
    (b,) = m.allocate(1)
    in_node([b], [9, 9])
    assert b.is_first_block
    b.release()
    m.free([b])
    assert m.is_free(b.block_id)
    assert b.node is None and b.token_ids == [] and not b.is_first_block
    assert m.stats().used_blocks == 0
    assert list(m.free_ids)[-1] == b.block_id  # goes to the back: least recently freed first


def test_free_while_referenced_raises() -> None:
    m = make_manager(num_blocks=4)
    (b,) = m.allocate(1)
    with pytest.raises(RuntimeError, match="referenced"):
        m.free([b])
    assert not m.is_free(b.block_id) and m.num_free == 3


def test_double_free_raises() -> None:
    m = make_manager(num_blocks=4)
    (b,) = m.allocate(1)
    b.release()
    m.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        m.free([b])
    assert m.num_free == 4 and len(set(m.free_ids)) == 4


def test_never_allocated_block_cannot_be_freed() -> None:
    m = make_manager(num_blocks=4)
    with pytest.raises(RuntimeError, match="double free"):
        m.free([m.blocks[2]])


def test_allocate_clears_previous_contents() -> None:
    m = make_manager(num_blocks=1)
    (b,) = m.allocate(1)
    in_node([b], [1])
    b.attn_score = 3.0
    b.release()
    m.free([b])
    (b2,) = m.allocate(1)
    assert b2 is b and b2.token_ids == [] and b2.attn_score == 0.0 and b2.ref_count == 1


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 4, 1, 1, 1)
    with pytest.raises(ValueError):
        BlockManager(4, 0, 1, 1, 1)
    with pytest.raises(ValueError, match="one device per layer"):
        BlockManager(4, 4, 2, 1, 1, devices=["cpu"])


# ---- K/V traffic -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [8, 6, 1, 12])  # full blocks, partial last block, single token
def test_write_then_gather_round_trip(n: int) -> None:
    m = make_manager(num_blocks=8, block_size=4)
    ids = [b.block_id for b in m.allocate(-(-n // 4))]
    kv = _kv(n, seed=n)
    m.write(ids, 0, kv)
    assert_kv_equal(m.gather(ids, n), kv)


def test_write_at_unaligned_offset_keeps_earlier_positions() -> None:
    m = make_manager(num_blocks=8, block_size=4)
    ids = [b.block_id for b in m.allocate(3)]
    full = _kv(11, seed=1)
    m.write(ids, 0, _slice(full, 0, 3))  # positions 0..2
    m.write(ids, 3, _slice(full, 3, 10))  # 3..9: starts mid-block, crosses two boundaries
    m.write(ids, 10, _slice(full, 10, 11))
    assert_kv_equal(m.gather(ids, 11), full)
    assert_kv_equal(m.gather(ids, 5), _slice(full, 0, 5))


def test_gather_reads_blocks_in_the_requested_order() -> None:
    m = make_manager(num_blocks=8, block_size=4)
    for b in m.allocate(8):
        # block b holds positions whose K/V is the constant b (V: -b)
        m.write([b.block_id], 0, [
            (torch.full((1, N_KV_HEADS, 4, HEAD_DIM), float(b.block_id)),
             torch.full((1, N_KV_HEADS, 4, HEAD_DIM), -float(b.block_id)))
        ] * N_LAYERS)
    order = [5, 2, 7]
    for k, v in m.gather(order, 10):
        per_pos = k[0, 0, :, 0].tolist()
        assert per_pos == [5.0] * 4 + [2.0] * 4 + [7.0] * 2
        assert v[0, 1, :, 3].tolist() == [-5.0] * 4 + [-2.0] * 4 + [-7.0] * 2


def test_gather_returns_a_copy_not_a_view_of_the_pool() -> None:
    m = make_manager(num_blocks=4, block_size=4)
    ids = [b.block_id for b in m.allocate(2)]
    kv = _kv(8, seed=3)
    m.write(ids, 0, kv)
    got = m.gather(ids, 8)
    got[0][0].zero_()
    got[1][1].fill_(7.0)
    assert_kv_equal(m.gather(ids, 8), kv)


def test_gather_shapes_and_zero_tokens() -> None:
    m = make_manager(num_blocks=4, block_size=4)
    ids = [b.block_id for b in m.allocate(2)]
    out = m.gather(ids, 5)
    assert len(out) == N_LAYERS
    assert all(k.shape == v.shape == (1, N_KV_HEADS, 5, HEAD_DIM) for k, v in out)
    assert m.gather([], 0)[0][0].shape == (1, N_KV_HEADS, 0, HEAD_DIM)


def test_write_and_gather_reject_runs_that_do_not_fit() -> None:
    m = make_manager(num_blocks=4, block_size=4)
    ids = [b.block_id for b in m.allocate(2)]
    with pytest.raises(ValueError, match="does not fit"):
        m.write(ids, 5, _kv(4, seed=0))
    with pytest.raises(ValueError, match="layers"):
        m.write(ids, 0, _kv(4, seed=0, n_layers=1))
    with pytest.raises(ValueError, match="exceeds"):
        m.gather(ids, 9)


def test_layers_and_k_v_are_independent() -> None:
    m = make_manager(num_blocks=4, block_size=4)
    ids = [b.block_id for b in m.allocate(2)]
    kv = ref_kv(list(range(7)))
    m.write(ids, 0, kv)
    out = m.gather(ids, 7)
    assert not torch.equal(out[0][0], out[0][1])  # K != V
    assert not torch.equal(out[0][0], out[1][0])  # layer 0 != layer 1
    assert_kv_equal(out, kv)


def test_copy_tokens_copies_only_the_head() -> None:
    m = make_manager(num_blocks=4, block_size=4)
    src, dst = m.allocate(2)
    a, b = _kv(4, seed=10), _kv(4, seed=11)
    m.write([src.block_id], 0, a)
    m.write([dst.block_id], 0, b)
    m.copy_tokens(src, dst, 3)
    got = m.gather([dst.block_id], 4)
    assert_kv_equal(_slice(got, 0, 3), _slice(a, 0, 3))
    assert_kv_equal(_slice(got, 3, 4), _slice(b, 3, 4))
    assert_kv_equal(m.gather([src.block_id], 4), a)  # the source is untouched


def test_block_tensors_are_views_of_the_pool() -> None:
    m = make_manager(num_blocks=4, block_size=4)
    (b,) = m.allocate(1)
    kv = _kv(4, seed=5)
    m.write([b.block_id], 0, kv)
    views = m.block_tensors(b.block_id)
    assert len(views) == N_LAYERS
    for (k, v), (wk, wv) in zip(views, kv, strict=True):
        assert k.shape == (N_KV_HEADS, 4, HEAD_DIM)
        assert torch.equal(k, wk[0]) and torch.equal(v, wv[0])
    views[1][1].fill_(1.5)  # writing through the view changes what gather reads
    want = torch.full((N_KV_HEADS, 4, HEAD_DIM), 1.5)
    assert torch.equal(m.gather([b.block_id], 4)[1][1][0], want)


def test_pool_never_grows() -> None:
    m = make_manager(num_blocks=6, block_size=4)
    tensors = [*m.k_pool, *m.v_pool]
    before = [(id(t), t.data_ptr(), tuple(t.shape)) for t in tensors]
    g = torch.Generator().manual_seed(0)
    for round_ in range(60):
        n = int(torch.randint(1, 7, (), generator=g))
        blocks = m.allocate(n)
        ids = [b.block_id for b in blocks]
        tokens = int(torch.randint(1, 4 * n + 1, (), generator=g))
        kv = _kv(tokens, seed=round_)
        m.write(ids, 0, kv)
        assert_kv_equal(m.gather(ids, tokens), kv)
        if n > 1:
            m.copy_tokens(blocks[0], blocks[1], 2)
        for b in blocks:
            b.release()
        m.free(blocks)
    after = [(id(t), t.data_ptr(), tuple(t.shape)) for t in [*m.k_pool, *m.v_pool]]
    assert after == before
    assert m.num_free == 6 and len(m.blocks) == 6
