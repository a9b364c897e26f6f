"""Where each kernel of the fused layer spends its time inside itself: Nsight Compute's warp-state sampling of
one step of real-size sparse MoE layers (the second layer's kernels have a predecessor in the step), read per
SASS instruction.

On the GPU machine (ncu serialises the kernels: PDL overlap is gone, each kernel's pre-wait work shows):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats \\
        --section Occupancy --section WarpStateStats --section SchedulerStats --section SourceCounters \\
        -o /tmp/layer -f python3 benchmarks/profile_layer.py run [--experts mxfp4] [--tokens 1] [--context 32768]
    ncu -i /tmp/layer.ncu-rep --page details > $OUT/details.txt
    ncu -i /tmp/layer.ncu-rep --page source --csv --print-source sass | gzip > $OUT/source.csv.gz

Here (any machine):

    python3 benchmarks/profile_layer.py report source.csv.gz [--kernel _attention_split_kernel] [--top 20]

The report gives, per kernel (the first profiled call of each name unless --all), its SASS instructions, its
samples, the share sampled before its PDL wait (ACQBULK) and the share sampled up to each global load or store
after it (where a program's time goes between its round trips); --kernel lists that kernel's most sampled
instructions (a stall shows at the first instruction that uses what it waits for).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io

_LANDMARKS = {"LDG", "STG", "LDGSTS", "ATOMG", "REDG", "UTMALDG", "UTMASTG"}  # global memory (opcode before its dot)
_WAIT = "ACQBULK"


def read_kernels(text: str) -> list[tuple[str, list[tuple[str, int]]]]:
    """(kernel name, [(SASS instruction, samples)]) per profiled kernel of ncu's ``--page source --csv``."""
    kernels: list[tuple[str, list[tuple[str, int]]]] = []
    column = None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernels.append((row[1], []))
        elif row[0] == "Address":
            column = row.index("Warp Stall Sampling (All Samples)")
        elif kernels and column is not None and len(row) > column:
            kernels[-1][1].append((row[1].strip(), int(row[column] or 0)))
    return kernels


def phases(instructions: list[tuple[str, int]]) -> tuple[int, float | None, list[tuple[int, float, str]]]:
    """(samples, share sampled before the PDL wait or None without one, [(index, cumulative share, instruction)]
    at each global memory instruction after the wait (or from the start))."""
    total = sum(s for _, s in instructions)
    share = 1 / max(total, 1)
    wait = next((i for i, (text, _) in enumerate(instructions) if _WAIT in text), None)
    cum, marks, before = 0, [], None
    for i, (text, samples) in enumerate(instructions):
        cum += samples
        if i == wait:
            before = cum * share
        words = [w for w in text.split() if not w.startswith("@")]  # (the predicate, if any, goes first)
        if (wait is None or i > wait) and words and words[0].split(".")[0] in _LANDMARKS:
            marks.append((i, cum * share, text))
    return total, before, marks


def report(text: str, kernel: str | None = None, top: int = 20, every: bool = False) -> str:
    lines, seen = [], set()
    for name, instructions in read_kernels(text):
        if (kernel and name != kernel) or (name in seen and not every):
            continue
        seen.add(name)
        total, before, marks = phases(instructions)
        pre = "no PDL wait" if before is None else f"{100 * before:.0f}% before the PDL wait"
        lines.append(f"{name}: {len(instructions)} instructions, {total} samples, {pre}")
        last = None
        for i, share, text_ in marks:
            if last is None or share - last >= 0.02:  # (a run of loads issued together: its first one)
                lines.append(f"    {i:5d} {100 * share:5.1f}%  {text_[:90]}")
                last = share
        if kernel:
            lines.append("  most sampled:")
            ranked = sorted(enumerate(instructions), key=lambda t: -t[1][1])[:top]
            lines += [f"    {i:5d} {s:6d} {100 * s / max(total, 1):5.1f}%  {t[:90]}" for i, (t, s) in ranked]
    return "\n".join(lines)


def run(experts: str, tokens: int, context: int) -> None:
    import torch

    from minimax_ops.bench import build_layers, layer_caches, layer_chain, step_inputs
    from minimax_ops.cache import build_step
    from minimax_ops.config import preset

    device = torch.device("cuda")
    cfg = preset("real")
    caches, blocks = layer_caches(cfg, 2, tokens, context, device)
    gen = torch.Generator().manual_seed(0)
    layers = build_layers(cfg, experts, 2, "kernel", gen, device)
    meta = build_step([context - 1] * tokens, 1, block_size=cfg.sparse_block_size, num_blocks=blocks, device=device,
                      generator=gen)
    step = layer_chain(layers, caches, *step_inputs(layers, caches, meta), meta, fused=True)
    for _ in range(3):  # compiled and warm before the profiled step
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="one profiled fused step (under ncu, on a GPU)")
    r.add_argument("--experts", default="mxfp4")
    r.add_argument("--tokens", type=int, default=1)
    r.add_argument("--context", type=int, default=32768)
    p = sub.add_parser("report", help="read ncu's source page (csv, optionally gzipped)")
    p.add_argument("csv")
    p.add_argument("--kernel", default=None)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--all", action="store_true", help="every profiled call, not each kernel's first")
    args = ap.parse_args(argv)
    if args.mode == "run":
        run(args.experts, args.tokens, args.context)
        return 0
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt") as f:
        print(report(f.read(), args.kernel, args.top, args.all))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
