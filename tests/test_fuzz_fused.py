"""Property-based tests (hypothesis): the fused decode ops equal the reference over random tiny configs
and steps.

Each example draws a config variant of preset("tiny") (heads / kv heads, rotary dim, experts, top-k,
block size, top-k blocks, shared expert in the table, separate or absent), weight formats (bf16,
MXFP8, MXFP4 for the linears and the experts), KV and index cache dtypes (bf16, fp8), 1-4 requests of
query_len 1-4 with contexts 0-150, 0-2 padding requests, and spare block-table columns; then runs one
dense and one sparse MoE layer through layer.fused_forward and reference_model.layer_forward on copies
of the same random caches. Real rows agree within 2e-2 relative error; the caches end byte-identical
where the reference stages run (CPU), and where kernels run (CUDA, or MINIMAX_OPS_CPU_KERNELS=1 under
the interpreter) unchanged outside the step's slots and close on them (2e-2 bf16, 1e-1 fp8).

MINIMAX_OPS_FUZZ_EXAMPLES sets the number of examples (CI: the default 12). No example database is
kept (nothing is written to the work tree); a failure prints the falsifying example and its blob.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minimax_ops.backend import cpu_kernels_enabled
from minimax_ops.cache import allocate_caches, build_step
from minimax_ops.config import SPARSE_MOE, MiniMaxM3Config, preset
from minimax_ops.constants import MAX_TOKENS
from minimax_ops.model import MiniMaxM3DecoderLayer
from minimax_ops.reference_model import layer_forward
from minimax_ops.weights import SHARED_IN_TABLE, SHARED_SEPARATE, random_layer_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = DEVICE == "cuda" or cpu_kernels_enabled()
EXAMPLES = int(os.environ.get("MINIMAX_OPS_FUZZ_EXAMPLES", "12"))
OUT_TOLERANCE = 2e-2
# Kernels and the reference round their own (slightly different) fp32 k / v / index_k to the cache
# dtype: where upstream bf16 stages already differ by an ulp, fp8's 3 mantissa bits flip often.
WRITTEN_SLOT_TOLERANCE = {torch.bfloat16: 2e-2, torch.float8_e4m3fn: 1e-1}
FORMATS = ("bf16", "mxfp8", "mxfp4")
CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
NO_SHARED = "none"


@dataclass(frozen=True)
class FuzzCase:
    heads: tuple[int, int]  # (attention heads, kv heads = index heads)
    rotary_dim: int
    experts: int
    top_k: int
    block_size: int
    topk_blocks: int
    shared: str  # SHARED_SEPARATE, SHARED_IN_TABLE or NO_SHARED
    linear_format: str
    expert_format: str
    kv_dtype: torch.dtype
    index_dtype: torch.dtype
    contexts: tuple[int, ...]
    query_len: int
    pad_requests: int
    spare_columns: int  # block-table columns past the widest request
    spare_blocks: int  # cache blocks no request uses
    seed: int

    def config(self) -> MiniMaxM3Config:
        heads, kv_heads = self.heads
        return preset("tiny").replace(
            num_hidden_layers=2, moe_layer_freq=(0, 1), sparse_attention_freq=(0, 1), num_attention_heads=heads,
            num_key_value_heads=kv_heads, sparse_num_index_heads=kv_heads, head_dim=32, sparse_index_dim=32,
            rotary_dim=self.rotary_dim, num_local_experts=self.experts, num_experts_per_tok=self.top_k,
            n_shared_experts=0 if self.shared == NO_SHARED else 1, sparse_block_size=self.block_size,
            sparse_topk_blocks=self.topk_blocks)


@st.composite
def fuzz_cases(draw) -> FuzzCase:
    query_len = draw(st.integers(1, 4))
    requests = draw(st.integers(1, min(4, MAX_TOKENS // query_len)))
    pad_requests = draw(st.integers(0, min(2, MAX_TOKENS // query_len - requests)))
    return FuzzCase(
        heads=draw(st.sampled_from([(4, 1), (8, 2), (4, 4)])),
        rotary_dim=draw(st.sampled_from([8, 16, 32])),
        experts=draw(st.integers(4, 8)),
        top_k=draw(st.integers(1, 3)),
        block_size=draw(st.sampled_from([16, 32])),
        topk_blocks=draw(st.integers(2, 4)),
        shared=draw(st.sampled_from([SHARED_IN_TABLE, SHARED_SEPARATE, NO_SHARED])),
        linear_format=draw(st.sampled_from(FORMATS)),
        expert_format=draw(st.sampled_from(FORMATS)),
        kv_dtype=draw(st.sampled_from(CACHE_DTYPES)),
        index_dtype=draw(st.sampled_from(CACHE_DTYPES)),
        contexts=tuple(draw(st.lists(st.integers(0, 150), min_size=requests, max_size=requests))),
        query_len=query_len,
        pad_requests=pad_requests,
        spare_columns=draw(st.integers(0, 2)),
        spare_blocks=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    assert torch.isfinite(got).all(), "non-finite values"
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def _slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """A paged cache as one row per slot: kv [blocks, heads, bs, 2D] or index [blocks, bs, D]."""
    rows = cache.transpose(1, 2) if cache.dim() == 4 else cache
    return rows.reshape(cache.shape[0] * cache.shape[-2], -1).cpu().view(torch.uint8)


def assert_cache_agrees(got: torch.Tensor | None, want: torch.Tensor | None, slots: torch.Tensor, what: str):
    assert (got is None) == (want is None)
    if got is None:
        return
    if not KERNELS:  # the same reference stages wrote both: every byte equal
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{what}: bytes differ"
        return
    g, w = _slot_rows(got), _slot_rows(want)
    written = torch.zeros(g.shape[0], dtype=torch.bool)
    slots = slots.cpu()
    written[slots[slots >= 0]] = True
    assert torch.equal(g[~written], w[~written]), \
        f"{what}: bytes changed outside the step's slots"
    tolerance = WRITTEN_SLOT_TOLERANCE[got.dtype]
    assert relative_error(g[written].view(got.dtype), w[written].view(want.dtype)) < tolerance, \
        f"{what}: written slots differ"


def run_case(case: FuzzCase) -> None:
    config = case.config()
    g = torch.Generator().manual_seed(case.seed)
    bs, q = case.block_size, case.query_len
    needed = [-(-(c + q) // bs) for c in case.contexts]
    num_blocks = sum(needed) + case.spare_blocks
    meta = build_step(list(case.contexts), q, block_size=bs, num_blocks=num_blocks, num_prefills=0,
                      pad_requests=case.pad_requests, table_width=max(needed) + case.spare_columns, generator=g,
                      device=DEVICE)
    caches = allocate_caches(config, num_blocks, kv_dtype=case.kv_dtype, index_dtype=case.index_dtype, generator=g,
                             device=DEVICE)
    n, real = meta.num_tokens, len(case.contexts) * q  # padding requests' rows come last
    assert n == (len(case.contexts) + case.pad_requests) * q <= MAX_TOKENS
    x = torch.randn(n, config.hidden_size, generator=g).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(n, config.hidden_size, generator=g).to(torch.bfloat16).to(DEVICE)
    shared = SHARED_SEPARATE if case.shared == NO_SHARED else case.shared
    for index in range(config.num_hidden_layers):
        weights = random_layer_weights(config, index, linear_format=case.linear_format,
                                       expert_format=case.expert_format, shared=shared, generator=g, device=DEVICE)
        layer = MiniMaxM3DecoderLayer(config, weights, index)
        fused_cache, ref_cache = caches[index].clone(), caches[index].clone()
        out, res = layer.fused_forward(x, residual, meta.positions, fused_cache, meta)
        want_out, want_res = layer_forward(x, residual, weights, ref_cache, meta, config)
        kind = weights.kind
        assert out.shape == res.shape == x.shape and out.dtype == res.dtype == torch.bfloat16
        assert relative_error(out[:real], want_out[:real]) < OUT_TOLERANCE, f"{kind} out"
        assert relative_error(res[:real], want_res[:real]) < OUT_TOLERANCE, f"{kind} residual"
        assert_cache_agrees(fused_cache.kv, ref_cache.kv, meta.slot_mapping, f"{kind} kv cache")
        assert_cache_agrees(fused_cache.index, ref_cache.index, meta.index_slot_mapping, f"{kind} index cache")
        assert (fused_cache.index is not None) == (kind == SPARSE_MOE)
        x, residual = out, res  # the next layer reads this one's output, as in the model


@settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=fuzz_cases())
def test_fused_layers_equal_the_reference(case):
    run_case(case)


@pytest.mark.parametrize("case", [
    # Fixed corners that random draws hit rarely: the largest step, q = 4, MXFP4 everywhere, fp8 caches,
    # a request with no context and one at the context limit, all-padding rows after the real ones.
    FuzzCase((4, 4), 32, 8, 3, 32, 4, SHARED_IN_TABLE, "mxfp4", "mxfp4", torch.float8_e4m3fn,
             torch.float8_e4m3fn, (0, 150, 77), 4, 1, 2, 3, seed=1),
    FuzzCase((4, 1), 8, 4, 1, 16, 2, NO_SHARED, "bf16", "mxfp8", torch.bfloat16, torch.float8_e4m3fn,
             (1,), 1, 2, 0, 0, seed=2),
    FuzzCase((8, 2), 16, 5, 2, 16, 3, SHARED_SEPARATE, "mxfp8", "bf16", torch.float8_e4m3fn, torch.bfloat16,
             (150, 149, 31, 16), 2, 2, 1, 1, seed=3),
], ids=["q4-mxfp4-fp8", "one-token", "four-requests-padded"])
def test_fixed_corners(case):
    run_case(case)
