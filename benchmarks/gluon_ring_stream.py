"""Prototype (Hopper, triton 3.6's Gluon): the one-token MXFP4 w13 stream of ring_stream.py with its weight loads
made by TMA into a shared-memory ring that a one-warp producer partition fills and the decoding warps read
(warp specialisation, mbarriers). No register is held by a load in flight, and a program's steps in flight are
bounded by shared memory (``--slots`` steps of 8.75 KB) instead of by registers (one step in the register stream).

Same blocks, same decode (mma_decode's inline PTX), same mma order as ring_stream's ``regs`` (outputs checked
bit for bit against it); the weights are laid step-major per program (each program's step one contiguous 8 KB of
words and 512 B of scales, one TMA box each), which the load-time re-layout could produce. x comes through the ring
too (256 B a step). CUDA sm_90+ only; a measurement of the next lever (BENCHMARKS.md, "Where it stands"), not a
kernel to ship.

    PYTHONPATH=$PWD python3 benchmarks/gluon_ring_stream.py [--mb 100] [--per-sm 4] [--slots 4,6] [--cap 64]
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from minimax_ops.bench import _time
from minimax_ops.kernels.mma_decode import MMA_BLOCK_PTX, SCALE_WORDS_PTX

WARPS, BLOCKS = 4, 2  # decoding warps a program (a gate and an up row block each), blocks of each stream a step
NW, DEPTH = gl.constexpr(WARPS), gl.constexpr(BLOCKS)
ROWS = gl.constexpr(2 * BLOCKS * WARPS)  # a step's TMA box rows: (stream, d, warp), a block each
BLOCK_BYTES = 128 * 4 + 32  # an mxfp4_mma block: 128 words, 32 scale bytes
STEP_BYTES = ROWS.value * BLOCK_BYTES


@gluon.jit
def _lane_rows(L: gl.constexpr):
    """(warp, g, c) of each element of a [NW, 8, 4, 4] tensor of layout L, as [NW, 1, 1, 1] / [1, 8, 1, 1] /
    [1, 1, 4, 1] tensors, and e as [1, 1, 1, 4]."""
    w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L))))
    w = gl.expand_dims(gl.expand_dims(gl.expand_dims(w, 1), 2), 3)
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L))))
    g = gl.expand_dims(gl.expand_dims(gl.expand_dims(g, 0), 2), 3)
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L))))
    c = gl.expand_dims(gl.expand_dims(gl.expand_dims(c, 0), 1), 3)
    e = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L))))
    e = gl.expand_dims(gl.expand_dims(gl.expand_dims(e, 0), 1), 2)
    return w, g, c, e


@gluon.jit
def _producer(w_desc, s_desc, x_desc, words, scales, xs, full, empty, n_steps):
    """One warp: step k's boxes into slot k % SLOTS once the decoding warps released it."""
    SLOTS: gl.constexpr = words.type.shape[0]
    pid = gl.program_id(0)
    nbytes: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes + x_desc.block_type.nbytes
    for k in range(n_steps):
        slot = k % SLOTS
        mbarrier.wait(empty.index(slot), ((k // SLOTS) & 1) ^ 1)
        bar = full.index(slot)
        mbarrier.expect(bar, nbytes)
        row = (pid * n_steps + k) * ROWS
        tma.async_copy_global_to_shared(w_desc, [row, 0], bar, words.index(slot))
        tma.async_copy_global_to_shared(s_desc, [row, 0], bar, scales.index(slot))
        tma.async_copy_global_to_shared(x_desc, [k, 0], bar, xs.index(slot))


@gluon.jit
def _decoder(words, scales, xs, full, empty, out_ptr, n_steps):
    """The NW decoding warps: each slot's fragments into registers, the slot released, then the block products
    in ring_stream's regs order (per step: gate d0, up d0, gate d1, up d1)."""
    SLOTS: gl.constexpr = words.type.shape[0]
    # lane 4g + c of warp w: words 4(4g + c) .. + 3 of its blocks; row g's 4 scale bytes; x pairs 4c .. 4c + 3
    L: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 8, 4, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
    gate = gl.zeros([NW, 8, 4, 4], gl.float32, L)
    up = gl.zeros([NW, 8, 4, 4], gl.float32, L)
    for k in range(n_steps):
        slot = k % SLOTS
        mbarrier.wait(full.index(slot), (k // SLOTS) & 1)
        # a slot's rows: (stream, d, warp); j = stream * DEPTH + d picks [warp, g, c, e]
        wv = words.index(slot)._reinterpret(gl.int32, [2 * DEPTH, NW, 8, 4, 4], flat)
        sv = scales.index(slot)._reinterpret(gl.uint8, [2 * DEPTH, NW, 8, 1, 4], flat)
        xv = xs.index(slot)._reinterpret(gl.int32, [2 * DEPTH, 1, 1, 4, 4], flat)  # j = d * 2 + K group
        g0, g1, u0, u1 = _four(wv, L)
        sg0, sg1, su0, su1 = _four(sv, L)
        x00, x01, x10, x11 = _four(xv, L)
        fence_async_shared()
        mbarrier.arrive(empty.index(slot), count=1)
        gate = _block(gate, g0, x00, x01, sg0)
        up = _block(up, u0, x00, x01, su0)
        gate = _block(gate, g1, x10, x11, sg1)
        up = _block(up, u1, x10, x11, su1)
    w, g, c, e = _lane_rows(L)
    ptrs = out_ptr + ((gl.program_id(0) * NW + w) * 32 + g * 4 + c) * 8 + e
    gl.store(ptrs, gate)
    gl.store(ptrs + 4, up)


@gluon.jit
def _four(view, L: gl.constexpr):
    """The 4 sub-views of a slot's view (its leading dimension), loaded into registers of layout L."""
    return view.index(0).load(L), view.index(1).load(L), view.index(2).load(L), view.index(3).load(L)


@gluon.jit
def _block(acc, w, x0, x1, s_bytes):
    """mma_decode.mma_block's PTX product of one block (scale words made from the loaded bytes as
    mma_decode.scale_words makes them)."""
    s = gl.inline_asm_elementwise(SCALE_WORDS_PTX, "=r,=r,=r,=r,r", [s_bytes], dtype=gl.int32, is_pure=True, pack=4)
    return gl.inline_asm_elementwise(MMA_BLOCK_PTX, "=f,=f,=f,=f," + "r," * 16 + "f,f,f,f", [w, x0, x1, s, acc],
                                     dtype=gl.float32, is_pure=True, pack=4)


@gluon.jit
def _ring_kernel(w_desc, s_desc, x_desc, out_ptr, n_steps, SLOTS: gl.constexpr):
    words = gl.allocate_shared_memory(gl.int32, [SLOTS] + w_desc.block_type.shape, w_desc.layout)
    scales = gl.allocate_shared_memory(gl.uint8, [SLOTS] + s_desc.block_type.shape, s_desc.layout)
    xs = gl.allocate_shared_memory(gl.int32, [SLOTS] + x_desc.block_type.shape, x_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_decoder, (words, scales, xs, full, empty, out_ptr, n_steps)),
        (_producer, (w_desc, s_desc, x_desc, words, scales, xs, full, empty, n_steps)),
    ], [1], [24])


def descriptors(w: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> tuple:
    """TMA descriptors of the step-major words [rows, 128] int32, scales [rows, 32] uint8 (a row: one block;
    a box: a program's step) and x [steps, 64] int32."""
    def desc(t, box, bits):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), box, gl.NVMMASharedLayout(0, bits, rank=2))
    return (desc(w, [ROWS.value, 128], 32), desc(s, [ROWS.value, 32], 8), desc(x, [1, BLOCKS * 32], 32))


def step_major(w: torch.Tensor, s: torch.Tensor, programs: int, n_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ring_stream's warp-major blocks (program, warp, stream, step, d, word) -> (program, step, stream, d, warp,
    word) as the 2-D tensors the descriptors read (a row: one block)."""
    w6 = w.view(programs, WARPS, 2, n_steps, BLOCKS, 128).permute(0, 3, 2, 4, 1, 5).contiguous()
    s6 = s.view(programs, WARPS, 2, n_steps, BLOCKS, 32).permute(0, 3, 2, 4, 1, 5).contiguous()
    return w6.view(-1, 128), s6.view(-1, 32)


def main() -> None:
    import ring_stream  # (benchmarks/ is on the path of a script run from it)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--per-sm", type=int, default=4)
    ap.add_argument("--slots", default="4,6", help="ring sizes (steps) to time")
    ap.add_argument("--cap", type=int, default=64, help="maxnreg of the launch (the decoding warps get what the "
                    "producer's 24 leave of 2 x cap per thread)")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = args.per_sm * sms
    warps = programs * WARPS
    n_steps = max(1, int(args.mb * 1e6 / (programs * STEP_BYTES)))
    n_blocks = warps * 2 * n_steps * BLOCKS
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randint(-2**31, 2**31 - 1, (n_blocks * 128,), dtype=torch.int32, device="cuda", generator=gen)
    s = torch.randint(120, 131, (n_blocks * 32,), dtype=torch.uint8, device="cuda", generator=gen)
    x = torch.randn(n_steps * BLOCKS * 64, device="cuda", generator=gen).to(torch.bfloat16).view(torch.int32)
    mb = n_blocks * BLOCK_BYTES / 1e6
    ref = torch.empty(warps * 32 * 8, dtype=torch.float32, device="cuda")

    def regs():
        return ring_stream._regs_kernel[(programs,)](w, s, x, ref, n_steps, NW=WARPS, DEPTH=BLOCKS, num_warps=WARPS,
                                                     num_stages=1, maxnreg=128)
    k = regs()
    us = _time(regs, graph=True)
    print(f"{torch.cuda.get_device_name()}: {programs} programs, {n_steps} steps of {BLOCKS} blocks a stream, "
          f"{mb:.1f} MB")
    print("variant | registers | shared KB | us | TB/s | equal to regs")
    print(f"regs (ring_stream) | {k.n_regs} | {k.metadata.shared / 1024:.0f} | {us:.1f} | {mb / us:.2f} | -")
    wd, sd = step_major(w, s, programs, n_steps)
    descs = descriptors(wd, sd, x.view(n_steps, BLOCKS * 32))
    for slots in (int(v) for v in args.slots.split(",")):
        out = torch.full_like(ref, float("nan"))

        def run():
            return _ring_kernel[(programs,)](*descs, out, n_steps, SLOTS=slots, num_warps=WARPS, maxnreg=args.cap)
        k = run()
        torch.cuda.synchronize()
        same = torch.equal(out, ref)
        us = _time(run, graph=True)
        print(f"gluon ring {slots} slots, cap {args.cap} | {k.n_regs} | {k.metadata.shared / 1024:.0f} | {us:.1f} | "
              f"{mb / us:.2f} | {same}", flush=True)


if __name__ == "__main__":
    main()
