"""What the indexer's top-k selection costs a program: chains of small kernels in one CUDA graph (programmatic
dependent launches, as the fused layer's attention runs), each program reading one score row of nb blocks after
its wait and storing the top-k block ids, the selection made different ways:

- ``none``: the row's keys read, the first k stored (no selection: the floor);
- ``slices``: a running best over tl.topk slices of up to 1024 blocks (the selection of long rows before the
  twenty-first session; one tl.topk as wide as the row up to 1024 blocks);
- ``select S``: ``index_topk.select_blocks_row`` with SHORT = S (rows of up to S blocks: one S-wide tl.topk;
  longer rows by groups of S / k blocks, ``topk_widths``); ``select`` alone is the kernels' own widths.

(A tl.topk of each of 2-8 slices of the row and one of the survivors, and a selection by counted ranks, measured
slower: BENCHMARKS.md, twentieth session.) Each variant's ids are checked against ``slices``'.

    PYTHONPATH=$PWD python3 benchmarks/select_latency.py [--blocks 256,1024] [--shorts 64,128] [--programs 128]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from minimax_ops.bench import _time
from minimax_ops.kernels import index_topk
from minimax_ops.kernels.index_topk import select_blocks_row, topk_keys, topk_widths
from minimax_ops.kernels.mx_decode import gdc_launch_dependents, gdc_wait

SLICE = 1024  # the slices' widest tl.topk


@triton.jit
def _select_kernel(scores_ptr, ids_ptr, nb, topk, stride_row, MODE: tl.constexpr, BLOCK_K: tl.constexpr,
                   SHORT: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    row = scores_ptr + pid * stride_row
    k = tl.arange(0, BLOCK_K)
    if MODE == 0:
        ids = (topk_keys(row, k, nb) & 0xFFFF).to(tl.int32)
    elif MODE == 1:
        best = tl.full([BLOCK_K], -2147483648, tl.int32).to(tl.int64) << 32
        for start in range(0, nb, CHUNK):
            cand = tl.topk(topk_keys(row, start + tl.arange(0, CHUNK), nb), BLOCK_K)
            best = tl.topk(tl.reshape(tl.join(best, cand), [2 * BLOCK_K]), BLOCK_K)
        ids = tl.where((k < nb) & (k < topk), (best & 0xFFFFFFFF).to(tl.int32), -1)
    else:
        ids = select_blocks_row(row, nb, topk, BLOCK_K, SHORT, CHUNK)
    tl.store(ids_ptr + pid * BLOCK_K + k, ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="256,1024", help="nb list: blocks in the row (context / 128)")
    ap.add_argument("--shorts", default="", help="SHORT widths to try besides the kernels' own")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--programs", type=int, default=128, help="one-token split programs: 4 kv heads x 32")
    ap.add_argument("--kernels", type=int, default=20)
    args = ap.parse_args()
    topk, progs = args.topk, args.programs
    print(f"{torch.cuda.get_device_name()}: {progs} programs, top {topk}, chains of {args.kernels} kernels in one "
          f"CUDA graph")
    print("| blocks | selection | SHORT / CHUNK / GROUP | us per kernel | over none | ids as slices' |")
    print("|---|---|---|---|---|---|")
    for nb in (int(b) for b in args.blocks.split(",")):
        width = triton.next_power_of_2(nb)
        g = torch.Generator(device="cuda").manual_seed(nb)
        scores = torch.randn(progs, width, device="cuda", generator=g)
        variants = [("none", 0, (1, 1)), ("slices", 1, (1, min(SLICE, width))),
                    ("select", 2, topk_widths(width, topk))]
        saved = index_topk.TOPK_CHUNK
        for s in (int(s) for s in args.shorts.split(",") if s):
            index_topk.TOPK_CHUNK = s
            variants.append((f"select {s}", 2, topk_widths(width, topk)))
        index_topk.TOPK_CHUNK = saved
        outs, base = {}, None
        for name, mode, (short, chunk) in variants:
            out = torch.empty(progs, topk, dtype=torch.int32, device="cuda")

            def run(mode=mode, out=out, short=short, chunk=chunk):
                for i in range(args.kernels):
                    _select_kernel[(progs,)](scores, out, nb, topk, scores.stride(0), MODE=mode, BLOCK_K=topk,
                                             SHORT=short, CHUNK=chunk, PDL=True, num_warps=4,
                                             launch_pdl=i > 0)
            run()
            torch.cuda.synchronize()
            outs[name] = out
            same = "-" if mode == 0 else str(bool(torch.equal(out, outs["slices"])))
            t = _time(run, graph=True) / args.kernels
            base = t if mode == 0 else base
            group = max(1, short // topk) if mode == 2 else 1
            print(f"| {nb} | {name} | {short} / {chunk} / {group} | {t:.2f} | {t - base:+.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
