"""The fused decode: one op per decoder layer and step.

    torch.ops.minimax.fused_decode_layer(x, residual, <step metadata>, kv_cache!, index_cache!,
                                         <layer weights>, <layer constants>, layer_index, checked,
                                         group_name) -> (out, residual)

replaces the sparse MoE chain of ops/chain.py (add_rmsnorm ... moe_experts, with its two
all-reduces under tensor parallelism), and ``fused_dense_decode_layer`` the dense chain. Weights,
caches and metadata are tensor arguments, so nothing is baked: re-allocated caches or new weights
are just new arguments, and under a CUDA graph the op reads each step's metadata from the same
persistent buffers. ``group_name`` names the tensor-parallel group ("" = none; collectives.py):
the op performs both all-reduces inside its body, between its two halves and after the second.

The implementation hooks, one per layer kind and half, are the module-level names below; a fused
kernel replaces a default by rebinding its name, nothing else changes:

    SPARSE_ATTENTION_IMPL(x, residual, positions, slot_mapping, index_slot_mapping, block_table,
                          seq_lens, kv_cache, index_cache, w, c) -> (o_unreduced, residual)
    DENSE_ATTENTION_IMPL(x, residual, positions, slot_mapping, block_table, seq_lens, kv_cache,
                         w, c) -> (o_unreduced, residual)
    SPARSE_FFN_IMPL(o_reduced, residual, w, c) -> (out_unreduced, residual)
    DENSE_FFN_IMPL(o_reduced, residual, w, c) -> (out_unreduced, residual)

On kernels without tensor parallelism the sparse attention half may return a chain.OutProjection
for o_unreduced (o_proj not yet run), which the sparse FFN half projects itself (chain.py).
``w``: the layer's weights by SPARSE_WEIGHTS / DENSE_WEIGHTS name; ``c``: chain.SparseConsts /
DenseConsts. The attention half writes the caches (k/v at slot_mapping, index_k at
index_slot_mapping; slot < 0 writes nothing). Outputs are [n, hidden]: residual and o_reduced bf16
(o_reduced fp32 for a hook's FFN half on the stage kernels under tensor parallelism: chain.run_layer's
``fp32_sums``); o_unreduced and out_unreduced bf16, or fp32 partial sums when ``c.partial`` (tensor
parallelism: fp32 keeps TP results equal to TP 1, as chain.py says). Defaults: the
vocabulary stages of chain.py, launched back to back inside this one op (one dispatch, one node
for CUDA graphs), which on CPU run the reference, so all paths agree by construction there.

One body serves both ops. Before anything is written: shapes and dtypes are checked always;
metadata values (slots and block ids inside the caches, seq_lens inside the table, shared block
ids) where reading them is free or asked for (validate.py); in checked mode also NaN/Inf in x, and
the step runs the unfused chain beside the fused one (checked.py). A step that is not the uniform
decode the op was compiled for (vLLM cannot guard batch kinds: step_context.py) runs the unfused
chain, whose step-dependent ops take the general path. Under tensor parallelism every decision is
taken from rank-identical state (shapes, dtypes, host step metadata, the op's arguments), and the
value checks that read per-rank device data are agreed across the group before anyone refuses, so
all ranks take the same path and none is left waiting in an all-reduce. ``layer_index`` only
labels checked-mode reports.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ..backend import use_kernels
from ..constants import MAX_TOKENS
from ..formats import logical_out_features
from ..log import log_once
from ..step_context import general_step
from . import chain
from . import checked as checked_mode
from . import stages
from .chain import DENSE_WEIGHTS, SPARSE_WEIGHTS, DenseConsts, SparseConsts
from .checks import check, check_activation, check_cache, check_down_proj, check_linear, check_shape, check_step
from .collectives import any_rank
from .validate import StepValueError, should_validate, validate_step_values

# How often each fused op's Python implementation ran: a captured CUDA graph replays without it.
impl_calls = {"sparse": 0, "dense": 0}
# How many of those ran the unfused stages instead (a step that is not the traced decode, or too large).
fallback_calls = {"sparse": 0, "dense": 0}

# The implementation hooks (see the module docstring).
def _on_kernels(half):
    """A chain half run on the stage kernels launched as programmatic dependents of each other
    (kernels/decode_layer.py) where kernels run; the vocabulary elsewhere."""
    def run(*args):
        if not use_kernels(args[1]):  # (the residual: every half's second argument, always a tensor)
            return half(*args)
        from ..kernels.decode_layer import kernel_stages
        return half(*args, ops=kernel_stages())
    return run


def fp32_between_halves() -> bool:
    """Whether a tensor-parallel fused layer on the stage kernels keeps its all-reduces' sums in fp32 for its
    own kernels (chain.run_layer's ``fp32_sums``): yes, unless MINIMAX_OPS_FP32_SUMS=0 (read at every call:
    A/B runs switch it; the bits are the same either way)."""
    return os.environ.get("MINIMAX_OPS_FP32_SUMS") != "0"


SPARSE_ATTENTION_IMPL = _on_kernels(chain.sparse_attention)
SPARSE_FFN_IMPL = _on_kernels(chain.sparse_ffn)
DENSE_ATTENTION_IMPL = _on_kernels(chain.dense_attention)
DENSE_FFN_IMPL = _on_kernels(chain.dense_ffn)


def _check_step(x, residual, positions, slot_mapping, block_table, seq_lens, kv_cache, query_len):
    n = x.shape[0]
    # No upper bound here: a graph that serves every step size (vLLM's trace-once mode) holds the fused
    # op for large steps too, and the implementation runs the unfused stages above MAX_TOKENS.
    check(n >= 1, f"x: expected at least 1 token, got {n}")
    check_activation("x", x)
    check_activation("residual", residual, x.shape[1])
    check_step(n, positions, slot_mapping, block_table, seq_lens, query_len)
    check_cache("kv_cache", kv_cache, (None, None, None, None))


def _meta(*shape, dtype=torch.bfloat16) -> Tensor:
    """A shape-only stand-in for an intermediate, so that a later stage's checks can run up front."""
    return torch.empty(shape, dtype=dtype, device="meta")


def _check_late_weights(x, w, num_heads, head_dim, top_k=None, num_routed_experts=None):
    """The weight checks of the stages after the cache insert, run before it: a refused call writes
    nothing. top_k None: the dense MLP, else the router and experts."""
    n, hidden = x.shape
    check_linear("o_proj", _meta(n, num_heads * head_dim), w["o_proj"], w["o_proj_scale"])
    check(logical_out_features(w["o_proj"], 2) == hidden,
          f"o_proj: expected {hidden} output rows, got shape {tuple(w['o_proj'].shape)}")
    check_shape("post_norm", w["post_norm"], (hidden,))
    if top_k is None:
        check_linear("w13", x, w["w13"], w["w13_scale"])
        check_down_proj("w2", "w13", w["w13"], w["w2"], w["w2_scale"], hidden)
        return
    stages._check_route(x, w["gate"], w["gate_bias"], top_k)
    stages._check_moe(x, _meta(n, top_k, dtype=torch.int32), _meta(n, top_k, dtype=torch.float32), w["w13"],
                      w["w13_scale"], w["w2"], w["w2_scale"], w["shared_w13"], w["shared_w13_scale"], w["shared_w2"],
                      w["shared_w2_scale"], num_routed_experts)


_KINDS = {  # kind -> (weight names, consts type, checked-mode label, default halves, hook names)
    "sparse": (SPARSE_WEIGHTS, SparseConsts, "sparse_moe", ("sparse_attention", "sparse_ffn"),
               ("SPARSE_ATTENTION_IMPL", "SPARSE_FFN_IMPL")),
    "dense": (DENSE_WEIGHTS, DenseConsts, "dense", ("dense_attention", "dense_ffn"),
              ("DENSE_ATTENTION_IMPL", "DENSE_FFN_IMPL")),
}


def _split(kind: str, args: tuple):
    """A fused op's arguments -> (step tensors, caches, weights dict, consts, layer_index, checked, group)."""
    names, consts_type = _KINDS[kind][:2]
    n_step, n_caches = (7, 2) if kind == "sparse" else (6, 1)
    step, rest = args[:n_step], args[n_step:]
    caches, rest = list(rest[:n_caches]), rest[n_caches:]
    w, rest = dict(zip(names, rest[:len(names)])), rest[len(names):]
    n_consts = len(consts_type._fields) - len(consts_type._field_defaults)  # the op's constants; not `partial`
    given, defaults = rest[n_consts:], (-1, False, "")  # a fake may get trailing defaults left out
    layer_index, checked, group_name = (*given, *defaults[len(given):])
    consts = consts_type(*rest[:n_consts], partial=bool(group_name))
    return step, caches, w, consts, layer_index, checked, group_name


def _check_call(kind, step, caches, w, c, fallback: bool) -> None:
    """Shape and dtype checks (fake and real): what every rank sees alike."""
    x, residual, positions, slot_mapping = step[:4]
    block_table, seq_lens = step[-2:]
    _check_step(x, residual, positions, slot_mapping, block_table, seq_lens, caches[0],
                None if fallback else c.query_len)
    if kind == "sparse":
        check_cache("index_cache", caches[1], (caches[0].shape[0], caches[0].shape[2], None))


def _checked(checked: bool, group_name: str) -> bool:
    if not checked_mode.enabled():
        return checked
    if group_name:  # an environment variable is per process: ranks could disagree and deadlock
        log_once("MINIMAX_OPS_CHECK is ignored under tensor parallelism (each rank reads its own "
                 "environment); use MiniMaxM3DecodePass(checked=True), which every rank's graph shares")
        return checked
    return True


def _validate(kind, step, caches, c, checked: bool, group_name: str) -> None:
    """Value checks, agreed across the tensor-parallel group: if any rank refuses, all do."""
    x, _, positions, slot_mapping = step[:4]
    index_slots = step[4] if kind == "sparse" else None
    error = None
    try:
        validate_step_values(x, positions, slot_mapping, index_slots, step[-2], step[-1], caches[0],
                             caches[1] if kind == "sparse" else None, c.query_len, finite=checked)
    except StepValueError as e:
        error = e
    if any_rank(error is not None, group_name, x.device):
        if error is not None:
            raise error
        raise StepValueError(f"another rank of tensor-parallel group {group_name!r} refused this step's input "
                             "(see its error); refused here too, so that no rank waits in an all-reduce")


def _layer(kind: str, args: tuple) -> tuple[Tensor, Tensor]:
    """The body both fused ops share."""
    impl_calls[kind] += 1
    step, caches, w, c, layer_index, checked, group_name = _split(kind, args)
    _, _, label, defaults, hooks = _KINDS[kind]
    # A step that is not the uniform decode this op was compiled for (vLLM cannot guard batch kinds),
    # or one larger than the fused kernels take (a graph serving every size), runs the unfused chain,
    # whose step-dependent ops take the general path (step_context.py). Host facts: rank-identical.
    fallback = general_step(c.query_len) is not None or step[0].shape[0] > MAX_TOKENS
    fallback_calls[kind] += fallback
    _check_call(kind, step, caches, w, c, fallback)
    checked = _checked(checked, group_name)
    if should_validate(step[0], checked) and not fallback:
        _validate(kind, step, caches, c, checked, group_name)
    _check_late_weights(step[0], w, c.num_heads, c.head_dim, *((c.top_k, c.num_routed_experts)
                                                              if kind == "sparse" else ()))

    def run(halves, cs, fp32_sums=False):
        return chain.run_layer(*halves, (*step, *cs), w, c, group_name, fp32_sums)

    def unfused(cs):  # looked up at call time, so tests can spy on the chain
        return run([getattr(chain, name) for name in defaults], cs)

    def fused(cs):  # (the hooks' FFN half runs on the stage kernels where use_kernels: it takes fp32 sums)
        return run([globals()[name] for name in hooks], cs, fp32_sums=use_kernels(step[1]) and fp32_between_halves())

    if fallback:
        return unfused(caches)
    if checked:
        return checked_mode.run_checked(layer_index, label, caches, fused, unfused, group_name)
    return fused(caches)


def _fake(kind: str, args: tuple) -> tuple[Tensor, Tensor]:
    step, caches, w, c, *_ = _split(kind, args)
    _check_call(kind, step, caches, w, c, False)
    return torch.empty_like(step[0]), torch.empty_like(step[0])


@torch.library.custom_op("minimax::fused_decode_layer", mutates_args=("kv_cache", "index_cache"))
def fused_decode_layer(
        x: Tensor, residual: Tensor, positions: Tensor, slot_mapping: Tensor, index_slot_mapping: Tensor,
        block_table: Tensor, seq_lens: Tensor, kv_cache: Tensor, index_cache: Tensor,
        input_norm: Tensor, qkv: Tensor, qkv_scale: Tensor | None, q_norm: Tensor, k_norm: Tensor,
        index_q_norm: Tensor, index_k_norm: Tensor, o_proj: Tensor, o_proj_scale: Tensor | None, post_norm: Tensor,
        gate: Tensor, gate_bias: Tensor | None, w13: Tensor, w13_scale: Tensor | None, w2: Tensor,
        w2_scale: Tensor | None, shared_w13: Tensor | None, shared_w13_scale: Tensor | None,
        shared_w2: Tensor | None, shared_w2_scale: Tensor | None,
        query_len: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, rope_theta: float,
        eps: float, index_heads: int, index_dim: int, topk_blocks: int, top_k: int, routed_scaling: float,
        num_routed_experts: int, alpha: float, limit: float, k_scale: float, v_scale: float,
        layer_index: int = -1, checked: bool = False, group_name: str = "",
) -> tuple[Tensor, Tensor]:
    """One sparse MoE decode layer: (x, residual) -> (out, residual); writes k/v and index_k."""
    return _layer("sparse", tuple(locals().values()))  # locals() here: the arguments, in schema order


@fused_decode_layer.register_fake
def _(*args):
    return _fake("sparse", args)


@torch.library.custom_op("minimax::fused_dense_decode_layer", mutates_args=("kv_cache",))
def fused_dense_decode_layer(
        x: Tensor, residual: Tensor, positions: Tensor, slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor,
        kv_cache: Tensor, input_norm: Tensor, qkv: Tensor, qkv_scale: Tensor | None, q_norm: Tensor,
        k_norm: Tensor, o_proj: Tensor, o_proj_scale: Tensor | None, post_norm: Tensor, w13: Tensor,
        w13_scale: Tensor | None, w2: Tensor, w2_scale: Tensor | None,
        query_len: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, rope_theta: float,
        eps: float, alpha: float, limit: float, k_scale: float, v_scale: float,
        layer_index: int = -1, checked: bool = False, group_name: str = "",
) -> tuple[Tensor, Tensor]:
    """One dense decode layer (full GQA attention + SwiGLU-OAI MLP)."""
    return _layer("dense", tuple(locals().values()))


@fused_dense_decode_layer.register_fake
def _(*args):
    return _fake("dense", args)
