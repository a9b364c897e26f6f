"""Step guards, re-checked on FakeTensor metadata when a layer is matched.

Under plain torch.compile the model's Python branch (model.decode_eligible) already turned each of
these into a Dynamo guard; re-checking them here means a graph that reached the pass by another
route (vLLM drops Dynamo guards) is still never rewritten for a step the fused op cannot serve.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from minimax_ops.constants import MAX_TOKENS
from minimax_ops.step_contract import STEP_DTYPES, query_len_ok

from .deployment import Deployment


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, Node) else x


def step_refusal(kw: dict[str, Any], deployment: Deployment, range_end: int | None = None) -> str | None:
    """Why the matched layer's step cannot be fused, or None. ``range_end``: the last token count of
    the compile range being compiled (vLLM), which bounds a symbolic token count."""
    x = _val(kw["x"])
    if x is None:
        return "no FakeTensor metadata on the layer input"
    n, q = x.shape[0], kw["query_len"]
    if not isinstance(q, int):
        return f"query_len is not a compile-time constant ({q!r})"
    if not query_len_ok(q):
        return f"query_len={q} outside 1..{MAX_TOKENS}"
    bounded = (range_end is not None and range_end <= MAX_TOKENS) or deployment.any_size_graphs
    if not (bounded or statically_known_true(n <= MAX_TOKENS)) or not statically_known_true(n >= 1):
        return f"step of {n} tokens is not known to be within 1..{MAX_TOKENS}"
    # Under vLLM (a compile range, or one graph for every size) the fused op reads the step at run time
    # and takes the unfused stages for any step that is not a uniform decode of query_len.
    decided_per_step = deployment.any_size_graphs or range_end is not None
    if not (decided_per_step or statically_known_true(n % q == 0)):
        return f"step of {n} tokens is not known to be a multiple of query_len={q}"
    for name, want in STEP_DTYPES.items():
        if name not in kw:
            continue
        got = _val(kw[name])
        if got is None or got.dtype != want:
            return f"{name} is {getattr(got, 'dtype', None)}, the fused decode needs {want}"
    table = _val(kw["block_table"])
    if table.dim() != 2 or not statically_known_true(table.stride(1) == 1) \
            or not statically_known_true(table.stride(0) == table.shape[1]):
        return f"block_table is not row-contiguous (strides {tuple(table.stride())})"
    kv = _val(kw["kv_cache"])
    block = kv.shape[2]
    cfg = deployment.model_config
    want_block = deployment.block_size or (cfg.sparse_block_size if cfg is not None else None)
    if want_block is not None and block != want_block:
        return f"kv cache block size {block} differs from the deployment's {want_block}"
    for which, name in (("kv", "kv_cache"), ("index", "index_cache")):
        if name not in kw:
            continue
        want = deployment.cache_dtype(which)
        got = _val(kw[name]).dtype
        if got not in (torch.bfloat16, torch.float8_e4m3fn):
            return f"{name} dtype {got} is not supported (bf16 or fp8 e4m3)"
        if want is not None and got != want:
            return f"{name} holds {got} but the deployment's {which} cache dtype is {want}"
    return None
