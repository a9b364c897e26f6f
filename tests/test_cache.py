"""Paged caches and StepMetadata: slot mapping, shuffled blocks, padding rows, next-step reuse."""

import pytest
import torch

from minimax_ops.cache import allocate_caches, build_step, request_block_ids
from minimax_ops.config import SPARSE_MOE, preset

BS = 16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check_slots(meta, context_lens, query_lens, block_size):
    """Every real token's position and slot, recomputed from the block table."""
    i = 0
    for r, (ctx, q) in enumerate(zip(context_lens, query_lens)):
        for pos in range(ctx, ctx + q):
            assert meta.positions[i].item() == pos
            want = meta.block_table[r, pos // block_size].item() * block_size + pos % block_size
            assert meta.slot_mapping[i].item() == want
            assert meta.index_slot_mapping[i].item() == want
            i += 1
    return i


@pytest.mark.parametrize("context_lens,query_lens", [
    ([5, 40, 16, 0], 1),
    ([15, 31, 100], 3),
    ([0, 7, 33], [20, 2, 1]),
])
def test_build_step_slot_mapping(context_lens, query_lens):
    meta = build_step(context_lens, query_lens, block_size=BS, num_blocks=64, generator=_gen(0))
    qs = [query_lens] * len(context_lens) if isinstance(query_lens, int) else query_lens
    n = _check_slots(meta, context_lens, qs, BS)
    assert meta.num_tokens == n == sum(qs)
    assert meta.seq_lens.tolist() == [c + q for c, q in zip(context_lens, qs)]
    assert meta.query_lens == tuple(qs)
    assert meta.num_prefills == sum(c == 0 for c in context_lens)
    # Slots are distinct (no two tokens write the same cache row).
    assert len(set(meta.slot_mapping.tolist())) == n


def test_build_step_physical_blocks_shuffled_and_distinct():
    context_lens = [40, 70, 3, 17]
    meta = build_step(context_lens, 1, block_size=BS, num_blocks=64, generator=_gen(1))
    used = []
    for r, s in enumerate(meta.seq_lens.tolist()):
        nb = -(-s // BS)
        used.append(meta.block_table[r, :nb].tolist())
    flat = [b for ids in used for b in ids]
    assert len(flat) == len(set(flat)), "a physical block is shared between requests"
    assert all(0 <= b < 64 for b in flat)
    assert flat != list(range(len(flat))), "physical blocks are in logical order"
    assert any(ids != sorted(ids) for ids in used if len(ids) > 1), "no request has out-of-order blocks"
    assert request_block_ids(meta, BS) == used
    # Another seed, another assignment.
    other = build_step(context_lens, 1, block_size=BS, num_blocks=64, generator=_gen(2))
    assert not torch.equal(other.block_table, meta.block_table)


def test_build_step_padding_rows_and_dtypes():
    meta = build_step([20, 9], 2, block_size=BS, num_blocks=16, pad_requests=3, generator=_gen(3))
    assert meta.num_tokens == 2 * 2 + 3 * 2
    assert meta.slot_mapping[4:].tolist() == [-1] * 6
    assert meta.index_slot_mapping[4:].tolist() == [-1] * 6
    assert (meta.slot_mapping[:4] >= 0).all()
    assert meta.seq_lens.tolist() == [22, 11, 0, 0, 0]
    assert meta.query_lens == (2,) * 5
    assert meta.query_len == 2 and meta.num_prefills == 0
    assert meta.positions.dtype == torch.int64
    assert meta.slot_mapping.dtype == torch.int64 and meta.index_slot_mapping.dtype == torch.int64
    assert meta.block_table.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
    assert meta.block_table.shape[0] == 5
    assert meta.block_table.is_contiguous() and meta.block_table.stride(1) == 1
    # The index slot mapping is its own tensor (a kernel may be handed either).
    assert meta.index_slot_mapping.data_ptr() != meta.slot_mapping.data_ptr()
    assert request_block_ids(meta, BS) == [meta.block_table[0, :2].tolist(), meta.block_table[1, :1].tolist()]


def test_build_step_table_width_and_errors():
    meta = build_step([3], 1, block_size=BS, num_blocks=8, table_width=6, generator=_gen(4))
    assert meta.block_table.shape == (1, 6)
    with pytest.raises(ValueError, match="table_width=1"):
        build_step([40], 1, block_size=BS, num_blocks=8, table_width=1)
    with pytest.raises(ValueError, match="num_blocks=2"):
        build_step([40], 1, block_size=BS, num_blocks=2)
    with pytest.raises(ValueError, match="query_lens"):
        build_step([4, 5], [1], block_size=BS, num_blocks=8)


def test_mixed_step_has_no_uniform_query_len():
    meta = build_step([0, 30], [5, 1], block_size=BS, num_blocks=8, generator=_gen(5))
    assert meta.num_prefills == 1 and meta.query_len == 0


def test_next_step_reuses_blocks_and_grows():
    gen = _gen(6)
    # Request 0 sits at a block boundary (16 tokens), request 1 mid-block, request 2 one short.
    ctx = [15, 20, 30]
    first = build_step(ctx, 1, block_size=BS, num_blocks=32, generator=gen)
    old = request_block_ids(first, BS)
    assert [len(ids) for ids in old] == [1, 2, 2]
    ctx2 = first.seq_lens.tolist()
    second = build_step(ctx2, 1, block_size=BS, num_blocks=32, generator=gen, block_ids=old)
    new = request_block_ids(second, BS)
    assert [len(ids) for ids in new] == [2, 2, 2]
    for a, b in zip(old, new):
        assert b[:len(a)] == a, "a request lost one of its blocks"
    added = new[0][1]
    assert added not in {b for ids in old for b in ids}, "new block already belongs to a request"
    _check_slots(second, ctx2, [1, 1, 1], BS)
    # Request 0's token lands at offset 0 of its new block; the others continue in their old blocks.
    assert second.slot_mapping.tolist()[0] == added * BS
    assert second.slot_mapping.tolist()[1] == old[1][1] * BS + 21 % BS
    # Going on by 3 tokens at once: request 2 crosses into a third block.
    third = build_step(second.seq_lens.tolist(), 3, block_size=BS, num_blocks=32, generator=gen, block_ids=new)
    ids3 = request_block_ids(third, BS)
    assert ids3[2][:2] == new[2] and len(ids3[2]) == 3
    assert len({b for ids in ids3 for b in ids}) == sum(len(ids) for ids in ids3)
    _check_slots(third, second.seq_lens.tolist(), [3, 3, 3], BS)


def test_metadata_to_device_keeps_host_facts():
    meta = build_step([3, 4], 1, block_size=BS, num_blocks=8, generator=_gen(7), pad_requests=1)
    moved = meta.to("cpu")
    assert moved.query_lens == meta.query_lens and moved.num_prefills == meta.num_prefills
    assert torch.equal(moved.slot_mapping, meta.slot_mapping)


@pytest.mark.parametrize("kv_dtype,index_dtype", [(torch.bfloat16, torch.bfloat16),
                                                  (torch.float8_e4m3fn, torch.float8_e4m3fn),
                                                  (torch.float8_e4m3fn, torch.bfloat16)])
def test_allocate_caches_shapes_and_dtypes(kv_dtype, index_dtype):
    c = preset("tiny")
    caches = allocate_caches(c, 10, kv_dtype=kv_dtype, index_dtype=index_dtype, generator=_gen(8))
    assert len(caches) == c.num_hidden_layers
    for layer, cache in enumerate(caches):
        assert cache.kv.shape == (10, c.num_key_value_heads, c.sparse_block_size, 2 * c.head_dim)
        assert cache.kv.dtype == kv_dtype and cache.kv.is_contiguous()
        assert cache.kv.float().abs().sum() > 0 and torch.isfinite(cache.kv.float()).all()
        if c.layer_kind(layer) == SPARSE_MOE:
            assert cache.index.shape == (10, c.sparse_block_size, c.sparse_index_dim)
            assert cache.index.dtype == index_dtype
            assert cache.index.float().abs().sum() > 0
        else:
            assert cache.index is None
    # Layers are separate tensors, and clone() copies.
    assert caches[1].kv.data_ptr() != caches[2].kv.data_ptr()
    copy = caches[1].clone()
    assert copy.kv.data_ptr() != caches[1].kv.data_ptr()
    assert torch.equal(copy.kv.view(torch.uint8), caches[1].kv.view(torch.uint8))


def test_allocate_caches_fills():
    c = preset("tiny")
    poisoned = allocate_caches(c, 2, kv_dtype=torch.float8_e4m3fn, fill="nan")
    assert torch.isnan(poisoned[1].kv.float()).all() and torch.isnan(poisoned[1].index.float()).all()
    assert torch.isnan(allocate_caches(c, 2, fill="nan")[0].kv.float()).all()
    assert (allocate_caches(c, 2, fill="zeros")[1].index.float() == 0).all()
    with pytest.raises(ValueError, match="fill"):
        allocate_caches(c, 2, fill="ones")


@pytest.mark.parametrize("arg", ["kv_dtype", "index_dtype"])
def test_allocate_caches_bad_dtype(arg):
    with pytest.raises(ValueError, match=f"{arg}.*float16"):
        allocate_caches(preset("tiny"), 2, **{arg: torch.float16})


def test_reused_block_ids_longer_than_needed():
    # A request may hold more blocks than a step needs (e.g. one token at a time through blocks
    # assigned for a longer step): the table keeps them and slots follow the same blocks.
    ids = [[7, 2, 5], [0, 9]]
    meta = build_step([3, 1], 1, block_size=BS, num_blocks=12, block_ids=ids)
    assert meta.block_table.tolist() == [[7, 2, 5], [0, 9, 0]]
    assert meta.slot_mapping.tolist() == [7 * BS + 3, 0 * BS + 1]
    narrow = build_step([3, 1], 1, block_size=BS, num_blocks=12, block_ids=ids, table_width=1)
    assert narrow.block_table.tolist() == [[7], [0]]
    with pytest.raises(ValueError, match="block_ids: expected 2"):
        build_step([3, 1], 1, block_size=BS, num_blocks=12, block_ids=ids[:1])
