"""Weight and cache number formats: MXFP8, MXFP4 (e2m1) with E8M0 block scales, fp8 e4m3 KV.

MX formats (OCP microscaling): every MX_BLOCK=32 consecutive elements along the reduction
dimension K share one E8M0 scale byte ``s``; an element's value is ``element * 2**(s - 127)``.
- MXFP8: elements are ``torch.float8_e4m3fn`` [N, K]; scales uint8 [N, K/32].
- MXFP4: elements are e2m1 packed two per uint8 [N, K/2], element 2j in the low nibble and 2j+1
  in the high nibble; scales uint8 [N, K/32].
A linear weight is therefore a pair (weight, scale) whose format follows from the dtypes:
bf16/fp32 with no scale, float8_e4m3fn + uint8 scale, or uint8 (packed e2m1) + uint8 scale.

Storage layouts (``LAYOUTS``, the one registry used by checks, kernels, loader and weights): the
element format says what the values are; the layout says how they sit in memory.
- canonical (the checkpoint's): bf16 / MXFP8 [..., N, K], MXFP4 bytes [..., N, K/2];
- ``mxfp4_words``: int32 [..., N, K/8], each word the canonical word's 8 values with their bits
  pre-placed where the kernels' bf16 decode wants them (``pack_mxfp4_words``);
- tiled (``*_tiled``): [..., N/BN, K/BK, BN, BK/k_per_unit], scales [..., N/BN, K/BK, BN, BK/32]:
  each [BN, BK] tile a kernel program streams per K step is one contiguous block (long DRAM
  bursts instead of BN short row pieces). BN and BK are read back from the shape. MXFP4 tiles
  hold ``mxfp4_words`` words.
- ``mxfp4_mma``: int32 [..., N/16, K/64, 128], scales uint8 [..., N/16, K/64, 32]: blocks of 16 rows
  x 64 K values, each laid out for one warp's ``mma.sync.m16n8k16`` operands
  (kernels/mma_decode.py): word 4l + j of a block (lane l = 4g + c, k-step j = 2q + jj) holds, in
  ``mxfp4_words`` bit placement, values (row g; K 32q + 8c + 4jj + 0, 1), (row g + 8; same K),
  (row g; + 2, 3), (row g + 8; + 2, 3); scale byte 4g + 2h + q of a block is row g + 8h's group q
  plus ``MMA_SCALE_BIAS`` (so E8M0 scales above 128 do not fit: ``to_mma_layout`` refuses them).
- ``mxfp8_mma``: the same blocks for MXFP8, 1024 bytes each: float8_e4m3fn storage [..., N/16, K/64,
  1024] (bit-placed, not values: the kernels read it as 256 int32 words), scales as in
  ``mxfp4_mma`` biased by ``MMA8_SCALE_BIAS`` (E8M0 scales above 134 do not fit). Word
  128q + 4(4g + c) + 2jj + h of a block holds the 4 values (row g + 8h; K 32q + 8c + 4jj + 0..3),
  bits placed so that one mask gives values 0, 1 and two shifts and a mask values 2, 3 as bf16x2
  pairs (``pack_mxfp8_words``); NaN codes are refused.
The reference and ``dequantize`` read every layout (``to_canonical`` undoes the re-layout);
weights.py re-lays a model's weights once at load time (``to_layout``).
"""

from __future__ import annotations

import dataclasses
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
    if weight.dtype in (torch.uint8, torch.int32):
        return WeightFormat.MXFP4
    raise ValueError(f"weight dtype must be bfloat16, float8_e4m3fn (MXFP8), uint8 (MXFP4) or int32 (MXFP4 "
                     f"words), got {weight.dtype}")


# Kernel decode codes (the kernels' FMT constexpr): how one storage row along K decodes.
FMT_BF16, FMT_MXFP8, FMT_MXFP4, FMT_MXFP4_WORDS, FMT_MXFP4_MMA, FMT_MXFP8_MMA = 0, 1, 2, 3, 4, 5
MMA_CODES = (FMT_MXFP4_MMA, FMT_MXFP8_MMA)
MMA_ROWS, MMA_K, MMA_WORDS, MMA_SCALES = 16, 64, 128, 32  # one mxfp4_mma block
MMA8_BYTES = MMA_ROWS * MMA_K  # one mxfp8_mma block (256 words)
# stored scale byte = E8M0 scale + bias: the bf16 exponent the decode multiplies by (e2m1 values
# decode as v * 2^-126, e4m3 values as v * 2^-120)
MMA_SCALE_BIAS, MMA8_SCALE_BIAS = 126, 120


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    name: str
    element: WeightFormat  # what the values are
    code: int  # the kernels' FMT decode code
    dtype: torch.dtype  # storage dtype
    k_per_unit: int  # K values per storage element along the last dimension
    tiled: bool = False
    mma: bool = False  # blocks of mma.sync operands (``mxfp4_mma``)

    @property
    def canonical(self) -> "WeightLayout":
        return CANONICAL[self.element]


LAYOUTS = {layout.name: layout for layout in (
    WeightLayout("bf16", WeightFormat.BF16, FMT_BF16, torch.bfloat16, 1),
    WeightLayout("mxfp8", WeightFormat.MXFP8, FMT_MXFP8, torch.float8_e4m3fn, 1),
    WeightLayout("mxfp4", WeightFormat.MXFP4, FMT_MXFP4, torch.uint8, 2),
    WeightLayout("mxfp4_words", WeightFormat.MXFP4, FMT_MXFP4_WORDS, torch.int32, 8),
    WeightLayout("bf16_tiled", WeightFormat.BF16, FMT_BF16, torch.bfloat16, 1, tiled=True),
    WeightLayout("mxfp8_tiled", WeightFormat.MXFP8, FMT_MXFP8, torch.float8_e4m3fn, 1, tiled=True),
    WeightLayout("mxfp4_tiled", WeightFormat.MXFP4, FMT_MXFP4_WORDS, torch.int32, 8, tiled=True),
    WeightLayout("mxfp4_mma", WeightFormat.MXFP4, FMT_MXFP4_MMA, torch.int32, 8, mma=True),
    WeightLayout("mxfp8_mma", WeightFormat.MXFP8, FMT_MXFP8_MMA, torch.float8_e4m3fn, 1, mma=True),
)}
_MMA_STORAGE = {torch.int32: (MMA_WORDS, "mxfp4_mma"), torch.float8_e4m3fn: (MMA8_BYTES, "mxfp8_mma")}
CANONICAL = {WeightFormat.BF16: LAYOUTS["bf16"], WeightFormat.MXFP8: LAYOUTS["mxfp8"],
             WeightFormat.MXFP4: LAYOUTS["mxfp4"]}
_BY_DTYPE = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "mxfp8", torch.uint8: "mxfp4", torch.int32: "mxfp4_words"}
# The tiled layout of each element format (MXFP4 tiles hold pre-placed words).
TILED = {WeightFormat.BF16: LAYOUTS["bf16_tiled"], WeightFormat.MXFP8: LAYOUTS["mxfp8_tiled"],
         WeightFormat.MXFP4: LAYOUTS["mxfp4_tiled"]}


def weight_layout(weight: torch.Tensor, scale: torch.Tensor | None, rank: int = 2, name: str = "weight") -> WeightLayout:
    """Layout of a (weight, scale) pair whose logical rank is ``rank`` (2: a matrix [N, K], 3: an
    expert table [E, N, K]); tiled storage has two more dimensions. Works on FakeTensors."""
    fmt = weight_format(weight, scale)
    if weight.dtype == torch.float32:
        base = LAYOUTS["bf16"]
    else:
        base = LAYOUTS[_BY_DTYPE[weight.dtype]]
    if weight.dim() == rank:
        return base
    if weight.dim() == rank + 1 and weight.shape[-1] == _MMA_STORAGE.get(weight.dtype, (None,))[0]:
        mma = _MMA_STORAGE[weight.dtype][1]
        want = (*weight.shape[:-1], MMA_SCALES)
        if scale is None or tuple(scale.shape) != want:
            raise ValueError(f"{name}_scale: expected {mma} scales of shape {want}, got "
                             f"{None if scale is None else tuple(scale.shape)}")
        return LAYOUTS[mma]
    if weight.dim() == rank + 2 and weight.dtype != torch.uint8:
        layout = TILED[fmt]
        if scale is not None and (scale.dim() != weight.dim() or tuple(scale.shape[:-1]) != tuple(weight.shape[:-1])):
            raise ValueError(f"{name}_scale: expected tiled scales of shape {tuple(weight.shape[:-1])} + [BK/32], got "
                             f"{tuple(scale.shape)}")
        return layout
    raise ValueError(f"{name}: expected a {rank}-d weight (or {rank + 2}-d tiled), got shape {tuple(weight.shape)} "
                     f"{weight.dtype}")


def logical_shape(weight: torch.Tensor, layout: WeightLayout) -> tuple[int, ...]:
    """[..., N, K] of a weight stored in ``layout``."""
    if layout.mma:
        *lead, nb, kb, _ = weight.shape
        return (*lead, nb * MMA_ROWS, kb * MMA_K)
    if layout.tiled:
        *lead, nt, kt, bn, units = weight.shape
        return (*lead, nt * bn, kt * units * layout.k_per_unit)
    return (*weight.shape[:-1], weight.shape[-1] * layout.k_per_unit)


def tile_shape(weight: torch.Tensor, layout: WeightLayout) -> tuple[int, int] | None:
    """(BN, BK) of tiled storage, None otherwise."""
    if not layout.tiled:
        return None
    return weight.shape[-2], weight.shape[-1] * layout.k_per_unit


def logical_in_features(weight: torch.Tensor, rank: int | None = None) -> int:
    """K of a weight [..., N, K] in any layout (``rank``: its logical rank; storage of rank + 2 is tiled)."""
    per_unit = {torch.uint8: 2, torch.int32: 8}.get(weight.dtype, 1)
    if rank is not None and weight.dim() == rank + 1 and weight.dtype in _MMA_STORAGE:
        return weight.shape[-2] * MMA_K
    if rank is not None and weight.dim() == rank + 2:
        return weight.shape[-3] * weight.shape[-1] * per_unit
    return weight.shape[-1] * per_unit


def logical_out_features(weight: torch.Tensor, rank: int) -> int:
    """N of a weight [..., N, K] in any layout."""
    if weight.dim() == rank + 1 and weight.dtype in _MMA_STORAGE:
        return weight.shape[-3] * MMA_ROWS
    return weight.shape[-4] * weight.shape[-2] if weight.dim() == rank + 2 else weight.shape[-2]


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


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None, rank: int | None = None) -> torch.Tensor:
    """Any (weight, scale) pair -> float32 [..., N, K]. ``rank``: the logical rank (2 matrix, 3
    table) when the pair may be tiled; None reads canonical or word layouts."""
    if rank is not None or weight.dtype == torch.int32:
        weight, scale = to_canonical(weight, scale, rank or weight.dim())
    fmt = weight_format(weight, scale)
    if fmt is WeightFormat.BF16:
        return weight.float()
    return dequantize_mxfp8(weight, scale) if fmt is WeightFormat.MXFP8 else dequantize_mxfp4(weight, scale)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast for a KV / index cache write: fp8 e4m3 saturates at +-448 with scale 1.0."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return x.to(dtype)


# ---- layouts -------------------------------------------------------------------------------------------


def pack_mxfp4_words(packed: torch.Tensor) -> torch.Tensor:
    """Canonical e2m1 bytes [..., K/2] -> ``mxfp4_words`` int32 [..., K/8], a bounded number of rows
    at a time (the int32 temporaries of a real expert table would not fit)."""
    rows = packed.reshape(-1, packed.shape[-1])
    out = torch.empty(rows.shape[0], rows.shape[1] // 4, dtype=torch.int32, device=packed.device)
    _by_chunks(_pack_words, rows, out, max(1, 2**24 // max(1, rows.shape[1])))
    return out.reshape(*packed.shape[:-1], -1)


def _by_chunks(fn, src: torch.Tensor, out: torch.Tensor, rows: int) -> None:
    """out[i:i + rows] = fn(src[i:i + rows]) down dimension 0: the packers' int64 temporaries stay
    bounded (those of a whole 128-expert table would not fit)."""
    for i in range(0, src.shape[0], rows):
        out[i:i + rows] = fn(src[i:i + rows])


# mxfp4_words bit placement: pair j (the bf16x2 register of a word's values 2j, 2j + 1) is the OR of
# rotl(word, r) & mask over its (r, mask) terms. Each mask covers the pair's target bits: value 2j + h
# (h = 16-bit half) sign@15, magnitude bits 2..0 @8..6 (all + 16h), i.e. bf16 bits of value * 2^-126.
# With rotations (one instruction each, like shifts) every pair but the last gathers its 8 bits with
# one rotate, so a word decodes with 9 integer instructions: pairs 0-2 a rotate and a mask each, pair
# 3 a rotate and two masks (kernels/mx_decode.py::mxfp4_word_pairs, mxfp4_words_ptx).
_WORD_PAIRS = (((2, 0x81C081C0),), ((6, 0x81C081C0),), ((12, 0x81C081C0),),
               ((0, 0x81808180), (8, 0x00400040)))


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    """Rotate left of uint32 values held in int64."""
    r %= 32
    return x if r == 0 else ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF


def _pack_words(packed: torch.Tensor) -> torch.Tensor:
    """``pack_mxfp4_words`` of one chunk.

    Word i holds values 8i..8i+7; value v has its sign s and magnitude bits m2 m1 m0 at
    v 0: s@13, m@6..4; 1: s@29, m@22..20; 2: s@9, m@2..0; 3: s@25, m@18..16; 4: s@3, m@28..26;
    5: s@19, m@12..10; 6: s@15, m@8,7,30; 7: s@31, m@24,23,14. These are the source bits of
    ``_WORD_PAIRS``: target bit t of term (r, mask) comes from word bit (t - r) mod 32."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)  # uint8, value order
    c = codes.unflatten(-1, (-1, 4, 2))  # [..., word, j, h]: value 2j + h
    words = torch.zeros(c.shape[:-2], dtype=torch.int64, device=packed.device)  # uint32 bits
    for j, terms in enumerate(_WORD_PAIRS):
        v = c[..., j, :].to(torch.int64)
        half = ((v & 8) << 12) | ((v & 7) << 6)
        pair = half[..., 0] | (half[..., 1] << 16)  # the bf16x2 register the decode must produce
        for r, mask in terms:
            words |= _rotl32(pair & mask, 32 - r)
    return (words - ((words & 0x80000000) << 1)).to(torch.int32)


def unpack_mxfp4_words(words: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_mxfp4_words``: int32 [..., K/8] -> canonical bytes [..., K/2]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    codes = []
    for terms in _WORD_PAIRS:
        pair = torch.zeros_like(w)
        for r, mask in terms:
            pair |= _rotl32(w, r) & mask
        codes += [((((pair >> (15 + 16 * h)) & 1) << 3) | ((pair >> (6 + 16 * h)) & 7)).to(torch.uint8)
                  for h in range(2)]
    c = torch.stack(codes, dim=-1).flatten(-2)  # value order 0..7 per word
    return c[..., 0::2] | (c[..., 1::2] << 4)


def _tile(t: torch.Tensor, block_n: int, units: int) -> torch.Tensor:
    """[..., N, U] -> [..., N/block_n, U/units, block_n, units], contiguous."""
    *lead, n, u = t.shape
    return t.reshape(*lead, n // block_n, block_n, u // units, units).transpose(-3, -2).contiguous()


def _untile(t: torch.Tensor) -> torch.Tensor:
    *lead, nt, kt, bn, units = t.shape
    return t.transpose(-3, -2).reshape(*lead, nt * bn, kt * units)


def to_layout(weight: torch.Tensor, scale: torch.Tensor | None, tiles: tuple[int, int] | None,
              rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Re-lay a canonical (weight, scale) pair: ``tiles`` (BN, BK) gives the element format's tiled
    layout, None keeps it canonical. BN must divide N and BK (a multiple of 32, and of 8 for MXFP4)
    must divide K, else ValueError. Load time only (allocates a copy)."""
    layout = weight_layout(weight, scale, rank or weight.dim())
    if layout.name not in ("bf16", "mxfp8", "mxfp4"):
        raise ValueError(f"weight: expected a canonical layout to re-lay, got {layout.name}")
    if tiles is None:
        return weight.contiguous(), None if scale is None else scale.contiguous()
    block_n, block_k = tiles
    n, k = weight.shape[-2], logical_shape(weight, layout)[-1]
    if n % block_n or k % block_k or block_k % MX_BLOCK:
        raise ValueError(f"tiles: ({block_n}, {block_k}) must divide [N, K] = [{n}, {k}] (BK a multiple of {MX_BLOCK})")
    target = TILED[layout.element]
    if layout.element is WeightFormat.MXFP4:
        weight = pack_mxfp4_words(weight.contiguous())
    tiled = _tile(weight, block_n, block_k // target.k_per_unit)
    return tiled, None if scale is None else _tile(scale, block_n, block_k // MX_BLOCK)


def to_canonical(weight: torch.Tensor, scale: torch.Tensor | None, rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Any layout -> the checkpoint's canonical (weight, scale) pair."""
    layout = weight_layout(weight, scale, rank)
    if layout.mma:
        return _from_mma(weight, scale) if layout.code == FMT_MXFP4_MMA else _from_mma8(weight, scale)
    if layout.tiled:
        weight, scale = _untile(weight), None if scale is None else _untile(scale)
    if layout.code == FMT_MXFP4_WORDS:
        weight = unpack_mxfp4_words(weight)
    return weight, scale


# mxfp4_mma: value (row 16b + 8h + g, K 64kb + 32q + 8c + 4jj + 2t + u) sits at block (b, kb), word
# 4(4g + c) + 2q + jj, value 4t + 2h + u of that word; its scale at byte 4g + 2h + q.
_MMA_ROW_K = (2, 8, 2, 4, 2, 2, 2)  # the axes (h, g) of a row block and (q, c, jj, t, u) of a K block
# [b, h, g, kb, q, c, jj, t, u] -> [b, kb, g, c, q, jj, t, h, u]: word (g, c, q, jj), value (t, h, u);
# scales [b, h, g, kb, q] -> [b, kb, g, h, q]
_MMA_VALUE_ORDER = (0, 3, 2, 5, 4, 6, 7, 1, 8)
_MMA_SCALE_ORDER = (0, 3, 2, 1, 4)


# mxfp8_mma: value (row 16b + 8h + g, K 64kb + 32q + 8c + 4jj + v) sits at block (b, kb), word
# 128q + 4(4g + c) + 2jj + h, value v of that word.
_MMA8_ROW_K = (2, 8, 2, 4, 2, 4)  # (h, g) of a row block, (q, c, jj, v) of a K block
# [b, h, g, kb, q, c, jj, v] -> [b, kb, q, g, c, jj, h, v]
_MMA8_VALUE_ORDER = (0, 3, 4, 2, 5, 6, 1, 7)


def _inverse(order: tuple[int, ...]) -> list[int]:
    return sorted(range(len(order)), key=order.__getitem__)


def to_mma_layout(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical MXFP4 [..., N, K/2] bytes or MXFP8 [..., N, K] + scales [..., N, K/32] ->
    ``mxfp4_mma`` / ``mxfp8_mma``. N must be a multiple of 16, K of 64, every scale at most 128
    (MXFP4) / 134 (MXFP8), and MXFP8 hold no NaN code (ValueError otherwise). Load time only."""
    layout = weight_layout(weight, scale, weight.dim())
    if layout.name not in ("mxfp4", "mxfp8"):
        raise ValueError(f"weight: expected canonical MXFP4 or MXFP8 to re-lay in an mma layout, got {layout.name}")
    mma = LAYOUTS[layout.name + "_mma"]
    *lead, n, k = logical_shape(weight, layout)
    if n % MMA_ROWS or k % MMA_K:
        raise ValueError(f"weight: {mma.name} needs N % {MMA_ROWS} == 0 and K % {MMA_K} == 0, got [N, K] = [{n}, {k}]")
    bias = MMA_SCALE_BIAS if mma.code == FMT_MXFP4_MMA else MMA8_SCALE_BIAS
    if scale.numel() and int(scale.max()) > 254 - bias:
        raise ValueError(f"weight_scale: {mma.name} stores E8M0 scales up to {254 - bias}, got {int(scale.max())}")
    nb, kb = n // MMA_ROWS, k // MMA_K
    d = len(lead)
    s = scale.reshape(*lead, nb, 2, 8, kb, 2).permute(*range(d), *(d + i for i in _MMA_SCALE_ORDER))
    s = (s.reshape(*lead, nb, kb, MMA_SCALES).to(torch.int32) + bias).to(torch.uint8).contiguous()
    if mma.code == FMT_MXFP8_MMA:
        codes = weight.view(torch.uint8)
        if has_fp8_nan(weight):
            raise ValueError("weight: mxfp8_mma refuses NaN codes (0x7f / 0xff)")
        codes = codes.reshape(*lead, nb, *_MMA8_ROW_K[:2], kb, *_MMA8_ROW_K[2:])
        codes = codes.permute(*range(d), *(d + i for i in _MMA8_VALUE_ORDER)).reshape(*lead, nb, kb, MMA8_BYTES)
        return pack_mxfp8_words(codes.contiguous()).view(torch.float8_e4m3fn), s
    codes = torch.stack([weight & 0xF, weight >> 4], dim=-1).flatten(-2)  # [..., N, K] e2m1 codes
    h, g, q, c, jj, t, u = _MMA_ROW_K
    codes = codes.reshape(*lead, nb, h, g, kb, q, c, jj, t, u)
    codes = codes.permute(*range(d), *(d + i for i in _MMA_VALUE_ORDER)).reshape(*lead, nb, kb, MMA_WORDS * 8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return pack_mxfp4_words(packed.contiguous()), s


def _mma_scales_back(scale: torch.Tensor, bias: int) -> torch.Tensor:
    *lead, nb, kb, _ = scale.shape
    d = len(lead)
    s = (scale.to(torch.int32) - bias).to(torch.uint8).reshape(*lead, nb, kb, 8, 2, 2)
    return s.permute(*range(d), *(d + i for i in _inverse(_MMA_SCALE_ORDER))).reshape(*lead, nb * MMA_ROWS, kb * 2)


def _from_mma(words: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, nb, kb, _ = words.shape
    d = len(lead)
    packed = unpack_mxfp4_words(words)  # [..., nb, kb, 512] bytes in word-value order
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    h, g, q, c, jj, t, u = _MMA_ROW_K
    codes = codes.reshape(*lead, nb, kb, g, c, q, jj, t, h, u)
    codes = codes.permute(*range(d), *(d + i for i in _inverse(_MMA_VALUE_ORDER)))
    codes = codes.reshape(*lead, nb * MMA_ROWS, kb * MMA_K // 2, 2)
    weight = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return weight.contiguous(), _mma_scales_back(scale, MMA_SCALE_BIAS).contiguous()


def _from_mma8(blocks: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, nb, kb, _ = blocks.shape
    d = len(lead)
    codes = unpack_mxfp8_words(blocks.contiguous().view(torch.int32))  # [..., nb, kb, 1024] in storage order
    sizes = (nb, *_MMA8_ROW_K[:2], kb, *_MMA8_ROW_K[2:])  # [b, h, g, kb, q, c, jj, v]
    codes = codes.reshape(*lead, *(sizes[i] for i in _MMA8_VALUE_ORDER))
    codes = codes.permute(*range(d), *(d + i for i in _inverse(_MMA8_VALUE_ORDER)))
    weight = codes.reshape(*lead, nb * MMA_ROWS, kb * MMA_K).view(torch.float8_e4m3fn)
    return weight.contiguous(), _mma_scales_back(scale, MMA8_SCALE_BIAS).contiguous()


def has_fp8_nan(weight: torch.Tensor) -> bool:
    """Whether an e4m3 tensor holds a NaN code (0x7f / 0xff), a bounded number of bytes at a time."""
    flat = weight.reshape(-1).view(torch.uint8)
    return any(bool(((flat[i:i + 2**26] & 0x7F) == 0x7F).any()) for i in range(0, flat.numel(), 2**26))


def pack_mxfp8_words(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes [..., 4m] -> int32 words [..., m], 4 values a word: value 0 sign@15 magnitude@4..10,
    value 1 the same + 16; value 2 sign@11, magnitude bits 0-3 @0..3 and 4-6 @12..14, value 3 the
    same + 16. So ``w & 0x87F087F0`` is values (0, 1) and ``(w << 4) & 0x80F080F0 | (w >> 4) &
    0x07000700`` values (2, 3), as bf16x2 pairs of v * 2^-120. A bounded number of words at a time."""
    flat = codes.reshape(-1, 4)
    out = torch.empty(flat.shape[0], dtype=torch.int32, device=codes.device)
    _by_chunks(_pack_fp8_words, flat, out, 2**24)
    return out.reshape(*codes.shape[:-1], codes.shape[-1] // 4)


def _pack_fp8_words(codes: torch.Tensor) -> torch.Tensor:
    b = codes.to(torch.int64)
    sign, mag = b >> 7, b & 0x7F
    w = ((mag[..., 0] << 4) | (sign[..., 0] << 15) | (mag[..., 1] << 20) | (sign[..., 1] << 31)
         | (mag[..., 2] & 0xF) | ((mag[..., 2] >> 4) << 12) | (sign[..., 2] << 11)
         | ((mag[..., 3] & 0xF) << 16) | ((mag[..., 3] >> 4) << 28) | (sign[..., 3] << 27))
    return (w - ((w >> 31) << 32)).to(torch.int32)


def unpack_mxfp8_words(words: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_mxfp8_words``: int32 [..., m] -> e4m3 bytes (uint8) [..., 4m]."""
    flat = words.reshape(-1)
    out = torch.empty(flat.numel(), 4, dtype=torch.uint8, device=words.device)
    _by_chunks(_unpack_fp8_words, flat, out, 2**24)
    return out.reshape(*words.shape[:-1], words.shape[-1] * 4)


def _unpack_fp8_words(words: torch.Tensor) -> torch.Tensor:
    w = words.to(torch.int64) & 0xFFFFFFFF
    mags = [(w >> 4) & 0x7F, (w >> 20) & 0x7F, (w & 0xF) | (((w >> 12) & 7) << 4),
            ((w >> 16) & 0xF) | (((w >> 28) & 7) << 4)]
    signs = [(w >> 15) & 1, (w >> 31) & 1, (w >> 11) & 1, (w >> 27) & 1]
    return torch.stack([(sg << 7) | m for sg, m in zip(signs, mags)], dim=-1).to(torch.uint8)
