"""fp8 KV-cache scales, vLLM's convention: the insert writes fp8(k / k_scale) and fp8(v / v_scale), the
attention reads fp8 * scale. So a layer's output does not depend on the scales (exactly so for
power-of-two scales over a bf16 cache), and the ops agree with the reference at any scale."""

from __future__ import annotations

import pytest
import torch

import graph_text as gt
from minimax_ops.cache import LayerCache, allocate_caches, build_step, request_block_ids
from minimax_ops.config import preset
from minimax_ops.model import MiniMaxM3DecoderLayer
from minimax_ops.reference_model import layer_forward
from minimax_ops.weights import random_layer_weights

CFG = preset("tiny")  # layer 0 dense, layers 1-2 sparse MoE; 16-token blocks
BS, BLOCKS = CFG.sparse_block_size, 16
DENSE, SPARSE = 0, 1


def _steps(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    prefill = build_step([0, 0], [37, 20], block_size=BS, num_blocks=BLOCKS, generator=g)
    decode = build_step([37, 20], 2, block_size=BS, num_blocks=BLOCKS, generator=g,
                        block_ids=request_block_ids(prefill, BS))
    xs = [(torch.randn(m.num_tokens, CFG.hidden_size, generator=g).to(torch.bfloat16),
           torch.randn(m.num_tokens, CFG.hidden_size, generator=g).to(torch.bfloat16)) for m in (prefill, decode)]
    return (prefill, decode), xs


def _cache(layer_index: int, kv_dtype) -> LayerCache:
    return allocate_caches(CFG, BLOCKS, kv_dtype=kv_dtype, fill="zeros")[layer_index]


def run_ops(layer_index: int, kv_dtype, k_scale: float, v_scale: float):
    """A prefill (general path) then a fused 2-token decode through the ops, with these scales."""
    w = random_layer_weights(CFG, layer_index, generator=torch.Generator().manual_seed(11))
    layer = MiniMaxM3DecoderLayer(CFG, w, layer_index)
    layer.k_scale, layer.v_scale = k_scale, v_scale
    (prefill, decode), ((x0, r0), (x1, r1)) = _steps()
    cache = _cache(layer_index, kv_dtype)
    layer(x0, r0, prefill.positions, cache, prefill, False)
    out = layer.fused_forward(x1, r1, decode.positions, cache, decode)
    return out, cache, w


def run_reference(layer_index: int, w, kv_dtype, k_scale: float, v_scale: float):
    (prefill, decode), ((x0, r0), (x1, r1)) = _steps()
    cache = _cache(layer_index, kv_dtype)
    layer_forward(x0, r0, w, cache, prefill, CFG, k_scale=k_scale, v_scale=v_scale)
    return layer_forward(x1, r1, w, cache, decode, CFG, k_scale=k_scale, v_scale=v_scale), cache


@pytest.mark.parametrize("layer_index", [DENSE, SPARSE], ids=["dense", "sparse"])
def test_power_of_two_scales_leave_a_bf16_layer_unchanged(layer_index):
    (out1, res1), cache1, _ = run_ops(layer_index, torch.bfloat16, 1.0, 1.0)
    (out, res), cache, _ = run_ops(layer_index, torch.bfloat16, 4.0, 0.25)
    assert torch.equal(out, out1) and torch.equal(res, res1)
    d = CFG.head_dim  # the cache holds k / 4 and v * 4
    assert torch.equal(cache.kv[..., :d].float() * 4, cache1.kv[..., :d].float())
    assert torch.equal(cache.kv[..., d:].float() / 4, cache1.kv[..., d:].float())


@pytest.mark.parametrize("layer_index", [DENSE, SPARSE], ids=["dense", "sparse"])
@pytest.mark.parametrize("scales", [(2.0, 0.5), (0.37, 1.9)], ids=["pow2", "any"])
def test_fp8_cache_with_scales_matches_the_reference(layer_index, scales):
    (out, res), cache, w = run_ops(layer_index, torch.float8_e4m3fn, *scales)
    (ref_out, ref_res), ref_cache = run_reference(layer_index, w, torch.float8_e4m3fn, *scales)
    assert gt.relative_error(out.float(), ref_out) < 2e-2 and gt.relative_error(res.float(), ref_res) < 2e-2
    # The scaled values are what is stored: dequantised * scale is the unscaled layer's k / v.
    (out1, _), cache1, _ = run_ops(layer_index, torch.float8_e4m3fn, 1.0, 1.0)
    d = CFG.head_dim
    k, k1 = cache.kv[..., :d].float() * scales[0], cache1.kv[..., :d].float()
    v, v1 = cache.kv[..., d:].float() * scales[1], cache1.kv[..., d:].float()
    assert gt.relative_error(k, k1) < 0.1 and gt.relative_error(v, v1) < 0.1  # fp8 rounding of each
    assert gt.relative_error(out.float(), out1.float()) < 0.1  # and the output barely moves


@pytest.mark.slow
@pytest.mark.parametrize("scales", [(4.0, 0.5), (0.37, 1.9)], ids=["pow2", "any"])
def test_insert_kernel_writes_scaled_values_like_the_reference(scales):
    """The Triton insert kernel (interpreted on CPU) stores k / k_scale and v / v_scale as the reference
    does: byte for byte where the division is exact (powers of two), within one fp8 step otherwise."""
    from minimax_ops import reference as ref
    from minimax_ops.kernels import qk_norm_rope

    g = torch.Generator().manual_seed(4)
    (_, decode), _ = _steps()
    c, n = CFG, decode.num_tokens
    qkv = (torch.randn(n, c.qkv_size(SPARSE), generator=g) * 2).to(torch.bfloat16)
    norms = [(torch.randn(c.head_dim, generator=g) * 0.3).to(torch.bfloat16) for _ in range(4)]
    kw = dict(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
              rotary_dim=c.rotary_dim, rope_theta=c.rope_theta, eps=c.rms_norm_eps,
              index_heads=c.sparse_num_index_heads, index_dim=c.sparse_index_dim, k_scale=scales[0], v_scale=scales[1])
    caches = [_cache(SPARSE, torch.float8_e4m3fn) for _ in range(2)]
    for fn, cache in zip((qk_norm_rope.qk_norm_rope_insert, ref.qk_norm_rope_insert), caches):
        fn(qkv, decode.positions, decode.slot_mapping, decode.index_slot_mapping, *norms, cache.kv, cache.index, **kw)
    kernel, reference = caches[0].kv, caches[1].kv
    if scales == (4.0, 0.5):
        assert torch.equal(kernel.view(torch.uint8), reference.view(torch.uint8))
    else:
        diff = (kernel.float() - reference.float()).abs()
        assert float(diff.max()) <= float(reference.float().abs().max()) / 8  # at most one e4m3 step
        assert float((diff > 0).float().mean()) < 0.02
    assert reference.float().abs().sum() > 0  # something was written
