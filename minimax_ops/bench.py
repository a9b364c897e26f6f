"""Benchmark of a real-size sparse MoE decode layer: the fused op against the unfused path.

    python -m minimax_ops bench [--tokens 1,2,4,8,16] [--contexts 4096,32768,131072] [--layers 4]
                                [--experts mxfp8,mxfp4] [--tp 1] [--out BENCHMARKS.md] [--png bench.png]

``--tp N`` (default 1) times one rank of a tensor-parallel deployment on this one GPU: the rank's shapes
(sharding.local_config: heads, kv heads and expert intermediates divided) and the layer's two all-reduces
where a TP > 1 model places them, so that the fused op takes its TP > 1 form (no fold across an all-reduce).
The all-reduces run over a one-rank NCCL group (no link traffic: a stand-in for the real collective, whose
cost a deployment adds to both paths alike).

Per (expert format, tokens, context) it times, from CUDA-graph replay, the fused op
(``fused_decode_layer``) and the unfused chain of vocabulary ops, and the unfused chain run eagerly
(and compiled, with --compile). Times are per layer inside one CUDA graph of ``--layers`` consecutive
sparse MoE layers (distinct weights and caches, each layer fed the previous one's output, all on the
step's metadata), as a model step runs them: there a layer pays no graph-launch boundary, and the
fused op's first kernel starts as a programmatic dependent of the previous layer's last one. The
last two columns time a graph of the first layer alone (what earlier runs reported), where every
replay pays that boundary. Bytes that must move are counted from the step itself, per layer (the
mean over the layers, whose routing differs): qkv+index and o_proj weights, the router, the distinct
experts the step's tokens chose plus the shared expert, the KV rows of the blocks each (request, kv
head) selected, the index keys of every request, and activations. Achieved TB/s is bytes / fused
time per layer; % is against a device-to-device copy measured in the same run. Requests have
query_len 1 (one token each), fp8 KV and index caches. Weights are in the layout a deployment loads
(weights.to_kernel_layout; ``--layout tiled`` / ``canonical``), the same for the fused op and the
unfused chain; "launches" counts the kernels one fused call (one layer) runs (profiler). ``--stages``
also times each stage alone, in a chain of its own, and inside the fused layers (timeline.py).
MINIMAX_OPS_NO_PDL=1 turns off programmatic dependent launch.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import timeline
from .cache import LayerCache, allocate_caches, build_step
from .config import preset
from .model import MiniMaxM3DecoderLayer
from .ops.chain import SPARSE_WEIGHTS
from .sharding import ShardingError, local_config
from .weights import random_layer_weights, to_kernel_layout

LAYER = 3  # the first sparse MoE layer of the real config
ROUNDS = 3  # alternating fused / unfused timings per case
LAYERS = 4  # consecutive layers per timed graph (--layers)
_SHARED_EXPERT = tuple(k for k in SPARSE_WEIGHTS if k.startswith("shared_"))  # (moe_experts' argument order)


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def copy_bandwidth(device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (_time(lambda: dst.copy_(src), graph=False) * 1e-6)


WARM_SECONDS = 0.25  # busy time before timing: the first ~0.1 s after a pause measured up to 6% slow


def _time(fn, *, graph: bool, iters: int = 30, reps: int = 10) -> float:
    """Median microseconds per call (CUDA events around ``reps`` back-to-back calls, so launch
    latency between calls is what a decode loop would see), from graph replay when graph=True,
    after WARM_SECONDS of calls (a GPU that was idle runs its first calls slower)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    warm_until = time.perf_counter() + WARM_SECONDS
    while time.perf_counter() < warm_until:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def kernel_launches(fn) -> int | None:
    """GPU kernels one call of fn launches (memory copies and fills excluded); None without a profiler."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return len(timeline.kernel_events(prof))
    except Exception:  # noqa: BLE001 (a missing CUPTI only loses the column)
        return None


def step_bytes(layer: MiniMaxM3DecoderLayer, cache: LayerCache, meta, topk_ids, block_ids) -> int:
    """The fewest bytes one step of this layer must move (each input read once, outputs written once)."""
    c, n = layer.config, meta.num_tokens
    total = sum(_bytes(getattr(layer, name)) for name in ("qkv", "qkv_scale", "o_proj", "o_proj_scale", "gate",
                                                          "gate_bias", "input_norm", "post_norm"))
    total += expert_bytes(layer, topk_ids)
    row = 2 * c.head_dim * cache.kv.element_size()
    seq = meta.seq_lens.tolist()
    q = meta.query_len
    for r in range(n // q):
        for h in range(c.num_key_value_heads):
            blocks = {b for b in block_ids[r * q:(r + 1) * q, h].flatten().tolist() if b >= 0}
            total += sum(min(c.sparse_block_size, seq[r] - b * c.sparse_block_size) for b in blocks) * row
        total += seq[r] * c.sparse_index_dim * cache.index.element_size()
    total += 4 * n * c.hidden_size * 2  # x, residual in; out, residual out (bf16)
    total += n * (2 * c.kv_size + c.sparse_index_dim) * cache.kv.element_size()  # cache writes
    return total


def layer_chain(layers, caches, x, residual, meta, *, fused: bool):
    """One step through the layers in order (fused ops or the unfused chain), each fed the previous
    one's (out, residual), all on the step's metadata, as a model step runs them."""
    def run():
        h, r = x, residual
        for layer, cache in zip(layers, caches):
            h, r = (layer.fused_forward(h, r, meta.positions, cache, meta) if fused
                    else layer(h, r, meta.positions, cache, meta, True))
        return h, r
    return run


def step_inputs(layers, caches, meta) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, residual) bf16 of the step the benchmark times (seeded: every timing of a case sees the same)."""
    gen = torch.Generator(caches[0].kv.device).manual_seed(0)
    x = torch.randn(meta.num_tokens, layers[0].config.hidden_size, generator=gen,
                    device=caches[0].kv.device).to(torch.bfloat16)
    return x, torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16)


def bench_case(layers, caches, meta, *, compile_unfused: bool):
    """Microseconds per layer of the chain of all the layers, and of the first layer alone in its own
    graph (the ``*_1layer_us`` keys); bytes per layer; fused kernel launches of one layer."""
    depth = len(layers)
    x, residual = step_inputs(layers, caches, meta)
    fused, unfused = (layer_chain(layers, caches, x, residual, meta, fused=f) for f in (True, False))
    timed = {"fused_us": fused, "unfused_graph_us": unfused}
    if depth > 1:
        timed["fused_1layer_us"], timed["unfused_1layer_us"] = (
            layer_chain(layers[:1], caches[:1], x, residual, meta, fused=f) for f in (True, False))
    # All graphs alternate over ROUNDS (medians of the rounds): none gets the warmer GPU.
    rounds = [{k: _time(fn, graph=True) for k, fn in timed.items()} for _ in range(ROUNDS)]
    row = {k: statistics.median(r[k] for r in rounds) / (1 if "1layer" in k else depth) for k in timed}
    if depth == 1:
        row["fused_1layer_us"], row["unfused_1layer_us"] = row["fused_us"], row["unfused_graph_us"]
    row["unfused_eager_us"] = _time(unfused, graph=False, iters=5) / depth
    if compile_unfused:
        compiled = torch.compile(unfused, fullgraph=True)
        row["unfused_compiled_us"] = _time(compiled, graph=True) / depth
    row["launches"] = kernel_launches(layer_chain(layers[:1], caches[:1], x, residual, meta, fused=True))
    row["bytes"] = chain_bytes(layers, caches, x, residual, meta)
    return row


class _StepChoices(TorchDispatchMode):
    """Records, in call order, the expert ids of every ``minimax.route`` and the block ids of every
    ``minimax.index_topk`` that runs under it (the unfused chain calls each once per sparse layer)."""

    def __init__(self):
        super().__init__()
        self.ids: list[torch.Tensor] = []
        self.blocks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name == "minimax::route":
            self.ids.append(out[1].cpu())
        elif name == "minimax::index_topk":
            self.blocks.append(out.cpu())
        return out


def chain_choices(layers, caches, x, residual, meta) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(expert ids, block ids) of each layer of the step the benchmark times, read from one eager run
    of the unfused chain on the same inputs (the fused op computes the same choices up to rounding)."""
    with _StepChoices() as seen:
        layer_chain(layers, caches, x, residual, meta, fused=False)()
    if len(seen.ids) != len(layers) or len(seen.blocks) != len(layers):
        raise RuntimeError(f"expected one route and one index_topk per layer, saw {len(seen.ids)} / "
                           f"{len(seen.blocks)} for {len(layers)} layers")
    return seen.ids, seen.blocks


def chain_bytes(layers, caches, x, residual, meta) -> float:
    """step_bytes per layer (mean over the chain) of the step the benchmark times (``chain_choices``)."""
    ids, blocks = chain_choices(layers, caches, x, residual, meta)
    return statistics.mean(step_bytes(layer, cache, meta, i, b)
                           for layer, cache, i, b in zip(layers, caches, ids, blocks))


def expert_bytes(layer: MiniMaxM3DecoderLayer, topk_ids: torch.Tensor) -> int:
    """Expert weights a step of this layer streams: the distinct routed experts chosen, and the shared one."""
    routed = sum(_bytes(t[0]) for t in (layer.w13, layer.w13_scale, layer.w2, layer.w2_scale) if t is not None)
    return routed * len(torch.unique(topk_ids)) + sum(_bytes(getattr(layer, k)) for k in _SHARED_EXPERT)


def fused_stages(layers, caches, meta) -> list[tuple[str, float, int]]:
    """(stage, us it adds to a fused layer, weight bytes it streams) in a graph of the chained fused
    layers (timeline.fused_stage_times: time between kernel ends, median over replays and the layers
    after the first; bytes: the mean over those layers)."""
    x, residual = step_inputs(layers, caches, meta)
    ids, _ = chain_choices(layers, caches, x, residual, meta)
    lay = layers[0]
    weights = {timeline.QKV: _bytes(lay.qkv) + _bytes(lay.qkv_scale),
               timeline.O_PROJ: _bytes(lay.o_proj) + _bytes(lay.o_proj_scale), timeline.ROUTER: _bytes(lay.gate),
               timeline.EXPERTS: statistics.mean(expert_bytes(layer, i) for layer, i in zip(layers[1:], ids[1:]))}
    times = timeline.fused_stage_times(layer_chain(layers, caches, x, residual, meta, fused=True), len(layers))
    return [(stage, us, int(weights.get(stage, 0))) for stage, us in times.items()]


def layer_caches(cfg, count: int, max_tokens: int, max_context: int, device) -> tuple[list[LayerCache], int]:
    """(fp8 KV + index caches of ``count`` consecutive sparse MoE layers from LAYER on, with random contents,
    their block count) for steps of up to max_tokens requests of up to max_context tokens."""
    blocks = max_tokens * (max_context // cfg.sparse_block_size + 1) + 8
    # The dense layers before LAYER are allocated (and dropped) too: layer LAYER's cache is then drawn
    # as in earlier single-layer runs.
    sparse = (0,) * LAYER + (1,) * count
    caches = allocate_caches(cfg.replace(num_hidden_layers=LAYER + count, moe_layer_freq=sparse,
                                         sparse_attention_freq=sparse), blocks,
                             kv_dtype=torch.float8_e4m3fn, index_dtype=torch.float8_e4m3fn, device=device,
                             fill="random")
    return caches[LAYER:], blocks


def build_layers(cfg, fmt: str, count: int, layout: str, generator, device,
                 group_name: str = "") -> list[MiniMaxM3DecoderLayer]:
    """``count`` sparse MoE layers of random weights (the first drawn, the rest its copies: drawing and
    quantising a real-size expert table is slow, and what a chain needs is that no layer finds another's
    weights in L2), indexed LAYER, LAYER + 1, ... (layer_index only labels checked-mode reports);
    ``group_name``: their all-reduce group ("" none: TP 1)."""
    weights = random_layer_weights(cfg, LAYER, linear_format="mxfp8", expert_format=fmt, generator=generator,
                                   device=device)
    if layout != "canonical":
        weights = to_kernel_layout(weights, tiled=layout == "tiled", mma=None if layout == "kernel" else False)
    copies = [weights] + [weights.map(torch.Tensor.clone) for _ in range(count - 1)]  # (same strides)
    return [MiniMaxM3DecoderLayer(cfg, w, LAYER + i, group_name).to(device) for i, w in enumerate(copies)]


def one_rank_group() -> str:
    """The name of a one-rank NCCL process group (this process, WORLD), initialised here if need be: the
    all-reduce group of ``--tp`` layers on one GPU."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    if dist.get_world_size() != 1:
        raise RuntimeError(f"bench --tp: expected a one-rank group, this process is in {dist.get_world_size()}")
    return dist.group.WORLD.group_name


def stage_breakdown(layers, caches, meta) -> list[tuple[str, float, float, int]]:
    """(stage, us alone, us per call in a chain, bytes of weights a call streams) for each vocabulary op
    and the fused op's indexer + attention kernels (launched as the fused op launches them). "Alone":
    a graph of one call, replayed (launch gaps included, as earlier runs reported); "chain": a graph
    of one call per layer copy (distinct weights and caches, so L2 holds none of a call's bytes),
    divided by the copies: the kernels' own time, as they run back to back in a model step."""
    from .kernels.decode_layer import kernel_stages  # (CUDA only: the stage kernels)
    mm, c = torch.ops.minimax, layers[0].config
    n = meta.num_tokens
    x = torch.randn(n, c.hidden_size, device=caches[0].kv.device).to(torch.bfloat16)
    ins = []
    for layer, cache in zip(layers, caches):
        qkv = mm.mx_linear(x, layer.qkv, layer.qkv_scale)
        q, iq = mm.qk_norm_rope_kv_index_insert(
            qkv, meta.positions, meta.slot_mapping, meta.index_slot_mapping, layer.q_norm, layer.k_norm,
            layer.index_q_norm, layer.index_k_norm, cache.kv, cache.index, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.rotary_dim, c.rope_theta, c.rms_norm_eps, c.sparse_num_index_heads,
            c.sparse_index_dim)
        ids = mm.index_topk(iq, cache.index, meta.block_table, meta.seq_lens, meta.query_len, c.sparse_topk_blocks)
        attn = mm.sparse_attention_decode(q, cache.kv, meta.block_table, meta.seq_lens, ids, meta.query_len, 1.0, 1.0)
        w, e = mm.route(x, layer.gate, layer.gate_bias, c.num_experts_per_tok, c.routed_scaling_factor)
        ins.append(dict(layer=layer, cache=cache, qkv=qkv, q=q, iq=iq, ids=ids, attn=attn, w=w, e=e))
    experts = statistics.mean(expert_bytes(d["layer"], d["e"]) for d in ins)
    lay = layers[0]
    stages = [
        ("add_rmsnorm", lambda d: mm.add_rmsnorm(x, x, d["layer"].input_norm, c.rms_norm_eps), 0),
        ("mx_linear qkv", lambda d: mm.mx_linear(x, d["layer"].qkv, d["layer"].qkv_scale),
         _bytes(lay.qkv) + _bytes(lay.qkv_scale)),
        ("qk_norm_rope_kv_index_insert", lambda d: mm.qk_norm_rope_kv_index_insert(
            d["qkv"], meta.positions, meta.slot_mapping, meta.index_slot_mapping, d["layer"].q_norm,
            d["layer"].k_norm, d["layer"].index_q_norm, d["layer"].index_k_norm, d["cache"].kv, d["cache"].index,
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim, c.rope_theta, c.rms_norm_eps,
            c.sparse_num_index_heads, c.sparse_index_dim), 0),
        ("index_topk", lambda d: mm.index_topk(d["iq"], d["cache"].index, meta.block_table, meta.seq_lens,
                                               meta.query_len, c.sparse_topk_blocks), 0),
        ("sparse_attention_decode", lambda d: mm.sparse_attention_decode(
            d["q"], d["cache"].kv, meta.block_table, meta.seq_lens, d["ids"], meta.query_len, 1.0, 1.0), 0),
        # The fused op's form of the two stages above: score pass, then attention selecting in-kernel.
        ("index + attention, fused form", lambda d: kernel_stages().index_sparse_attention(
            d["q"], d["iq"], d["cache"].kv, d["cache"].index, meta.block_table, meta.seq_lens, meta.query_len,
            c.sparse_topk_blocks, 1.0, 1.0), 0),
        ("mx_linear o_proj", lambda d: mm.mx_linear(d["attn"], d["layer"].o_proj, d["layer"].o_proj_scale),
         _bytes(lay.o_proj) + _bytes(lay.o_proj_scale)),
        ("route", lambda d: mm.route(x, d["layer"].gate, d["layer"].gate_bias, c.num_experts_per_tok,
                                     c.routed_scaling_factor), _bytes(lay.gate)),
        ("moe_experts", lambda d: mm.moe_experts(
            x, d["e"], d["w"], d["layer"].w13, d["layer"].w13_scale, d["layer"].w2, d["layer"].w2_scale,
            *(getattr(d["layer"], k) for k in _SHARED_EXPERT), c.num_local_experts, c.swiglu_alpha, c.swiglu_limit),
         experts),
    ]
    return [(name, _time(lambda: fn(ins[0]), graph=True),
             _time(lambda: [fn(d) for d in ins], graph=True) / len(ins), nbytes) for name, fn, nbytes in stages]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minimax_ops bench", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--experts", default="mxfp4,mxfp8")
    ap.add_argument("--layers", type=int, default=LAYERS,
                    help="consecutive layers (distinct weights and caches) per timed graph; times are per layer")
    ap.add_argument("--tp", type=int, default=1,
                    help="time one rank of this tensor-parallel degree: its shapes, and its two all-reduces over a "
                         "one-rank group (default 1: the whole layer)")
    ap.add_argument("--compile", action="store_true", help="also time the unfused chain under torch.compile")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--png", default=None, help="plot %% of copy bandwidth against tokens here")
    ap.add_argument("--stages", action="store_true",
                    help="also time each stage: alone, per call in a chain of the layer copies, and (with --layers "
                         "> 1) inside the fused layers (time between kernel ends, profiler) (first context)")
    ap.add_argument("--layout", choices=("kernel", "words", "tiled", "canonical"), default="kernel",
                    help="weights: weights.to_kernel_layout (kernel: the mxfp4_mma / mxfp8_mma layouts), the same "
                         "without them (MXFP4 as words), tiled, or the checkpoint's")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error("--layers: expected at least 1")
    try:
        cfg = local_config(preset("real"), args.tp)
    except ShardingError as e:
        ap.error(f"--tp: {e}")
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    tokens = [int(t) for t in args.tokens.split(",")]
    contexts = [int(t) for t in args.contexts.split(",")]
    group_name = one_rank_group() if args.tp > 1 else ""
    bw = copy_bandwidth(device)
    note = f"{timing_note(args.layers)} {shapes_note(cfg, args.tp)}"
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s. {note}", flush=True)
    caches, blocks = layer_caches(cfg, args.layers, max(tokens), max(contexts), device)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for fmt in args.experts.split(","):
        layers = build_layers(cfg, fmt, args.layers, args.layout, gen, device, group_name)
        for ctx in contexts:
            for n in tokens:
                meta = build_step([ctx - 1] * n, 1, block_size=cfg.sparse_block_size, num_blocks=blocks,
                                  device=device, generator=gen)
                row = bench_case(layers, caches, meta,
                                 compile_unfused=args.compile and ctx == contexts[len(contexts) // 2] and n in (1, 16))
                row.update(experts=fmt, tokens=n, context=ctx)
                row["tbps"] = row["bytes"] / (row["fused_us"] * 1e-6) / 1e12
                row["pct"] = 100 * row["bytes"] / (row["fused_us"] * 1e-6) / bw
                row["floor_us"] = row["bytes"] / bw * 1e6
                rows.append(row)
                print(format_row(row), flush=True)
                if args.stages and ctx == contexts[0]:
                    for name, alone, chained, nbytes in stage_breakdown(layers, caches, meta):
                        rate = (f" ({nbytes / (alone * 1e-6) / 1e12:.2f} / {nbytes / (chained * 1e-6) / 1e12:.2f} "
                                f"TB/s of weights)") if nbytes else ""
                        print(f"    stage {name:30s} alone {alone:6.1f} us, in a chain {chained:6.1f} us{rate}",
                              flush=True)
                    if args.layers > 1:
                        for name, us, nbytes in fused_stages(layers, caches, meta):
                            rate = f" ({nbytes / (us * 1e-6) / 1e12:.2f} TB/s of weights)" if nbytes and us > 0 else ""
                            print(f"    fused layer: {name:30s} {us:6.1f} us{rate}", flush=True)
        del layers
        if args.compile:
            torch._dynamo.reset()  # compiled chains may hold this format's layers
        torch.cuda.empty_cache()
    table = format_table(rows, bw)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Benchmarks\n\n{datetime.date.today()}, {torch.cuda.get_device_name()}, torch "
                    f"{torch.__version__}, triton {_triton_version()}. {note}\n\n"
                    f"Command: `python -m minimax_ops bench {' '.join(argv or sys.argv[1:])}`\n\n{table}\n")
    if args.png:
        plot(rows, args.png, args.layers)
    return 0


def timing_note(layers: int) -> str:
    """What the table's times are, for its header."""
    if layers == 1:
        return ("Times are of one sparse MoE layer alone in a CUDA graph (what earlier runs reported; the last two "
                "columns repeat them).")
    return (f"Times are per layer inside a CUDA graph of {layers} consecutive sparse MoE layers (distinct weights "
            "and caches, each layer fed the previous one's output, as a model step runs them); the last two "
            "columns are a graph of the one layer alone (what earlier runs reported).")


def shapes_note(c, tp: int) -> str:
    """What the table's layer is (``c``: the rank's config, tensor-parallel degree ``tp``), for its header."""
    if tp == 1:
        return "One whole layer (TP 1)."
    return (f"One rank of TP {tp}: its shapes ({c.num_attention_heads} q heads, {c.num_key_value_heads} kv head(s), "
            f"expert intermediate {c.intermediate_size}) and its two all-reduces over a one-rank NCCL group (no "
            f"link traffic; the real collective adds the same to both paths).")


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "absent"


HEADER = ("| experts | tokens | context | fused us | floor us | MB moved | TB/s | % of copy BW | unfused graph us | "
          "unfused eager us | unfused compiled us | speedup vs graph | speedup vs eager | launches | "
          "fused us, 1-layer graph | unfused us, 1-layer graph |")


def format_row(r: dict) -> str:
    comp = f"{r['unfused_compiled_us']:.1f}" if "unfused_compiled_us" in r else "-"
    return (f"| {r['experts']} | {r['tokens']} | {r['context'] // 1024}k | {r['fused_us']:.1f} | {r['floor_us']:.1f} | "
            f"{r['bytes'] / 1e6:.1f} | {r['tbps']:.2f} | {r['pct']:.0f}% | {r['unfused_graph_us']:.1f} | "
            f"{r['unfused_eager_us']:.1f} | {comp} | {r['unfused_graph_us'] / r['fused_us']:.2f}x | "
            f"{r['unfused_eager_us'] / r['fused_us']:.2f}x | {r.get('launches') or '-'} | "
            f"{r['fused_1layer_us']:.1f} | {r['unfused_1layer_us']:.1f} |")


def format_table(rows: list[dict], bw: float) -> str:
    sep = "|" + "|".join("---" for _ in HEADER.split("|")[1:-1]) + "|"
    lines = [f"Copy bandwidth measured in this run: {bw / 1e12:.2f} TB/s.", "", HEADER, sep]
    lines += [format_row(r) for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], path: str, layers: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["experts"], r["context"]) for r in rows}):
        pts = [r for r in rows if (r["experts"], r["context"]) == key]
        ax.plot([r["tokens"] for r in pts], [r["pct"] for r in pts], marker="o", label=f"{key[0]}, {key[1] // 1024}k")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step")
    ax.set_ylabel("% of measured copy bandwidth")
    ax.set_title(f"fused_decode_layer per MiniMax-M3 sparse MoE layer, graph of {layers} layers, TP 1")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
