"""torch.library.opcheck on every torch.ops.minimax op, and input validation that names the argument.

opcheck runs, per sample: test_schema (declared mutations match what the op really writes: the
caches of the insert and fused ops, nothing else), test_autograd_registration, test_faketensor
(the fake's outputs match the real ones in shape/dtype/strides) and test_aot_dispatch_dynamic
(the op traced with dynamic shapes and run through AOTAutograd gives the eager results).
Samples cover q = 1 and q > 1 steps with a padding request, bf16 and fp8 caches, bf16 / MXFP8 /
MXFP4 weights, and the shared expert separate, in the table, or absent.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from minimax_ops import reference as ref
from minimax_ops.cache import allocate_caches, build_step
from minimax_ops.config import preset
from minimax_ops.formats import quantize
from minimax_ops.ops.chain import DENSE_WEIGHTS, SPARSE_WEIGHTS, DenseConsts, SparseConsts
from minimax_ops.weights import SHARED_IN_TABLE, SHARED_SEPARATE, random_layer_weights

minimax = torch.ops.minimax
CFG = preset("tiny")
H, KVH, D, ROT = CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim, CFG.rotary_dim
HI, DI, HID = CFG.sparse_num_index_heads, CFG.sparse_index_dim, CFG.hidden_size
E, TOPK, K_ROUTE = CFG.num_local_experts, CFG.sparse_topk_blocks, CFG.num_experts_per_tok
BS, NUM_BLOCKS = CFG.sparse_block_size, 24
THETA, EPS, ALPHA, LIMIT = CFG.rope_theta, CFG.rms_norm_eps, CFG.swiglu_alpha, CFG.swiglu_limit
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
DENSE_LAYER, SPARSE_LAYER = 0, 1
ALL_OPS = ("add_rmsnorm", "mx_linear", "qk_norm_rope_kv_insert", "qk_norm_rope_kv_index_insert", "index_topk",
           "sparse_attention_decode", "dense_attention_decode", "route", "moe_experts", "mlp", "attention_any_step",
           "fused_decode_layer", "fused_dense_decode_layer")
# Ops whose samples need more than one process: opcheck runs on them in the named test file.
OPCHECKED_ELSEWHERE = {"all_reduce": "tests/test_tensor_parallel.py"}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, gen, dtype=BF16, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _step(q: int, gen, contexts=(70, 21)):
    """A uniform decode step (q tokens per request) over two requests (the first spans 5-6 blocks, more
    than top-k) plus one padding request (seq_len 0, slots -1)."""
    return build_step(list(contexts), q, block_size=BS, num_blocks=NUM_BLOCKS, pad_requests=1, generator=gen)


def _caches(gen, kv_dtype=BF16, index_dtype=BF16):
    return allocate_caches(CFG, NUM_BLOCKS, kv_dtype=kv_dtype, index_dtype=index_dtype, generator=gen)[SPARSE_LAYER]


def _linear(n, k, fmt, gen):
    return quantize(torch.randn(n, k, generator=gen) * k ** -0.5, fmt)


def _experts(fmt, gen, count=E):
    w13, s13 = quantize(torch.randn(count, 2 * CFG.intermediate_size, HID, generator=gen) * HID ** -0.5, fmt)
    w2, s2 = quantize(torch.randn(count, HID, CFG.intermediate_size, generator=gen) * 0.2, fmt)
    return w13, s13, w2, s2


# ---- samples: (op name, args) --------------------------------------------------------------------------


def _add_rmsnorm(gen, n):
    return (_randn(n, HID, gen=gen), _randn(n, HID, gen=gen), _randn(HID, gen=gen, scale=0.1), EPS)


def _mx_linear(gen, n, fmt):
    return (_randn(n, HID, gen=gen), *_linear(96, HID, fmt, gen))


def _insert(gen, q, kv_dtype):
    meta = _step(q, gen)
    n = meta.num_tokens
    return (_randn(n, (H + 2 * KVH) * D, gen=gen), meta.positions, meta.slot_mapping, _randn(D, gen=gen, scale=0.1),
            _randn(D, gen=gen, scale=0.1), _caches(gen, kv_dtype).kv, H, KVH, D, ROT, THETA, EPS)


def _index_insert(gen, q, kv_dtype, index_dtype):
    meta = _step(q, gen)
    n = meta.num_tokens
    cache = _caches(gen, kv_dtype, index_dtype)
    norms = [_randn(d, gen=gen, scale=0.1) for d in (D, D, DI, DI)]
    return (_randn(n, (H + 2 * KVH) * D + (HI + 1) * DI, gen=gen), meta.positions, meta.slot_mapping,
            meta.index_slot_mapping, *norms, cache.kv, cache.index, H, KVH, D, ROT, THETA, EPS, HI, DI)


def _index_topk(gen, q, index_dtype):
    meta = _step(q, gen)
    return (_randn(meta.num_tokens, HI, DI, gen=gen), _caches(gen, index_dtype=index_dtype).index,
            meta.block_table, meta.seq_lens, q, TOPK)


def _sparse_attention(gen, q, kv_dtype, k_scale=1.0, v_scale=1.0):
    meta = _step(q, gen)
    n = meta.num_tokens
    cache = _caches(gen, kv_dtype)
    block_ids = ref.index_topk(_randn(n, KVH, DI, gen=gen), cache.index, meta.block_table, meta.seq_lens, q, TOPK)
    return (_randn(n, H, D, gen=gen), cache.kv, meta.block_table, meta.seq_lens, block_ids, q, k_scale, v_scale)


def _dense_attention(gen, q, kv_dtype, k_scale=1.0, v_scale=1.0):
    meta = _step(q, gen)
    return (_randn(meta.num_tokens, H, D, gen=gen), _caches(gen, kv_dtype).kv, meta.block_table, meta.seq_lens, q,
            k_scale, v_scale)


def _route(gen, n, bias):
    return (_randn(n, HID, gen=gen), torch.randn(E, HID, generator=gen) * HID ** -0.5,
            torch.randn(E, generator=gen) * 0.1 if bias else None, K_ROUTE, CFG.routed_scaling_factor)


def _moe(gen, n, fmt, shared, shared_fmt=None):
    h = _randn(n, HID, gen=gen)
    weights, ids = ref.route(h, torch.randn(E, HID, generator=gen) * HID ** -0.5, None, K_ROUTE, 2.0)
    table = _experts(fmt, gen, E + (shared == SHARED_IN_TABLE))
    sep = (None,) * 4
    if shared == SHARED_SEPARATE:
        sep = (*_linear(2 * CFG.shared_intermediate_size, HID, shared_fmt or fmt, gen),
               *_linear(HID, CFG.shared_intermediate_size, shared_fmt or fmt, gen))
    return (h, ids, weights, *table, *sep, E, ALPHA, LIMIT)


def _mlp(gen, n, fmt):
    inter = CFG.dense_intermediate_size
    return (_randn(n, HID, gen=gen), *_linear(2 * inter, HID, fmt, gen), *_linear(HID, inter, fmt, gen), ALPHA, LIMIT)


def _attention_any_step(gen, sparse, kv_dtype):
    # a prefill (12 tokens), a 3-token continuation and a padding request of 12 tokens
    meta = build_step([0, 30], [12, 3], block_size=BS, num_blocks=NUM_BLOCKS, pad_requests=1, generator=gen)
    n = meta.num_tokens
    cache = _caches(gen, kv_dtype)
    index_q, index = (_randn(n, HI, DI, gen=gen), cache.index) if sparse else (None, None)
    return (_randn(n, H, D, gen=gen), index_q, cache.kv, index, meta.block_table, meta.seq_lens,
            list(meta.query_lens), TOPK, 1.0, 1.0)


def _fused(gen, q, sparse, kv_dtype, **formats):
    meta = _step(q, gen)
    n = meta.num_tokens
    layer = SPARSE_LAYER if sparse else DENSE_LAYER
    w = random_layer_weights(CFG, layer, generator=gen, **formats)
    cache = _caches(gen, kv_dtype, kv_dtype)
    x, residual = _randn(n, HID, gen=gen), _randn(n, HID, gen=gen)
    dims = (q, H, KVH, D, ROT, THETA, EPS)
    if sparse:
        return (x, residual, meta.positions, meta.slot_mapping, meta.index_slot_mapping, meta.block_table,
                meta.seq_lens, cache.kv, cache.index, *(getattr(w, f) for f in SPARSE_WEIGHTS), *dims, HI, DI,
                TOPK, K_ROUTE, CFG.routed_scaling_factor, E, ALPHA, LIMIT, 1.0, 1.0)
    return (x, residual, meta.positions, meta.slot_mapping, meta.block_table, meta.seq_lens, cache.kv,
            *(getattr(w, f) for f in DENSE_WEIGHTS), *dims, ALPHA, LIMIT, 1.0, 1.0)


SAMPLES = {
    "add_rmsnorm-n1": ("add_rmsnorm", lambda g: _add_rmsnorm(g, 1)),
    "add_rmsnorm-n6": ("add_rmsnorm", lambda g: _add_rmsnorm(g, 6)),
    "mx_linear-bf16-n1": ("mx_linear", lambda g: _mx_linear(g, 1, "bf16")),
    "mx_linear-mxfp8-n6": ("mx_linear", lambda g: _mx_linear(g, 6, "mxfp8")),
    "mx_linear-mxfp4-n3": ("mx_linear", lambda g: _mx_linear(g, 3, "mxfp4")),
    "mx_linear-mxfp8-n2-fp32": ("mx_linear", lambda g: (*_mx_linear(g, 2, "mxfp8"), True)),
    "insert-q1-bf16": ("qk_norm_rope_kv_insert", lambda g: _insert(g, 1, BF16)),
    "insert-q2-fp8": ("qk_norm_rope_kv_insert", lambda g: _insert(g, 2, FP8)),
    "index_insert-q1-bf16": ("qk_norm_rope_kv_index_insert", lambda g: _index_insert(g, 1, BF16, BF16)),
    "index_insert-q2-fp8": ("qk_norm_rope_kv_index_insert", lambda g: _index_insert(g, 2, FP8, FP8)),
    "index_topk-q1-bf16": ("index_topk", lambda g: _index_topk(g, 1, BF16)),
    "index_topk-q3-fp8": ("index_topk", lambda g: _index_topk(g, 3, FP8)),
    "sparse_attention-q1-bf16": ("sparse_attention_decode", lambda g: _sparse_attention(g, 1, BF16)),
    "sparse_attention-q2-fp8": ("sparse_attention_decode", lambda g: _sparse_attention(g, 2, FP8, 0.5, 2.0)),
    "dense_attention-q1-fp8": ("dense_attention_decode", lambda g: _dense_attention(g, 1, FP8, 2.0, 0.5)),
    "dense_attention-q2-bf16": ("dense_attention_decode", lambda g: _dense_attention(g, 2, BF16)),
    "route-n1-bias": ("route", lambda g: _route(g, 1, True)),
    "route-n6-nobias": ("route", lambda g: _route(g, 6, False)),
    "moe-bf16-separate": ("moe_experts", lambda g: _moe(g, 3, "bf16", SHARED_SEPARATE)),
    "moe-mxfp8-table": ("moe_experts", lambda g: _moe(g, 1, "mxfp8", SHARED_IN_TABLE)),
    "moe-mxfp4-separate-mxfp8": ("moe_experts", lambda g: _moe(g, 6, "mxfp4", SHARED_SEPARATE, "mxfp8")),
    "moe-mxfp4-noshared": ("moe_experts", lambda g: _moe(g, 2, "mxfp4", None)),
    "moe-bf16-separate-fp32": ("moe_experts", lambda g: (*_moe(g, 2, "bf16", SHARED_SEPARATE), True)),
    "mlp-bf16": ("mlp", lambda g: _mlp(g, 1, "bf16")),
    "mlp-mxfp8": ("mlp", lambda g: _mlp(g, 6, "mxfp8")),
    "mlp-mxfp4": ("mlp", lambda g: _mlp(g, 3, "mxfp4")),
    "mlp-mxfp8-fp32": ("mlp", lambda g: (*_mlp(g, 2, "mxfp8"), True)),
    "any_step-dense-bf16": ("attention_any_step", lambda g: _attention_any_step(g, False, BF16)),
    "any_step-sparse-fp8": ("attention_any_step", lambda g: _attention_any_step(g, True, FP8)),
    "fused-q1-bf16-separate": ("fused_decode_layer", lambda g: _fused(g, 1, True, BF16)),
    "fused-q2-mx-table-fp8": ("fused_decode_layer", lambda g: _fused(
        g, 2, True, FP8, linear_format="mxfp8", expert_format="mxfp4", shared=SHARED_IN_TABLE)),
    "fused_dense-q1-bf16": ("fused_dense_decode_layer", lambda g: _fused(g, 1, False, BF16)),
    "fused_dense-q2-mxfp8-fp8": ("fused_dense_decode_layer", lambda g: _fused(g, 2, False, FP8, linear_format="mxfp8")),
}


@pytest.mark.parametrize("op,consts", [(minimax.fused_decode_layer, SparseConsts),
                                       (minimax.fused_dense_decode_layer, DenseConsts)])
def test_layer_constants_follow_the_fused_op_schemas(op, consts):
    """chain.py's constants are the fused op's scalar arguments, in order (then ``partial``, not an argument)."""
    scalars = [a.name for a in op.default._schema.arguments if str(a.type) in ("int", "float")]
    assert list(consts._fields) == scalars[:scalars.index("layer_index")] + ["partial"]


def test_samples_cover_every_op():
    assert {op for op, _ in SAMPLES.values()} == set(ALL_OPS)
    registered = {name for name in dir(minimax) if isinstance(getattr(minimax, name), torch._ops.OpOverloadPacket)}
    assert set(ALL_OPS) <= registered
    missing = registered - set(ALL_OPS) - set(OPCHECKED_ELSEWHERE)
    assert missing == set(), f"ops without opcheck samples: {missing}"


_allclose = torch.allclose


def _allclose_with_fp8(a, b, *args, **kwargs):
    # opcheck's test_schema (SchemaCheckMode.bitwise_equal) compares every argument before and after
    # the call with torch.allclose, which has no float8 kernel on CPU ("mul_cpu_reduced_float" not
    # implemented for 'Float8_e4m3fn'; pytorch/pytorch#135998): compare fp8 tensors' bits instead.
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype == a.dtype:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return _allclose(a, b, *args, **kwargs)


@pytest.mark.parametrize("sample", list(SAMPLES))
def test_opcheck(sample, monkeypatch):
    monkeypatch.setattr(torch, "allclose", _allclose_with_fp8)
    op_name, make = SAMPLES[sample]
    args = make(_gen(list(SAMPLES).index(sample)))
    result = torch.library.opcheck(getattr(minimax, op_name).default, args)
    assert set(result) == {"test_schema", "test_autograd_registration", "test_faketensor",
                           "test_aot_dispatch_dynamic"}
    assert all(v == "SUCCESS" for v in result.values()), result


@torch.library.custom_op("minimax_opcheck_control::undeclared_cache_write", mutates_args=())
def _undeclared_cache_write(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache.view(torch.uint8)[0].add_(1)  # writes an argument it does not declare as mutated
    return x.clone()


@_undeclared_cache_write.register_fake
def _(x, cache):
    return torch.empty_like(x)


def test_schema_check_catches_an_undeclared_fp8_cache_write(monkeypatch):
    """Negative control: with the fp8 comparison above, test_schema still sees a write to an fp8 cache."""
    monkeypatch.setattr(torch, "allclose", _allclose_with_fp8)
    cache = torch.randn(4, 8).to(FP8)
    with pytest.raises(Exception, match="mutated"):
        torch.library.opcheck(_undeclared_cache_write._opoverload, (torch.randn(3), cache), test_utils="test_schema")


def test_mutating_ops_really_write_their_caches():
    """The cache writes that opcheck's schema test checks against the declarations do happen."""
    args = _index_insert(_gen(1), 2, BF16, FP8)
    kv, index = args[8].clone(), args[9].clone()
    minimax.qk_norm_rope_kv_index_insert(*args)
    assert not torch.equal(kv, args[8])
    assert not torch.equal(index.view(torch.uint8), args[9].view(torch.uint8))


# ---- errors name the argument, in the real and the fake implementation -----------------------------------


def _replace(op_name: str, args: tuple, name: str, value) -> tuple:
    schema = getattr(minimax, op_name).default._schema
    index = next(i for i, a in enumerate(schema.arguments) if a.name == name)
    return args[:index] + (value,) + args[index + 1:]


def _arg(op_name: str, args: tuple, name: str):
    schema = getattr(minimax, op_name).default._schema
    return args[next(i for i, a in enumerate(schema.arguments) if a.name == name)]


_rows = lambda t, n: t[:n].clone()  # noqa: E731
ERRORS = [
    # (sample, argument, replacement(args) -> bad value, message regex)
    ("add_rmsnorm-n6", "x", lambda a: a[0].float(), r"x: expected dtype torch\.bfloat16"),
    ("add_rmsnorm-n6", "residual", lambda a: a[1][:, :32].clone(), r"residual"),
    ("add_rmsnorm-n6", "weight", lambda a: a[2][:32].clone(), r"weight: expected size 64"),
    ("mx_linear-mxfp8-n6", "x", lambda a: a[0][:, :32].clone(), r"weight: weight takes 64 input features"),
    ("mx_linear-mxfp8-n6", "scale", lambda a: None, r"weight: .*needs an E8M0 scale"),
    ("mx_linear-mxfp4-n3", "scale", lambda a: a[2][:, :1].clone(), r"weight_scale: expected size 2"),
    ("mx_linear-bf16-n1", "weight", lambda a: a[1].to(torch.float64), r"weight: .*dtype"),
    ("insert-q1-bf16", "positions", lambda a: a[1].int(), r"positions: expected dtype torch\.int64"),
    ("insert-q1-bf16", "slot_mapping", lambda a: a[2][:-1].clone(), r"slot_mapping: expected size 3"),
    ("insert-q2-fp8", "kv_cache", lambda a: a[5].float(), r"kv_cache: expected dtype"),
    ("insert-q2-fp8", "kv_cache", lambda a: a[5][:, :1].clone(), r"kv_cache: expected size 2"),
    ("insert-q1-bf16", "kv_cache", lambda a: a[5].transpose(0, 1).contiguous().transpose(0, 1),
     r"kv_cache: expected a contiguous cache"),
    ("insert-q1-bf16", "qkv", lambda a: a[0][:, :-32].clone(), r"qkv: expected size 384"),
    ("index_insert-q2-fp8", "index_slot_mapping", lambda a: a[3].int(), r"index_slot_mapping: expected dtype"),
    ("index_insert-q2-fp8", "index_cache", lambda a: a[9][:, :8].clone(), r"index_cache: expected size 16"),
    ("index_topk-q1-bf16", "block_table", lambda a: a[2].long(), r"block_table: expected dtype torch\.int32"),
    ("index_topk-q1-bf16", "block_table", lambda a: a[2].t().contiguous().t(), r"block_table: expected a row-contig"),
    ("index_topk-q3-fp8", "seq_lens", lambda a: a[3].long(), r"seq_lens: expected dtype torch\.int32"),
    ("index_topk-q3-fp8", "query_len", lambda a: 0, r"query_len: expected 1\.\.16"),
    ("index_topk-q3-fp8", "query_len", lambda a: 2, r"tokens: expected a multiple of query_len=2"),
    ("index_topk-q1-bf16", "topk", lambda a: 0, r"topk: expected >= 1"),
    ("index_topk-q1-bf16", "index_q", lambda a: a[0].float(), r"index_q: expected dtype"),
    ("sparse_attention-q1-bf16", "block_ids", lambda a: a[4].long(), r"block_ids: expected dtype torch\.int32"),
    ("sparse_attention-q1-bf16", "block_ids", lambda a: a[4][:, :1].clone(), r"block_ids: expected size 2"),
    ("sparse_attention-q2-fp8", "q", lambda a: a[0][:, :7].clone(), r"q: expected a multiple of"),
    ("sparse_attention-q2-fp8", "seq_lens", lambda a: _rows(a[3], 1), r"seq_lens: expected at least 3 entries"),
    ("dense_attention-q1-fp8", "q", lambda a: a[0].float(), r"q: expected dtype torch\.bfloat16"),
    ("dense_attention-q2-bf16", "block_table", lambda a: _rows(a[2], 2), r"block_table: expected at least 3 rows"),
    ("dense_attention-q2-bf16", "kv_cache", lambda a: a[1][..., :32].clone(), r"kv_cache: expected size 64"),
    ("route-n1-bias", "gate", lambda a: a[1].bfloat16(), r"gate: expected dtype torch\.float32"),
    ("route-n1-bias", "gate_bias", lambda a: a[2][:4].clone(), r"gate_bias: expected size 8"),
    ("route-n6-nobias", "top_k", lambda a: E + 1, r"top_k: expected 1\.\.8"),
    ("route-n6-nobias", "h", lambda a: a[0].float(), r"h: expected dtype"),
    ("moe-bf16-separate", "topk_ids", lambda a: a[1].long(), r"topk_ids: expected dtype torch\.int32"),
    ("moe-bf16-separate", "topk_weights", lambda a: a[2].bfloat16(), r"topk_weights: expected dtype torch\.float32"),
    ("moe-bf16-separate", "w13", lambda a: a[3][:E - 1].clone(), r"w13: expected 8 experts"),
    ("moe-mxfp8-table", "w2", lambda a: a[5][:E].clone(), r"w2: expected 9 experts"),
    ("moe-mxfp8-table", "shared_w13", lambda a: _linear(64, HID, "bf16", _gen(0))[0],
     r"shared_w13: given separately while w13 also holds a shared expert"),
    ("moe-bf16-separate", "shared_w2", lambda a: None, r"shared_w2: expected a tensor"),
    ("mlp-bf16", "w13", lambda a: a[1][:, :32].clone(), r"w13: weight takes 32 input features"),
    ("mlp-mxfp8", "h", lambda a: a[0].float(), r"h: expected dtype"),
    ("mlp-bf16", "w2", lambda a: a[3][:, :64].clone(), r"w2: expected 96 input features \(half of w13's rows\)"),
    ("mlp-mxfp8", "w2_scale", lambda a: None, r"w2: .*needs an E8M0 scale"),
    ("mlp-mxfp4", "w2_scale", lambda a: a[4][:, :1].clone(), r"w2_scale: expected size 3"),
    ("mlp-mxfp8", "w2", lambda a: a[3][:32].clone(), r"w2: expected 64 output rows"),
    ("moe-bf16-separate", "w2", lambda a: a[5][..., :16].clone(), r"w2: expected 32 input features"),
    ("moe-mxfp8-table", "w2_scale", lambda a: None, r"w2: .*needs an E8M0 scale"),
    ("moe-mxfp4-separate-mxfp8", "shared_w2", lambda a: a[9][:, :16].clone(),
     r"shared_w2: expected 32 input features \(half of shared_w13's rows\)"),
    ("any_step-dense-bf16", "query_lens", lambda a: [12, 3, 11], r"query_lens: expected lengths summing to 27"),
    ("any_step-sparse-fp8", "index_cache", lambda a: None, r"index_q and index_cache: give both"),
    ("any_step-sparse-fp8", "kv_cache", lambda a: a[2].half(), r"kv_cache: expected dtype"),
    ("fused-q1-bf16-separate", "x", lambda a: a[0][:0], r"x: expected at least 1 token, got 0"),
    ("fused-q1-bf16-separate", "positions", lambda a: a[2].int(), r"positions: expected dtype torch\.int64"),
    ("fused-q2-mx-table-fp8", "kv_cache", lambda a: a[7].half(), r"kv_cache: expected dtype"),
    ("fused-q2-mx-table-fp8", "index_cache", lambda a: a[8][:, :8].clone(), r"index_cache: expected size 16"),
    ("fused_dense-q1-bf16", "block_table", lambda a: a[4].long(), r"block_table: expected dtype torch\.int32"),
    ("fused_dense-q2-mxfp8-fp8", "residual", lambda a: a[1][:, :32].clone(), r"residual: expected size 64"),
]


def _error_id(case) -> str:
    return f"{case[0]}-{case[1]}-{ERRORS.index(case)}"


@pytest.mark.parametrize("mode", ["real", "fake"])
@pytest.mark.parametrize("case", ERRORS, ids=_error_id)
def test_bad_input_names_the_argument(case, mode):
    sample, name, bad, message = case
    op_name, make = SAMPLES[sample]
    args = make(_gen(ERRORS.index(case)))
    args = _replace(op_name, args, name, bad(args))
    op = getattr(minimax, op_name).default
    if mode == "fake":
        with FakeTensorMode(allow_non_fake_inputs=False) as fake:
            fake_args = tuple(fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            with pytest.raises((RuntimeError, ValueError), match=message):
                op(*fake_args)
    else:
        with pytest.raises((RuntimeError, ValueError), match=message):
            op(*args)


def test_error_cases_cover_every_op():
    assert {SAMPLES[s][0] for s, *_ in ERRORS} == set(ALL_OPS)
