"""A/B of fused-layer variants chosen by environment variables and tile knobs, in one process (H200, one real-size
sparse MoE layer at TP 1, or one rank's with --tp, fp8 KV + index caches, as ``python -m minimax_ops bench`` builds it).

    python benchmarks/ab_fused.py --variants "base;w2d2:W2=2/0/1/128;w13d4:W13=4/0/1/0/1" \
        [--experts mxfp4,mxfp8] [--tokens 1,16] [--context 32768] [--rounds 3] [--timeline] [--layers 1] [--tp 1]

Besides environment variables a variant may set the mxfp4_mma expert tiles of every step size
(kernels/tiles.py): ``W13=depth/prefetch/split/cap/paired[/ring]`` and ``W2=depth/prefetch/split/cap[/ring]``
(cap: ptxas register cap, 0 none; paired 1: gate and up blocks in one stream, the depth then per matrix;
ring: load steps held in registers, 2 or 3, 2 if left out),
``W13F8`` / ``W2F8`` the same for the mxfp8_mma expert tables (the one-token w2 that makes the router's top-k
holds tiles._ROUTED_W2_RING's steps whatever W2F8's ring: ``RW2F8=ring`` sets that, 0 the table's), the mxfp8_mma
GEMV tiles (qkv, o_proj):
``LIN=row blocks/depth/prefetch/cap/streams per SM``, fixed tiles of one of them: ``QKV=`` / ``OPROJ=warps/depth/
grid splits/cap[/warp splits]``, the
router's tile: ``ROUTER=experts/H``, ``WS=gemv+w13``: the kernels whose K splits the programs' warps
make where they divide them (tiles.WARP_SPLIT; ``WS=0``: none, every split by the grid), the sparse
attention's split launch: ``ATTN=programs per SM/pipeline stages``, the indexer's score pass launch:
``SCORE=programs per SM/warps/pipeline stages`` (index_topk.SCORE_LAUNCH), the indexer top-k's one-slice
width: ``SHORT=blocks`` (index_topk.TOPK_CHUNK: rows of more blocks are selected by groups), the most tokens
a step may have for the one-kernel qkv path: ``QKV1=n`` (qkv_mma.ONE_KERNEL_TOKENS), the shared-memory
carveout every package kernel prefers: ``CARVE=percent`` of the largest share (-1: the driver's choice;
kernel_attributes.py; the layer is run once first so that its kernels are loaded), and
``TWO=1``: two token groups on one expert weight stream for MXFP4 too (with an unpaired w13),
``TWO=0``: for no format (MXFP8 too).

Variants alternate round by round (the spread between rounds is the noise floor; the first round of a
process runs on a GPU that was idle: compare the later ones); each round captures a fresh CUDA graph of
the fused op under the variant's environment (only switches the code reads at every call take effect;
MINIMAX_OPS_NO_PDL and the like are read once per process). Prints each variant's new kernels with their
registers and spills, its median fused time, the unfused graph once per case (under the process's own
environment, not a variant's: where a variant switches kernels the unfused chain shares, its "vs unfused"
compares against the default kernels' chain), a warning where a variant's
output leaves the first variant's by more than 2e-2, and with --timeline each variant's kernels inside one
graph replay (profiler; start and end relative to the first kernel, so PDL overlap shows) and, with
--layers > 1, the time each stage adds to a layer (minimax_ops/timeline.py). --occupancy prints, once per case,
each loaded kernel's registers, shared memory and programs an SM holds, by the driver.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import torch

from minimax_ops.bench import _time, build_layers, chain_bytes, copy_bandwidth, layer_caches, layer_chain, one_rank_group
from minimax_ops.cache import build_step
from minimax_ops.config import preset
from minimax_ops.kernels import attention, index_topk, linear_mma, moe_mma, qkv_mma, router, tiles
from minimax_ops.sharding import local_config
from minimax_ops.timeline import kernel_timelines, stage_medians

import kernel_attributes  # (benchmarks/ is on the path of a script run from it)


def parse_variants(text: str) -> list[tuple[str, dict[str, str]]]:
    """"name:A=1,B=2;name2:..." -> [(name, {A: 1, B: 2}), ...]; a name alone sets nothing."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(";"))):
        name, _, assigns = item.partition(":")
        env = dict(a.split("=", 1) for a in filter(None, assigns.split(",")))
        out.append((name, env))
    return out


# Knobs a variant sets besides environment variables, and what each patches (restored after the variant).
_KNOBS = ("W13", "W2", "W13F8", "W2F8", "RW2F8", "LIN", "ROUTER", "TWO", "QKV", "OPROJ", "ATTN", "SHORT", "WS", "QKV1",
          "CARVE", "SCORE")
_BASE_EXPERT_TILES = dict(tiles._MMA_EXPERT_TILES)
_BASE_ROUTED_RING = dict(tiles._ROUTED_W2_RING)
_BASE_LINEAR = (tiles._MMA_LINEAR_TILES[True], tiles._MMA_LINEAR_WARPS_PER_SM)
_BASE_ROUTER = router.router_config
_BASE_TWO_GROUPS = moe_mma._two_groups
_BASE_LINEAR_TILES = {qkv_mma: qkv_mma.linear_tiles, linear_mma: linear_mma.linear_tiles}
_BASE_SPLIT_LAUNCH = dict(attention.SPLIT_LAUNCH)
_BASE_SCORE_LAUNCH = dict(index_topk.SCORE_LAUNCH)
_BASE_TOPK_CHUNK = index_topk.TOPK_CHUNK
_BASE_WARP_SPLIT = tiles.WARP_SPLIT
_BASE_ONE_KERNEL = qkv_mma.ONE_KERNEL_TOKENS


def _set_expert_tiles(w13: str | None, w2: str | None, fp8: bool = False) -> None:
    """W13 / W2 (W13F8 / W2F8): the mxfp4_mma (mxfp8_mma) expert tiles of every step size (None: the table's)."""
    for key in ((fp8, True), (fp8, False)):
        t13, t2, paired = _BASE_EXPERT_TILES[key]
        if w13:
            d, pf, sp, cap, pr, *ring = map(int, w13.split("/"))
            t13, paired = (t13[0], d, pf, sp, cap, *ring), bool(pr)
        if w2:
            d, pf, sp, cap, *ring = map(int, w2.split("/"))
            t2 = (t2[0], d, pf, sp, cap, *ring)
        tiles._MMA_EXPERT_TILES[key] = (t13, t2, paired)
    tiles.mma_expert_tiles.cache_clear()


def _set_routed_ring(ring: str | None) -> None:
    """RW2F8: the load steps the routed one-token MXFP8 w2 holds (0: the table's; None: tiles._ROUTED_W2_RING's)."""
    tiles._ROUTED_W2_RING.clear()
    tiles._ROUTED_W2_RING.update(_BASE_ROUTED_RING)
    if ring is not None:
        tiles._ROUTED_W2_RING.pop(True, None)
        if int(ring):
            tiles._ROUTED_W2_RING[True] = int(ring)
    tiles.mma_expert_tiles.cache_clear()


def _set_fp8_linear_tiles(lin: str | None) -> None:
    """LIN: the mxfp8_mma GEMV tiles (qkv, o_proj) and their streams per SM (None: the table's)."""
    t, per_sm = _BASE_LINEAR
    if lin:
        nw, d, pf, cap, per_sm = map(int, lin.split("/"))
        t = (nw, d, pf, cap)
    tiles._MMA_LINEAR_TILES[True] = t
    tiles._MMA_LINEAR_WARPS_PER_SM = per_sm
    tiles.mma_linear_tiles.cache_clear()


def _set_router_tiles(spec: str | None) -> None:
    """ROUTER: the router's expert and H tile, its H split by the same rule as tiles.router_config (the
    most splits that keep the grid within two programs per SM); None: router_config's."""
    if not spec:
        router.router_config = _BASE_ROUTER
        return
    block_e, block_h = map(int, spec.split("/"))

    def config(n_tokens, n_experts, hidden, sms):
        iters, groups = hidden // block_h, -(-n_experts // block_e)
        split = max(d for d in range(1, iters + 1) if iters % d == 0 and (groups * d <= 2 * sms or d == 1))
        return dataclasses.replace(_BASE_ROUTER(n_tokens, n_experts, hidden, sms), block_e=block_e,
                                   block_h=block_h, split=split)
    router.router_config = config


def _set_two_groups(spec: str | None) -> None:
    """TWO=1: every mma-layout expert table (MXFP4 too) multiplies steps of more than 8 tokens as two
    token groups on one weight stream (moe_mma._two_groups; w13 must stream gate, then up: W13=.../0);
    TWO=0: none does (MXFP8 too: one token group a pass)."""
    two = {"1": lambda fmt, n, ptx: n > 8 and ptx, "0": lambda fmt, n, ptx: False}
    moe_mma._two_groups = two.get(spec, _BASE_TWO_GROUPS)


def _set_gemv_tiles(module, spec: str | None) -> None:
    """QKV / OPROJ: fixed mxfp8_mma tiles (warps/depth/grid splits/cap[/warp splits]) for the qkv GEMV
    (qkv_mma's; no warp splits) or mx_linear's mma GEMVs (o_proj in the layer), PTX launches only; None:
    the heuristic's."""
    base = _BASE_LINEAR_TILES[module]
    if not spec:
        module.linear_tiles = base
        return
    warps, depth, split, cap, *ws = map(int, spec.split("/"))

    def fixed(n, k, device, fp8, override=None, warp_split=True):
        t, ptx = base(n, k, device, fp8, override, warp_split)
        if override is None and fp8 and ptx:
            t = tiles.MmaLinearTiles(warps, depth, 0, split, cap, ws[0] if ws and warp_split else 1)
        return t, ptx
    module.linear_tiles = fixed


def _set_attention_launch(spec: str | None) -> None:
    """ATTN: the sparse attention split kernel's programs per SM and pipeline stages (None: the table's)."""
    attention.SPLIT_LAUNCH.clear()
    attention.SPLIT_LAUNCH.update(_BASE_SPLIT_LAUNCH)
    if spec:
        per_sm, stages = map(int, spec.split("/"))
        attention.SPLIT_LAUNCH.update(sparse_per_sm=per_sm, num_stages=stages)


def _set_score_launch(spec: str | None) -> None:
    """SCORE: the indexer's score pass programs per SM, warps and pipeline stages (None: the table's)."""
    index_topk.SCORE_LAUNCH.clear()
    index_topk.SCORE_LAUNCH.update(_BASE_SCORE_LAUNCH)
    if spec:
        per_sm, warps, stages = map(int, spec.split("/"))
        index_topk.SCORE_LAUNCH.update(programs_per_sm=per_sm, num_warps=warps, num_stages=stages)


class _Env:
    """A variant's environment variables and knobs, for the duration of a with block (warm: a call that loads the
    variant's kernels, made before a CARVE is set)."""

    def __init__(self, env: dict[str, str], warm=None):
        self.knobs = {k: env.get(k) for k in _KNOBS}
        self.env, self.saved = {k: v for k, v in env.items() if k not in _KNOBS}, {}
        self.warm = warm

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        self._apply(self.knobs)
        if self.knobs["CARVE"] is not None:
            if self.warm is not None:
                self.warm()
            kernel_attributes.set_carveout(int(self.knobs["CARVE"]))

    def __exit__(self, *exc):
        if self.knobs["CARVE"] is not None:
            kernel_attributes.set_carveout(-1)
        self._apply(dict.fromkeys(_KNOBS))
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    @staticmethod
    def _apply(knobs: dict) -> None:
        _set_expert_tiles(knobs["W13"], knobs["W2"])
        _set_expert_tiles(knobs["W13F8"], knobs["W2F8"], fp8=True)
        _set_routed_ring(knobs["RW2F8"])
        _set_fp8_linear_tiles(knobs["LIN"])
        _set_router_tiles(knobs["ROUTER"])
        _set_two_groups(knobs["TWO"])
        _set_gemv_tiles(qkv_mma, knobs["QKV"])
        _set_gemv_tiles(linear_mma, knobs["OPROJ"])
        _set_attention_launch(knobs["ATTN"])
        _set_score_launch(knobs["SCORE"])
        index_topk.TOPK_CHUNK = int(knobs["SHORT"]) if knobs["SHORT"] else _BASE_TOPK_CHUNK
        qkv_mma.ONE_KERNEL_TOKENS = int(knobs["QKV1"]) if knobs["QKV1"] else _BASE_ONE_KERNEL
        ws = knobs["WS"]
        tiles.WARP_SPLIT = _BASE_WARP_SPLIT if ws is None else frozenset(filter(None, ws.split("+"))) - {"0"}
        tiles.mma_linear_tiles.cache_clear()
        tiles.mma_expert_tiles.cache_clear()


def _compiled(kernels) -> dict:
    """Every compiled specialisation of the given @triton.jit kernels so far, by identity."""
    return {id(k): (name, k.n_regs, k.n_spills) for name, k in kernel_attributes.specialisations(
        (k.__name__, k) for k in kernels)}


def run_cases(experts: str, tokens: list[int], context: int, count: int, case, tp: int = 1) -> None:
    """Calls case(format, tokens, layers, caches, step metadata, x, residual) for each format and step size, as
    the benchmark builds them: ``count`` real-size sparse MoE layers of each format (kernel layouts) on one
    set of caches, one-token requests at ``context``; ``tp`` > 1: one rank of that degree, as bench --tp. A
    format's layers are freed before the next is built (nothing outside ``case`` holds them)."""
    device = torch.device("cuda")
    cfg = local_config(preset("real"), tp)
    group_name = one_rank_group() if tp > 1 else ""
    caches, blocks = layer_caches(cfg, count, max(tokens), context, device)
    gen = torch.Generator().manual_seed(0)
    for fmt in experts.split(","):
        layers = build_layers(cfg, fmt, count, "kernel", gen, device, group_name)
        for n in tokens:
            meta = build_step([context - 1] * n, 1, block_size=cfg.sparse_block_size, num_blocks=blocks,
                              device=device, generator=gen)
            x = torch.randn(n, cfg.hidden_size, device=device).to(torch.bfloat16)
            residual = torch.randn(n, cfg.hidden_size, device=device).to(torch.bfloat16)
            case(fmt, n, layers, caches, meta, x, residual)
        del layers
        torch.cuda.empty_cache()


def print_medians(times: dict[str, list[float]], width: int, tail) -> None:
    """One line per variant: its median us, its rounds, then tail(median)."""
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:{width}s} {med:9.1f} {' '.join(f'{t:.1f}' for t in ts):>24s} {tail(med)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", required=True)
    ap.add_argument("--experts", default="mxfp4")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--occupancy", action="store_true")
    ap.add_argument("--layers", type=int, default=1,
                    help="time a graph of this many consecutive layers (as the benchmark's --layers); us per layer")
    ap.add_argument("--tp", type=int, default=1, help="one rank of this tensor-parallel degree (as bench --tp)")
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, copy {bw / 1e12:.2f} TB/s", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]

    def case(fmt, n, layers, caches, meta, x, residual):
        fused, unfused = (layer_chain(layers, caches, x, residual, meta, fused=f) for f in (True, False))
        nbytes = chain_bytes(layers, caches, x, residual, meta)
        ref = fused()[0].float()
        times = {name: [] for name, _ in variants}
        expert_kernels = (moe_mma._mma_w13_kernel, moe_mma._mma_w2_kernel, linear_mma._mma_linear_kernel,
                          qkv_mma._qkv_norm_rope_insert_kernel)
        for r in range(args.rounds):
            for name, env in variants:
                with _Env(env, warm=fused):
                    seen = _compiled(expert_kernels)
                    times[name].append(_time(fused, graph=True) / args.layers)
                    if r == 0:
                        new = [v for k, v in _compiled(expert_kernels).items() if k not in seen]
                        print(f"  {name}: new kernels (name, registers, spills): {new}", flush=True)
                    err = ((fused()[0].float() - ref).norm() / ref.norm()).item()
                    if err > 2e-2:
                        print(f"  !! {name}: output differs from the first variant's by {err:.3g}")
        unf = _time(unfused, graph=True) / args.layers
        print(f"\n{fmt} tokens {n} ctx {args.context}, {args.layers} layer(s) a graph, us per layer: "
              f"{nbytes / 1e6:.1f} MB, floor {nbytes / bw * 1e6:.1f} us, unfused graph {unf:.1f} us")
        print(f"  {'variant':24s} {'median us':>9s} {'rounds':>24s} {'% copy':>7s} {'vs unfused':>10s}")
        print_medians(times, 24, lambda med: f"{100 * nbytes / (med * 1e-6) / bw:6.1f}% {unf / med:9.3f}x")
        if args.occupancy:
            print("  every kernel specialisation loaded so far (all variants, fused and unfused), by the driver:")
            for line in kernel_attributes.report():
                print(f"    {line}")
        if args.timeline:
            for name, env in variants:
                with _Env(env, warm=fused):
                    runs = kernel_timelines(fused)  # (one capture: a replay printed, all for the stages)
                rows = runs[0]
                stages = stage_medians(runs, args.layers) if args.layers > 1 else {}
                print(f"  timeline {name} (us: start, end, duration)")
                for kname, t0, t1 in rows:
                    print(f"    {t0:7.1f} {t1:7.1f} {t1 - t0:6.1f}  {kname[:70]}")
                if stages:
                    print(f"  {name}, us each stage adds to a layer (median of replays x layers after the first): "
                          + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))

    run_cases(args.experts, tokens, args.context, args.layers, case, args.tp)


if __name__ == "__main__":
    main()
