"""Tile sweep of the mma-layout GEMVs (linear_mma: qkv 9856 x 6144 and o_proj 6144 x 8192, MXFP8) on one GPU.

    PYTHONPATH=$PWD python3 benchmarks/sweep_mma_linear.py [--tokens 1,16] [--copies 4] [--warps 8]
        [--matrices qkv,o_proj]

Each timed CUDA graph holds one call per weight copy (--copies layers' weights, so L2 never holds what
a call streams); the median replay over the copies is one call. Variants are MmaLinearTiles (row
blocks per program = warps, blocks per load step, K splits, register cap); every variant's output is
checked against the heuristic's (1e-2 relative: splits change the order of the sums). --warps 8 keeps
the qkv GEMV's programs one head wide, as the fused qkv + norm / RoPE / insert kernel needs.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from minimax_ops.bench import _time, copy_bandwidth
from minimax_ops.config import preset
from minimax_ops.formats import FMT_MXFP8_MMA, MMA_K, MMA_ROWS
from minimax_ops.kernels.linear_mma import mma_linear
from minimax_ops.kernels.tiles import MmaLinearTiles, mma_linear_tiles, num_sms
from minimax_ops.weights import random_layer_weights, to_kernel_layout


CONFIG = preset("real").replace(num_local_experts=4, num_experts_per_tok=2)  # (the GEMVs are the real ones)


def _weights(copies: int, device) -> list:
    gen = torch.Generator(device=device).manual_seed(0)
    return [to_kernel_layout(random_layer_weights(CONFIG, 3, linear_format="mxfp8", expert_format="mxfp8",
                                                  generator=gen, device=device)) for _ in range(copies)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--warps", default="8")
    ap.add_argument("--matrices", default="qkv,o_proj")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    layers = _weights(args.copies, device)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for name in args.matrices.split(","):
        mats = [(getattr(w, name), getattr(w, f"{name}_scale")) for w in layers]
        n = mats[0][0].shape[-3] * MMA_ROWS
        k = CONFIG.q_size if name == "o_proj" else CONFIG.hidden_size
        nbytes = sum(t.numel() * t.element_size() for t in mats[0])
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            base = mma_linear_tiles(n, k, num_sms(device), True)
            want = mma_linear(x, *mats[0], FMT_MXFP8_MMA, torch.bfloat16).float()
            steps = k // MMA_K
            rows = []
            grid = itertools.product([int(w) for w in args.warps.split(",")], (1, 2, 4), (1, 2, 3, 4, 6, 8),
                                     (0, 64, 80, 96, 128))
            for warps, depth, split, regs in grid:
                if steps % (depth * split):
                    continue
                t = MmaLinearTiles(warps, depth, 0, split, regs)
                try:
                    got = mma_linear(x, *mats[0], FMT_MXFP8_MMA, torch.bfloat16, tiles=t).float()
                    err = ((got - want).norm() / want.norm()).item()
                    if err > 1e-2:
                        print(f"  {name} m={m} {t}: WRONG rel {err:.2e}", flush=True)
                        continue
                    us = _time(lambda: [mma_linear(x, w, s, FMT_MXFP8_MMA, torch.bfloat16, tiles=t) for w, s in mats],
                               graph=True, iters=15, reps=5) / len(mats)
                except Exception as e:  # (a register cap below what the tile needs fails to compile)
                    print(f"  {name} m={m} {t}: {type(e).__name__} {str(e)[:120]}", flush=True)
                    continue
                rows.append((us, t))
            rows.sort(key=lambda r: r[0])
            default = next((us for us, t in rows if t == base), float("nan"))
            print(f"{name} [{n} x {k}] m={m}: heuristic {base} {default:.1f} us "
                  f"({nbytes / (default * 1e-6) / 1e12:.2f} TB/s)", flush=True)
            for us, t in rows[:8]:
                print(f"    {us:7.1f} us {nbytes / (us * 1e-6) / 1e12:5.2f} TB/s  warps {t.num_warps} depth {t.depth} "
                      f"split {t.split} regs {t.max_registers}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
