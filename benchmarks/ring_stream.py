"""Prototype (H200): does a per-lane shared-memory ring lift the one-token MXFP4 w13 stream above the
register double buffer? Same blocks, same decode, same mma order; only where the loads in flight wait.

The one-token MXFP4 experts are bound by how their loads overlap the decode (BENCHMARKS.md, sixteenth
session): a warp holds one step of loads in registers while it decodes the previous one. Here each warp
streams a gate and an up row block of ``mxfp4_mma`` blocks, DEPTH blocks of each a step, for up to 8 tokens
(x of one token, as a one-token step), in two ways:

- ``regs``: mma_decode.block_stream itself (PAIR, the w13 kernel's loop): registers double-buffer the steps.
- ``ring R``: each lane ``cp.async``s its own 16-byte fragments (and 4 scale bytes) of the step R - 1 ahead
  into its own slots of an R-slot ring in shared memory, waits for its oldest group
  (``cp.async.wait_group R - 2``) and reads back exactly what it copied (``ld.shared``): no barrier, no
  registers held by the loads in flight. The multiply is mma_decode.mma_block, in block_stream's order,
  so both outputs are bit-identical (checked).

The ring lives at the start of Triton's dynamic shared memory (the PTX symbol ``global_smem``), reserved by
a ``tl.dot`` in a branch that never runs (its operand buffers set the kernel's shared size, checked against
the ring's at launch); the kernel uses no other shared memory. CUDA only, Triton-internal symbol: a
measurement, not a kernel to ship (Gluon would express the same ring properly).

    PYTHONPATH=$PWD python3 benchmarks/ring_stream.py [--mb 100] [--per-sm 4 | --programs 480] [--rings 2,3,4]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from minimax_ops.bench import _time
from minimax_ops.kernels.mma_decode import block_stream, fragment_index, mma_block, pair_sets, scale_words, warp_rows

WORDS = 128  # an mxfp4_mma block: 128 int32 words + 32 scale bytes
SCALES = 32
NEVER = tl.constexpr(0x5EED)  # the reservation branch's flag: the launch passes anything else


@triton.constexpr_function
def _copy_asm(nbytes):
    """cp.async of nbytes (16: through L2 only; 4: the size .cg cannot copy) from $2 to shared $1 where $3."""
    cache = "cg" if nbytes == 16 else "ca"
    return (f"{{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n@p cp.async.{cache}.shared.global [$1], [$2], {nbytes};\n"
            f"mov.b32 $0, 0;\n}}")


@triton.jit
def _copy(smem, ptrs, on, BYTES: tl.constexpr):
    """cp.async of each row's BYTES (16 or 4) at ptrs [R, 1] into shared address smem [R, 1] where on."""
    tl.inline_asm_elementwise(_copy_asm(BYTES), "=r,r,l,r", [smem, ptrs.to(tl.int64, bitcast=True), on.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.constexpr_function
def _wait_asm(pending):
    """Wait until at most ``pending`` of the thread's cp.async groups are in flight."""
    return f"cp.async.wait_group {pending};"


@triton.jit
def _per_thread(asm: tl.constexpr, NT: tl.constexpr):
    """One instruction per thread (commit / wait), ordered with the other side-effecting asm."""
    tl.inline_asm_elementwise(asm + "\nmov.b32 $0, 0;", "=r,r", [tl.arange(0, NT)], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _read_words(smem):
    """The lane's 4 words at shared address smem [R, 4] (equal along the columns) -> int32 [R, 4]."""
    return tl.inline_asm_elementwise("ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,r,r,r", [smem],
                                     dtype=tl.int32, is_pure=False, pack=4)


@triton.jit
def _read_scales(smem):
    """The lane's 4 scale bytes at shared address smem [R, 4] -> uint8 [R, 4] (one register, as mma_block
    wants them)."""
    return tl.inline_asm_elementwise("ld.shared.u32 $0, [$1];", "=r,r,r,r,r", [smem], dtype=tl.uint8,
                                     is_pure=False, pack=4)


@triton.jit
def _reserve(p, flag, ROWS: tl.constexpr):
    """Never runs (flag != NEVER): a two-stage cp.async-pipelined dot loop whose stage buffers (bf16
    [ROWS, 64] and [64, 32] each) reserve shared memory without staging anything in registers."""
    q = p.to(tl.pointer_type(tl.bfloat16))
    acc = tl.zeros([ROWS, 32], dtype=tl.float32)
    for i in tl.range(0, tl.where(flag == NEVER, 2, 0), num_stages=2):
        a = tl.load(q + i * 64 + tl.arange(0, ROWS)[:, None] * 64 + tl.arange(0, 64)[None, :])
        b = tl.load(q + i * 64 + tl.arange(0, 64)[:, None] * 32 + tl.arange(0, 32)[None, :])
        acc = tl.dot(a, b, acc)
    if flag == NEVER:
        tl.store(p + tl.arange(0, ROWS)[:, None] * 32 + tl.arange(0, 32)[None, :], acc.to(tl.int32))


@triton.jit
def _copy_step(step, n_steps, n_blocks, gate_w, gate_s, words_at, scales_at, NT: tl.constexpr, DEPTH: tl.constexpr,
               RING: tl.constexpr):
    """One commit group: the lane's fragments of step ``step`` (nothing past the last step), gate blocks then
    up blocks, DEPTH of each, into slots ((step % RING) * 2 + stream) * DEPTH + d of the ring."""
    on = (tl.zeros([NT, 1], dtype=tl.int32) + step) < n_steps
    for j in tl.static_range(2 * DEPTH):
        block = (j // DEPTH) * n_blocks + step * DEPTH + j % DEPTH
        slot = ((step % RING) * 2 + j // DEPTH) * DEPTH + j % DEPTH
        _copy(words_at + slot * NT * 16, gate_w + block * 128, on, 16)
        _copy(scales_at + slot * NT * 4, gate_s + block * 32, on, 4)
    _per_thread("cp.async.commit_group;", NT)


@triton.jit
def _regs_kernel(w_ptr, s_ptr, x_ptr, out_ptr, n_steps, NW: tl.constexpr, DEPTH: tl.constexpr):
    d, g, c, e = fragment_index(NW, DEPTH)
    warp = (tl.program_id(0) * NW + warp_rows(NW, DEPTH)).to(tl.int64)
    n_blocks = n_steps * DEPTH
    w_rows = w_ptr + warp * 2 * n_blocks * 128
    s_rows = s_ptr + warp * 2 * n_blocks * 32
    zp = tl.zeros([pair_sets(DEPTH) * NW * 32, 4], dtype=tl.float32)
    # (one token: every lane's x row is x itself, as a pointer per fragment row)
    gate, up = block_stream(zp, zp, w_rows, s_rows, x_ptr + d * 0, x_ptr + d * 0, 0, n_steps, NW, DEPTH, True, 0, False,
                            False, 1, True, n_blocks * 128, n_blocks * 32)
    rows = tl.arange(0, pair_sets(DEPTH) * NW * 32)[:, None]
    out = out_ptr + (tl.program_id(0) * pair_sets(DEPTH) * NW * 32 + rows) * 8 + tl.arange(0, 4)[None, :]
    tl.store(out, gate)
    tl.store(out + 4, up)


@triton.jit
def _ring_kernel(w_ptr, s_ptr, x_ptr, out_ptr, n_steps, flag, NW: tl.constexpr, DEPTH: tl.constexpr,
                 RING: tl.constexpr, ROWS: tl.constexpr):
    tl.static_assert(DEPTH == 2, "ring prototype: block_stream's PAIR order for depth 2")
    _reserve(x_ptr, flag, ROWS)
    NT: tl.constexpr = NW * 32
    base = tl.inline_asm_elementwise("mov.u32 $0, global_smem;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    t = tl.arange(0, NT)[:, None]  # [NT, 1]: one row a thread
    warp = (tl.program_id(0) * NW + t // 32).to(tl.int64)
    lane = t % 32
    n_blocks = n_steps * DEPTH
    gate_w = w_ptr + warp * 2 * n_blocks * 128 + lane * 4  # the lane's 16 bytes of the warp's gate block 0
    gate_s = s_ptr + warp * 2 * n_blocks * 32 + (lane // 4) * 4  # its 4 scale bytes (lane 4g + c: bytes 4g..)
    # the ring: every slot's words (16 bytes a thread), then every slot's scales (4 bytes a thread)
    words_at = base + t * 16
    scales_at = base + RING * 2 * DEPTH * NT * 16 + t * 4
    for k in range(RING - 1):  # the first RING - 1 steps
        _copy_step(k, n_steps, n_blocks, gate_w, gate_s, words_at, scales_at, NT, DEPTH, RING)
    acc = tl.zeros([NT, 4], dtype=tl.float32)
    acc2 = tl.zeros([NT, 4], dtype=tl.float32)
    fc = tl.arange(0, NT)[:, None] % 4  # c
    e = tl.arange(0, 4)[None, :]
    for k in range(n_steps):
        _copy_step(k + RING - 1, n_steps, n_blocks, gate_w, gate_s, words_at, scales_at, NT, DEPTH, RING)
        _per_thread(_wait_asm(RING - 1), NT)
        now = k % RING
        for dd in tl.static_range(DEPTH):
            g_slot = (now * 2) * DEPTH + dd
            u_slot = (now * 2 + 1) * DEPTH + dd
            w = _read_words(tl.broadcast_to(words_at + g_slot * NT * 16, [NT, 4]))
            s = scale_words(_read_scales(tl.broadcast_to(scales_at + g_slot * NT * 4, [NT, 4])), True)
            u = _read_words(tl.broadcast_to(words_at + u_slot * NT * 16, [NT, 4]))
            us = scale_words(_read_scales(tl.broadcast_to(scales_at + u_slot * NT * 4, [NT, 4])), True)
            xk = x_ptr + (k * DEPTH + dd) * 32 + fc * 4 + e
            x0 = tl.load(xk)
            x1 = tl.load(xk + 16)
            acc = mma_block(acc, w, w, x0, x1, s, NW, True)
            acc2 = mma_block(acc2, u, u, x0, x1, us, NW, True)
    _per_thread(_wait_asm(0), NT)
    out = out_ptr + (tl.program_id(0) * NT + t) * 8 + e
    tl.store(out, acc)
    tl.store(out + 4, acc2)


def ring_bytes(ring: int, depth: int, nw: int) -> int:
    """Shared memory the ring takes: ring steps of 2 * depth blocks, 16 word bytes and 4 scale bytes a thread."""
    return ring * 2 * depth * nw * 32 * (16 + 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--per-sm", type=int, default=4)
    ap.add_argument("--programs", type=int, default=0, help="the grid (0: --per-sm per SM)")
    ap.add_argument("--rings", default="2,3,4", help="ring sizes to time ('': the register stream only)")
    ap.add_argument("--cap", type=int, default=128, help="ptxas register cap (0: none)")
    args = ap.parse_args()
    nw, depth = 4, 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = args.programs or args.per_sm * sms
    warps = programs * nw
    step_bytes = 2 * depth * (WORDS * 4 + SCALES)
    n_steps = max(1, int(args.mb * 1e6 / (warps * step_bytes)))
    n_blocks = warps * 2 * n_steps * depth
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randint(-2**31, 2**31 - 1, (n_blocks * WORDS,), dtype=torch.int32, device="cuda", generator=gen)
    s = torch.randint(120, 131, (n_blocks * SCALES,), dtype=torch.uint8, device="cuda", generator=gen)
    x = torch.randn(n_steps * depth * 64, device="cuda", generator=gen).to(torch.bfloat16).view(torch.int32)
    cap = {"maxnreg": args.cap} if args.cap else {}
    mb = n_blocks * (WORDS * 4 + SCALES) / 1e6
    print(f"{torch.cuda.get_device_name()}: {programs} programs of {nw} warps, {n_steps} steps of {depth} blocks a "
          f"stream, {mb:.1f} MB")
    print("variant | registers | spills | shared KB | us | TB/s | equal to regs")
    ref = torch.empty(programs * nw * 32 * 8, dtype=torch.float32, device="cuda")

    def regs():
        return _regs_kernel[(programs,)](w, s, x, ref, n_steps, NW=nw, DEPTH=depth, num_warps=nw, num_stages=1, **cap)
    k = regs()
    us = _time(regs, graph=True)
    print(f"regs | {k.n_regs} | {k.n_spills} | {k.metadata.shared / 1024:.0f} | {us:.1f} | {mb / us:.2f} | -")
    for ring in (int(r) for r in filter(None, args.rings.split(","))):
        out = torch.empty_like(ref)
        need = ring_bytes(ring, depth, nw)
        for rows in (64, 128, 256):  # the smallest reservation that holds the ring (compiled, not launched)
            opts = dict(NW=nw, DEPTH=depth, RING=ring, ROWS=rows, num_warps=nw, num_stages=1, **cap)
            k = _ring_kernel.warmup(w, s, x, out, n_steps, 0, grid=(programs,), **opts)
            if k.metadata.shared >= need:
                break
        else:
            raise SystemExit(f"ring {ring}: the kernel reserved {k.metadata.shared} B of shared memory, needs {need}")
        def run():
            return _ring_kernel[(programs,)](w, s, x, out, n_steps, 0, **opts)
        us = _time(run, graph=True)
        torch.cuda.synchronize()
        same = torch.equal(out, ref)
        print(f"ring {ring} | {k.n_regs} | {k.n_spills} | {k.metadata.shared / 1024:.0f} | {us:.1f} | {mb / us:.2f} | "
              f"{same}")


if __name__ == "__main__":
    main()
