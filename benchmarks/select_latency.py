"""What the indexer's top-k selection costs a program: chains of small kernels in one CUDA graph (programmatic
dependent launches, as the fused layer's attention runs), each program reading one score row of nb blocks after
its wait and storing the top-k block ids, the selection made different ways:

- ``none``: the row's keys read, the first k stored (no selection: the floor);
- ``bitonic``: ``index_topk.select_blocks_row`` (what the kernels run: one tl.topk as wide as the row);
- ``rank``: every key's rank counted against all the others (no sort), the k best placed by rank.

(A third form, a tl.topk of each of 2-8 slices of the row and one of the survivors, measured slower: commit
558e905 has it as ``select_blocks_row``'s PARTS, BENCHMARKS.md the figures.)

Each variant's ids are checked against ``bitonic``'s.

    PYTHONPATH=$PWD python3 benchmarks/select_latency.py [--blocks 256] [--programs 128] [--kernels 20]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from minimax_ops.bench import _time
from minimax_ops.kernels.index_topk import select_blocks_row, topk_keys, topk_widths
from minimax_ops.kernels.mx_decode import gdc_launch_dependents, gdc_wait

MODES = {"none": 0, "bitonic": 1, "rank": 2}


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
        ids = select_blocks_row(row, nb, topk, BLOCK_K, SHORT, CHUNK)
    else:
        i = tl.arange(0, SHORT)
        ki = topk_keys(row, i, nb)
        rank = tl.zeros([SHORT], tl.int32)
        J: tl.constexpr = 16
        for j0 in tl.static_range(0, SHORT, J):
            kj = topk_keys(row, j0 + tl.arange(0, J), nb)
            rank += tl.sum((kj[None, :] > ki[:, None]).to(tl.int32), axis=1)
        placed = tl.sum(tl.where(rank[None, :] == k[:, None], i[None, :], 0), axis=1)
        ids = tl.where((k < nb) & (k < topk), placed, -1)
    tl.store(ids_ptr + pid * BLOCK_K + k, ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256, help="nb: blocks in the row (32k context / 128)")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--programs", type=int, default=128, help="one-token split programs: 4 kv heads x 32")
    ap.add_argument("--kernels", type=int, default=20)
    args = ap.parse_args()
    nb, topk, progs = args.blocks, args.topk, args.programs
    short, chunk = topk_widths(nb, topk)
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(progs, max(short, nb), device="cuda", generator=g)
    outs = {m: torch.empty(progs, topk, dtype=torch.int32, device="cuda") for m in MODES}

    def launch(mode):
        def run():
            for i in range(args.kernels):
                _select_kernel[(progs,)](scores, outs[mode], nb, topk, scores.stride(0), MODE=MODES[mode],
                                         BLOCK_K=topk, SHORT=short, CHUNK=chunk, PDL=True, num_warps=4,
                                         launch_pdl=i > 0)
        return run

    print(f"{torch.cuda.get_device_name()}: {progs} programs, rows of {nb} blocks, top {topk}, chains of "
          f"{args.kernels} kernels in one CUDA graph")
    print("| selection | us per kernel | over none | ids as bitonic's |")
    print("|---|---|---|---|")
    times = {}
    for mode in MODES:
        if MODES[mode] == 2 and nb > short:  # the rank form takes one row slice of up to SHORT blocks
            continue
        launch(mode)()  # bitonic's ids are in place before rank's are compared (MODES' order)
        torch.cuda.synchronize()
        same = "-" if mode == "none" else str(bool(torch.equal(outs[mode], outs["bitonic"])))
        times[mode] = _time(launch(mode), graph=True) / args.kernels
        print(f"| {mode} | {times[mode]:.2f} | {times[mode] - times['none']:+.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
