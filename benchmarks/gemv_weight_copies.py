"""What L2 adds to a GEMV timed alone: the qkv and o_proj GEMVs (mxfp8_mma, one token) with one weight copy
replayed against 2 and 4 copies called in turn in one CUDA graph (so that no call finds its weights in L2).

The H200's L2 (60 MiB) holds much of o_proj's 52 MB: replayed alone it reads part of it from L2, and its
figure is not a DRAM stream's. ``--stages``' "chain" column times 4 copies.

    PYTHONPATH=$PWD python3 benchmarks/gemv_weight_copies.py [--copies 1,2,4]
"""

from __future__ import annotations

import argparse

import torch

from minimax_ops.bench import _time, copy_bandwidth
from minimax_ops.formats import FMT_MXFP8_MMA
from minimax_ops.kernels.linear_mma import mma_linear
from sweep_mma_linear import CONFIG, _weights  # (benchmarks/ is on the path of a script run from it)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", default="1,2,4")
    args = ap.parse_args()
    counts = [int(c) for c in args.copies.split(",")]
    device = torch.device("cuda")
    layers = _weights(max(counts), device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size / 2**20
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bandwidth(device) / 1e12:.2f} TB/s, L2 {l2:.0f} MiB")
    print("| GEMV | MB | weight copies a graph | us per call | TB/s |")
    print("|---|---|---|---|---|")
    for name, k in (("qkv", CONFIG.hidden_size), ("o_proj", CONFIG.q_size)):
        mats = [(getattr(w, name), getattr(w, f"{name}_scale")) for w in layers]
        nbytes = sum(t.numel() * t.element_size() for t in mats[0])
        x = torch.randn(1, k, device=device).to(torch.bfloat16)
        for copies in counts:
            def run(copies=copies):
                for i in range(copies):
                    mma_linear(x, *mats[i], FMT_MXFP8_MMA, torch.bfloat16)
            t = _time(run, graph=True) / copies
            print(f"| {name} | {nbytes / 1e6:.1f} | {copies} | {t:.1f} | {nbytes / t / 1e6:.2f} |", flush=True)


if __name__ == "__main__":
    main()
