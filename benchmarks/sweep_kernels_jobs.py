"""The jobs of benchmarks/sweep_kernels.py: the real sizes, the read-pattern kernel, the tile grids, the sweep's
random tensors (``Env``) and one launch of a job (``call``), with the bytes it must read (``nbytes``).
"""

from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl

H, I, E, TOPK = 6144, 3072, 128, 4
LIN_SHAPES = [(9856, 6144), (6144, 8192)]  # qkv+index, o_proj (MXFP8)
R_MOE = 3  # routings per moe graph
LIN_COPIES = 4
ROUTE_COPIES = 24  # 24 x 3 MB fp32 gates > L2


# ---- read patterns -----------------------------------------------------------------------------------------



@triton.jit
def _read_pattern_kernel(w_ptr, out_ptr, row_words, iters_per_split,
                         ROWS: tl.constexpr, WORDS: tl.constexpr, CHUNKS: tl.constexpr):
    """Reads a [N, row_words] int32 matrix the way a GEMV tile loop does: program (row tile, K split)
    loads ROWS x WORDS words per chunk, CHUNKS consecutive chunks per loop step; no arithmetic
    beyond an xor, so the time is the memory system's for that access pattern."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * ROWS + tl.arange(0, ROWS)
    k0 = pid_k * iters_per_split * CHUNKS * WORDS
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * row_words + (k0 + tl.arange(0, WORDS))[None, :]
    acc = tl.zeros([ROWS, WORDS], dtype=tl.int32)
    for _ in range(iters_per_split):
        for c in tl.static_range(CHUNKS):
            acc ^= tl.load(ptrs + c * WORDS)
        ptrs += CHUNKS * WORDS
    tl.store(out_ptr + pid_n * tl.num_programs(1) + pid_k, tl.max(tl.max(acc, axis=1), axis=0))


# (rows per tile, bytes per row per chunk, chunks per step, K splits, num_stages)
PATTERNS = [(64, 256, 1, 4, 3), (64, 256, 1, 4, 2), (128, 128, 1, 4, 3), (64, 256, 4, 1, 2), (64, 256, 4, 2, 2),
            (64, 128, 8, 2, 2), (128, 128, 4, 3, 2), (16, 1024, 1, 2, 3), (32, 1024, 1, 2, 2), (64, 1024, 1, 2, 2),
            (8, 2048, 3, 1, 2), (16, 1024, 3, 2, 2), (64, 512, 1, 4, 3), (64, 512, 2, 2, 2)]


def pattern_call(job, env, rep):
    rows, row_bytes, chunks, split, stages = job["pattern"]
    n, k = LIN_SHAPES[0]
    w, _ = env.lin(n, k, rep % LIN_COPIES)
    words = w.view(torch.int32)
    row_words = words.shape[1]
    step = row_bytes // 4 * chunks
    iters = row_words // step
    out = torch.empty(triton.cdiv(n, rows) * split, dtype=torch.int32, device=w.device)
    _read_pattern_kernel[(n // rows, split)](words, out, row_words, iters // split, ROWS=rows, WORDS=row_bytes // 4,
                                              CHUNKS=chunks, num_warps=4, num_stages=stages)
    return out


def pattern_jobs():
    return [{"kind": "pattern", "pattern": p, "label": f"read rows{p[0]} {p[1]}B x{p[2]} split{p[3]} stages{p[4]}"}
            for p in PATTERNS]


# ---- grids -------------------------------------------------------------------------------------------------

def lin_grid(quick: bool):
    from minimax_ops.kernels.tiles import GemvConfig
    # (BLOCK_N, BLOCK_K, warps, stages, K chunks per step): the old tile, then longer runs per row.
    tiles = [(64, 256, 4, 3, 1), (64, 256, 4, 2, 2), (64, 256, 4, 2, 4), (64, 128, 4, 2, 4), (64, 128, 4, 3, 4),
             (64, 128, 4, 2, 8), (128, 128, 4, 2, 4), (128, 128, 8, 2, 4), (64, 256, 8, 2, 4), (128, 256, 8, 2, 2)]
    if quick:
        tiles = tiles[:3]
    out = []
    for bn, bk, nw, ns, ch in tiles:
        for split in (1, 2, 3, 4, 6, 8):
            out.append(GemvConfig(16, bn, bk, split, num_warps=nw, num_stages=ns, k_chunks=ch))
    return out


OLD_LIN = dict(block_m=16, block_n=64, block_k=256, split_k=4, num_warps=4, num_stages=3, fused_reduce=False)


def moe_grid(fmt: str, which: str, quick: bool):
    """ExpertTiles candidates for one kernel (w13: block_n = gate rows = weight rows / 2)."""
    from minimax_ops.kernels.tiles import ExpertTiles
    # (weight rows per program, BLOCK_K, warps, stages, K chunks per step). Runs 1-2 swept 4-8 warp
    # tiles of 64-256 rows x 64-256 values and K chunks 1-8 (see the report); this grid tries wider
    # MXFP4 rows (512 values = 256 bytes per row per step) against the encoded tiles.
    if which == "w13":
        rows = [(128, 256, 4, 3, 1), (64, 256, 4, 3, 1), (64, 512, 8, 2, 1), (128, 512, 8, 2, 1), (128, 128, 4, 3, 1)]
    else:
        rows = [(128, 64, 4, 3, 1), (64, 256, 4, 3, 1), (64, 512, 8, 2, 1), (128, 512, 8, 2, 1), (128, 256, 4, 3, 1)]
    if quick:
        rows = rows[:2]
    out = []
    for r, bk, nw, ns, ch in rows:
        for split in (1, 2, 3, 4):
            out.append(ExpertTiles(r // 2 if which == "w13" else r, bk, nw, ns, split, k_chunks=ch))
    return out


def default_moe_tiles(fmt_code: int, n: int):
    from minimax_ops.kernels import tiles as moe
    slots = min(E, n * TOPK) + 1
    return (moe.expert_tiles(fmt_code, H, 2 * I, slots, True, 132), moe.expert_tiles(fmt_code, I, H, slots, False, 132))


def route_grid(quick: bool):
    from minimax_ops.kernels.tiles import RouterConfig
    out = []
    for logits in (2, 1, 0):
        for be, bh, split in ((16, 128, 12), (16, 128, 24), (32, 128, 48), (16, 256, 6), (32, 256, 24), (8, 128, 12)):
            for fused in (True, False):
                if logits != 2 and be < 16:  # tl.dot tiles are >= 16 wide
                    continue
                out.append(RouterConfig(be, bh, split, logits, fused))
    return out[:4] if quick else out


# ---- tensors -----------------------------------------------------------------------------------------------

FMT_CODES = {"mxfp8": 1, "mxfp4": 2, "mxfp4p": 3}


def random_mx(shape_nk: tuple[int, ...], fmt: str, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MX weight bytes [..., N, K(packed)] + scales [..., N, K/32]: timing data, never zeros."""
    *lead, n, k = shape_nk
    if fmt == "mxfp8":
        w = torch.randint(0, 256, (*lead, n, k), generator=gen, device=device, dtype=torch.uint8)
        w = torch.where((w & 0x7F) == 0x7F, w - 1, w).view(torch.float8_e4m3fn)  # no NaN codes
    elif fmt == "mxfp4":
        w = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, device=device, dtype=torch.uint8)
    else:  # kernel layout: every bit pattern is a valid set of 8 e2m1 values
        w = torch.randint(-2**31, 2**31 - 1, (*lead, n, k // 8), generator=gen, device=device, dtype=torch.int32)
    s = torch.randint(118, 125, (*lead, n, k // 32), generator=gen, device=device, dtype=torch.uint8)
    return w, s


class Env:
    """Tensors of the sweep, made on first use. light=True (compile workers): expert tables are
    one expert broadcast with stride 0 (same kernel specialisation, no memory)."""

    def __init__(self, device, light: bool):
        self.device, self.light = device, light
        self.gen = torch.Generator(device).manual_seed(0)
        self.cache = {}

    def get(self, key, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def lin(self, n, k, copy):
        return self.get(("lin", n, k, copy if not self.light else 0), lambda: random_mx((n, k), "mxfp8", self.device, self.gen))

    def x(self, m, k):
        return self.get(("x", m, k), lambda: torch.randn(m, k, generator=self.gen, device=self.device).bfloat16())

    def tables(self, fmt):
        def make():
            e = 1 if self.light else E
            w13, s13 = random_mx((e, 2 * I, H), fmt, self.device, self.gen)
            w2, s2 = random_mx((e, H, I), fmt, self.device, self.gen)
            if self.light:
                w13, s13, w2, s2 = (t.expand(E, *t.shape[1:]) for t in (w13, s13, w2, s2))
            sw13, ss13 = random_mx((2 * I, H), fmt, self.device, self.gen)
            sw2, ss2 = random_mx((H, I), fmt, self.device, self.gen)
            return w13, s13, w2, s2, sw13, ss13, sw2, ss2
        return self.get(("tables", fmt), make)

    def routing(self, n, r):
        def make():
            g = torch.Generator().manual_seed(1000 * n + r)
            if n == 1:  # disjoint experts across the R routings
                ids = torch.randperm(E, generator=g)[:R_MOE * TOPK].view(R_MOE, 1, TOPK)[r]
            else:
                ids = torch.rand(n, E, generator=g).topk(TOPK, dim=-1).indices
            w = torch.rand(n, TOPK, generator=g) + 0.1
            return ids.int().to(self.device), w.to(self.device)
        return self.get(("routing", n, r), make)

    def h(self, n):
        return self.get(("h", n), lambda: torch.randn(n, H, generator=self.gen, device=self.device).bfloat16())

    def gate(self, copy=0):
        return self.get(("gate", copy if not self.light else 0),
                        lambda: (torch.randn(E, H, generator=self.gen, device=self.device) * H ** -0.5,
                                 torch.randn(E, generator=self.gen, device=self.device) * 0.1))


# ---- calls ---------------------------------------------------------------------------------------------------

def call(job: dict, env: Env, rep: int):
    """One launch of the op a job describes; rep picks the weight copy / routing."""
    if job["kind"] == "lin":
        from minimax_ops.kernels.mx_linear import mx_linear
        n, k = job["shape"]
        w, s = env.lin(n, k, rep % LIN_COPIES)
        return mx_linear(env.x(job["m"], k), w, s, config=job["cfg"])
    if job["kind"] == "moe":
        from minimax_ops.kernels.moe import moe_experts
        ids, wts = env.routing(job["n"], rep % R_MOE)
        tiles = None if job["t13"] is None else (job["t13"], job["t2"])
        return moe_experts(env.h(job["n"]), ids, wts, *env.tables(job["fmt"]), num_routed_experts=E, tiles=tiles)
    if job["kind"] == "pattern":
        return pattern_call(job, env, rep)
    if job["kind"] == "route":
        from minimax_ops.kernels.router import route
        gate, bias = env.gate(rep)
        return route(env.h(job["n"]), gate, bias, TOPK, 2.0, config=job["cfg"])
    raise ValueError(job["kind"])


def reps(job) -> int:
    return {"lin": LIN_COPIES, "moe": R_MOE, "route": ROUTE_COPIES, "pattern": LIN_COPIES}[job["kind"]]


def nbytes(job, env: Env) -> int:
    if job["kind"] == "lin":
        n, k = job["shape"]
        return n * k + n * k // 32
    if job["kind"] == "pattern":
        return LIN_SHAPES[0][0] * LIN_SHAPES[0][1]
    if job["kind"] == "route":
        return E * H * 4
    per = {"mxfp8": 1.0, "mxfp4": 0.5, "mxfp4p": 0.5}[job["fmt"]]
    expert = int(3 * I * H * per + 3 * I * H // 32)  # w13 + w2 values and scales
    distinct = statistics.mean(len(torch.unique(env.routing(job["n"], r)[0])) for r in range(R_MOE))
    return int((distinct + 1) * expert)
