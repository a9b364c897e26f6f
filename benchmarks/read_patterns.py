"""Pure-read microbenchmark of the weight streams' DRAM access pattern (H200): does the order in which
concurrent warps walk memory change the read rate at the same bytes in flight?

Each warp streams its own 2 x DEPTH blocks of 512 B a step (as the mxfp4_mma w13 kernel: a gate and an
up stream, DEPTH blocks each), holding the next step's loads while it folds the current one. Layouts:
``rows``: a warp's blocks follow each other (the mxfp4_mma layout: row block after row block, each over
all of K); ``steps``: the blocks of one step of every warp follow each other (step-major), so the warps
of a wave read one contiguous region at a time. Prints, per layout and programs per SM: time, MB and TB/s.

    PYTHONPATH=$PWD python3 benchmarks/read_patterns.py [--mb 200] [--depth 2]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from minimax_ops.bench import _time

WORDS = 128  # 512 B: one mxfp4_mma block
BLOCK_WORDS = tl.constexpr(WORDS)


@triton.jit
def _read_kernel(src, out, n_warps_total, n_steps, half_words, STEP_MAJOR: tl.constexpr, DEPTH: tl.constexpr,
                 NW: tl.constexpr):
    """Each warp (stream id s) reads 2 x DEPTH blocks a step for n_steps steps, XOR-folded into out."""
    rows = tl.arange(0, NW * 32)
    warp = tl.program_id(0) * NW + rows // 32
    lane = rows % 32
    cols = tl.arange(0, 4)
    acc = tl.zeros([NW * 32, 4], dtype=tl.int32)
    if STEP_MAJOR:  # step k of stream s at block (k * n_warps_total + s) * DEPTH
        base = warp.to(tl.int64) * DEPTH * BLOCK_WORDS
        step_words = n_warps_total.to(tl.int64) * DEPTH * BLOCK_WORDS
    else:  # stream s's steps follow each other
        base = warp.to(tl.int64) * n_steps * DEPTH * BLOCK_WORDS
        step_words = (tl.zeros([], dtype=tl.int64) + DEPTH) * BLOCK_WORDS
    ptrs = src + base[:, None] + lane[:, None] * 4 + cols[None, :]
    for d in tl.static_range(DEPTH):
        acc ^= tl.load(ptrs + d * BLOCK_WORDS) ^ tl.load(ptrs + d * BLOCK_WORDS + half_words)
    for k in range(1, n_steps):
        p = ptrs + k * step_words
        for d in tl.static_range(DEPTH):
            acc ^= tl.load(p + d * BLOCK_WORDS) ^ tl.load(p + d * BLOCK_WORDS + half_words)
    tl.store(out + tl.program_id(0) * NW * 32 * 4 + rows[:, None] * 4 + cols[None, :], acc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0)
    ap.add_argument("--depth", type=int, default=2)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nw = 4
    step_bytes = 2 * args.depth * WORDS * 4
    print("layout | programs | programs/SM | steps | us | MB | TB/s")
    for per_sm in (2, 3, 4):
        programs = per_sm * sms
        warps = programs * nw
        steps = max(1, int(args.mb * 1e6 / (warps * step_bytes)))
        half = warps * steps * args.depth * WORDS
        src = torch.randint(0, 2**31 - 1, (2 * half,), dtype=torch.int32, device="cuda")
        out = torch.empty(programs * nw * 32 * 4, dtype=torch.int32, device="cuda")
        for step_major in (False, True):
            def run():
                _read_kernel[(programs,)](src, out, warps, steps, half, STEP_MAJOR=step_major, DEPTH=args.depth,
                                          NW=nw, num_warps=nw, num_stages=1)
            us = _time(run, graph=True)
            mb = warps * steps * step_bytes / 1e6
            print(f"{'steps' if step_major else 'rows'} | {programs} | {per_sm} | {steps} | {us:.1f} | {mb:.1f} | "
                  f"{mb / us:.2f}")
        del src


if __name__ == "__main__":
    main()
