"""``python -m minimax_ops demo``: the tiny model, compiled with the fused-decode graph pass, against
the eager reference.

It builds the ``tiny`` preset with random weights, prefills a few requests (eager), then runs decode
steps through ``torch.compile(model, fullgraph=True, options={"post_grad_custom_post_pass": pass})``
and through the pure-PyTorch reference (reference_model.model_forward) on separate caches. It prints
the decode graph's torch.ops.minimax.* ops before and after the pass, the logits error per step, whether
the caches agree, and timings (on CUDA also fused vs unfused compiled step time).
Exit status 0 when every step is within tolerance and the caches agree, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import time
from dataclasses import dataclass

import torch

from .cache import LayerCache, allocate_caches, build_step, request_block_ids
from .config import preset
from .formats import WeightFormat
from .model import MiniMaxM3ForCausalLM
from .reference_model import model_forward
from .weights import random_model_weights

LOGITS_TOLERANCE = 2e-2  # per-row relative error of fp32 logits vs the reference (bf16 activations)
CACHE_TOLERANCE = 1e-2
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# torch.ops.minimax.<op>.<overload>; auto_functionalized prints its op as minimax.<op>.<overload>.
_OP_RE = re.compile(r"\bminimax\.(\w+)\.\w+")


def add_arguments(p: argparse.ArgumentParser) -> None:
    formats = [f.value for f in WeightFormat]
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default: cpu")
    p.add_argument("--preset", default="tiny", help="model config preset (default: tiny)")
    p.add_argument("--linear-format", choices=formats, default="mxfp8", help="qkv, o_proj, dense MLP (default: mxfp8)")
    p.add_argument("--expert-format", choices=formats, default="mxfp4", help="MoE experts (default: mxfp4)")
    p.add_argument("--kv-cache", choices=sorted(CACHE_DTYPES), default="bf16", help="KV cache dtype (default: bf16)")
    p.add_argument("--index-cache", choices=sorted(CACHE_DTYPES), default="bf16", help="index cache dtype")
    p.add_argument("--prompts", type=_lengths, default=[90, 37, 150],
                   help="comma-separated prompt lengths, one request each (default: 90,37,150)")
    p.add_argument("--steps", type=int, default=4, help="decode steps (default: 4)")
    p.add_argument("--query-len", type=int, default=1, help="tokens per request per decode step (default: 1)")
    p.add_argument("--pad-requests", type=int, default=1,
                   help="padding requests in each decode batch (seq_len 0, slot -1), as CUDA-graph batches have")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU intra-op threads while the demo runs (default 1: the tiny ops are too small to split)")


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 90,37,150, got {text!r}")
    return lengths


# ---- graph text -------------------------------------------------------------------------------------------


def op_counts(graph_text: str) -> collections.Counter:
    """torch.ops.minimax.<op> calls per op name in an FX graph's text (auto_functionalized included)."""
    return collections.Counter(_OP_RE.findall(graph_text))


def op_summary(before: str, after: str) -> str:
    b, a = op_counts(before), op_counts(after)
    names = sorted(set(b) | set(a), key=lambda n: (n.startswith("fused"), n))
    width = max([len(n) for n in names] + [24])
    lines = [f"  {'torch.ops.minimax.*':<{width}} before  after"]
    lines += [f"  {n:<{width}} {b[n]:>6} {a[n]:>6}" for n in names]
    lines.append(f"  {'total':<{width}} {sum(b.values()):>6} {sum(a.values()):>6}")
    return "\n".join(lines)


# ---- numerics ---------------------------------------------------------------------------------------------


def max_row_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)).max().item()


def cache_difference(got: list[LayerCache], want: list[LayerCache]) -> tuple[bool, float]:
    """(bitwise equal?, largest relative difference) over every layer's KV and index cache."""
    equal, worst = True, 0.0
    for g, w in zip(got, want):
        for a, b in ((g.kv, w.kv), (g.index, w.index)):
            if a is None:
                continue
            if torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                continue
            equal = False
            a, b = a.float().cpu(), b.float().cpu()
            worst = max(worst, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    return equal, worst


# ---- the run ----------------------------------------------------------------------------------------------


@dataclass
class Setup:
    config: object
    weights: object
    model: MiniMaxM3ForCausalLM
    caches: list[LayerCache]
    ref_caches: list[LayerCache]
    num_blocks: int
    generator: torch.Generator


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def build(args, prompts: list[int]) -> Setup:
    cfg = preset(args.preset)
    g = torch.Generator().manual_seed(args.seed)
    weights = random_model_weights(cfg, generator=g, device=args.device, linear_format=args.linear_format,
                                   expert_format=args.expert_format)
    model = MiniMaxM3ForCausalLM(cfg, weights).to(args.device)
    bs = cfg.sparse_block_size
    blocks = sum(-(-(p + args.steps * args.query_len) // bs) for p in prompts) + 2
    caches = allocate_caches(cfg, blocks, kv_dtype=CACHE_DTYPES[args.kv_cache],
                             index_dtype=CACHE_DTYPES[args.index_cache], device=args.device, generator=g)
    return Setup(cfg, weights, model, caches, [c.clone() for c in caches], blocks, g)


def load_pass():
    """(pass instance, None) or (None, why the fusion pass is unavailable)."""
    try:
        from graph_passes import MiniMaxM3DecodePass
    except ImportError as e:
        return None, f"graph_passes is not importable ({e}); compiling without the fused-decode pass"
    return MiniMaxM3DecodePass(record=True), None


def run(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("demo: --device cuda, but torch.cuda.is_available() is False")
        return 2
    if args.steps < 1 or args.query_len < 1 or args.pad_requests < 0:
        print("demo: --steps and --query-len must be >= 1, --pad-requests >= 0")
        return 2
    prompts = list(args.prompts)
    dev, q = args.device, args.query_len
    s = build(args, prompts)
    cfg, bs = s.config, s.config.sparse_block_size
    kinds = collections.Counter(cfg.layer_kinds)
    print(f"MiniMax-M3 '{args.preset}' preset, random weights on {dev}: {cfg.num_hidden_layers} layers "
          f"({kinds['dense']} dense, {kinds['sparse_moe']} sparse MoE), hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads x {cfg.head_dim}, "
          f"{cfg.num_local_experts} experts top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}")
    print(f"weights: linears {args.linear_format}, experts {args.expert_format}; caches: kv {args.kv_cache}, "
          f"index {args.index_cache}, {s.num_blocks} blocks of {bs} tokens, top-{cfg.sparse_topk_blocks} blocks")
    if dev == "cpu":
        print("on CPU the ops run their PyTorch reference implementations (Triton kernels need CUDA, or "
              "TRITON_INTERPRET=1 MINIMAX_OPS_CPU_KERNELS=1 for the interpreter)")

    # Prefill (eager model vs reference, separate caches): fills the caches the decode steps read.
    pre = build_step([0] * len(prompts), prompts, block_size=bs, num_blocks=s.num_blocks, device=dev,
                     generator=s.generator)
    ids = torch.randint(0, cfg.vocab_size, (sum(prompts),), generator=s.generator).to(dev)
    with torch.no_grad():
        got = s.model(ids, pre.positions, s.caches, pre)
        want = model_forward(ids, s.weights, s.ref_caches, pre, cfg)
    last = [sum(prompts[:i + 1]) - 1 for i in range(len(prompts))]
    prefill_err = max_row_rel_error(got[last], want[last])
    prefill_ok = prefill_err < LOGITS_TOLERANCE
    print(f"prefill: {len(prompts)} requests of {prompts} tokens, eager model vs reference: max rel error of "
          f"last-token logits {prefill_err:.2e} ({'ok' if prefill_ok else 'FAIL'})")

    decode_pass, why = load_pass()
    if why:
        print(f"NOTE: {why}")
    options = {"post_grad_custom_post_pass": decode_pass} if decode_pass is not None else {}
    torch._dynamo.reset()  # a fresh compile (and recompile budget), whatever this process compiled before
    compiled = torch.compile(s.model, fullgraph=True, options=options)
    print(f"decode: {args.steps} steps of {len(prompts)} requests x query_len {q} + {args.pad_requests} padding "
          f"request(s) = {(len(prompts) + args.pad_requests) * q} tokens/step, compiled (fullgraph, fused-decode "
          f"pass) vs eager reference")
    # Compile caches off: a cache hit would skip the pass (nothing recorded) and hide the compile time.
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        ok, times, last_step = decode(args, s, compiled, pre, prompts)
    ok &= prefill_ok

    if decode_pass is not None:
        print(f"\ngraph pass: {decode_pass.calls} graph(s) compiled, {decode_pass.rewrites} decode layer(s) fused "
              f"of {cfg.num_hidden_layers}")
        if decode_pass.graphs:
            before, after = decode_pass.graphs[-1]
            print("decode graph, before -> after the pass:")
            print(op_summary(before, after))
        else:
            print("the pass recorded no graph (was it called?)")
            ok = False
    print(f"\ntiming: compile + first step {times['compile']:.1f}s; compiled step {_ms(times['compiled'])}; "
          f"eager reference step {_ms(times['reference'])}")
    if dev == "cuda":
        _cuda_speedup(s, compiled, last_step)
    else:
        print("(on CPU both sides run the PyTorch reference ops: these times say nothing about the kernels)")
    print(f"\nresult: {'OK' if ok else 'FAILED (see above)'} in {time.perf_counter() - start:.0f}s")
    return 0 if ok else 1


def decode(args, s: Setup, compiled, pre, prompts: list[int]):
    """The decode steps, compiled model vs reference on separate caches: (ok, timings, last step)."""
    cfg, bs, dev, q = s.config, s.config.sparse_block_size, args.device, args.query_len
    block_ids, ctx = request_block_ids(pre, bs), list(prompts)
    real = len(prompts) * q  # rows of real requests; padding rows follow and are not compared
    ok, times = True, {"compile": 0.0, "compiled": [], "reference": []}
    for step in range(args.steps):
        # Same table width every step, so shapes stay fixed and the graph compiles once.
        meta = build_step(ctx, q, block_size=bs, num_blocks=s.num_blocks, block_ids=block_ids,
                          pad_requests=args.pad_requests, table_width=s.num_blocks, device=dev,
                          generator=s.generator)
        tokens = torch.randint(0, cfg.vocab_size, (meta.num_tokens,), generator=s.generator).to(dev)
        with torch.no_grad():
            got, seconds = _timed(lambda: compiled(tokens, meta.positions, s.caches, meta), dev)
            want, ref_seconds = _timed(lambda: model_forward(tokens, s.weights, s.ref_caches, meta, cfg), dev)
        if step == 0:
            times["compile"] = seconds
        else:
            times["compiled"].append(seconds)
        times["reference"].append(ref_seconds)
        err = max_row_rel_error(got[:real], want[:real])
        equal, diff = cache_difference(s.caches, s.ref_caches)
        caches_ok = equal or diff < CACHE_TOLERANCE
        ok &= err < LOGITS_TOLERANCE and caches_ok
        print(f"  step {step}: context {ctx} -> max rel error of logits {err:.2e} "
              f"({'ok' if err < LOGITS_TOLERANCE else 'FAIL'}, limit {LOGITS_TOLERANCE:g}); caches "
              + ("equal (bitwise)" if equal else f"differ by {diff:.2e} ({'ok' if caches_ok else 'FAIL'})"))
        block_ids, ctx = request_block_ids(meta, bs), [c + q for c in ctx]
    return ok, times, (tokens, meta)


def _ms(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:.1f} ms (median of {len(times)})" if times else "n/a"


def _cuda_speedup(s: Setup, fused, step) -> None:
    """Fused compiled step vs the same model compiled without the pass, on scratch caches."""
    tokens, meta = step
    unfused = torch.compile(s.model, fullgraph=True)
    scratch = [c.clone() for c in s.caches]

    def median_ms(fn, iters: int = 20) -> float:
        with torch.no_grad():
            for _ in range(3):
                fn()
            times = []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        return statistics.median(times)

    t_fused = median_ms(lambda: fused(tokens, meta.positions, scratch, meta))
    t_unfused = median_ms(lambda: unfused(tokens, meta.positions, scratch, meta))
    print(f"cuda: fused compiled step {t_fused:.3f} ms, unfused compiled step {t_unfused:.3f} ms "
          f"-> speedup {t_unfused / t_fused:.2f}x (no CUDA graphs; launch overhead included)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minimax_ops demo", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))
