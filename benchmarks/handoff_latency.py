"""What a dependent kernel boundary costs on this GPU: a chain of small kernels in one CUDA graph, each program
reading what another program of the previous kernel wrote, handed off four ways:

- ``plain``: stream order (no PDL);
- ``pdl``: programmatic dependent launch, ``griddepcontrol.wait`` then ``launch_dependents`` (as the decode
  layer's latency-bound kernels do);
- ``spin``: launched as a programmatic dependent but never waiting on the grid: each program polls an arrival
  counter the previous kernel's programs increment (release) when their stores are done, then lets its own
  dependents launch; the last program through resets the counter;
- ``spin_early``: ``spin`` with the dependents let launch before the poll;
- ``flag``: launched as a programmatic dependent, never waiting on the grid and with no counter: each value
  travels in an 8-byte word with the step's epoch in its high half (one store, no fence), and a program polls
  the words it reads (volatile loads) until every one carries this step's epoch, then lets its own dependents
  launch. The epoch is a device counter bumped once before each chain, as a decode step would;
- ``flag_early``: ``flag`` with the dependents let launch before the poll.

Each program reads 256 values; with ``--fan-in F`` value j comes from program (p + 1 + j % F) of the previous
kernel, so that a program waits for F producers (the fused layer's attention splits read the scores of 256 score
programs). Each chain's final values are checked (a handoff that let a program read too early shows as a wrong
count).

    PYTHONPATH=$PWD python3 benchmarks/handoff_latency.py [--programs 132,264] [--kernels 20] [--fan-in 1,32,256]
                                                          [--modes pdl,flag]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from minimax_ops.bench import _time
from minimax_ops.kernels.mx_decode import gdc_launch_dependents, gdc_wait

MODES = ("plain", "pdl", "spin", "spin_early", "flag", "flag_early")


@triton.jit
def _step_kernel(x_ptr, y_ptr, arrive_in, passed_in, arrive_out, WAIT: tl.constexpr, SPIN: tl.constexpr,
                 EARLY: tl.constexpr, BLOCK: tl.constexpr, FAN: tl.constexpr = 1):
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    if SPIN:
        if EARLY:
            gdc_launch_dependents()
        seen = tl.atomic_add(arrive_in, 0, sem="acquire", scope="gpu")
        while seen < n:
            seen = tl.atomic_add(arrive_in, 0, sem="acquire", scope="gpu")
        if not EARLY:
            gdc_launch_dependents()
        # The last of this kernel's programs through resets the counters: every program of the previous
        # kernel has arrived, and none of this one polls again.
        ticket = tl.atomic_add(passed_in, 1, sem="relaxed", scope="gpu")
        if ticket == n - 1:
            tl.atomic_xchg(arrive_in, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(passed_in, 0, sem="relaxed", scope="gpu")
    elif WAIT:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    src = (pid + 1 + offs % FAN) % n  # other programs' values: the handoff must make them visible
    v = tl.load(x_ptr + src * BLOCK + offs, cache_modifier=".cg")
    tl.store(y_ptr + pid * BLOCK + offs, v + 1)
    if SPIN:
        tl.debug_barrier()  # every thread's store before the release
        tl.atomic_add(arrive_out, 1, sem="release", scope="gpu")


@triton.jit
def _flag_step_kernel(x_ptr, y_ptr, epoch_ptr, EARLY: tl.constexpr, BLOCK: tl.constexpr, FAN: tl.constexpr = 1):
    """One kernel of a ``flag`` chain: x and y hold int64 words (epoch << 32 | value)."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    epoch = tl.load(epoch_ptr).to(tl.int64)  # (bumped before the chain's first, stream-ordered, launch)
    if EARLY:
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    src = (pid + 1 + offs % FAN) % n  # other programs' values: the flags must make them visible
    ptrs = x_ptr + src * BLOCK + offs
    w = tl.load(ptrs, volatile=True)
    while tl.min(((w >> 32) == epoch).to(tl.int32), 0) == 0:
        w = tl.load(ptrs, volatile=True)
    if not EARLY:
        gdc_launch_dependents()
    v = (w & 0xFFFFFFFF) + 1
    tl.store(y_ptr + pid * BLOCK + offs, (epoch << 32) | v)


def flag_chain(programs: int, kernels: int, early: bool, block: int = 256, fan: int = 1):
    """(run, check) of a ``flag`` chain: run bumps the epoch, seeds the first words, launches the chain."""
    bufs = [torch.zeros(programs * block, dtype=torch.int64, device="cuda") for _ in range(2)]
    epoch = torch.zeros(1, dtype=torch.int32, device="cuda")

    def run():
        epoch.add_(1)
        bufs[0].copy_((epoch.to(torch.int64) << 32).expand_as(bufs[0]))
        for i in range(kernels):
            x, y = bufs[i % 2], bufs[(i + 1) % 2]
            _flag_step_kernel[(programs,)](x, y, epoch, EARLY=early, BLOCK=block, FAN=fan, num_warps=4,
                                           launch_pdl=i > 0)
        return bufs[kernels % 2]

    def check() -> bool:
        out = run()
        torch.cuda.synchronize()
        return bool(((out & 0xFFFFFFFF) == kernels).all()) and bool(((out >> 32) == epoch.to(torch.int64)).all())

    return run, check


def chain(mode: str, programs: int, kernels: int, block: int = 256, fan: int = 1):
    """(run, check): run launches the chain; check says whether its values are right."""
    if mode.startswith("flag"):
        return flag_chain(programs, kernels, mode == "flag_early", block, fan)
    bufs = [torch.zeros(programs * block, dtype=torch.int32, device="cuda") for _ in range(2)]
    counters = torch.zeros(2 * (kernels + 1), dtype=torch.int32, device="cuda")
    spin, pdl = mode.startswith("spin"), mode != "plain"

    def run():
        bufs[0].zero_()
        bufs[1].zero_()
        for i in range(kernels):
            x, y = bufs[i % 2], bufs[(i + 1) % 2]
            # The first kernel of a chain has no predecessor to poll: its counter starts full.
            if spin and i == 0:
                counters[0].fill_(programs)
            _step_kernel[(programs,)](x, y, counters[2 * i:], counters[2 * i + 1:], counters[2 * i + 2:],
                                      WAIT=pdl, SPIN=spin, EARLY=mode == "spin_early", BLOCK=block, FAN=fan,
                                      num_warps=4, launch_pdl=pdl and i > 0)
        return bufs[kernels % 2]

    def check() -> bool:
        out = run()
        torch.cuda.synchronize()
        return bool((out == kernels).all()) and bool((counters[2:-2] == 0).all())

    return run, check


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", default="132,264")
    ap.add_argument("--kernels", type=int, default=20)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--fan-in", default="1", help="programs of the previous kernel each program reads from")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, chains of {args.kernels} kernels in one CUDA graph")
    print("| programs | fan-in | mode | us per kernel | values right |")
    print("|---|---|---|---|---|")
    for programs in (int(p) for p in args.programs.split(",")):
        for fan in (int(f) for f in args.fan_in.split(",")):
            for mode in args.modes.split(","):
                run, check = chain(mode, programs, args.kernels, fan=fan)
                ok = check()
                us = _time(run, graph=True) / args.kernels
                print(f"| {programs} | {fan} | {mode} | {us:.2f} | {ok and check()} |", flush=True)


if __name__ == "__main__":
    main()
