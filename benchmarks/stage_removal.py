"""Upper bounds of what folding a stage of the fused layer away could save: the fused layer timed with a
stage taken out (H200, real-size sparse MoE layers, a graph of --layers consecutive layers as the
benchmark builds them). Numerics are wrong by design: a removed norm passes its input through, a removed
router or indexer + attention returns its first call's output (per layer, so later layers still run); a
removed router top-k or attention merge still launches the router's logits or the attention's splits (the
top-k or merge kernel not), returning the first full call's output. The router variants time the router's
own launches: where one is chosen, the process runs with MINIMAX_OPS_ROUTE_IN_EXPERTS=0 (every variant, the
full layer too; one-token steps otherwise make the top-k inside the expert kernels, where no router
launch is left to remove but the logits). Every variant runs the post-attention norm's kernel
(MINIMAX_OPS_DEFER_POST_NORM=0: the bounds are those of the layer with it).

    PYTHONPATH=$PWD python3 benchmarks/stage_removal.py [--experts mxfp4] [--tokens 1] [--layers 4] [--timeline]

Prints, per case, each variant's median us per layer over 3 alternating rounds, what it saves against the
full layer and its ratio to the unfused graph; with --timeline the full layer's kernels in one replay of a
two-layer graph (start, end, duration, time since the previous kernel's end).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import statistics
import sys

import torch

from minimax_ops.bench import _time, copy_bandwidth, layer_chain
from minimax_ops.kernels import attention, decode_layer, router
from minimax_ops.kernels.tiles import num_sms, router_config
from minimax_ops.timeline import kernel_timelines

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (ab_fused beside this script)
from ab_fused import print_medians, run_cases  # noqa: E402

_NORM, _ROUTE, _STAGES = decode_layer._add_rmsnorm, decode_layer._route, decode_layer.kernel_stages
_STATE = {"calls": 0, "remove": set(), "route": {}, "attention": {}, "topk": {}, "merge": {}}
VARIANTS = {"full layer": set(), "input norm": {"input"}, "post-attention norm": {"post"},
            "both norms": {"input", "post"}, "router": {"route"}, "both norms and the router": {"input", "post", "route"},
            "indexer + attention": {"attention"}, "router top-k": {"topk"}, "attention merge": {"merge"},
            "router top-k and merge": {"topk", "merge"}}


class _NoLaunch:
    """Stands for a @triton.jit kernel whose launches are skipped."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _without(module, name):
    kernel = getattr(module, name)
    setattr(module, name, _NoLaunch())
    try:
        yield
    finally:
        setattr(module, name, kernel)


def _first_full(kind, key, fn, *args, **kwargs):
    """fn's first full call's output for key; later calls launch fn with the kind's kernel skipped."""
    if key not in _STATE[kind]:
        _STATE[kind][key] = fn(*args, **kwargs)
        return _STATE[kind][key]
    module, name = (router, "_router_topk_kernel") if kind == "topk" else (attention, "_attention_merge_kernel")
    with _without(module, name):
        fn(*args, **kwargs)
    return _STATE[kind][key]


def _norm(x, residual, weight, eps):
    which = "input" if _STATE["calls"] % 2 == 0 else "post"  # a layer calls the input norm, then the post norm
    _STATE["calls"] += 1
    return (x, residual) if which in _STATE["remove"] else _NORM(x, residual, weight, eps)


def _first_call(kind, key, fn, *args):
    if kind not in _STATE["remove"]:
        return fn(*args)
    if key not in _STATE[kind]:
        _STATE[kind][key] = fn(*args)
    return _STATE[kind][key]


def _route(h, gate, bias, top_k, scaling):
    if "topk" in _STATE["remove"]:  # the logits kernel alone (its top-k kernel skipped, none in its last program)
        cfg = dataclasses.replace(router_config(h.shape[0], gate.shape[0], gate.shape[1], num_sms(h.device)),
                                  fused_topk=False)
        return _first_full("topk", gate.data_ptr(), router.route, h, gate, bias, top_k, scaling, config=cfg, pdl=True)
    return _first_call("route", gate.data_ptr(), _ROUTE, h, gate, bias, top_k, scaling)


def _stages():
    ns = _STAGES()
    attention_ = ns.index_sparse_attention

    def index_sparse_attention(q, index_q, kv_cache, *args):
        if "merge" in _STATE["remove"]:
            return _first_full("merge", kv_cache.data_ptr(), attention_, q, index_q, kv_cache, *args)
        return _first_call("attention", kv_cache.data_ptr(), attention_, q, index_q, kv_cache, *args)
    ns.index_sparse_attention = index_sparse_attention
    del ns.input_add_rmsnorm  # (both norms through add_rmsnorm, told apart by their call order)
    return ns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", default="mxfp4")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--only", default="", help="the variants to time, comma-separated (default: all)")
    args = ap.parse_args()
    variants = {k: v for k, v in VARIANTS.items() if not args.only or k == "full layer" or k in args.only.split(",")}
    decode_layer._add_rmsnorm, decode_layer._route, decode_layer.kernel_stages = _norm, _route, _stages
    if any(v & {"route", "topk"} for v in variants.values()):
        os.environ["MINIMAX_OPS_ROUTE_IN_EXPERTS"] = "0"
        print("router variants chosen: the router's own launches (MINIMAX_OPS_ROUTE_IN_EXPERTS=0)", flush=True)
    # Each layer's two norms are told apart by their call order: the post norm's kernel must run.
    os.environ["MINIMAX_OPS_DEFER_POST_NORM"] = "0"
    print(f"{torch.cuda.get_device_name()}, copy {copy_bandwidth(torch.device('cuda')) / 1e12:.2f} TB/s", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]

    def case(fmt, n, layers, caches, meta, x, residual):
        fused, unfused = (layer_chain(layers, caches, x, residual, meta, fused=f) for f in (True, False))
        times = {name: [] for name in variants}
        for _ in range(3):
            for name, remove in variants.items():
                _STATE["remove"] = remove
                times[name].append(_time(fused, graph=True) / args.layers)
        _STATE["remove"] = set()
        unf = _time(unfused, graph=True) / args.layers
        full = statistics.median(times["full layer"])
        print(f"\n{fmt}, {n} token(s), {args.context} context: unfused graph {unf:.1f} us per layer")
        print(f"  {'stage removed':28s} {'median us':>9s} {'rounds':>24s} {'saves us':>8s} {'vs unfused':>10s}")
        print_medians(times, 28, lambda med: f"{full - med:8.1f} {unf / med:9.3f}x")
        if args.timeline:
            print("  timeline of a two-layer graph (us: start, end, duration, since the previous end)")
            prev = 0.0
            for kname, t0, t1 in kernel_timelines(layer_chain(layers[:2], caches[:2], x, residual, meta, fused=True),
                                                  replays=1)[0]:
                print(f"    {t0:7.1f} {t1:7.1f} {t1 - t0:6.1f} {t1 - prev:6.1f}  {kname[:60]}")
                prev = t1

    run_cases(args.experts, tokens, args.context, args.layers, case)


if __name__ == "__main__":
    main()
