"""MX weight formats (MXFP8, MXFP4 e2m1 + E8M0 scales) and the fp8 cache cast."""

import pytest
import torch

from minimax_ops import formats as F
from minimax_ops.constants import E8M0_BIAS, MX_BLOCK
from utils import rel_err

# The 16 e2m1 codes by value: bit 3 is the sign, bits 0-2 index the magnitudes.
E2M1_CODE_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
# Block exponents from near the bottom to near the top of what fp32 holds after scaling.
EXPONENTS = [-120, -60, -7, 0, 5, 60, 100]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- MXFP4 -------------------------------------------------------------------------------------


def test_mxfp4_unpack_all_codes_both_nibbles():
    codes = torch.arange(16, dtype=torch.uint8)
    # Every code in the low nibble next to every code in the high nibble.
    lo, hi = codes.repeat_interleave(16), codes.repeat(16)
    values = F.unpack_e2m1(lo | (hi << 4))
    lut = torch.tensor(E2M1_CODE_VALUES)
    assert torch.equal(values[0::2], lut[lo.long()])
    assert torch.equal(values[1::2], lut[hi.long()])


def test_mxfp4_packing_order_hand_built_bytes():
    # Row of 32 elements: element 2j low nibble, 2j+1 high nibble.
    # Bytes 0x21 -> (0.5, 1.0); 0x7F -> (-6, 6); 0xA3 -> (1.5, -1.0); 0x08 -> (-0.0, 0.0).
    packed = torch.tensor([[0x21, 0x7F, 0xA3, 0x08] + [0x00] * 12], dtype=torch.uint8)
    scale = torch.tensor([[E8M0_BIAS + 1]], dtype=torch.uint8)  # x2
    got = F.dequantize(packed, scale)
    want = torch.tensor([0.5, 1.0, -6.0, 6.0, 1.5, -1.0, -0.0, 0.0] + [0.0] * 24) * 2
    assert got.shape == (1, 32)
    assert torch.equal(got[0], want)
    # quantize writes the same bytes back (-0.0 is the one code that comes back as +0).
    q, s = F.quantize_mxfp4(want[None])
    assert q.tolist()[0][:4] == [0x21, 0x7F, 0xA3, 0x00]
    assert s.tolist() == [[E8M0_BIAS + 1]]


@pytest.mark.parametrize("exp", EXPONENTS)
def test_mxfp4_grid_values_round_trip_exactly(exp):
    g = _gen(100 + exp)
    rows = 6
    # Each 32-block holds all 16 codes twice, shuffled, so its amax is exactly 6 * 2^exp.
    codes = torch.stack([torch.arange(16).repeat(2)[torch.randperm(32, generator=g)]
                         for _ in range(rows * 2)]).view(rows, 64)
    values = torch.tensor(E2M1_CODE_VALUES)[codes] * 2.0 ** exp
    packed, scale = F.quantize(values, "mxfp4")
    assert packed.dtype == torch.uint8 and packed.shape == (rows, 32)
    assert scale.dtype == torch.uint8 and scale.shape == (rows, 2)
    assert (scale.int() == E8M0_BIAS + exp).all()
    assert torch.equal(F.dequantize(packed, scale), values)
    # Bytes too: the codes come back, except -0 which quantises to +0.
    expect_codes = torch.where(codes == 8, 0, codes)
    assert torch.equal(packed, (expect_codes[:, 0::2] | (expect_codes[:, 1::2] << 4)).to(torch.uint8))


def test_mxfp4_block_with_smaller_amax_round_trips():
    # amax 1.5 * 2^e: the quantiser rescales the block by 4 (to amax 6); all values stay on the grid.
    g = _gen(1)
    small = torch.tensor([0.0, 0.5, 1.0, 1.5, -0.5, -1.0, -1.5])
    vals = small[torch.randint(0, 7, (4, 64), generator=g)]
    vals[:, ::32] = 1.5
    x = vals * 2.0 ** 3
    w, s = F.quantize_mxfp4(x)
    assert (s.int() == E8M0_BIAS + 3 - 2).all()
    assert torch.equal(F.dequantize(w, s), x)


def test_mxfp4_rounds_to_nearest_grid_value():
    g = _gen(2)
    x = (torch.rand(8, 64, generator=g) * 12 - 6)
    x[:, ::32] = 6.0  # pin the scale to 2^0 so the grid is the e2m1 grid itself
    w, s = F.quantize_mxfp4(x)
    got = F.dequantize(w, s)
    grid = torch.tensor(sorted(set(abs(v) for v in E2M1_CODE_VALUES)))
    nearest = (x.abs()[..., None] - grid).abs().min(-1).values
    assert torch.allclose((got - x).abs(), nearest, atol=1e-6)
    assert torch.equal(got.sign() * (got != 0), x.sign() * (got != 0))


def test_mxfp4_ties_round_to_even_code():
    # Midpoints between neighbouring e2m1 magnitudes go to the code with an even mantissa bit.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = torch.tensor((mids + [-m for m in mids] + [6.0]) * 2 + [0.0] * 2)
    w, s = F.quantize_mxfp4(x[None])
    assert s.tolist() == [[E8M0_BIAS]]
    got = F.dequantize(w, s)[0]
    assert got.tolist() == (want + [-v for v in want] + [6.0]) * 2 + [0.0] * 2


# ---- MXFP8 -------------------------------------------------------------------------------------


def _representable_e4m3(g: torch.Generator, shape) -> torch.Tensor:
    """Random e4m3fn values (every finite bit pattern but NaN), as float32."""
    bits = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    bits = torch.where((bits & 0x7F) == 0x7F, bits & 0xF0, bits)  # drop the NaN patterns
    return bits.view(torch.float8_e4m3fn).float()


@pytest.mark.parametrize("exp", EXPONENTS)
def test_mxfp8_representable_values_round_trip_exactly(exp):
    g = _gen(200 + exp)
    vals = _representable_e4m3(g, (5, 96))
    vals[:, ::32] = 448.0  # block amax = max e4m3, so the block scale is exactly 2^exp
    x = vals * 2.0 ** exp
    w, s = F.quantize(x, "mxfp8")
    assert w.dtype == torch.float8_e4m3fn and w.shape == (5, 96)
    assert s.dtype == torch.uint8 and s.shape == (5, 3)
    assert (s.int() == E8M0_BIAS + exp).all()
    assert torch.equal(F.dequantize(w, s), x)
    assert torch.equal(w.float(), vals)


def test_mxfp8_small_amax_block_round_trips():
    # Block amax 1.0: rescaled by 2^8 before the cast, which must not lose any e4m3 value.
    g = _gen(3)
    vals = _representable_e4m3(g, (4, 64)).clamp(-1, 1)
    vals[:, ::32] = -1.0
    w, s = F.quantize_mxfp8(vals)
    assert (s.int() == E8M0_BIAS - 8).all()
    assert torch.equal(F.dequantize(w, s), vals)


# ---- random data: error bounds and no saturation -----------------------------------------------------


@pytest.mark.parametrize("fmt,bound,block_bound", [("mxfp8", 0.04, 1 / 16), ("mxfp4", 0.15, 0.2)])
def test_quantize_random_error_bounds(fmt, bound, block_bound):
    g = _gen(4)
    # Rows of very different magnitude and heavy-tailed blocks.
    # Gaussian rows of very different magnitudes.
    x = torch.randn(32, 256, generator=g) * torch.exp2(torch.randint(-20, 20, (32, 1), generator=g).float())
    w, s = F.quantize(x, fmt)
    y = F.dequantize(w, s)
    assert torch.isfinite(y).all()
    assert rel_err(y, x) < bound
    # Row-wise too: no row is badly off.
    row_err = (y - x).norm(dim=-1) / x.norm(dim=-1)
    assert row_err.max() < 1.25 * bound
    # Heavy-tailed blocks: the block amax survives within the element format's rounding (nothing clipped).
    x = x * (1 + 5 * torch.rand(32, 256, generator=g) ** 8)
    y = F.dequantize(*F.quantize(x, fmt))
    xa = x.unflatten(-1, (-1, MX_BLOCK)).abs().amax(-1)
    ya = y.unflatten(-1, (-1, MX_BLOCK)).abs().amax(-1)
    assert ((ya - xa).abs() / xa).max() <= block_bound + 1e-6


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_no_saturation_for_large_mantissa_amax(fmt):
    # Block amax m * 2^k with m in (1.5, 2): OCP's floor(log2 amax) - emax scale would put these
    # blocks past the element max (448 = 1.75 * 2^8, 6 = 1.5 * 2^2) and clip them.
    g = _gen(5)
    x = torch.randn(4, 64, generator=g)
    amax = torch.tensor([[1.6], [1.8], [1.9], [1.99]]) * torch.tensor([[2.0 ** -30], [1.0], [2.0 ** 9], [2.0 ** 40]])
    x = x / x.abs().amax(-1, keepdim=True) * amax
    w, s = F.quantize(x, fmt)
    y = F.dequantize(w, s)
    tol = 1 / 16 if fmt == "mxfp8" else 0.2
    xa = x.unflatten(-1, (-1, MX_BLOCK)).abs().amax(-1)
    ya = y.unflatten(-1, (-1, MX_BLOCK)).abs().amax(-1)
    assert ((ya - xa).abs() / xa).max() <= tol + 1e-6
    assert torch.isfinite(y).all()


def test_quantize_rejects_ragged_blocks():
    x = torch.randn(2, 48, generator=_gen(6))
    for fn in (F.quantize_mxfp8, F.quantize_mxfp4):
        with pytest.raises(ValueError, match="multiple of 32"):
            fn(x)


def test_logical_in_features():
    x = torch.randn(3, 64, generator=_gen(7))
    for fmt in ("bf16", "mxfp8", "mxfp4"):
        w, _ = F.quantize(x, fmt)
        assert F.logical_in_features(w) == 64


# ---- weight_format --------------------------------------------------------------------------------


def test_weight_format_from_dtypes():
    x = torch.randn(4, 64, generator=_gen(8))
    assert F.weight_format(x.bfloat16(), None) is F.WeightFormat.BF16
    assert F.weight_format(*F.quantize_mxfp8(x)) is F.WeightFormat.MXFP8
    assert F.weight_format(*F.quantize_mxfp4(x)) is F.WeightFormat.MXFP4
    assert torch.equal(F.dequantize(x.bfloat16(), None), x.bfloat16().float())


@pytest.mark.parametrize("weight_dtype,scale_dtype,match", [
    (torch.float8_e4m3fn, None, "needs an E8M0 scale"),
    (torch.uint8, None, "needs an E8M0 scale"),
    (torch.bfloat16, torch.uint8, "takes no scale"),
    (torch.float8_e4m3fn, torch.float32, "scale must be uint8"),
    (torch.int8, torch.uint8, "int8"),
    (torch.float8_e5m2, torch.uint8, "float8_e5m2"),
])
def test_weight_format_errors_name_the_problem(weight_dtype, scale_dtype, match):
    weight = torch.ones(4, 64).to(weight_dtype)
    scale = None if scale_dtype is None else torch.ones(4, 2).to(scale_dtype)
    with pytest.raises(ValueError, match=match):
        F.weight_format(weight, scale)


# ---- cache cast -----------------------------------------------------------------------------------------


def test_to_cache_dtype_saturates_fp8():
    x = torch.tensor([1000.0, -1e6, 448.0, -448.0, 449.0, 300.0, -0.75, float("inf"), -float("inf")])
    y = F.to_cache_dtype(x, torch.float8_e4m3fn)
    assert y.dtype == torch.float8_e4m3fn
    assert y.float().tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, 288.0, -0.75, 448.0, -448.0]
    # bf16 caches are a plain cast.
    z = torch.randn(5, 7, generator=_gen(9)) * 1000
    assert torch.equal(F.to_cache_dtype(z, torch.bfloat16), z.bfloat16())
