"""Where a fused layer's time goes: its kernels' timeline inside a CUDA-graph replay (profiler), and
from it the time each stage adds to the layer, "time between kernel ends".

Under programmatic dependent launch a kernel starts (and reads its first weights) while its
predecessor runs, so a kernel's own duration overstates what it costs the layer; what it adds is the
time from its predecessor's end to its own end. Summed over a stage's kernels (the experts: slot
table, w13, w2, combine) that is the stage's share of the layer, and a weight-streaming stage's
bytes over it the rate it streams at inside the layer (its first load step, read before its wait,
is counted in the stage). Used by ``python -m minimax_ops bench --stages`` and benchmarks/ab_fused.py.
"""

from __future__ import annotations

import statistics

import torch

QKV, ATTENTION, O_PROJ, ROUTER, EXPERTS = ("qkv + qk norm / RoPE / insert", "index + top-k + attention", "o_proj",
                                          "router", "experts")
INPUT_NORM, POST_NORM = "input norm", "post-attention norm"
STAGE_ORDER = (INPUT_NORM, QKV, ATTENTION, O_PROJ, POST_NORM, ROUTER, EXPERTS)
# Stage of each kernel a fused layer launches, by the kernel's name (the first match; order matters).
# The two norms of a layer are told apart by their order (the first is the input norm; one-token steps that defer
# the post norm into o_proj, the router and w13 launch only the input norm).
_STAGES = (
    ("_qkv_norm_rope_insert_kernel", QKV),
    ("_qk_norm_rope", QKV),
    ("_index_", ATTENTION),
    ("_attention_", ATTENTION),
    ("_router_", ROUTER),
    ("_slot_table_kernel", EXPERTS),
    ("_w13_kernel", EXPERTS),
    ("_w2_kernel", EXPERTS),
    ("_moe_combine_kernel", EXPERTS),
    ("_rmsnorm_kernel", "norm"),
    ("linear", O_PROJ),  # (a GEMV before the layer's attention kernels is the qkv one: layer_stage_times)
)
REPLAY_GAP_US = 30.0  # idle time that separates two replays (kernels of one replay follow within a few us)


def kernel_events(prof) -> list:
    """The GPU kernels of a finished torch.profiler run (memory copies and fills excluded), by start."""
    from torch.autograd import DeviceType
    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA
                   and not any(w in e.name.lower() for w in ("memcpy", "memset"))), key=lambda e: e.time_range.start)


def kernel_timelines(fn, replays: int = 10) -> list[list[tuple[str, float, float]]]:
    """Per replay of a CUDA graph of fn: (kernel, start us, end us) of each kernel, in launch order,
    relative to the replay's first kernel. The graph is captured inside the profiled region (kernels
    of a graph captured before it are not traced one by one); the first replay is dropped."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        for _ in range(replays + 1):
            g.replay()
            torch.cuda.synchronize()
    ev = kernel_events(prof)
    # Replays are told apart by the idle GPU between them (each waits for the host): a kernel that
    # starts more than REPLAY_GAP_US after every earlier one ended begins a replay.
    runs, last_end = [], float("-inf")
    for e in ev:
        if e.time_range.start - last_end > REPLAY_GAP_US:
            runs.append([])
        runs[-1].append(e)
        last_end = max(last_end, e.time_range.end)
    runs = runs[-replays:]  # (the first replay may carry one-time work)
    if len(runs) != replays or len({len(r) for r in runs}) != 1:
        raise RuntimeError(f"profiler: expected {replays} replays of one graph after the first, found kernel runs of "
                           f"{[len(r) for r in runs]}")
    out = []
    for run in runs:
        t0 = run[0].time_range.start
        out.append([(e.name, e.time_range.start - t0, e.time_range.end - t0) for e in run])
    return out


def stage_of(kernel: str) -> str:
    """The stage a fused-layer kernel belongs to (see _STAGES), or its own name."""
    return next((stage for key, stage in _STAGES if key in kernel), kernel)


def layer_stage_times(run: list[tuple[str, float, float]], layers: int) -> list[dict[str, float]]:
    """Per layer of one replay of ``layers`` consecutive fused layers but the first (whose first
    kernel has no predecessor in the graph): {stage: us between the ends of its kernels and of the
    kernels before them}, plus "layer" (the layer's whole share)."""
    if len(run) % layers:
        raise ValueError(f"{len(run)} kernels do not split into {layers} layers")
    per = len(run) // layers
    out = []
    for layer in range(1, layers):
        times: dict[str, float] = {}
        norms = 0
        for i in range(layer * per, (layer + 1) * per):
            stage = stage_of(run[i][0])
            if stage == "norm":
                stage = INPUT_NORM if norms == 0 else POST_NORM
                norms += 1
            elif stage == O_PROJ and ATTENTION not in times:  # (steps whose qkv GEMV is a kernel of its own)
                stage = QKV
            times[stage] = times.get(stage, 0.0) + run[i][2] - run[i - 1][2]
        times["layer"] = run[(layer + 1) * per - 1][2] - run[layer * per - 1][2]
        out.append(times)
    return out


def fused_stage_times(fn, layers: int, replays: int = 10) -> dict[str, float]:
    """{stage: median us it adds to a fused layer} over the replays and the layers after the first,
    from a graph of fn (``layers`` consecutive fused layers)."""
    return stage_medians(kernel_timelines(fn, replays), layers)


def stage_medians(runs: list[list[tuple[str, float, float]]], layers: int) -> dict[str, float]:
    """fused_stage_times from replays already traced (``kernel_timelines``)."""
    samples = [t for run in runs for t in layer_stage_times(run, layers)]
    keys = [k for k in (*STAGE_ORDER, "layer") if any(k in s for s in samples)]
    keys += sorted({k for s in samples for k in s} - set(keys))
    return {k: statistics.median(s.get(k, 0.0) for s in samples) for k in keys}
