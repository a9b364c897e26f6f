"""Tile heuristics of the weight-streaming kernels, apart from the kernels: GEMV tiles and K splits,
expert tiles, router tiles, and the tiles the load-time tiled weight layout is cut to (which the
kernels then read back from the weight's shape).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch
import triton

from ..formats import FMT_BF16, FMT_MXFP4, FMT_MXFP4_WORDS, FMT_MXFP8, FMT_MXFP8_MMA, MMA_CODES, MMA_K

# The one-token CUDA-core path (GemvConfig.fma); MINIMAX_OPS_NO_FMA=1 keeps the MMA path everywhere.
FMA_ENABLED = os.environ.get("MINIMAX_OPS_NO_FMA") != "1"
DEFAULT_SMS = 132  # an H200; used where no GPU can be asked (CPU / interpreter)
TOKEN_BLOCK = 16  # token rows per tl.dot tile (a step's tokens, padded)


# SWAP_AB_NOTE: the row kernels (stream_rows) put the tokens, not the weights, in the MMA's A operand.
# With the decoded weights as A (swap_ab), 16 tokens make a 64 x 16 wgmma whose A sits in registers;
# Triton 3.6 leaves it in flight into the next K step, where ptxas reuses those registers for the next
# decode (a race, wgmma_hazards.py), and waiting for it every step (mx_decode._mma) made the kernels
# slower than the tokens-as-A form (mma.sync) on the H200 (BENCHMARKS.md, thirteenth session).
@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1  # requested splits of K (the wrapper rounds to whole BLOCK_K steps)
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False  # weights as the MMA's A operand (see SWAP_AB_NOTE)
    ptx: bool | None = None  # MXFP4 inline-PTX decode; None: wherever use_ptx(device) allows
    fused_reduce: bool = True  # split-K: the last split program of a tile sums the partials
    k_chunks: int = 1  # BLOCK_K tiles per K-loop step (longer runs of each weight row per step)
    fma: bool = False  # one token (block_m 1): CUDA-core multiply-adds instead of the MMA (stream_rows)


# Per format: (BLOCK_N, largest BLOCK_K, num_warps, num_stages, K chunks per step). MXFP8 from
# benchmarks/sweep_kernels.py on an H200 (triton 3.6; qkv 9856x6144 and o_proj 6144x8192, M = 1..16:
# 10 tiles x 6 splits, then K chunks 1-8); the others keep the SASS-derived tiles. Narrower K
# (64-128) with more resident warps, 8 warps, and K chunks (longer bursts per row, but 2-4x the
# shared memory) all measured slower than 64 x 256 x 3 stages split 4: wide per-row bursts matter
# more than occupancy here.
_TILES = {FMT_BF16: (64, 128, 4, 4, 1), FMT_MXFP8: (64, 256, 4, 3, 1), FMT_MXFP4: (128, 256, 4, 3, 1),
          FMT_MXFP4_WORDS: (128, 256, 4, 3, 1)}
_PROGRAMS_PER_SM = 4  # K is split until this many programs stream per SM ...
_MAX_SPLIT = 4  # ... but into at most this many parts (8 splits of o_proj measured 10% slower than 4)
_MIN_ITERS_PER_SPLIT = 2


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def block_k_for(k: int, cap: int) -> int:
    """Largest power of two <= cap dividing K (K is a multiple of 32), so the K loop needs no masks."""
    block = cap
    while k % block:
        block //= 2
    return block


def block_m_for(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


# One-token steps: the FMA path's tiles (rows, largest BLOCK_K, warps, stages), per format.
_FMA_TILES = {FMT_BF16: (16, 256, 4, 3), FMT_MXFP8: (32, 256, 4, 3), FMT_MXFP4: (32, 256, 4, 3),
              FMT_MXFP4_WORDS: (32, 256, 4, 3)}


def gemv_config(fmt: int, m: int, n: int, k: int, sms: int = DEFAULT_SMS) -> GemvConfig:
    """Tiles for one GEMV: the format's tile, K split (at most _MAX_SPLIT ways) until ~4 programs
    per SM stream."""
    block_n, cap_k, warps, stages, chunks = _TILES[fmt]
    fma = m == 1 and FMA_ENABLED
    if fma:
        block_n, cap_k, warps, stages = _FMA_TILES[fmt]
    block_m = 1 if fma else block_m_for(m)
    block_k = block_k_for(k, cap_k)
    while chunks > 1 and k % (block_k * chunks):
        chunks //= 2
    iters = k // (block_k * chunks)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    target = _PROGRAMS_PER_SM * sms
    if tiles < (target if fma else target // 2):  # one-token programs are short: split sooner
        # Splits that divide the K steps evenly, each with at least a few steps.
        options = [d for d in range(1, min(iters, _MAX_SPLIT) + 1)
                   if iters % d == 0 and iters // d >= _MIN_ITERS_PER_SPLIT] or [1]
        split = next((d for d in options if tiles * d >= target), options[-1])
    return GemvConfig(block_m, block_n, block_k, split, num_warps=warps, num_stages=stages, k_chunks=chunks, fma=fma)


@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    block_n: int  # w13: gate rows per program (and as many up rows); w2: output rows per program
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split: int = 1  # K splits (w13: over H, w2: over I)
    swap_ab: bool = False  # weights as the MMA's A operand (see SWAP_AB_NOTE)
    ptx: bool | None = None  # MXFP4 inline-PTX decode; None: wherever mx_linear.use_ptx allows
    k_chunks: int = 1  # BLOCK_K tiles per K-loop step (see mx_linear.stream_rows)
    fma: bool = False  # one-token step: CUDA-core multiply-adds, one token row at a time
    max_registers: int = 0  # ptxas register cap of the mma-layout kernels' PTX launch (0: the compiler's choice)
    paired: bool = False  # mma-layout w13: each K block's gate and up blocks in one stream (moe_mma's PAIRED)
    ring: int = 2  # mma-layout kernels: load steps held in registers (mma_decode.block_stream's RING, 2 or 3)
    warp_split: int = 1  # mma-layout kernels: K splits by each program's warps (tiles.split_in_warps)

    @property
    def row_blocks(self) -> int:
        """mma-layout kernels: row blocks (16 rows; w13: gate + up pairs) per program."""
        return self.num_warps // self.warp_split


# Per format, per kernel (w13, w2): (weight rows per program, largest BLOCK_K, num_warps, num_stages,
# K chunks per step), from benchmarks/sweep_kernels.py on an H200 (triton 3.6; 1/4/16-token steps,
# shared expert separate; 3 runs, ~40 tiles x splits per kernel and format): MXFP8 streams 64-row
# tiles 256 values wide, MXFP4 128-row tiles 256 (w13) / 64 (w2) values wide. Wider MXFP4 rows
# (512 values, 8 warps: 10% slower at 1 token, 2x at 16) and K chunks (up to 30% slower: shared
# memory) lost. K is split only to bring a launch to _EXPERT_MIN_PROGRAMS per SM: splitting w13 (H)
# never paid, splitting w2 (I) helps 1-2 token steps by a few %. The kernel-layout MXFP4
# (prepare_weight) runs 9-10% faster than canonical with these tiles; the PTX decode is worth ~10%
# there and nothing measurable on canonical MXFP4.
_EXPERT_TILES = {
    FMT_BF16: ((64, 128, 4, 3, 1), (64, 128, 4, 3, 1)),
    FMT_MXFP8: ((64, 256, 4, 3, 1), (64, 256, 4, 3, 1)),
    FMT_MXFP4: ((128, 256, 4, 3, 1), (128, 64, 4, 3, 1)),
    FMT_MXFP4_WORDS: ((128, 256, 4, 3, 1), (128, 64, 4, 3, 1)),
}
_EXPERT_MIN_PROGRAMS = (1.0, 5.0)  # per SM, (w13, w2)
_MIN_ITERS_PER_SPLIT = 4
# The expert combine's columns a program: a one-token step's row over 24 programs, two columns a thread (fewer
# loads a thread than 1024's eight; faster at one token: BENCHMARKS.md, forty-fourth session).
COMBINE_BLOCK = 256


def combine_block() -> int:
    """The expert combine's columns a program: COMBINE_BLOCK, unless MINIMAX_OPS_COMBINE_BLOCK (a power of
    two, 128-4096; read at every launch: A/B runs switch it between rounds) names another."""
    value = os.environ.get("MINIMAX_OPS_COMBINE_BLOCK")
    if value is None:
        return COMBINE_BLOCK
    block = int(value) if value.strip().isdigit() else 0
    if block < 128 or block > 4096 or block & (block - 1):
        raise ValueError(f"MINIMAX_OPS_COMBINE_BLOCK: expected a power of two in 128..4096, got {value!r}")
    return block


# One-token steps (the FMA path): per format, (w13, w2) rows and largest BLOCK_K (4 warps, 3 stages).
_FMA_EXPERT_TILES = {FMT_BF16: ((32, 128), (32, 128)), FMT_MXFP8: ((64, 128), (64, 128)),
                     FMT_MXFP4: ((64, 128), (64, 128)), FMT_MXFP4_WORDS: ((64, 128), (64, 128))}


def expert_tiles(fmt: int, k: int, rows_total: int, slots: int, w13: bool, sms: int,
                 can_split: bool = True, n_tokens: int = 16, routed: bool = False) -> ExpertTiles:
    """Tiles of one expert launch over `slots` experts of `rows_total` weight rows (w13: 2I) and
    K = k: the format's tile, K split until the launch has _EXPERT_MIN_PROGRAMS programs per SM.
    A one-token step takes the FMA path's tiles; mma-layout tables take ``mma_expert_tiles`` (``routed``
    as there), with ``fill`` for a one-token w13 whose launch would leave some of the ``sms`` without a program
    (a tensor-parallel rank's intermediate: 120 programs at TP 4 where TP 1 has 480; BENCHMARKS.md)."""
    if fmt in MMA_CODES:
        fp8, one_token = fmt == FMT_MXFP8_MMA, n_tokens == 1
        t = mma_expert_tiles(k, w13, can_split, fp8=fp8, one_token=one_token, routed=routed)
        if w13 and one_token and can_split and slots * -(-rows_total // (32 * t.row_blocks)) * t.split < sms:
            t = mma_expert_tiles(k, w13, can_split, fp8=fp8, one_token=one_token, routed=routed, fill=True)
        return t
    rows, cap_k, warps, stages, chunks = _EXPERT_TILES[fmt][0 if w13 else 1]
    fma = n_tokens == 1 and FMA_ENABLED
    if fma:
        rows, cap_k = _FMA_EXPERT_TILES[fmt][0 if w13 else 1]
        chunks = 1
    rows = max(32 if w13 else 16, min(rows, triton.next_power_of_2(rows_total)))  # tiny models: no idle rows
    block_k = block_k_for(k, cap_k)
    chunks = fit_chunks(k, block_k, chunks)
    tiles = slots * triton.cdiv(rows_total, rows)
    split = 1
    if can_split:
        iters = k // (block_k * chunks)
        options = [d for d in range(1, iters + 1) if iters % d == 0 and iters // d >= _MIN_ITERS_PER_SPLIT] or [1]
        target = _EXPERT_MIN_PROGRAMS[0 if w13 else 1] * sms
        split = next((d for d in options if tiles * d >= target), options[-1])
    return ExpertTiles(rows // 2 if w13 else rows, block_k, warps, stages, split, k_chunks=chunks, fma=fma)


# mma-layout expert kernels (moe_mma.py), per (mxfp8_mma, one-token step): per kernel (w13, w2) (row blocks
# per program = warps, blocks per load step, L2 prefetch distance in steps, K splits, register cap or 0),
# then whether w13 streams each K block's gate and up blocks together on one set of x loads (moe_mma's
# PAIRED: the depth then counts blocks per matrix).
# No table prefetches into L2: every A/B of it, in every kernel, measured slower or equal (BENCHMARKS.md);
# the tiles keep the option (tests run it).
# mxfp4_mma, from A/B runs inside the fused layer on the H200 (BENCHMARKS.md): w13 paired; one-token
# steps load 2 blocks a matrix per step and split K in two at 128 registers (480 programs, 4 per SM: all
# resident at once; the two parts made by each program's warps, WARP_SPLIT below), larger steps load 2
# unsplit at 128 registers; w2 capped at 128 registers (4 programs per SM), 2 blocks a step (4 measured
# slower at one token in the seventeenth session).
# mxfp8_mma from the H200 sweep, then A/B in the fused layer: shallow loads, w13 split in two (by the
# warps), gate then up, both kernels at 128 registers (4 programs per SM).
# One-token w2 (both formats) holds three load steps in registers, x loaded at each product (block_stream's
# RING 3; twenty-second session: ~0.5 us a layer at one token, slower at 16 tokens and for w13 or the GEMVs),
# except where the kernel also makes the router's top-k (_ROUTED_W2_RING).
_MMA_EXPERT_TILES = {
    (False, True): ((4, 2, 0, 2, 128), (4, 2, 0, 1, 128, 3), True),
    (False, False): ((4, 2, 0, 1, 128), (4, 2, 0, 1, 128), True),
    (True, True): ((4, 2, 0, 2, 128), (4, 2, 0, 1, 128, 3), False),
    (True, False): ((4, 2, 0, 2, 128), (4, 2, 0, 1, 128), False),
}
# The load steps a one-token w2 holds where it makes the router's top-k itself (moe.routed_moe_experts), by
# mxfp8_mma: MXFP8's two (the top-k takes the registers of the third: thirty-third session's A/B), MXFP4's
# the table's.
_ROUTED_W2_RING = {True: 2}


# mma-layout GEMV (linear_mma.py, qkv_mma.py): (row blocks per program, blocks per load step, L2 prefetch
# steps, register cap or 0); K is split until the launch has about _MMA_LINEAR_WARPS_PER_SM row-block
# streams per SM. mxfp8_mma (qkv / o_proj) from the H200 sweep (8 row blocks, no prefetch, ~18 streams
# per SM), then an A/B inside the fused layer: one block a step at 80 registers (3 programs of 8 warps
# per SM at every step size) beat two blocks a step uncapped.
_MMA_LINEAR_TILES = {False: (8, 4, 0, 0), True: (8, 1, 0, 80)}
_MMA_LINEAR_WARPS_PER_SM = 18
_MMA_LINEAR_MAX_SPLIT = 8
# The kernels ("gemv": the mma-layout GEMVs, "w13": the mma-layout w13) whose K splits that divide a
# program's warps are made by its warps (``warp_split``) instead of by the grid: the parts meet in
# shared memory, not as fp32 partials that the last program to arrive sums (splitk.py: a store, an
# arrival and a read of L2 at the tail of every program). w13 gained from it on the H200; o_proj,
# one row block a program in 8 parts, lost more (BENCHMARKS.md, twenty-fifth session). Read when
# tiles are asked for (the tile functions' caches must then be cleared), so A/B runs switch it.
WARP_SPLIT = frozenset({"w13"})


@dataclasses.dataclass(frozen=True)
class MmaLinearTiles:
    num_warps: int  # warps per program, each streaming a row block (16 rows) or a K part of one
    depth: int  # 64-value blocks per load step
    prefetch: int  # L2 prefetch distance in load steps (CUDA)
    split: int  # K splits by the grid (each a whole number of load steps)
    max_registers: int = 0  # ptxas register cap of the PTX launch (0: the compiler's choice)
    warp_split: int = 1  # K splits by each program's warps (divides num_warps: num_warps // it row blocks)

    @property
    def row_blocks(self) -> int:
        """Row blocks (16 rows) per program."""
        return self.num_warps // self.warp_split


def split_in_warps(warps: int, split: int, kernel: str) -> tuple[int, int]:
    """(grid splits, warp splits) of ``split`` K splits over programs of ``warps`` warps of ``kernel``:
    as many as divide both made by the warps where WARP_SPLIT names the kernel, the rest by the grid."""
    ws = math.gcd(warps, split) if kernel in WARP_SPLIT else 1
    return split // ws, ws


@functools.lru_cache(maxsize=None)  # every decode step asks, with the same few shapes (WARP_SPLIT: clear it)
def mma_linear_tiles(n: int, k: int, sms: int, fp8: bool, warp_split: bool = True) -> MmaLinearTiles:
    """Tiles of an mma-layout GEMV [N, K]: the format's warps per program and depth, K split (into
    whole load steps, at most _MMA_LINEAR_MAX_SPLIT) until N/16 x split streams fill the SMs, the
    splits made by the warps where they can (``split_in_warps``; ``warp_split`` False: by the grid
    only, for programs that must own num_warps row blocks)."""
    warps, depth, prefetch, max_registers = _MMA_LINEAR_TILES[fp8]
    depth = fit_chunks(k, MMA_K, depth)
    steps = k // MMA_K // depth
    target = _MMA_LINEAR_WARPS_PER_SM * sms
    options = [d for d in range(1, min(steps, _MMA_LINEAR_MAX_SPLIT) + 1) if steps % d == 0]
    split = next((d for d in options if (n // 16) * d >= target), options[-1])
    grid_split, ws = split_in_warps(warps, split, "gemv") if warp_split else (split, 1)
    return MmaLinearTiles(warps, depth, prefetch, grid_split, max_registers, ws)


@functools.lru_cache(maxsize=None)
def mma_expert_tiles(k: int, w13: bool, can_split: bool = True, fp8: bool = False,
                     one_token: bool = False, routed: bool = False, fill: bool = False) -> ExpertTiles:
    """Tiles of an mma-layout expert launch (_MMA_EXPERT_TILES: by format and whether the step has
    one token), as ExpertTiles: block_n 16 rows (w13: 16 gate + 16 up rows) per warp, num_warps warps
    per program, k_chunks 64-value blocks per load step (shrunk to divide each split's blocks; per
    matrix of a w13 streaming gate and up together: ``paired``), num_stages 1 + the L2 prefetch
    distance, ring the load steps held in registers (a table entry's optional sixth field, else 2);
    w13's K splits made by the program's warps where they can (``split_in_warps``), w2's by the grid;
    ``routed``: the one-token kernels that make the router's top-k themselves (_ROUTED_W2_RING); ``fill``: a w13
    launch that would leave SMs without a program (``expert_tiles`` asks) splits K at least in as many parts
    as a program has warps (one row block a program: the intermediates of a tensor-parallel rank)."""
    w13_tiles, w2_tiles, paired = _MMA_EXPERT_TILES[(fp8, one_token)]
    warps, depth, prefetch, split, max_registers, *ring = w13_tiles if w13 else w2_tiles
    if fill and w13:
        split = max(split, warps)
    if routed and one_token and not w13 and fp8 in _ROUTED_W2_RING:
        ring = [_ROUTED_W2_RING[fp8]]
    split = split if can_split else 1
    blocks = k // MMA_K
    while split > 1 and blocks % split:
        split -= 1
    grid_split, ws = split_in_warps(warps, split, "w13") if w13 else (split, 1)  # (w2's programs: one split each)
    return ExpertTiles(16, MMA_K, warps, 1 + prefetch, grid_split, k_chunks=fit_chunks(k // split, MMA_K, depth),
                       max_registers=max_registers, paired=w13 and paired, ring=ring[0] if ring else 2, warp_split=ws)


def portable_mma_tiles(t: ExpertTiles | MmaLinearTiles) -> ExpertTiles | MmaLinearTiles:
    """The tiles the emulated mma block product (interpreter, AMD) runs: one row block per program
    (a warp per K part of its warp split), one block per step, no L2 prefetch, no register cap and
    the plain ring of two load steps (its whole-tensor intermediates, and its compile time, grow with
    the first two; the prefetch, the cap and the ring's register budget are PTX's). The splits stay:
    they divide K whatever the depth."""
    if isinstance(t, MmaLinearTiles):
        return dataclasses.replace(t, num_warps=t.warp_split, depth=1, prefetch=0, max_registers=0)
    return dataclasses.replace(t, num_warps=t.warp_split, k_chunks=1, num_stages=1, max_registers=0,
                               ring=2)  # stages: 1 + prefetch


def register_cap(t: ExpertTiles | MmaLinearTiles) -> dict:
    """The launch option of a tile's ptxas register cap (max_registers; portable tiles carry none)."""
    return {"maxnreg": t.max_registers} if t.max_registers else {}


def check_k_steps(name: str, split: int, depth: int, *ks: int) -> None:
    """An mma-layout kernel streams whole load steps: ``split`` K splits of ``depth`` 64-value blocks a
    step must divide each K in ``ks`` (else a split streams nothing), or ValueError naming ``name``."""
    blocks = [k // MMA_K for k in ks]
    if any(b % (split * depth) for b in blocks):
        raise ValueError(f"tiles: {name}'s {split} splits x {depth} blocks a step must divide its {blocks} K blocks")


def check_warp_split(name: str, warps: int, warp_split: int) -> None:
    """A K split made by a program's warps (``split_in_warps``) must divide them, or ValueError naming ``name``."""
    if warp_split < 1 or warps % warp_split:
        raise ValueError(f"tiles: {name}'s warp_split {warp_split} must divide num_warps {warps}")


def fit_chunks(k: int, block_k: int, chunks: int) -> int:
    """The largest power-of-two count <= chunks of BLOCK_K tiles per step that divides K."""
    while chunks > 1 and k % (block_k * chunks):
        chunks //= 2
    return chunks


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    block_e: int
    block_h: int
    split: int  # H splits (the wrapper rounds it down to a divisor of hidden / block_h)
    logits: int = 2  # _router_logits_kernel's LOGITS mode
    fused_topk: bool = True
    num_warps: int = 4


def router_config(n_tokens: int, n_experts: int, hidden: int, sms: int) -> RouterConfig:
    """Router GEMV tiles, from benchmarks/sweep_kernels.py on an H200 (128 x 6144 fp32 gate): 32
    experts x 256 of H per program, one step each (96 programs). 1 token: multiply + row sums and
    the top-k in the last program (one launch, 5.8 us); up to 8 tokens the same logits and the
    top-k one program per token (9 us at 4); more tokens: 3xTF32 tensor-core logits (10 us at 16).
    The fp32-FMA tl.dot (LOGITS 0) took ~15 us at every size."""
    block_e = 32 if n_experts >= 32 else 16
    block_h = block_k_for(hidden, 256)
    iters = hidden // block_h
    tiles = triton.cdiv(n_experts, block_e)
    split = max(d for d in range(1, iters + 1) if iters % d == 0 and (tiles * d <= 2 * sms or d == 1))
    logits = 2 if n_tokens <= 8 else 1
    return RouterConfig(block_e, block_h, split, logits, fused_topk=n_tokens == 1)


EXPERT_FORMATS = tuple(_EXPERT_TILES)  # the row layouts' decode codes (the mma layouts have their own kernels)


def _dividing_rows(rows: int, n: int, least: int = 16) -> int | None:
    """The largest power of two <= rows that divides n (at least ``least``), None if there is none."""
    while rows >= least:
        if n % rows == 0:
            return rows
        rows //= 2
    return None


def linear_layout_tiles(code: int, n: int, k: int) -> tuple[int, int] | None:
    """(BN, BK) a linear weight [N, K] is cut to in the tiled layout (the GEMV's preferred tile,
    shrunk to divide N), None if no tile fits (the weight then stays in its row layout)."""
    block_n, cap_k = _TILES[code][:2]
    rows = _dividing_rows(block_n, n)
    block_k = block_k_for(k, cap_k)
    return None if rows is None or block_k < 32 else (rows, block_k)


def expert_layout_tiles(code: int, hidden: int, inter: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """((BN, BK) of w13 [2I, H] tiles, (BN, BK) of w2 [H, I] tiles) in the tiled layout: w13 tiles
    hold BLOCK_I rows (a program reads a gate tile and the matching up tile), w2 tiles the w2
    kernel's rows. None if no tile fits."""
    (rows13, cap13, *_), (rows2, cap2, *_) = _EXPERT_TILES[code]
    rows13 = max(32, min(rows13, triton.next_power_of_2(2 * inter)))
    rows2 = max(16, min(rows2, triton.next_power_of_2(hidden)))
    block_i, block_n = _dividing_rows(rows13 // 2, inter), _dividing_rows(rows2, hidden)
    k13, k2 = block_k_for(hidden, cap13), block_k_for(inter, cap2)
    if block_i is None or block_n is None or min(k13, k2) < 32:
        return None
    return (block_i, k13), (block_n, k2)
