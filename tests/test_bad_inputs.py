"""Bad inputs at the fused ops' boundary: each gets a clear error naming the argument, what was expected
and what came, and the kv and index caches are byte-identical after the refused call.

The ops are called directly (the arguments the graph pass passes, built from a MiniMaxM3DecoderLayer
of preset("tiny")) and through layer.fused_forward. Shape and dtype errors come from the shared checks
(RuntimeError through torch._check, the same text as the fake implementation gives at trace time);
value errors from validate.py (StepValueError), which reads tensor contents and so runs on CPU always,
on the GPU only in checked mode. NaN/Inf in the hidden state is refused in checked mode only.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from minimax_ops.cache import LayerCache, allocate_caches, build_step
from minimax_ops.config import SPARSE_MOE, preset
from minimax_ops.constants import MAX_TOKENS
from minimax_ops.model import MiniMaxM3DecoderLayer
from minimax_ops.ops import fused as fused_ops
from minimax_ops.ops.chain import DENSE_WEIGHTS, SPARSE_WEIGHTS
from minimax_ops.ops.validate import StepValueError
from minimax_ops.weights import random_layer_weights

minimax = torch.ops.minimax
CFG = preset("tiny")  # layer 0 dense, layers 1-2 sparse MoE; 16-token blocks
BS = CFG.sparse_block_size
NUM_BLOCKS = 16
CAPACITY = NUM_BLOCKS * BS
DENSE, SPARSE = 0, 1
KINDS = [pytest.param(DENSE, id="dense"), pytest.param(SPARSE, id="sparse")]


@functools.lru_cache(maxsize=None)
def _layer(layer_index: int) -> MiniMaxM3DecoderLayer:
    g = torch.Generator().manual_seed(10 + layer_index)
    return MiniMaxM3DecoderLayer(CFG, random_layer_weights(CFG, layer_index, generator=g), layer_index)


@pytest.fixture(autouse=True)
def unchecked(monkeypatch):
    monkeypatch.delenv("MINIMAX_OPS_CHECK", raising=False)


class OpCall:
    """One fused-op call as keyword arguments by schema name; tests replace entries, then call."""

    def __init__(self, layer_index: int, contexts=(37, 70), query_len: int = 2, *, pad_requests: int = 1,
                 seed: int = 0, table_width: int | None = None, num_blocks: int = NUM_BLOCKS):
        self.layer = _layer(layer_index)
        self.sparse = self.layer.kind == SPARSE_MOE
        g = torch.Generator().manual_seed(seed)
        self.cache = allocate_caches(CFG, num_blocks, generator=g)[layer_index]
        self.meta = build_step(list(contexts), query_len, block_size=BS, num_blocks=num_blocks,
                               pad_requests=pad_requests, num_prefills=0, generator=g, table_width=table_width)
        n = self.meta.num_tokens
        self.x = torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16)
        self.residual = torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16)
        self.op = minimax.fused_decode_layer if self.sparse else minimax.fused_dense_decode_layer
        c, m, layer = CFG, self.meta, self.layer
        dims = (m.query_len, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim, c.rope_theta,
                c.rms_norm_eps)
        if self.sparse:
            values = (self.x, self.residual, m.positions, m.slot_mapping.clone(), m.index_slot_mapping.clone(),
                      m.block_table.clone(), m.seq_lens.clone(), self.cache.kv, self.cache.index,
                      *(getattr(layer, n) for n in SPARSE_WEIGHTS), *dims, c.sparse_num_index_heads,
                      c.sparse_index_dim, c.sparse_topk_blocks, c.num_experts_per_tok, c.routed_scaling_factor,
                      c.num_local_experts, c.swiglu_alpha, c.swiglu_limit, 1.0, 1.0)
        else:
            values = (self.x, self.residual, m.positions, m.slot_mapping.clone(), m.block_table.clone(),
                      m.seq_lens.clone(), self.cache.kv, *(getattr(layer, n) for n in DENSE_WEIGHTS), *dims,
                      c.swiglu_alpha, c.swiglu_limit, 1.0, 1.0)
        names = [a.name for a in self.op.default._schema.arguments]
        self.args = dict(zip(names, values))

    @property
    def num_tokens(self) -> int:
        return self.args["x"].shape[0]

    def caches(self) -> list[torch.Tensor]:
        return [self.args[k] for k in ("kv_cache", "index_cache") if k in self.args]

    def set_slots(self, row: int, value: int) -> None:
        """One slot, in both slot mappings (so the index slots keep sharing the main ones)."""
        for key in ("slot_mapping", "index_slot_mapping"):
            if key in self.args:
                self.args[key][row] = value

    def __call__(self, **extra):
        return self.op(**self.args, **extra)


def assert_refused(call, exc: type[Exception], *fragments: str, caches: list[torch.Tensor] | None = None) -> str:
    """call() raises exc whose message holds every fragment; the caches keep every byte."""
    caches = call.caches() if caches is None else caches
    before = [c.clone() for c in caches]
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in the error message {message!r}"
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c.view(torch.uint8), b.view(torch.uint8)), f"a refused call wrote the cache ({message})"
    return message


def test_good_call_goes_through():
    """The baseline every test below breaks one thing of: it runs and writes the caches."""
    for layer_index in (DENSE, SPARSE):
        call = OpCall(layer_index)
        before = [c.clone() for c in call.caches()]
        out, residual = call()
        assert out.shape == residual.shape == call.x.shape and torch.isfinite(out).all()
        assert all(not torch.equal(c, b) for c, b in zip(call.caches(), before))


# ---- dtypes ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_index", KINDS)
@pytest.mark.parametrize("name,dtype,want", [
    ("x", torch.float32, "torch.bfloat16"),
    ("residual", torch.float16, "torch.bfloat16"),
    ("positions", torch.int32, "torch.int64"),
    ("slot_mapping", torch.int32, "torch.int64"),
    ("block_table", torch.int64, "torch.int32"),
    ("seq_lens", torch.int64, "torch.int32"),
])
def test_wrong_metadata_or_activation_dtype(layer_index, name, dtype, want):
    call = OpCall(layer_index)
    call.args[name] = call.args[name].to(dtype)
    assert_refused(call, RuntimeError, f"{name}: expected dtype {want}, got {dtype}")


@pytest.mark.parametrize("layer_index", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_wrong_kv_cache_dtype(layer_index, dtype):
    call = OpCall(layer_index)
    call.args["kv_cache"] = call.args["kv_cache"].to(dtype)
    assert_refused(call, RuntimeError, f"kv_cache: expected dtype torch.bfloat16 or torch.float8_e4m3fn, got {dtype}")


def test_wrong_index_cache_dtype():
    call = OpCall(SPARSE)
    call.args["index_cache"] = call.args["index_cache"].float()
    assert_refused(call, RuntimeError, "index_cache: expected dtype torch.bfloat16 or torch.float8_e4m3fn, got "
                                       "torch.float32")


def test_wrong_index_slot_mapping_dtype():
    call = OpCall(SPARSE)
    call.args["index_slot_mapping"] = call.args["index_slot_mapping"].to(torch.int32)
    assert_refused(call, RuntimeError, "index_slot_mapping: expected dtype torch.int64, got torch.int32")


@pytest.mark.parametrize("layer_index,name,dtype,fragments", [
    (SPARSE, "gate", torch.bfloat16, ("gate: expected dtype torch.float32, got torch.bfloat16",)),
    (SPARSE, "gate_bias", torch.bfloat16, ("gate_bias: expected dtype torch.float32, got torch.bfloat16",)),
    (SPARSE, "w2", torch.int32, ("w2: weight of dtype torch.int32 needs an E8M0 scale tensor, got None",)),
    (SPARSE, "shared_w13", torch.int16, ("shared_w13: weight of dtype torch.int16 needs an E8M0 scale",)),
    (DENSE, "w13", torch.int32, ("w13: weight of dtype torch.int32 needs an E8M0 scale tensor, got None",)),
    (DENSE, "o_proj", torch.uint8, ("o_proj: weight of dtype torch.uint8 needs an E8M0 scale tensor, got None",)),
], ids=["gate", "gate_bias", "experts_w2", "shared_w13", "dense_w13", "o_proj"])
def test_wrong_late_weight_dtype(layer_index, name, dtype, fragments):
    """Weights read after the cache insert inside the fused op: still refused before any write."""
    call = OpCall(layer_index)
    call.args[name] = call.args[name].to(dtype)
    assert_refused(call, (RuntimeError, ValueError), *fragments)


@pytest.mark.parametrize("layer_index", KINDS)
def test_wrong_qkv_weight_dtype(layer_index):
    call = OpCall(layer_index)
    call.args["qkv"] = call.args["qkv"].to(torch.int32)
    assert_refused(call, ValueError, "needs an E8M0 scale tensor, got None")


@pytest.mark.parametrize("layer_index,name,cut,fragment", [
    (SPARSE, "gate", (slice(None), slice(0, 32)), "gate: expected size 64 in dimension 1, got shape (8, 32)"),
    (SPARSE, "w13", (slice(0, 5),), "w13: expected 8 experts (+1 shared in the table), got 5"),
    (DENSE, "w2", (slice(0, 48),), "w2: expected 64 output rows, got shape (48, 96)"),
    (SPARSE, "o_proj", (slice(0, 32),), "o_proj: expected 64 output rows, got shape (32, 256)"),
], ids=["gate", "experts_w13", "dense_w2", "o_proj"])
def test_wrong_late_weight_shape(layer_index, name, cut, fragment):
    call = OpCall(layer_index)
    call.args[name] = call.args[name][cut].contiguous()
    assert_refused(call, RuntimeError, fragment)


@pytest.mark.parametrize("layer_index", KINDS)
@pytest.mark.parametrize("layout", ["column_slice", "transposed"])
def test_non_contiguous_block_table(layer_index, layout):
    call = OpCall(layer_index)
    table = call.args["block_table"]
    if layout == "column_slice":  # the first columns of a wider table: rows are not adjacent
        wide = torch.full((table.shape[0], table.shape[1] + 3), 0, dtype=torch.int32)
        wide[:, :table.shape[1]] = table
        table = wide[:, :table.shape[1]]
    else:  # column-major storage of the same values
        table = table.t().contiguous().t()
    assert torch.equal(table, call.args["block_table"]) and not table.is_contiguous()
    call.args["block_table"] = table
    assert_refused(call, RuntimeError, "block_table: expected a row-contiguous table",
                   f"got strides {table.stride()}")


@pytest.mark.parametrize("layer_index", KINDS)
def test_residual_of_other_width(layer_index):
    call = OpCall(layer_index)
    call.args["residual"] = call.args["residual"][:, :32].contiguous()
    assert_refused(call, RuntimeError, "residual: expected size 64 in dimension 1, got shape (6, 32)")


@pytest.mark.parametrize("layer_index", KINDS)
def test_positions_of_other_length(layer_index):
    call = OpCall(layer_index)
    call.args["positions"] = call.args["positions"][:-1]
    assert_refused(call, RuntimeError, "positions: expected size 6 in dimension 0, got shape (5,)")


def test_index_cache_with_fewer_blocks_than_kv_cache():
    """The index cache is read through the main block table: it needs as many blocks."""
    call = OpCall(SPARSE)
    call.args["index_cache"] = call.args["index_cache"][:NUM_BLOCKS // 2].clone()
    assert_refused(call, RuntimeError, f"index_cache: expected size {NUM_BLOCKS} in dimension 0, got shape "
                                       f"({NUM_BLOCKS // 2}, {BS}, {CFG.sparse_index_dim})")


# ---- metadata values ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_index", KINDS)
@pytest.mark.parametrize("slot", [CAPACITY, CAPACITY + 1000, -2, -(2**40)])
def test_slot_outside_the_cache(layer_index, slot):
    call = OpCall(layer_index)
    call.set_slots(1, slot)
    assert_refused(call, StepValueError, f"slot_mapping: expected slots in -1..{CAPACITY - 1} "
                                         f"(cache of {CAPACITY} slots), got [{slot}] at rows [1]")


def test_index_slots_different_from_main_slots():
    """The fused decode inserts and indexes both caches through the main block table."""
    call = OpCall(SPARSE)
    slots = call.args["index_slot_mapping"]
    slots[0] = (slots[0] + BS) % CAPACITY  # a valid slot, but in another block
    assert_refused(call, StepValueError, "index_slot_mapping: the fused decode needs the index cache to share "
                                         "the main cache's block ids")


def test_index_slot_outside_the_index_cache():
    call = OpCall(SPARSE)
    call.args["index_slot_mapping"][2] = CAPACITY
    assert_refused(call, StepValueError, f"index_slot_mapping: expected slots in -1..{CAPACITY - 1}",
                   f"got [{CAPACITY}] at rows [2]")


@pytest.mark.parametrize("layer_index", KINDS)
@pytest.mark.parametrize("block", [NUM_BLOCKS, NUM_BLOCKS + 7, -1])
def test_block_id_outside_the_cache(layer_index, block):
    call = OpCall(layer_index)
    call.args["block_table"][1, 2] = block  # request 1 (70 + 2 tokens) uses 5 blocks
    assert_refused(call, StepValueError, f"block_table: expected block ids in 0..{NUM_BLOCKS - 1}, got [{block}]")


@pytest.mark.parametrize("layer_index", KINDS)
def test_unused_block_table_entries_are_not_read(layer_index):
    """Entries past a request's blocks (and a padding request's row) may hold anything."""
    call = OpCall(layer_index, table_width=8)
    good = OpCall(layer_index, table_width=8)
    table = call.args["block_table"]
    table[0, 3:] = 10**6  # request 0 (37 + 2 tokens) uses 3 blocks
    table[2, :] = -5  # the padding request
    out, residual = call()
    want_out, want_residual = good()
    assert torch.equal(out, want_out) and torch.equal(residual, want_residual)
    for a, b in zip(call.caches(), good.caches()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("layer_index", KINDS)
def test_seq_len_beyond_the_block_table(layer_index):
    call = OpCall(layer_index)
    width = call.args["block_table"].shape[1] * BS
    call.args["seq_lens"][0] = width + 1
    assert_refused(call, StepValueError, f"seq_lens: expected at most block_table width x block size = {width} "
                                         f"tokens, got [{width + 1}, 72, 0]")


@pytest.mark.parametrize("layer_index", KINDS)
def test_negative_seq_len(layer_index):
    call = OpCall(layer_index)
    call.args["seq_lens"][1] = -3
    assert_refused(call, StepValueError, "seq_lens: expected values in 0..", "got [39, -3, 0]")


@pytest.mark.parametrize("layer_index", KINDS)
def test_seq_len_shorter_than_query_len(layer_index):
    call = OpCall(layer_index)
    call.args["seq_lens"][0] = 1  # a live request holding fewer tokens than the 2 it adds
    assert_refused(call, StepValueError, "seq_lens: a live request must hold at least query_len=2 tokens, got "
                                         "[1, 72, 0]")


# ---- token counts --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_index", KINDS)
def test_more_than_max_tokens_runs_the_unfused_stages(layer_index):
    """A graph that serves every step size (vLLM's trace-once mode) holds the fused op for large steps
    too: above MAX_TOKENS it runs the unfused stages, with their answer and cache writes."""
    contexts = [3 * r + 1 for r in range(MAX_TOKENS + 1)]
    call = OpCall(layer_index, contexts, 1, pad_requests=0, num_blocks=48)
    assert call.num_tokens == MAX_TOKENS + 1
    caches = [c.clone() for c in call.caches()]
    calls = dict(fused_ops.impl_calls)
    out, residual = call()
    assert fused_ops.impl_calls != calls  # the fused op's implementation ran (and chose the stages)
    x, res, meta = call.x, call.residual, call.meta
    cache = LayerCache(*caches) if len(caches) == 2 else LayerCache(caches[0])
    want, want_res = call.layer(x, res, meta.positions, cache, meta, True)
    assert torch.equal(out, want) and torch.equal(residual, want_res)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(call.caches(), caches))


@pytest.mark.parametrize("layer_index", KINDS)
def test_no_tokens(layer_index):
    call = OpCall(layer_index)
    for name in ("x", "residual", "positions", "slot_mapping", "index_slot_mapping"):
        if name in call.args:
            call.args[name] = call.args[name][:0]
    assert_refused(call, RuntimeError, "x: expected at least 1 token, got 0")


@pytest.mark.parametrize("layer_index", KINDS)
def test_tokens_not_a_multiple_of_query_len(layer_index):
    call = OpCall(layer_index, (37, 70), 2)  # 6 tokens (3 requests of 2)
    call.args["query_len"] = 4
    assert_refused(call, RuntimeError, "tokens: expected a multiple of query_len=4, got 6")


@pytest.mark.parametrize("layer_index", KINDS)
@pytest.mark.parametrize("query_len", [0, MAX_TOKENS + 1])
def test_query_len_out_of_range(layer_index, query_len):
    call = OpCall(layer_index)
    call.args["query_len"] = query_len
    assert_refused(call, RuntimeError, f"query_len: expected 1..{MAX_TOKENS}, got {query_len}")


# ---- NaN / Inf in the hidden state: checked mode only ---------------------------------------------------


@pytest.mark.parametrize("layer_index", KINDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("how", ["env", "argument"])
def test_non_finite_hidden_state_refused_in_checked_mode(monkeypatch, layer_index, bad, how):
    call = OpCall(layer_index)
    x = call.args["x"].clone()
    x[1, 5] = bad
    x[3, 0] = bad
    call.args["x"] = x
    extra = {}
    if how == "env":
        monkeypatch.setenv("MINIMAX_OPS_CHECK", "1")
    else:  # what MiniMaxM3DecodePass(checked=True) passes
        extra = {"checked": True}
    assert_refused(functools.partial(call, **extra), StepValueError,
                   "x: the hidden state holds NaN or Inf at token rows [1, 3]", caches=call.caches())


@pytest.mark.parametrize("layer_index", KINDS)
def test_non_finite_hidden_state_passes_unchecked(layer_index):
    """Without checked mode the op does not look for NaN/Inf: on the GPU that would be a host sync on
    every step (and impossible under CUDA-graph capture), and the CPU path behaves the same so the two
    agree. The bad row poisons its own outputs; the call itself goes through and writes the caches."""
    call = OpCall(layer_index)
    x = call.args["x"].clone()
    x[1, 5] = float("nan")
    call.args["x"] = x
    out, residual = call()
    assert torch.isnan(residual[1]).all()
    assert torch.isfinite(residual[0]).all() and torch.isfinite(out[0]).all()


# ---- through layer.fused_forward (the model's eager fused path) -------------------------------------------


def _forward(call: OpCall, meta):
    return call.layer.fused_forward(call.x, call.residual, meta.positions, call.cache, meta)


@pytest.mark.parametrize("layer_index", KINDS)
def test_fused_forward_refuses_bad_metadata(layer_index):
    call = OpCall(layer_index)
    caches = call.caches()
    meta = call.meta
    table = meta.block_table.t().contiguous().t()
    assert_refused(lambda: _forward(call, dataclasses.replace(meta, block_table=table)), RuntimeError,
                   "block_table: expected a row-contiguous table", caches=caches)
    slots = meta.slot_mapping.clone()
    slots[0] = CAPACITY
    bad_slots = dataclasses.replace(meta, slot_mapping=slots, index_slot_mapping=slots.clone())
    assert_refused(lambda: _forward(call, bad_slots), StepValueError, "slot_mapping: expected slots in",
                   caches=caches)
    seq_lens = meta.seq_lens.clone()
    seq_lens[1] = 10**4
    assert_refused(lambda: _forward(call, dataclasses.replace(meta, seq_lens=seq_lens)), StepValueError,
                   "seq_lens: expected at most block_table width", caches=caches)
    assert_refused(lambda: _forward(call, dataclasses.replace(meta, query_len=4)), RuntimeError,
                   "tokens: expected a multiple of query_len=4, got 6", caches=caches)
    # The same metadata, unchanged, goes through.
    out, _ = _forward(call, meta)
    assert torch.isfinite(out).all()
