"""Weight and cache number formats: MXFP8, MXFP4 (e2m1) with E8M0 block scales, fp8 e4m3 KV.

MX formats (OCP microscaling): every MX_BLOCK=32 consecutive elements along the reduction
dimension K share one E8M0 scale byte ``s``; an element's value is ``element * 2**(s - 127)``.
- MXFP8: elements are ``torch.float8_e4m3fn`` [N, K]; scales uint8 [N, K/32].
- MXFP4: elements are e2m1 packed two per uint8 [N, K/2], element 2j in the low nibble and 2j+1
  in the high nibble; scales uint8 [N, K/32].
A linear weight is therefore a pair (weight, scale) whose format follows from the dtypes:
bf16/fp32 with no scale, float8_e4m3fn + uint8 scale, or uint8 (packed e2m1) + uint8 scale.
"""

from __future__ import annotations

import enum

import torch

from .constants import E8M0_BIAS, MX_BLOCK

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Magnitudes of the 8 e2m1 codes 0b000..0b111 (the sign is bit 3).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_ELEM_MAX = {"mxfp8": FP8_E4M3_MAX, "mxfp4": E2M1_MAX}


class WeightFormat(str, enum.Enum):
    BF16 = "bf16"
    MXFP8 = "mxfp8"
    MXFP4 = "mxfp4"


def weight_format(weight: torch.Tensor, scale: torch.Tensor | None) -> WeightFormat:
    """Format of a (weight, scale) pair, from dtypes alone (works on FakeTensors)."""
    if weight.dtype in (torch.bfloat16, torch.float16, torch.float32):
        if scale is not None:
            raise ValueError(f"weight of dtype {weight.dtype} takes no scale, got one")
        return WeightFormat.BF16
    if scale is None:
        raise ValueError(f"weight of dtype {weight.dtype} needs an E8M0 scale tensor, got None")
    if scale.dtype != torch.uint8:
        raise ValueError(f"weight scale must be uint8 (E8M0), got {scale.dtype}")
    if weight.dtype == torch.float8_e4m3fn:
        return WeightFormat.MXFP8
    if weight.dtype == torch.uint8:
        return WeightFormat.MXFP4
    raise ValueError(
        f"weight dtype must be bfloat16, float8_e4m3fn (MXFP8) or uint8 (MXFP4), got {weight.dtype}")


def logical_in_features(weight: torch.Tensor) -> int:
    """K of a weight [..., N, K] (MXFP4 stores K/2 bytes per row)."""
    return weight.shape[-1] * 2 if weight.dtype == torch.uint8 else weight.shape[-1]


def _shared_exponent(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Unbiased E8M0 exponent per 32-block: the smallest power of two that brings the block's
    amax within the element format's largest value (rounding the exponent up, so nothing saturates;
    OCP's floor(log2(amax)) - emax can push a block past 448 for e4m3)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    exp = torch.ceil(torch.log2(amax.clamp_min(2.0**-127) / _ELEM_MAX[fmt]))
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS)


def _check_blocks(x: torch.Tensor, name: str) -> None:
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"{name}: last dimension must be a multiple of {MX_BLOCK}, got {x.shape[-1]}")


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(scale.to(torch.float32) - E8M0_BIAS)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (float8_e4m3fn [..., K], uint8 scales [..., K/32]); saturates at 448."""
    _check_blocks(x, "quantize_mxfp8(x)")
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK))
    exp = _shared_exponent(blocks, "mxfp8")
    vals = (blocks * torch.exp2(-exp)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return vals.to(torch.float8_e4m3fn).flatten(-2), (exp.squeeze(-1) + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    blocks = weight.float().unflatten(-1, (-1, MX_BLOCK))
    return (blocks * e8m0_to_float(scale).unsqueeze(-1)).flatten(-2)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round |v| <= 6 to the nearest e2m1 magnitude (ties to the even code) -> 4-bit codes."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    dist = (v.abs().unsqueeze(-1) - grid).abs()
    # Break ties towards the even code (the OCP round-half-to-even rule on the mantissa bit).
    odd = torch.arange(8, device=v.device) % 2
    mag = torch.argmin(dist * 2 + odd * 1e-6, dim=-1)
    sign = ((v < 0) & (mag > 0)).to(torch.int64) << 3
    return (mag | sign).to(torch.uint8)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (packed uint8 [..., K/2], uint8 scales [..., K/32]); saturates at 6."""
    _check_blocks(x, "quantize_mxfp4(x)")
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK))
    exp = _shared_exponent(blocks, "mxfp4")
    vals = (blocks * torch.exp2(-exp)).clamp(-E2M1_MAX, E2M1_MAX).flatten(-2)
    codes = _e2m1_codes(vals)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exp.squeeze(-1) + E8M0_BIAS).to(torch.uint8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] -> float32 element values [..., K] (before scaling)."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                       device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    return lut[codes.long()]


def dequantize_mxfp4(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    blocks = unpack_e2m1(weight).unflatten(-1, (-1, MX_BLOCK))
    return (blocks * e8m0_to_float(scale).unsqueeze(-1)).flatten(-2)


def quantize(x: torch.Tensor, fmt: WeightFormat | str) -> tuple[torch.Tensor, torch.Tensor | None]:
    fmt = WeightFormat(fmt)
    if fmt is WeightFormat.BF16:
        return x.to(torch.bfloat16), None
    return quantize_mxfp8(x) if fmt is WeightFormat.MXFP8 else quantize_mxfp4(x)


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Any (weight, scale) pair -> float32 [..., N, K]."""
    fmt = weight_format(weight, scale)
    if fmt is WeightFormat.BF16:
        return weight.float()
    return dequantize_mxfp8(weight, scale) if fmt is WeightFormat.MXFP8 else dequantize_mxfp4(weight, scale)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast for a KV / index cache write: fp8 e4m3 saturates at +-448 with scale 1.0."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return x.to(dtype)
