"""Weight-streaming kernels: mx_linear (bf16 / MXFP8 / MXFP4, canonical and kernel layout), the
sigmoid router and the routed + shared experts, against the fp32 reference at tiny sizes.

Runs on CPU under the Triton interpreter (conftest sets TRITON_INTERPRET) and on CUDA, where the
MXFP4 launches take the inline-PTX decode; the exact-decode tests then check it bit for bit.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from minimax_ops import reference as ref
from minimax_ops.formats import E2M1_VALUES, dequantize, pack_mxfp4_words, quantize, to_layout
from minimax_ops.kernels import moe as moe_kernels
from minimax_ops.kernels import mx_linear as lin
from minimax_ops.kernels import router as router_kernels
from minimax_ops.kernels import splitk
from minimax_ops.kernels.moe import moe_experts
from minimax_ops.kernels.router import route
from minimax_ops.kernels.tiles import COMBINE_BLOCK, ExpertTiles, GemvConfig, RouterConfig, combine_block
from minimax_ops.kernels.mx_linear import mx_linear
from utils import rel_err

# Storage layouts (formats.LAYOUTS): mxfp4w = MXFP4 words; *_t = tiled (16-row, 32-wide tiles here).
FORMATS = ["bf16", "mxfp8", "mxfp4", "mxfp4w", "bf16_t", "mxfp8_t", "mxfp4_t"]
TEST_TILES = (16, 32)


def kernel_layout(w: torch.Tensor, s: torch.Tensor | None, fmt: str, tiles=TEST_TILES):
    """A canonical (weight, scale) pair in the layout ``fmt`` names."""
    if fmt == "mxfp4w":
        return pack_mxfp4_words(w), s
    if fmt.endswith("_t"):
        return to_layout(w, s, tiles, rank=w.dim())
    return w, s


def make_weight(n: int, k: int, fmt: str, device: str, scale: float = 0.3, lead: tuple[int, ...] = ()):
    """(canonical weight, scale) for the reference and (weight, scale) in the kernel's layout."""
    w, s = quantize(torch.randn(*lead, n, k) * scale, fmt.removesuffix("_t").removesuffix("w"))
    canonical = (w.to(device), None if s is None else s.to(device))
    return canonical, kernel_layout(*canonical, fmt)


# ---- mx_linear -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 16, 20])
def test_mx_linear_matches_reference(fmt, m, device):
    torch.manual_seed(m)
    (w, s), (kw, ks) = make_weight(48, 96, fmt, device)  # N=48: partial tile; K=96: three 32-wide K steps
    x = torch.randn(m, 96, device=device).bfloat16()
    want = ref.linear(x, w, s)
    y = mx_linear(x, kw, ks)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 48)
    assert rel_err(y, want) < 1e-2
    y32 = mx_linear(x, kw, ks, out_dtype=torch.float32)
    assert rel_err(y32, want) < 1e-5


def _all_codes_weight(fmt: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every element code (e2m1: all 16, subnormal 0.5 included; e4m3: all but NaN, subnormals
    included) under random scales up to the kernels' limit (2^1 for MXFP4, 2^7 for MXFP8)."""
    gen = torch.Generator().manual_seed(7)
    if fmt == "mxfp8":
        codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
        w = codes[torch.randint(len(codes), (n, k), generator=gen)].view(torch.float8_e4m3fn)
        s = torch.randint(100, 135, (n, k // 32), generator=gen, dtype=torch.uint8)
    else:
        w = torch.randint(256, (n, k // 2), generator=gen, dtype=torch.uint8)
        s = torch.randint(100, 129, (n, k // 32), generator=gen, dtype=torch.uint8)
    return w, s


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "mxfp4w", "mxfp8_t", "mxfp4_t"])
def test_decode_is_exact(fmt, device):
    """x = identity gives y = W^T: every decoded value must equal formats.dequantize exactly."""
    w, s = _all_codes_weight(fmt.removesuffix("_t").removesuffix("w"), 48, 64)
    assert len(E2M1_VALUES) == 8
    want = dequantize(w, s).T
    kw, ks = kernel_layout(w, s, fmt)
    eye = torch.eye(64, device=device, dtype=torch.bfloat16)
    y = mx_linear(eye, kw.to(device), ks.to(device), out_dtype=torch.float32)
    assert torch.equal(y.cpu(), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tile_configs_agree(fmt, device):
    """Split-K (deterministic reduce), both MMA orientations, M tiled in 16-row blocks."""
    torch.manual_seed(1)
    n = 48 if fmt.endswith("_t") else 40  # tiles divide N; row layouts also meet a partial tile
    (w, s), (kw, ks) = make_weight(n, 128, fmt, device)
    x = torch.randn(40, 128, device=device).bfloat16()
    want = ref.linear(x, w, s)
    configs = [GemvConfig(16, 16, 32, split_k=3), GemvConfig(16, 32, 64, split_k=2, swap_ab=True),
               GemvConfig(64, 64, 128, swap_ab=True)]
    if device == "cuda" and fmt.startswith("mxfp4"):
        configs.append(GemvConfig(16, 64, 64, ptx=False))  # the portable decode next to the PTX one
    for cfg in configs:
        y = mx_linear(x, kw, ks, out_dtype=torch.float32, config=cfg)
        assert rel_err(y, want) < 1e-5, cfg
        assert torch.equal(y, mx_linear(x, kw, ks, out_dtype=torch.float32, config=cfg)), "not deterministic"


def _counters_clear(device) -> bool:
    """The fused split-K reductions leave their arrival counters at zero for the next launch."""
    buf = splitk._COUNTERS.get(torch.device(device))
    return buf is None or not buf.any().item()


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4w", "mxfp8_t"])
def test_split_reduce_modes_and_chunks(fmt, device):
    """Fused split-K (last program sums) and the two-launch reduce agree with the reference and
    with each other bit for bit (same order); K chunks per step change nothing numerically."""
    torch.manual_seed(2)
    (w, s), (kw, ks) = make_weight(48, 256, fmt, device)
    x = torch.randn(5, 256, device=device).bfloat16()
    want = ref.linear(x, w, s)
    outs = []
    for cfg in (GemvConfig(16, 16, 32, split_k=3, fused_reduce=True), GemvConfig(16, 16, 32, split_k=3, fused_reduce=False),
                GemvConfig(16, 32, 32, split_k=2, k_chunks=2), GemvConfig(16, 32, 64, split_k=4, k_chunks=4)):
        y = mx_linear(x, kw, ks, out_dtype=torch.float32, config=cfg)
        assert rel_err(y, want) < 1e-5, cfg
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    assert _counters_clear(device)


def test_table_layouts_slice_per_expert(device):
    """A table re-laid whole (words, tiles) equals each expert re-laid alone, and every expert of it
    multiplies like its canonical weight."""
    (w, s), _ = make_weight(16, 64, "mxfp4", device, lead=(3,))
    pw = pack_mxfp4_words(w)
    assert pw.dtype == torch.int32 and pw.shape == (3, 16, 8)
    tw, ts = to_layout(w, s, (8, 32), rank=3)
    assert tw.shape == (3, 2, 2, 8, 4) and ts.shape == (3, 2, 2, 8, 1)
    x = torch.randn(2, 64, device=device).bfloat16()
    for e in range(3):
        want = mx_linear(x, w[e], s[e], out_dtype=torch.float32)
        assert torch.equal(pw[e], pack_mxfp4_words(w[e]))
        assert torch.equal(mx_linear(x, pw[e], s[e], out_dtype=torch.float32), want)
        assert torch.equal(mx_linear(x, tw[e], ts[e], out_dtype=torch.float32), want)


def test_mx_linear_rejects_bad_inputs(device):
    (w, s), _ = make_weight(16, 64, "mxfp8", device)
    x = torch.randn(2, 64, device=device).bfloat16()
    with pytest.raises(ValueError, match="x: expected dtype"):
        mx_linear(x.float(), w, s)
    with pytest.raises(ValueError, match="weight: expected K = 32"):
        mx_linear(x[:, :32], w, s)
    with pytest.raises(ValueError, match="scale: expected shape"):
        mx_linear(x, w, s[:, :1])
    with pytest.raises(ValueError, match="_scale: expected a uint8"):
        mx_linear(x, w, None)
    with pytest.raises(ValueError, match="bf16 weights take no scale"):
        mx_linear(x, torch.randn(16, 64, device=device).bfloat16(), s)


# ---- router ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, experts, top_k", [(1, 8, 2), (3, 8, 2), (16, 128, 4)])
def test_route(n, experts, top_k, device):
    torch.manual_seed(n)
    h = torch.randn(n, 64, device=device).bfloat16()
    gate = torch.randn(experts, 64, device=device) * 0.3
    bias = torch.randn(experts, device=device) * 0.05
    weights, ids = route(h, gate, bias, top_k, 2.0)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (n, top_k)
    scores = torch.sigmoid(h.float() @ gate.T)
    choice = scores + bias
    want_ids = choice.topk(top_k, dim=-1).indices
    assert torch.equal(ids.long().sort(-1).values, want_ids.sort(-1).values)  # same sets
    assert (choice.gather(1, ids.long()).diff(dim=-1) <= 0).all()  # descending by score + bias
    chosen = scores.gather(1, ids.long())  # the bias only chooses: weights come from the scores
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * 2.0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.full((n,), 2.0, device=device))
    ref_weights, ref_ids = ref.route(h, gate, bias, top_k, 2.0)
    assert torch.equal(ids.long().sort(-1).values, ref_ids.long().sort(-1).values)
    torch.testing.assert_close(weights.sort(-1).values, ref_weights.sort(-1).values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 5, 20])
def test_route_modes_agree(n, device):
    """Every logits mode (fp32 FMA dot, 3xTF32 on NVIDIA, multiply + row sums) and both top-k
    placements (last logits program / one program per token) pick the reference's experts; 20
    tokens take two 16-token tiles."""
    torch.manual_seed(20 + n)
    h = torch.randn(n, 64, device=device).bfloat16()
    gate = torch.randn(128, 64, device=device) * 0.3
    bias = torch.randn(128, device=device) * 0.05
    want_w, want_ids = ref.route(h, gate, bias, 4, 2.0)
    for logits in (0, 1, 2):
        for fused in (True, False):
            cfg = RouterConfig(16 if logits != 2 else 32, 32, 2, logits, fused)
            weights, ids = route(h, gate, bias, 4, 2.0, config=cfg)
            assert torch.equal(ids.long().sort(-1).values, want_ids.long().sort(-1).values), cfg
            torch.testing.assert_close(weights.sort(-1).values, want_w.sort(-1).values, rtol=1e-4, atol=1e-5)
    assert _counters_clear(device)


def test_route_bias_changes_choice_only(device):
    torch.manual_seed(5)
    h = torch.randn(4, 64, device=device).bfloat16()
    gate = torch.randn(8, 64, device=device) * 0.3
    w0, ids0 = route(h, gate, None, 2, 1.0)
    bias = torch.zeros(8, device=device)
    bias[ids0[:, 0].long()] = -10.0  # push every token's first choice out
    w1, ids1 = route(h, gate, bias, 2, 1.0)
    assert not (ids1 == ids0[:, :1]).any()
    scores = torch.sigmoid(h.float() @ gate.T).gather(1, ids1.long())
    torch.testing.assert_close(w1, scores / scores.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


# ---- experts ---------------------------------------------------------------------------------------------

H, I, E, K = 64, 32, 8, 2


def _tables(fmt: str, experts: int, device: str):
    (w13, s13), (kw13, ks13) = make_weight(2 * I, H, fmt, device, lead=(experts,))
    (w2, s2), (kw2, ks2) = make_weight(H, I, fmt, device, lead=(experts,))
    return (w13, s13, w2, s2), (kw13, ks13, kw2, ks2)


def _routing(n: int, device: str, few_experts: bool):
    """Random distinct top-k ids per token (optionally from only 3 experts, so many tokens share
    one) and positive weights."""
    pool = torch.tensor([1, 4, 6]) if few_experts else torch.arange(E)
    ids = torch.stack([pool[torch.randperm(len(pool))[:K]] for _ in range(n)]).int()
    weights = torch.rand(n, K) + 0.1
    return ids.to(device), weights.to(device)


@pytest.mark.parametrize("fmt, n, shared, few", [
    ("bf16", 1, "fused", False), ("mxfp8", 3, "fused", True), ("mxfp4", 16, "fused", True),
    ("mxfp4w", 3, "separate", False), ("mxfp8", 16, "separate", False), ("mxfp4", 1, "separate", False),
    ("bf16", 16, "none", True),
    ("mxfp8", 40, "fused", False),  # > 16 tokens (several token tiles) and > 64 (token, expert) pairs
    ("mxfp4_t", 3, "fused", True), ("mxfp8_t", 16, "separate", False), ("mxfp4_t", 1, "same", False),
    ("bf16_t", 5, "same", True),
])
def test_moe_experts_matches_reference(fmt, n, shared, few, device):
    torch.manual_seed(n + len(fmt))
    h = torch.randn(n, H, device=device).bfloat16()
    ids, weights = _routing(n, device, few)
    table, ktable = _tables(fmt, E + (shared == "fused"), device)
    extra, kextra = (), ()
    if shared == "separate":  # MXFP8 shared expert next to the routed table's format
        (sw13, ss13), _ = make_weight(2 * I, H, "mxfp8", device)
        (sw2, ss2), _ = make_weight(H, I, "mxfp8", device)
        extra = kextra = (sw13, ss13, sw2, ss2)
    elif shared == "same":  # a separate shared expert in the table's own layout: one merged launch
        (sw13, ss13), (ksw13, kss13) = make_weight(2 * I, H, fmt, device)
        (sw2, ss2), (ksw2, kss2) = make_weight(H, I, fmt, device)
        extra, kextra = (sw13, ss13, sw2, ss2), (ksw13, kss13, ksw2, kss2)
    want = ref.moe_experts(h, ids, weights, *table, *extra, num_routed_experts=E)
    out = moe_experts(h, ids, weights, *ktable, *kextra, num_routed_experts=E)
    assert out.dtype == torch.bfloat16 and out.shape == (n, H)
    # Two bf16 roundings (the SwiGLU intermediate and the output; the interpreter truncates).
    assert rel_err(out, want) < 1.5e-2
    assert torch.equal(out, moe_experts(h, ids, weights, *ktable, *kextra, num_routed_experts=E))


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_moe_split_and_chunked_tiles(fmt, device):
    """H split of w13 (last program sums the partials, then SwiGLU), I split of w2 (the combine sums;
    a split past I stores zeros) and K chunks, against the reference and the unsplit tiles."""
    torch.manual_seed(11)
    n = 5
    h = torch.randn(n, H, device=device).bfloat16()
    ids, weights = _routing(n, device, few_experts=True)
    table, ktable = _tables(fmt, E + 1, device)
    want = ref.moe_experts(h, ids, weights, *table, num_routed_experts=E)
    plain = moe_experts(h, ids, weights, *ktable, num_routed_experts=E,
                        tiles=(ExpertTiles(16, 32), ExpertTiles(32, 32)))
    for t13, t2 in ((ExpertTiles(16, 32, split=2), ExpertTiles(32, 32, split=2)),
                    (ExpertTiles(16, 32, k_chunks=2), ExpertTiles(16, 32, split=3)),
                    (ExpertTiles(32, 32, split=2, k_chunks=1, swap_ab=True), ExpertTiles(64, 32, k_chunks=2, swap_ab=True))):
        out = moe_experts(h, ids, weights, *ktable, num_routed_experts=E, tiles=(t13, t2))
        assert rel_err(out, want) < 1.5e-2, (t13, t2)
        assert rel_err(out, plain) < 1e-2, (t13, t2)
    assert _counters_clear(device)


def test_moe_shared_expert_of_other_size(device):
    """A separate shared expert with its own intermediate size joins the routed launches (same
    format) or runs in its own launches (other format, here with w2 split over I)."""
    torch.manual_seed(12)
    n = 3
    h = torch.randn(n, H, device=device).bfloat16()
    ids, weights = _routing(n, device, few_experts=False)
    table, ktable = _tables("mxfp8", E, device)
    for shared_fmt in ("mxfp8", "bf16"):
        (sw13, ss13), _ = make_weight(2 * 64, H, shared_fmt, device)  # Is = 64, I = 32
        (sw2, ss2), _ = make_weight(H, 64, shared_fmt, device)
        want = ref.moe_experts(h, ids, weights, *table, sw13, ss13, sw2, ss2, num_routed_experts=E)
        for tiles in (None, (ExpertTiles(16, 32), ExpertTiles(32, 32, split=2))):
            out = moe_experts(h, ids, weights, *ktable, sw13, ss13, sw2, ss2, num_routed_experts=E, tiles=tiles)
            assert rel_err(out, want) < 1.5e-2, (shared_fmt, tiles)


def test_moe_padding_rows_and_invalid_ids(device):
    """Zero-weight padding rows stay finite and get the shared expert only (an all-zero row gives
    exactly 0); ids outside [0, num_routed) are ignored."""
    torch.manual_seed(3)
    n = 5
    h = torch.randn(n, H, device=device).bfloat16()
    h[3] = 0
    ids, weights = _routing(n, device, few_experts=False)
    weights[3:] = 0
    ids[4, 1] = -1
    table, ktable = _tables("mxfp8", E + 1, device)
    out = moe_experts(h, ids, weights, *ktable, num_routed_experts=E)
    assert torch.isfinite(out).all()
    assert (out[3] == 0).all()
    keep = ids.clone()
    keep[4, 1] = 0  # the reference cannot take -1; weight 0 makes the pair contribute nothing
    want = ref.moe_experts(h, keep, weights, *table, num_routed_experts=E)
    assert rel_err(out, want) < 1.5e-2
    shared_only = ref.mlp(h[4:].float(), table[0][E], table[1][E], table[2][E], table[3][E])
    assert rel_err(out[4:], shared_only) < 1.5e-2


def test_combine_block_switch(monkeypatch, device):
    """The combine's columns a program (tiles.combine_block, an A/B switch) change no bit of the output at a
    hidden size several programs split (uneven at 384 / 256); a value that is no power of two in range is
    refused, naming the variable."""
    torch.manual_seed(21)
    n, hidden = 3, 384
    h = torch.randn(n, hidden, device=device).bfloat16()
    ids, weights = _routing(n, device, few_experts=False)
    _, (kw13, ks13) = make_weight(2 * I, hidden, "mxfp8", device, lead=(E + 1,))
    _, (kw2, ks2) = make_weight(hidden, I, "mxfp8", device, lead=(E + 1,))
    outs = []
    for block in ("128", "256", "1024"):
        monkeypatch.setenv("MINIMAX_OPS_COMBINE_BLOCK", block)
        assert combine_block() == int(block)
        outs.append(moe_experts(h, ids, weights, kw13, ks13, kw2, ks2, num_routed_experts=E))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert outs[0].abs().max() > 0
    for bad in ("96", "64", "8192", "wide"):
        monkeypatch.setenv("MINIMAX_OPS_COMBINE_BLOCK", bad)
        with pytest.raises(ValueError, match="MINIMAX_OPS_COMBINE_BLOCK"):
            combine_block()
    monkeypatch.delenv("MINIMAX_OPS_COMBINE_BLOCK")
    assert combine_block() == COMBINE_BLOCK


def test_moe_rejects_bad_tables(device):
    table, _ = _tables("mxfp8", E + 1, device)
    h = torch.randn(2, H, device=device).bfloat16()
    ids, weights = _routing(2, device, False)
    with pytest.raises(ValueError, match="w13: expected 6 experts"):
        moe_experts(h, ids, weights, *table, num_routed_experts=6)
    with pytest.raises(ValueError, match="w2: expected 9 experts x 64 rows"):
        moe_experts(h, ids, weights, table[0], table[1], table[2][:, :32], table[3][:, :32], num_routed_experts=E)
    with pytest.raises(ValueError, match="topk_weights"):
        moe_experts(h, ids, weights.double(), *table, num_routed_experts=E)


# ---- ahead-of-time specs ---------------------------------------------------------------------------------


def _python_function(kernel):
    while hasattr(kernel, "fn"):  # JITFunction / InterpretedFunction -> the decorated function
        kernel = kernel.fn
    return kernel


@pytest.mark.parametrize("module", [lin, moe_kernels, router_kernels, splitk])
def test_aot_specs_match_kernel_signatures(module):
    """Every spec names each kernel parameter once, constexprs with a value, and leaves out only
    parameters with a default (aot_check compiles those at their default, as a launch that leaves them
    out does; compiling them is aot_check's job, not the interpreter's)."""
    specs = module.aot_specs()
    labels = [spec.label() for spec in specs]
    assert len(labels) == len(set(labels))
    for spec in specs:
        params = inspect.signature(_python_function(spec.kernel)).parameters
        required = {name for name, p in params.items() if p.default is inspect.Parameter.empty}
        constexprs = {name for name, p in params.items() if "constexpr" in str(p.annotation)}
        named = set(spec.signature) | set(spec.constexprs)
        assert required <= named <= set(params) and not set(spec.signature) & set(spec.constexprs), spec.label()
        assert constexprs & required <= set(spec.constexprs) and not constexprs & set(spec.signature), spec.label()
