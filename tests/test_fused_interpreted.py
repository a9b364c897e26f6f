"""The fused ops through the Triton kernels under the interpreter (CPU, tiny sizes): what CI can run of
the GPU path. Needs TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA) and
MINIMAX_OPS_CPU_KERNELS=1 (set here), so backend.use_kernels routes CPU tensors to the kernels."""

from __future__ import annotations

import os

import pytest
import torch

from minimax_ops.cache import allocate_caches, build_step
from minimax_ops.config import preset
from minimax_ops.model import MiniMaxM3DecoderLayer
from minimax_ops.reference_model import layer_forward
from minimax_ops.weights import random_layer_weights, to_kernel_layout

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter-only test (GPU runs the kernels in test_gpu.py)")


def _layer_step(layer_idx, fmts, kv_dtype, seed=11):
    """(config, canonical weights, the layer's cache, step metadata, x, residual) of a tiny two-request
    step (query_len 2) with a padding request."""
    cfg = preset("tiny")
    g = torch.Generator().manual_seed(seed)
    w = random_layer_weights(cfg, layer_idx, linear_format=fmts[0], expert_format=fmts[1], generator=g)
    caches = allocate_caches(cfg, 16, kv_dtype=kv_dtype, index_dtype=kv_dtype, generator=g)
    meta = build_step([40, 9], 2, block_size=cfg.sparse_block_size, num_blocks=16, pad_requests=1, generator=g)
    x = torch.randn(meta.num_tokens, cfg.hidden_size, generator=g).to(torch.bfloat16)
    res = torch.randn(meta.num_tokens, cfg.hidden_size, generator=g).to(torch.bfloat16)
    return cfg, w, caches[layer_idx], meta, x, res


@pytest.mark.parametrize("layer_idx,fmts,kv_dtype,tiled", [(1, ("mxfp8", "mxfp4"), torch.float8_e4m3fn, False),
                                                           (1, ("mxfp8", "mxfp4"), torch.float8_e4m3fn, True),
                                                           (0, ("bf16", "bf16"), torch.bfloat16, False),
                                                           (0, ("mxfp8", "mxfp8"), torch.bfloat16, True)])
def test_fused_layer_runs_the_kernels_and_matches_the_reference(monkeypatch, layer_idx, fmts, kv_dtype, tiled):
    """Canonical weights, and the tiled layouts of weights.to_kernel_layout (the reference reads the
    canonical ones). A sparse layer's attention makes the indexer's top-k in-kernel (decode_layer's
    index_sparse_attention stage)."""
    monkeypatch.setenv("MINIMAX_OPS_CPU_KERNELS", "1")
    monkeypatch.delenv("MINIMAX_OPS_NO_ATTN_SELECT", raising=False)
    from minimax_ops.kernels import attention as attention_module
    from minimax_ops.kernels import mx_linear as mx_linear_module
    calls, select_calls = [], []
    real_kernel = mx_linear_module.mx_linear
    monkeypatch.setattr(mx_linear_module, "mx_linear", lambda *a, **k: calls.append(1) or real_kernel(*a, **k))
    real_select = attention_module.index_sparse_attention_decode
    monkeypatch.setattr(attention_module, "index_sparse_attention_decode",
                        lambda *a, **k: select_calls.append(1) or real_select(*a, **k))
    cfg, w, cache, meta, x, res = _layer_step(layer_idx, fmts, kv_dtype)
    layer = MiniMaxM3DecoderLayer(cfg, to_kernel_layout(w, tiled=True) if tiled else w, layer_idx)
    if tiled:
        assert layer.qkv.dim() == 4 and layer.w13.dim() == (5 if layer_idx else 4), "weights were not tiled"
    ref_cache = cache.clone()
    want, want_res = layer_forward(x, res, w, ref_cache, meta, cfg)
    out, out_res = layer.fused_forward(x, res, meta.positions, cache, meta)
    assert calls, "the fused op did not run the Triton kernels"
    assert len(select_calls) == (1 if layer_idx else 0), "a sparse layer runs the in-kernel top-k once"
    real = meta.num_tokens - 2  # the padding request's two rows
    rel = ((out[:real].float() - want[:real]).norm() / want[:real].norm()).item()
    assert torch.isfinite(out).all() and rel < 3e-2
    assert ((out_res[:real].float() - want_res[:real]).norm() / want_res[:real].norm()).item() < 1e-2
    # Written slots within a cache-dtype rounding step (the interpreter truncates fp32 -> bf16), the rest untouched.
    slots = meta.slot_mapping[meta.slot_mapping >= 0]
    bs = cfg.sparse_block_size
    untouched = torch.ones(cache.kv.shape[0] * bs, dtype=torch.bool)
    untouched[slots] = False
    kv_rows = cache.kv.permute(0, 2, 1, 3).reshape(-1, cache.kv.shape[1], cache.kv.shape[3])
    ref_rows = ref_cache.kv.permute(0, 2, 1, 3).reshape(-1, cache.kv.shape[1], cache.kv.shape[3])
    assert torch.equal(kv_rows[untouched].view(torch.uint8), ref_rows[untouched].view(torch.uint8))
    written = ((kv_rows[slots].float() - ref_rows[slots].float()).norm() / ref_rows[slots].float().norm()).item()
    assert written < (6e-2 if kv_dtype == torch.float8_e4m3fn else 1e-2)


@pytest.mark.parametrize("layer_idx,fmts,kv_dtype", [(1, ("mxfp8", "mxfp4"), torch.float8_e4m3fn),
                                                     (0, ("bf16", "bf16"), torch.bfloat16)])
def test_tensor_parallel_fused_layer_hands_its_post_norm_the_fp32_sum(monkeypatch, one_rank_group, layer_idx, fmts,
                                                                      kv_dtype):
    """Under tensor parallelism the fused layer on the kernels sums its fp32 partials in place and gives the
    post norm kernel the first sum in fp32 (no bf16 cast kernel between the halves): the same bits as with
    minimax.all_reduce's bf16 between them (MINIMAX_OPS_FP32_SUMS=0), outputs and caches, and the reference's
    values within tolerance."""
    monkeypatch.setenv("MINIMAX_OPS_CPU_KERNELS", "1")
    from minimax_ops.kernels import norm
    dtypes, add_rmsnorm = [], norm.add_rmsnorm
    monkeypatch.setattr(norm, "add_rmsnorm", lambda x, *a, **k: dtypes.append(x.dtype) or add_rmsnorm(x, *a, **k))
    cfg, w, cache, meta, x, res = _layer_step(layer_idx, fmts, kv_dtype, seed=12)
    layer = MiniMaxM3DecoderLayer(cfg, w, layer_idx, one_rank_group)
    ref_cache, bf16_cache = cache.clone(), cache.clone()
    want, want_res = layer_forward(x, res, w, ref_cache, meta, cfg)
    out, out_res = layer.fused_forward(x, res, meta.positions, cache, meta)
    assert dtypes == [torch.bfloat16, torch.float32], "the post norm did not take the fp32 sum"
    monkeypatch.setenv("MINIMAX_OPS_FP32_SUMS", "0")
    bf16_out, bf16_res = layer.fused_forward(x, res, meta.positions, bf16_cache, meta)
    assert dtypes[2:] == [torch.bfloat16, torch.bfloat16]
    assert out.dtype == out_res.dtype == torch.bfloat16
    assert torch.equal(out, bf16_out) and torch.equal(out_res, bf16_res)
    assert torch.equal(cache.kv.view(torch.uint8), bf16_cache.kv.view(torch.uint8))
    real = meta.num_tokens - 2  # the padding request's two rows
    rel = ((out[:real].float() - want[:real]).norm() / want[:real].norm()).item()
    assert torch.isfinite(out[:real]).all() and rel < 3e-2
    assert ((out_res[:real].float() - want_res[:real]).norm() / want_res[:real].norm()).item() < 1e-2
