"""The one-kernel qkv GEMV + qk-norm / RoPE / cache insert (kernels/qkv_mma.py) against the two-kernel
chain it replaces, qk_norm_rope_insert(mx_linear(h, qkv)), bit for bit (q, index_q and every byte
of both caches), and against the fp32 reference with bf16 / fp8 tolerances.

On CPU the kernels run under the Triton interpreter (the portable block product, head_dim / 16 row
blocks a program); on CUDA through the inline PTX with the tiles given (tiles whose row blocks make
one head-wide segment) or, at head_dim 128, the heuristic's. Inputs are fresh random non-zero
values; steps of 1 and 3 tokens, the 3-token ones with a padding row (slot -1).
"""

from __future__ import annotations

import pytest
import torch

from minimax_ops import reference as ref
from minimax_ops.formats import FMT_MXFP4_MMA, FMT_MXFP8_MMA, dequantize, quantize, to_mma_layout
from minimax_ops.kernels import qkv_mma
from minimax_ops.kernels.linear_mma import mma_linear
from minimax_ops.kernels.mx_linear import mx_linear
from minimax_ops.kernels.qk_norm_rope import qk_norm_rope_insert, qkv_width
from minimax_ops.kernels.tiles import MmaLinearTiles
from utils import rel_err

FP8 = torch.float8_e4m3fn
NUM_BLOCKS = 12
THETA, EPS = 5e6, 1e-6
# (heads, kv heads, index heads, head_dim, rotary_dim, block_size)
SMALL = (4, 2, 2, 32, 16, 16)
WIDE = (2, 1, 1, 128, 64, 16)  # a GEMV group of 8 row blocks: the heuristic's tiles on CUDA


def _case(shape, sparse, n, hidden, fmt, kv_dtype, index_dtype, device, seed, mma=True):
    heads, kv_heads, index_heads, dim, rot, bs = shape
    gen = torch.Generator().manual_seed(seed)
    ih = index_heads if sparse else 0
    width = qkv_width(heads, kv_heads, dim, ih, dim if sparse else 0)
    w, s = quantize(torch.randn(width, hidden, generator=gen) * 0.3, fmt)
    dense_w = dequantize(w, s)
    if mma:
        w, s = to_mma_layout(w, s)
    h = (torch.randn(n, hidden, generator=gen) + 0.1).bfloat16()
    norms = [(torch.randn(dim, generator=gen) * 0.3).bfloat16() for _ in range(4)]
    perm = torch.randperm(NUM_BLOCKS * bs, generator=gen)
    slots = perm[:n].clone()
    islots = perm[n:2 * n].clone()
    if n > 1:
        slots[1] = islots[1] = -1  # a padding row
    positions = torch.randint(0, 5000, (n,), generator=gen)
    kv = torch.randn(NUM_BLOCKS, kv_heads, bs, 2 * dim, generator=gen).to(kv_dtype)
    index = torch.randn(NUM_BLOCKS, bs, dim, generator=gen).to(index_dtype) if sparse else None
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, rotary_dim=rot, rope_theta=THETA, eps=EPS,
              index_heads=ih, index_dim=dim if sparse else 0, k_scale=0.5, v_scale=2.0)
    to = (lambda t: None if t is None else t.to(device))
    args = dict(h=to(h), w=to(w), s=to(s), positions=to(positions), slots=to(slots),
                islots=to(islots) if sparse else None, q_norm=to(norms[0]), k_norm=to(norms[1]),
                iq_norm=to(norms[2]) if sparse else None, ik_norm=to(norms[3]) if sparse else None,
                kv=to(kv), index=to(index))
    return args, dense_w, kw


def _run(fn, a, kv, index, kw, **extra):
    return fn(a["h"], a["w"], a["s"], a["positions"], a["slots"], a["islots"], a["q_norm"], a["k_norm"], a["iq_norm"],
              a["ik_norm"], kv, index, **kw, **extra)


def _two_kernels(h, w, s, positions, slots, islots, q_norm, k_norm, iq_norm, ik_norm, kv, index, *, tiles=None,
                 fmt_code=None, **kw):
    qkv = mx_linear(h, w, s) if tiles is None else mma_linear(h, w, s, fmt_code, torch.bfloat16, tiles=tiles)
    return qk_norm_rope_insert(qkv, positions, slots, islots, q_norm, k_norm, iq_norm, ik_norm, kv, index, **kw)


def _same_bytes(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what}: bytes differ"


def _same_results(got, want, caches, want_caches):
    """q, index_q and both caches bit for bit as the two kernels left them."""
    for a, b, what in zip((*got, *caches), (*want, *want_caches), ("q", "index_q", "kv_cache", "index_cache")):
        _same_bytes(a, b, what)


def _check_reference(q, index_q, kv, index, a, dense_w, kw, sparse):
    """Against the fp32 reference fed the bf16 qkv the GEMV stores (its rounding is the chain's)."""
    qkv = (a["h"].float().cpu() @ dense_w.T).bfloat16()
    kv_r, index_r = a["kv"].cpu().clone(), None if a["index"] is None else a["index"].cpu().clone()
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    q_r, iq_r = ref.qk_norm_rope_insert(qkv, cpu["positions"], cpu["slots"], cpu["islots"], cpu["q_norm"],
                                        cpu["k_norm"], cpu["iq_norm"], cpu["ik_norm"], kv_r, index_r, **kw)
    assert rel_err(q.cpu(), q_r) < 1e-2
    cache_tol = 4e-2 if kv.dtype == FP8 else 1e-2
    live = cpu["slots"][cpu["slots"] >= 0]
    bs = kv.shape[2]
    assert rel_err(kv.cpu()[live // bs, :, live % bs].float(), kv_r[live // bs, :, live % bs].float()) < cache_tol
    before = a["kv"].cpu()
    untouched = torch.ones(kv.shape[0] * bs, dtype=torch.bool)
    untouched[live] = False
    untouched = untouched.view(kv.shape[0], bs)
    assert torch.equal(kv.cpu().transpose(1, 2)[untouched].view(torch.uint8),
                       before.transpose(1, 2)[untouched].view(torch.uint8)), "kv_cache: bytes outside the step"
    if sparse:
        assert rel_err(index_q.cpu(), iq_r) < 1e-2
        ilive = cpu["islots"][cpu["islots"] >= 0]
        tol = 4e-2 if index.dtype == FP8 else 1e-2
        assert rel_err(index.cpu()[ilive // bs, ilive % bs].float(), index_r[ilive // bs, ilive % bs].float()) < tol


def _forbid_two_kernels(monkeypatch):
    """The one-kernel path must not fall back (qkv_mma calls these only when it does)."""
    def refuse(*args, **kwargs):
        raise AssertionError("fell back to the two-kernel chain")
    monkeypatch.setattr(qkv_mma, "qk_norm_rope_insert", refuse)
    monkeypatch.setattr(qkv_mma, "mx_linear", refuse)


BF16 = torch.bfloat16
CASES = [  # (format, tokens, (kv cache, index cache), K splits, sparse)
    ("mxfp8", 1, (FP8, FP8), 4, True), ("mxfp8", 3, (BF16, FP8), 1, True), ("mxfp8", 3, (FP8, BF16), 4, False),
    ("mxfp4", 1, (BF16, BF16), 1, True), ("mxfp4", 3, (FP8, BF16), 4, True), ("mxfp4", 3, (BF16, BF16), 4, False),
]


@pytest.mark.parametrize("fmt,n,caches,split,sparse", CASES,
                         ids=[f"{c[0]}-n{c[1]}-kv{str(c[2][0])[-4:]}-split{c[3]}-{'sparse' if c[4] else 'dense'}"
                              for c in CASES])
def test_one_kernel_matches_the_chain(fmt, n, caches, split, sparse, device, monkeypatch):
    """Bit-identical to qk_norm_rope_insert(mma GEMV) with the same tiles: K split 4 (the last split
    runs the epilogue) and unsplit (every program does); the reference within bf16 / fp8 noise."""
    a, dense_w, kw = _case(SMALL, sparse, n, 256, fmt, *caches, device, seed=n * 10 + split)
    tiles = MmaLinearTiles(SMALL[3] // 16, 1, 0, split)
    kv2, index2 = a["kv"].clone(), None if a["index"] is None else a["index"].clone()
    code = FMT_MXFP8_MMA if fmt == "mxfp8" else FMT_MXFP4_MMA
    want = _run(_two_kernels, a, kv2, index2, kw, tiles=tiles, fmt_code=code)
    kv1, index1 = a["kv"].clone(), None if a["index"] is None else a["index"].clone()
    _forbid_two_kernels(monkeypatch)
    got = _run(qkv_mma.qkv_norm_rope_insert, a, kv1, index1, kw, tiles=tiles)
    assert got[0].shape == (n, SMALL[0], SMALL[3]) and got[0].dtype == torch.bfloat16
    assert (got[1] is None) == (not sparse)
    _same_results(got, want, (kv1, index1), (kv2, index2))
    _check_reference(got[0], got[1], kv1, index1, a, dense_w, kw, sparse)


@pytest.mark.parametrize("fmt,n", [("mxfp8", 3), ("mxfp4", 1)])
def test_default_tiles_head_dim_128(fmt, n, device, monkeypatch):
    """head_dim 128: on CUDA the heuristic's own tiles (8 row blocks a program) take the one-kernel
    path, and match the GEMV with those tiles + qk_norm_rope_insert bit for bit. (mx_linear's own
    tiles may split K by the warps, which a program owning a head's rows cannot: other sums.)"""
    a, dense_w, kw = _case(WIDE, True, n, 128, fmt, FP8, FP8, device, seed=7 + n)
    code = FMT_MXFP8_MMA if fmt == "mxfp8" else FMT_MXFP4_MMA
    plan = qkv_mma.one_kernel_tiles(True, code == FMT_MXFP8_MMA, a["w"].shape[0] * 16, 128, WIDE[3], a["h"].device)
    assert plan is not None and plan[0].warp_split == 1
    kv2, index2 = a["kv"].clone(), a["index"].clone()
    want = _run(_two_kernels, a, kv2, index2, kw, tiles=plan[0], fmt_code=code)
    kv1, index1 = a["kv"].clone(), a["index"].clone()
    _forbid_two_kernels(monkeypatch)
    got = _run(qkv_mma.qkv_norm_rope_insert, a, kv1, index1, kw)
    _same_results(got, want, (kv1, index1), (kv2, index2))
    _check_reference(got[0], got[1], kv1, index1, a, dense_w, kw, True)


@pytest.mark.parametrize("layout", ["canonical", "head_dim_8"])
def test_fallback_runs_the_two_kernels(layout, device):
    """Weights not in an mma layout, and a head_dim no GEMV group matches (8 < 16 rows): the two
    kernels run, with the chain's results."""
    shape = SMALL if layout == "canonical" else (4, 2, 1, 8, 8, 16)
    a, dense_w, kw = _case(shape, True, 3, 128, "mxfp8", FP8, FP8, device, seed=5, mma=layout != "canonical")
    assert qkv_mma.one_kernel_tiles(layout != "canonical", True, a["w"].shape[0] * (16 if a["w"].dim() == 3 else 1),
                                    128, shape[3], a["h"].device) is None
    kv2, index2 = a["kv"].clone(), a["index"].clone()
    want = _run(_two_kernels, a, kv2, index2, kw)
    kv1, index1 = a["kv"].clone(), a["index"].clone()
    got = _run(qkv_mma.qkv_norm_rope_insert, a, kv1, index1, kw)
    _same_results(got, want, (kv1, index1), (kv2, index2))
    _check_reference(got[0], got[1], kv1, index1, a, dense_w, kw, True)


def test_bad_inputs_name_the_argument(device):
    a, _, kw = _case(SMALL, True, 1, 128, "mxfp8", FP8, FP8, device, seed=3)
    with pytest.raises(ValueError, match="qkv_weight: expected"):
        _run(qkv_mma.qkv_norm_rope_insert, a, a["kv"], a["index"], {**kw, "num_heads": 6})
    with pytest.raises(ValueError, match="positions:"):
        _run(qkv_mma.qkv_norm_rope_insert, {**a, "positions": a["positions"].int()}, a["kv"], a["index"], kw)
    with pytest.raises(ValueError, match="h: expected dtype"):
        _run(qkv_mma.qkv_norm_rope_insert, {**a, "h": a["h"].float()}, a["kv"], a["index"], kw)
    with pytest.raises(ValueError, match="index_slot_mapping, index_q_norm"):
        _run(qkv_mma.qkv_norm_rope_insert, {**a, "islots": None}, a["kv"], a["index"], kw)


def test_steps_of_more_token_groups_run_the_two_kernels(device, monkeypatch):
    """A step of more than ONE_KERNEL_TOKENS tokens (a padding row among them) takes the two kernels, with
    the chain's results bit for bit, even for weights the one kernel takes."""
    n = qkv_mma.ONE_KERNEL_TOKENS + 1
    a, dense_w, kw = _case(SMALL, True, n, 128, "mxfp4", FP8, FP8, device, seed=9)
    kv2, index2 = a["kv"].clone(), a["index"].clone()
    want = _run(_two_kernels, a, kv2, index2, kw)
    monkeypatch.setattr(qkv_mma, "_qkv_norm_rope_insert_kernel", None)  # (launching it would fail)
    kv1, index1 = a["kv"].clone(), a["index"].clone()
    got = _run(qkv_mma.qkv_norm_rope_insert, a, kv1, index1, kw)
    _same_results(got, want, (kv1, index1), (kv2, index2))
    _check_reference(got[0], got[1], kv1, index1, a, dense_w, kw, True)
