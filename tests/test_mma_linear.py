"""The mma-layout GEMV (kernels/linear_mma.py, mx_linear's path for mxfp4_mma / mxfp8_mma weights).

On CPU it runs under the Triton interpreter through the portable emulation of the inline-PTX block
product; on CUDA through the PTX itself (row blocks per program, load depths and K splits as the
tile cases say). Both are checked against the fp32 product of the dequantized canonical weights.
"""

from __future__ import annotations

import math

import pytest
import torch

from minimax_ops.formats import FMT_MXFP4_MMA, FMT_MXFP8_MMA, dequantize, quantize, to_mma_layout
from minimax_ops.kernels import tiles as tile_module
from minimax_ops.kernels.linear_mma import mma_linear
from minimax_ops.kernels.mx_linear import mx_linear
from minimax_ops.kernels.tiles import MmaLinearTiles, mma_linear_tiles
from utils import rel_err


def _weight(fmt, n, k, device):
    w, s = quantize(torch.randn(n, k) * 0.3, fmt)
    mw, ms = to_mma_layout(w, s)
    return dequantize(w, s).to(device), mw.to(device), ms.to(device)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("m", [1, 5, 8, 9, 16])
def test_mma_linear_matches_reference(fmt, m, device):
    """1..8 tokens: one token group; 9..16: two groups on one weight stream (rows past M unstored)."""
    torch.manual_seed(m)
    want_w, mw, ms = _weight(fmt, 48, 256, device)
    x = torch.randn(m, 256, device=device).bfloat16()
    y = mx_linear(x, mw, ms)
    assert y.shape == (m, 48) and y.dtype == torch.bfloat16
    assert rel_err(y, x.float() @ want_w.T) < 1e-2
    y32 = mx_linear(x, mw, ms, out_dtype=torch.float32)
    assert rel_err(y32, x.float() @ want_w.T) < 1e-5
    assert torch.equal(y32, mx_linear(x, mw, ms, out_dtype=torch.float32))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mma_linear_splits_and_depths(fmt, device):
    """K splits (partials, last arrival sums them; or made by a program's warps, summed through shared
    memory; or both), load depths, row blocks per program, an N that does not fill the last program,
    strided x rows, padding rows of zeros."""
    torch.manual_seed(3)
    want_w, mw, ms = _weight(fmt, 80, 512, device)
    x = torch.randn(6, 640, device=device).bfloat16()[:, 64:576]  # rows 1280 bytes apart
    x[4] = 0
    want = x.float() @ want_w.T
    for tiles in (MmaLinearTiles(4, 2, 2, 2), MmaLinearTiles(2, 1, 0, 8), MmaLinearTiles(1, 4, 1, 1),
                  MmaLinearTiles(4, 1, 0, 2, warp_split=2), MmaLinearTiles(8, 1, 0, 1, warp_split=8)):
        y = mma_linear(x, mw, ms, FMT_MXFP8_MMA if fmt == "mxfp8" else FMT_MXFP4_MMA, torch.float32, tiles=tiles)
        assert rel_err(y, want) < 1e-5, tiles
        assert (y[4] == 0).all()
    with pytest.raises(ValueError, match="tiles: weight's 3 splits"):
        mma_linear(x, mw, ms, FMT_MXFP4_MMA if fmt == "mxfp4" else FMT_MXFP8_MMA, torch.float32,
                   tiles=MmaLinearTiles(1, 1, 0, 3))
    with pytest.raises(ValueError, match="warp_split 3 must divide num_warps 4"):
        mma_linear(x, mw, ms, FMT_MXFP4_MMA if fmt == "mxfp4" else FMT_MXFP8_MMA, torch.float32,
                   tiles=MmaLinearTiles(4, 1, 0, 1, warp_split=3))


def test_mma_linear_tiles_fill_the_gpu():
    """Real sizes: qkv 9856 x 6144, o_proj 6144 x 8192 split K until ~16 row-block streams per SM
    (whole load steps per split), the splits made by the program's warps where they divide them if
    tiles.WARP_SPLIT names the GEMVs (never where the caller's programs must own num_warps row
    blocks), a small matrix is not split."""
    for n, k, fp8 in ((9856, 6144, True), (6144, 8192, True), (9856, 6144, False)):
        t = mma_linear_tiles(n, k, 132, fp8)
        parts = t.split * t.warp_split
        assert (k // 64) % (t.depth * parts) == 0
        assert (n // 16) * parts >= 16 * 132 or parts == 8
        assert t.warp_split == (math.gcd(t.num_warps, parts) if "gemv" in tile_module.WARP_SPLIT else 1)
        whole = mma_linear_tiles(n, k, 132, fp8, warp_split=False)
        assert whole.warp_split == 1 and whole.split == parts
    assert mma_linear_tiles(64, 128, 132, True).split * mma_linear_tiles(64, 128, 132, True).warp_split in (1, 2)
