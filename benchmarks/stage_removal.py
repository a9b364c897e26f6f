"""Upper bounds of what folding a stage of the fused layer away could save: the fused layer timed with a
stage taken out (H200, real-size sparse MoE layers, a graph of --layers consecutive layers as the
benchmark builds them). Numerics are wrong by design, but the work stays the layer's: the attention's
selection and the experts' routing always come from real scores and logits (made from garbage they would
change what streams), while values downstream of a removed stage may be anything. A removed norm passes
its input through; a removed score pass, router (logits) or indexer + attention returns its first call's
output (per layer, so later layers still run); a removed attention merge, router top-k or expert combine
still launches the rest of its step (the splits, the router's logits, the experts), that one kernel not,
returning the first full call's output.

A removed kernel can also remove a wait. Without the router, w13's shared-expert programs become direct
dependents of o_proj. They stream h before o_proj's last programs have written it, which is a head start no
correct fold has. So the router's saving here overstates that fold: built with the wait kept, it cost 2.2 us
(BENCHMARKS.md, forty-eighth session). The same applies to the variants that take the router out with others.

The default variants take stages out of the layer as it runs by default (one-token steps: the post norm
deferred into o_proj, the router and w13; the router's top-k made in the expert kernels), each alone and
the five latency-bound kernels (input norm, score pass, attention merge, router logits, expert combine)
together, and "streams only" (those five and the attention's split kernel: the weight streams and their
handoffs alone). The legacy variants (``--only`` names them) time stages those defaults leave out: the
post-attention norm's kernel (the process then runs with MINIMAX_OPS_DEFER_POST_NORM=0), the router's own
top-k launch (MINIMAX_OPS_ROUTE_IN_EXPERTS=0); the switch then holds for every variant of the process, the
full layer too.

    PYTHONPATH=$PWD python3 benchmarks/stage_removal.py [--experts mxfp4] [--tokens 1] [--layers 4] [--timeline]
                                                        [--only "input norm,attention merge"]

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
from minimax_ops.kernels import attention, decode_layer, index_topk, moe, moe_combine, router
from minimax_ops.kernels.tiles import num_sms, router_config
from minimax_ops.timeline import kernel_timelines

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (ab_fused beside this script)
from ab_fused import print_medians, run_cases  # noqa: E402

_INPUT_NORM, _POST_NORM, _ROUTE = decode_layer._input_add_rmsnorm, decode_layer._add_rmsnorm, decode_layer._route
_STAGES, _LOGITS, _ROUTED = decode_layer.kernel_stages, router.router_logits, moe.routed_moe_experts
_SCORES = index_topk.index_scores
_STATE = {"remove": set(), "route": {}, "attention": {}, "topk": {}, "merge": {}, "logits": {}, "combine": {},
          "score": {}}
LATENCY_BOUND = {"input", "score", "merge", "logits", "combine"}
# (No score pass alone: without it the attention split, which reads q before its PDL wait on the score pass,
# reads it before the qkv kernel is done; the routing then follows garbage. "all five" keeps the first call's
# router logits, so there the work stays the layer's.)
# "streams only": every kernel that streams no weights taken out (the five and the attention's split kernel): what
# is left is the weight streams with their handoffs, the least any fold of the latency-bound work could leave.
VARIANTS = {"full layer": set(), "input norm": {"input"}, "attention merge": {"merge"}, "router logits": {"logits"},
            "expert combine": {"combine"}, "all five": LATENCY_BOUND, "indexer + attention": {"attention"},
            "streams only": {"input", "attention", "logits", "combine"}}
LEGACY = {"post-attention norm": {"post"}, "both norms": {"input", "post"}, "router": {"route"},
          "both norms and the router": {"input", "post", "route"}, "router top-k": {"topk"},
          "router top-k and merge": {"topk", "merge"}}
_SKIPPED = {"topk": (router, "_router_topk_kernel"), "merge": (attention, "_attention_merge_kernel"),
            "combine": (moe_combine, "_moe_combine_kernel")}


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
    with _without(*_SKIPPED[kind]):
        fn(*args, **kwargs)
    return _STATE[kind][key]


def _input_norm(x, residual, weight, eps):
    return (x, residual) if "input" in _STATE["remove"] else _INPUT_NORM(x, residual, weight, eps)


def _post_norm(x, residual, weight, eps):
    return (x, residual) if "post" in _STATE["remove"] else _POST_NORM(x, residual, weight, eps)


def _first_call(kind, key, fn, *args, **kwargs):
    if kind not in _STATE["remove"]:
        return fn(*args, **kwargs)
    if key not in _STATE[kind]:
        _STATE[kind][key] = fn(*args, **kwargs)
    return _STATE[kind][key]


def _route(h, gate, bias, top_k, scaling):
    if "topk" in _STATE["remove"]:  # the logits kernel alone (its top-k kernel skipped, none in its last program)
        cfg = dataclasses.replace(router_config(h.shape[0], gate.shape[0], gate.shape[1], num_sms(h.device)),
                                  fused_topk=False)
        return _first_full("topk", gate.data_ptr(), router.route, h, gate, bias, top_k, scaling, config=cfg, pdl=True)
    return _first_call("route", gate.data_ptr(), _ROUTE, h, gate, bias, top_k, scaling)


def _router_logits(h, gate, **kwargs):
    return _first_call("logits", gate.data_ptr(), _LOGITS, h, gate, **kwargs)


def _index_scores(index_q, index_cache, *args, **kwargs):
    return _first_call("score", index_cache.data_ptr(), _SCORES, index_q, index_cache, *args, **kwargs)


def _routed_moe_experts(h, gate, *args, **kwargs):
    if "combine" in _STATE["remove"]:
        return _first_full("combine", gate.data_ptr(), _ROUTED, h, gate, *args, **kwargs)
    return _ROUTED(h, gate, *args, **kwargs)


def _stages():
    ns = _STAGES()
    attention_ = ns.index_sparse_attention

    def index_sparse_attention(q, index_q, kv_cache, *args):
        if "merge" in _STATE["remove"]:
            return _first_full("merge", kv_cache.data_ptr(), attention_, q, index_q, kv_cache, *args)
        return _first_call("attention", kv_cache.data_ptr(), attention_, q, index_q, kv_cache, *args)
    ns.index_sparse_attention = index_sparse_attention
    ns.input_add_rmsnorm = _input_norm
    return ns


def _install() -> None:
    """Every hook in place (each passes through unless its stage is in _STATE["remove"]; the input norm's is the
    stages' own, _stages)."""
    decode_layer._add_rmsnorm = _post_norm
    decode_layer._route, decode_layer.kernel_stages = _route, _stages
    router.router_logits, moe.routed_moe_experts = _router_logits, _routed_moe_experts
    index_topk.index_scores = _index_scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", default="mxfp4")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--only", default="", help="the variants to time, comma-separated (default: VARIANTS)")
    args = ap.parse_args()
    known = {**VARIANTS, **LEGACY}
    chosen = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown:
        ap.error(f"--only: unknown variants {unknown}; expected some of {sorted(known)}")
    variants = {k: v for k, v in known.items() if k == "full layer" or (k in chosen if chosen else k in VARIANTS)}
    _install()
    if any(v & {"route", "topk"} for v in variants.values()):
        os.environ["MINIMAX_OPS_ROUTE_IN_EXPERTS"] = "0"
        print("router variants chosen: the router's own launches (MINIMAX_OPS_ROUTE_IN_EXPERTS=0)", flush=True)
    if any("post" in v for v in variants.values()):
        os.environ["MINIMAX_OPS_DEFER_POST_NORM"] = "0"
        print("post-norm variants chosen: the norm's own kernel (MINIMAX_OPS_DEFER_POST_NORM=0)", flush=True)
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
