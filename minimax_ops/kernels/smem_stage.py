"""Weight steps staged in shared memory before a GEMV's PDL wait (CUDA sm_90+, inline PTX).

A GEMV launched as a programmatic dependent is resident while its predecessor runs (o_proj under the
attention block, whose merge kernel lets it launch first). Its weights do not depend on that kernel,
only x does. ``mma_decode.first_blocks`` holds one weight step in registers across the wait; more steps
there would cost the registers, hence the programs per SM, that the stream needs. Shared memory is idle
in these kernels, so a program also copies its first STAGED steps into it:

1. Before the wait (``stage_weights``), each thread ``cp.async``s the fragments of its rows of those
   steps (the 16-byte words, FP8's second words, the 4 scale bytes) into a static shared buffer that the
   kernel's inline PTX declares (``stage_base``: at most 48 KB, the static limit). Those DRAM reads
   overlap the predecessor.
2. After the wait (``stage_x``), the first 64 threads copy the staged K blocks' x the same way, 1 KB a
   block: 8 token rows of 64 bf16, rows past the step's tokens repeating its last.
3. The program streams the rest of its K range as before (mma_decode.block_stream).
4. Then (``staged_product``) it waits for its copies and meets the other threads at one barrier, since
   x's copies are read by every thread. It multiplies the staged blocks from shared memory into the same
   accumulators.

The product is the same as streaming every step; only the order of the fp32 sums differs (the staged
blocks come last). Off PTX (interpreter, AMD) nothing is staged: STAGED is 0 and none of this is traced.
"""

from __future__ import annotations

import ctypes
import os

import triton
import triton.language as tl

from .mma_decode import TOKENS, fragment_index, mma_block

# Of the 48 KB a launch may take without opting in (static + Triton's own dynamic shared memory, up to
# 8 KB in these kernels), what the staging buffer may declare.
STATIC_SHARED = 40 * 1024
X_BLOCK_BYTES = tl.constexpr(TOKENS.value * 64 * 2)  # one K block of x: 8 token rows of 64 bf16


@triton.constexpr_function
def step_bytes(num_warps, depth, fp8):
    """Shared bytes one staged load step takes: per thread row 16 word bytes (32 for FP8) and 4 scale
    bytes, plus x for its K blocks (host and kernels)."""
    return depth * (num_warps * 32 * ((32 if fp8 else 16) + 4) + TOKENS.value * 64 * 2)


def staged_steps(n_tokens: int, n_steps: int, num_warps: int, depth: int, fp8: bool, ptx: bool, pdl: bool) -> int:
    """The rule: load steps (of n_steps a program streams) an mma GEMV program stages before its PDL
    wait. Staging applies to PTX launches that are PDL dependents, in steps of one token group (the
    staged product is one group's): as many steps as fit in STATIC_SHARED, leaving the register stream
    at least one. The AOT specs follow it as is."""
    if not (ptx and pdl and 0 < n_tokens <= TOKENS.value and num_warps >= 2):  # (stage_x: 64 threads)
        return 0
    return max(0, min(STATIC_SHARED // step_bytes(num_warps, depth, fp8), n_steps - 1))


def staged_at_launch(n_tokens: int, n_steps: int, num_warps: int, depth: int, fp8: bool, ptx: bool,
                     pdl: bool) -> int:
    """``staged_steps`` at a launch, capped by MINIMAX_OPS_STAGE_STEPS=N (0: off; read at every call:
    A/B runs switch it between rounds of one process)."""
    steps = staged_steps(n_tokens, n_steps, num_warps, depth, fp8, ptx, pdl)
    cap = os.environ.get("MINIMAX_OPS_STAGE_STEPS")
    return steps if cap is None else min(steps, int(cap))


_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
_carveouts: dict[int, int] = {}


def prefer_shared(compiled) -> None:
    """Ask the driver to give the staged kernel's SMs their largest shared-memory carveout (once per
    function). Left to choose, it may pick one that holds fewer programs per SM than the registers
    allow. MINIMAX_OPS_STAGE_CARVEOUT=default leaves the driver's choice (A/B runs)."""
    handle = getattr(compiled, "function", None)
    if not handle:
        return
    value = -1 if os.environ.get("MINIMAX_OPS_STAGE_CARVEOUT") == "default" else 100
    if _carveouts.get(handle) != value:
        err = _libcuda().cuFuncSetAttribute(ctypes.c_void_p(handle), _CARVEOUT, value)
        if err:
            raise RuntimeError(f"cuFuncSetAttribute(carveout {value}) failed with CUresult {err}")
        _carveouts[handle] = value


_lib = []


def _libcuda():
    if not _lib:
        _lib.append(ctypes.CDLL("libcuda.so.1"))
    return _lib[0]


@triton.constexpr_function
def _declare_asm(nbytes):
    return f"{{\n.shared .align 16 .b8 minimax_stage[{nbytes}];\nmov.u32 $0, minimax_stage;\n}}"


@triton.jit
def stage_base(STEPS: tl.constexpr, NW: tl.constexpr, DEPTH: tl.constexpr, FP8: tl.constexpr):
    """The shared address of the kernel's staging buffer (declared here: call it once per kernel)."""
    return tl.inline_asm_elementwise(_declare_asm(STEPS * step_bytes(NW, DEPTH, FP8)), "=r", [], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _regions(base, STEPS: tl.constexpr, NW: tl.constexpr, DEPTH: tl.constexpr, FP8: tl.constexpr):
    """(words, FP8's second words, scale bytes, x) addresses of the buffer's regions."""
    ROWS: tl.constexpr = STEPS * DEPTH * NW * 32
    words_hi = base + ROWS * 16
    scales = base + ROWS * (32 if FP8 else 16)
    return base, words_hi, scales, scales + ROWS * 4


@triton.constexpr_function
def _copy_asm(nbytes):
    cache = "cg" if nbytes == 16 else "ca"  # .cg copies 16 bytes only
    return (f"{{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n@p cp.async.{cache}.shared.global [$1], [$2], {nbytes};\n"
            f"mov.b32 $0, 0;\n}}")


@triton.jit
def _copy(smem, ptrs, on, BYTES: tl.constexpr):
    """cp.async of BYTES (16 or 4) at each row's pointer ([R, 1]) into its shared address where ``on``."""
    tl.inline_asm_elementwise(_copy_asm(BYTES), "=r,r,l,r", [smem, ptrs.to(tl.int64, bitcast=True), on.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _per_thread(asm: tl.constexpr, NT: tl.constexpr):
    """``asm`` once per thread, ordered with the other side-effecting asm."""
    tl.inline_asm_elementwise(asm + "\nmov.b32 $0, 0;", "=r,r", [tl.arange(0, NT)[:, None]], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def stage_weights(base, w_rows, s_rows, kb_begin, STEPS: tl.constexpr, NW: tl.constexpr, DEPTH: tl.constexpr,
                  FP8: tl.constexpr):
    """Copy steps 0 .. STEPS - 1 of block_stream's weights from K block kb_begin (w_rows / s_rows as
    block_stream's) into the buffer: row r of step j's fragment-order tensors at slot j * DEPTH * NW * 32 + r."""
    WORDS: tl.constexpr = 256 if FP8 else 128
    R: tl.constexpr = DEPTH * NW * 32
    words, words_hi, scales, xs = _regions(base, STEPS, NW, DEPTH, FP8)
    d, g, c, e = fragment_index(NW, DEPTH)
    row = tl.arange(0, R)[:, None]
    on = row >= 0
    for j in tl.static_range(STEPS):
        kb = kb_begin + j * DEPTH + d
        w = w_rows + kb * WORDS + (4 * g + c) * 4
        slot = j * R + row
        _copy(words + slot * 16, w, on, 16)
        if FP8:
            _copy(words_hi + slot * 16, w + 128, on, 16)
        _copy(scales + slot * 4, s_rows + kb * 32 + 4 * g, on, 4)
    _per_thread("cp.async.commit_group;", NW * 32)


@triton.jit
def stage_x(base, x_ptr, stride_xm, M, kb_begin, STEPS: tl.constexpr, NW: tl.constexpr, DEPTH: tl.constexpr,
            FP8: tl.constexpr):
    """Copy the staged K blocks' x (int32 pairs; rows of stride_xm words; one token group, M <= 8) into
    the buffer: thread i < 64 copies 16 bytes of token row min(i // 8, M - 1)."""
    tl.static_assert(NW * 32 >= 64, "stage_x: a block's x takes 64 threads")
    words, words_hi, scales, xs = _regions(base, STEPS, NW, DEPTH, FP8)
    i = tl.arange(0, NW * 32)[:, None]
    tok = i // 8
    src = x_ptr + tl.minimum(tok, M - 1).to(tl.int64) * stride_xm + kb_begin * 32 + (i % 8) * 4
    dst = xs + tok * 128 + (i % 8) * 16
    for b in tl.static_range(STEPS * DEPTH):
        _copy(dst + b * X_BLOCK_BYTES, src + b * 32, i < 64, 16)
    _per_thread("cp.async.commit_group;", NW * 32)


@triton.jit
def _read_words(smem):
    """The 4 words at each row's shared address (smem [R, 4], equal along the columns) -> int32 [R, 4]."""
    return tl.inline_asm_elementwise("ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,r,r,r", [smem],
                                     dtype=tl.int32, is_pure=False, pack=4)


@triton.jit
def _read_scales(smem):
    """The 4 scale bytes at each row's shared address -> uint8 [R, 4] (one register, as mma_block takes them)."""
    return tl.inline_asm_elementwise("ld.shared.u32 $0, [$1];", "=r,r,r,r,r", [smem], dtype=tl.uint8,
                                     is_pure=False, pack=4)


@triton.jit
def staged_product(acc, base, STEPS: tl.constexpr, NW: tl.constexpr, DEPTH: tl.constexpr, PTX: tl.constexpr,
                   FP8: tl.constexpr):
    """acc (block_stream's, [DEPTH * NW * 32, 4]) += the staged steps' blocks times their x, once every
    copy has landed (each thread waits for its own, then one barrier makes them everyone's)."""
    R: tl.constexpr = DEPTH * NW * 32
    _per_thread("cp.async.wait_all;", NW * 32)
    tl.debug_barrier()
    words, words_hi, scales, xs = _regions(base, STEPS, NW, DEPTH, FP8)
    d, g, c, e = fragment_index(NW, DEPTH)
    row = tl.arange(0, R)[:, None]
    for j in tl.static_range(STEPS):
        slot = tl.broadcast_to(j * R + row, [R, 4])
        w = _read_words(words + slot * 16)
        w_hi = _read_words(words_hi + slot * 16) if FP8 else w
        s = _read_scales(scales + slot * 4)
        x = tl.broadcast_to(xs + ((j * DEPTH + d) * TOKENS + g) * 128 + c * 16, [R, 4])
        acc = mma_block(acc, w, w_hi, _read_words(x), _read_words(x + 64), s, NW * DEPTH, PTX, FP8)
    return acc


def aot_specs() -> list:
    """None of its own: helpers, compiled (and covered) through the GEMV kernels that call them."""
    return []
