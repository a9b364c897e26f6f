"""The add + Gemma RMSNorm kernels (minimax_ops.kernels.norm) against the fp32 reference: values within one
bf16 ulp (the interpreter truncates fp32 -> bf16 casts where GPUs round to nearest), an fp32 input rounded as
torch's cast rounds it, the fused layer's input norm launching its dependent first, and bad inputs refused. On
CPU they run under the Triton interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from minimax_ops import reference as ref
from minimax_ops.config import preset
from minimax_ops.kernels import norm
from utils import assert_within_ulp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = preset("tiny").rms_norm_eps


def randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("hidden", [64, 96, 6144])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_add_rmsnorm(hidden, w_dtype):
    gen = torch.Generator().manual_seed(hidden)
    x, residual = randn(5, hidden, gen=gen), randn(5, hidden, gen=gen, scale=4.0)
    weight = (torch.randn(hidden, generator=gen) * 0.3).to(w_dtype).to(DEVICE)
    h, res_out = norm.add_rmsnorm(x, residual, weight, EPS)
    assert h.dtype == res_out.dtype == torch.bfloat16 and h.shape == res_out.shape == x.shape
    assert_within_ulp(res_out, (residual.float() + x.float()).to(torch.bfloat16), torch.bfloat16, "residual_out")
    # h normalises the stored residual (whichever way it was rounded).
    assert_within_ulp(h, ref.gemma_rmsnorm(res_out, weight, EPS), torch.bfloat16, "h")
    assert_within_ulp(norm.rmsnorm(x, weight, EPS), ref.gemma_rmsnorm(x, weight, EPS), torch.bfloat16, "rmsnorm")


@pytest.mark.parametrize("hidden", [96, 6144])
def test_add_rmsnorm_takes_an_fp32_sum_with_the_bits_of_its_bf16_cast(hidden):
    """x fp32 (a tensor-parallel fused layer's all-reduce sum) gives the bits x.to(torch.bfloat16) gives: the
    kernel rounds to nearest, ties to even, as torch's cast does (interpreted too, where a plain cast
    truncates). x sits between bf16 neighbours: exact ties, just above and below them, elsewhere; rows of
    unit, tiny and large magnitude. Row 0's residual is zero on purpose: its residual_out is the rounded x."""
    gen = torch.Generator().manual_seed(hidden + 1)
    scales = torch.tensor([1.0, 3e-20, 7e18]).view(3, 1)
    below = (torch.randn(3, hidden, generator=gen) * scales).to(torch.bfloat16).float()  # bf16 values
    offsets = torch.tensor([0x8000, 0x8001, 0x7FFF, 0x1234, 0xC000], dtype=torch.int32)
    x = (below.view(torch.int32) + offsets[torch.randint(0, 5, (3, hidden), generator=gen)]).view(torch.float32)
    x = x.to(DEVICE)
    residual = randn(3, hidden, gen=gen, scale=4.0)
    residual[0] = 0.0
    weight = (torch.randn(hidden, generator=gen) * 0.3).bfloat16().to(DEVICE)
    h, res_out = norm.add_rmsnorm(x, residual, weight, EPS)
    h_cast, res_cast = norm.add_rmsnorm(x.to(torch.bfloat16), residual, weight, EPS)
    assert h.dtype == res_out.dtype == torch.bfloat16
    assert torch.equal(res_out[0], x[0].to(torch.bfloat16)), "x rounded otherwise than torch's cast"
    assert torch.equal(res_out, res_cast) and torch.equal(h, h_cast)
    with pytest.raises(ValueError, match="x: expected dtype torch.bfloat16 or torch.float32, got torch.float16"):
        norm.add_rmsnorm(x.half(), residual, weight, EPS)


def test_the_fused_layers_input_norm_lets_its_dependent_launch_first(monkeypatch):
    """The fused layer's input norm lets the qkv GEMV launch before its own PDL wait (decode_layer's
    ``input_add_rmsnorm``), its other norms do not, MINIMAX_OPS_NORM_LAUNCH_FIRST=0 turns it off; the values
    are the same bits either way."""
    from minimax_ops.kernels import decode_layer
    monkeypatch.delenv("MINIMAX_OPS_NORM_LAUNCH_FIRST", raising=False)
    calls, add_rmsnorm = [], norm.add_rmsnorm
    monkeypatch.setattr(norm, "add_rmsnorm",
                        lambda *a, **k: calls.append(k.get("launch_first")) or add_rmsnorm(*a, **k))
    gen = torch.Generator().manual_seed(5)
    x, residual = randn(2, 96, gen=gen), randn(2, 96, gen=gen, scale=4.0)
    weight = (torch.randn(96, generator=gen) * 0.3).bfloat16().to(DEVICE)
    stages = decode_layer.kernel_stages()
    first = stages.input_add_rmsnorm(x, residual, weight, EPS)
    plain = stages.add_rmsnorm(x, residual, weight, EPS)
    monkeypatch.setenv("MINIMAX_OPS_NORM_LAUNCH_FIRST", "0")
    switched = stages.input_add_rmsnorm(x, residual, weight, EPS)
    assert calls == [True, None, False]
    for got in (plain, switched):
        assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])


def test_rmsnorm_rejects_bad_inputs():
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="x: expected dtype torch.bfloat16"):
        norm.rmsnorm(x, torch.zeros(64, device=DEVICE), EPS)
    with pytest.raises(ValueError, match=r"weight: expected a contiguous \[64\]"):
        norm.rmsnorm(x.bfloat16(), torch.zeros(32, device=DEVICE), EPS)
