"""How fast one kernel can read S MB on this GPU, at the sizes of the fused layer's weight streams: the
floor of each stream, launch ramp and tail included, to hold the layer's stages against.

A read kernel streams its S MB once (each program XOR-folds int32 tiles into registers, one tile loaded
ahead of the one it folds; a tile is U 16-byte loads a thread), in one of two orders: ``contig`` (each
program its own contiguous run) or ``stride`` (tile i of program p at i * programs + p: a wave reads
one region at a time). The grid is P programs an SM. A timed call launches C reads of C distinct copies
back to back (C x S >= 600 MB, so L2 holds none of a read's bytes), as a stage runs in a chain of layers,
in one of three launch modes: ``plain`` (each waits for its predecessor to drain), ``pdl`` (programmatic
dependents that read their first tile before ``griddepcontrol.wait`` and launch their own dependents
after it: the fused layer's handoff with nothing to wait for), ``free`` (dependents launched at the
start and never waiting: the best overlap a chain of streams could have). Times are per read (the call
over C), CUDA-graph replays (minimax_ops.bench._time).

    PYTHONPATH=$PWD python3 benchmarks/read_ceiling.py [--sizes 50,52,62,97,100,150,195,292,416] [--sweep-mb 200]

Prints the sweep of configurations at --sweep-mb (plain), then per size the best of the sweep's top
configurations in each mode and a torch.sum of the same bytes: us, TB/s.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minimax_ops.bench import _time

MODES = ("plain", "pdl", "free")


@triton.jit
def _read_kernel(src, out, n_tiles, per_program, TILE: tl.constexpr, CONTIG: tl.constexpr, MODE: tl.constexpr):
    """XOR-fold this program's tiles of src (int32) into out[program]; MODE 0 plain, 1 pdl, 2 free."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs = tl.arange(0, TILE)
    if CONTIG:
        first = pid * per_program
        step = 1
        count = tl.minimum(per_program, n_tiles - first)
    else:
        first = pid
        step = programs
        count = tl.cdiv(n_tiles - pid, programs)
    if MODE == 2:
        gdc_launch_dependents()
    x = tl.load(src + first.to(tl.int64) * TILE + offs, mask=(offs >= 0) & (count > 0), other=0)
    if MODE == 1:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([TILE], dtype=tl.int32)
    for i in range(1, count):
        nxt = tl.load(src + (first + i * step).to(tl.int64) * TILE + offs)
        acc ^= x
        x = nxt
    acc ^= x
    tl.store(out + pid * TILE + offs, acc)


def _config_label(c) -> str:
    warps, u, per_sm, contig = c
    return f"w{warps} u{u} p{per_sm} {'contig' if contig else 'stride'}"


def _fits(warps: int, u: int, per_sm: int) -> bool:
    """Whether per_sm programs fit an SM's 64K registers (~3 tiles of 4 u registers a thread, + 24)."""
    return per_sm * warps * 32 * (12 * u + 24) <= 65536 and per_sm * warps <= 64


def _reads(config, mode: str, sms: int, copies: list[torch.Tensor], out: torch.Tensor):
    """The timed call: one read of each copy, back to back."""
    warps, u, per_sm, contig = config
    tile = warps * 32 * 4 * u
    programs = per_sm * sms
    n_tiles = copies[0].numel() // tile
    per_program = triton.cdiv(n_tiles, programs)
    m = MODES.index(mode)

    def run():
        for src in copies:
            _read_kernel[(programs,)](src, out, n_tiles, per_program, TILE=tile, CONTIG=contig, MODE=m,
                                      num_warps=warps, num_stages=1, launch_pdl=m > 0)
    return run


def _buffers(mb: float, tile_max: int) -> list[torch.Tensor]:
    words = int(mb * 1e6 / 4) // tile_max * tile_max
    if words == 0:
        raise ValueError(f"size: expected at least {tile_max * 4 / 1e6:.2f} MB (one tile of the sweep), got {mb} MB")
    n = max(2, math.ceil(600 / mb))
    return [torch.randn(words, device="cuda").view(torch.int32) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="50,52,62,97,100,150,195,292,416")
    ap.add_argument("--sweep-mb", type=float, default=200.0)
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [c for c in itertools.product((4, 8), (2, 4, 8), (1, 2, 4, 8), (True, False)) if _fits(*c[:3])]
    tile_max = max(w * 32 * 4 * u for w, u, _, _ in configs)
    out = torch.empty(8 * sms * tile_max, dtype=torch.int32, device="cuda")

    copies = _buffers(args.sweep_mb, tile_max)
    mb = copies[0].numel() * 4 / 1e6
    print(f"sweep: {mb:.1f} MB a read, {len(copies)} copies, plain launches")
    print("config | us | TB/s")
    swept = []
    for c in configs:
        us = _time(_reads(c, "plain", sms, copies, out), graph=True) / len(copies)
        swept.append((us, c))
        print(f"{_config_label(c)} | {us:.1f} | {mb / us:.2f}")
    best = [c for _, c in sorted(swept)[:args.top]]
    del copies

    print("\nsize MB | mode | best config | us | TB/s")
    for size in (float(s) for s in args.sizes.split(",")):
        copies = _buffers(size, tile_max)
        mb = copies[0].numel() * 4 / 1e6
        for mode in MODES:
            us, c = min((_time(_reads(c, mode, sms, copies, out), graph=True) / len(copies), c) for c in best)
            print(f"{mb:.1f} | {mode} | {_config_label(c)} | {us:.1f} | {mb / us:.2f}")
        floats = [x.view(torch.float32) for x in copies]
        us = _time(lambda: [torch.sum(x) for x in floats], graph=True) / len(copies)
        print(f"{mb:.1f} | torch.sum | - | {us:.1f} | {mb / us:.2f}")
        del copies, floats


if __name__ == "__main__":
    main()
