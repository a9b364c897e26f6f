"""Input checks shared by the fake and the real implementations of every op.

They read only shapes, dtypes and strides, so they run on FakeTensors at trace time and on real
tensors eagerly, and each failure names the argument, what was expected and what came.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..constants import MAX_TOKENS
from ..formats import WeightFormat, logical_in_features, logical_out_features, weight_layout
from ..step_contract import STEP_DTYPES, query_len_ok

CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def check(cond, msg: str) -> None:
    torch._check(cond, lambda: msg)


def check_dtype(name: str, t: torch.Tensor, dtypes: torch.dtype | Sequence[torch.dtype]) -> None:
    dtypes = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    check(t.dtype in dtypes, f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """shape entries of None match any size."""
    check(t.dim() == len(shape), f"{name}: expected {len(shape)} dimensions {tuple(shape)}, got shape {tuple(t.shape)}")
    for i, (got, want) in enumerate(zip(t.shape, shape)):
        if want is not None:
            check(got == want, f"{name}: expected size {want} in dimension {i}, got shape {tuple(t.shape)}")


def check_device(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    check(t.device == like.device, f"{name}: expected a tensor on {like.device}, got {t.device}")


def _checked_weight(name: str, weight: torch.Tensor, scale: torch.Tensor | None, experts: bool):
    """Format and rank of a (weight, scale) pair in any layout (formats.LAYOUTS) -> (format, K)."""
    rank = 3 if experts else 2
    try:
        layout = weight_layout(weight, scale, rank, name)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return layout.element, logical_in_features(weight, rank)


def _check_scale(name: str, weight: torch.Tensor, scale: torch.Tensor | None) -> None:
    if scale is not None:  # one scale per 32 values of each storage row (a tile row when tiled)
        check_shape(f"{name}_scale", scale, (*weight.shape[:-1], logical_in_features(weight) // 32))


def check_linear(name: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                 experts: bool = False) -> WeightFormat:
    """A (weight, scale) pair of any supported format whose K matches x's last dimension."""
    fmt, k = _checked_weight(name, weight, scale, experts)
    check(x.shape[-1] == k, f"{name}: weight takes {k} input features, the activation has {x.shape[-1]}")
    _check_scale(name, weight, scale)
    return fmt


def check_down_proj(name: str, up_name: str, up: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                    out_features: int, experts: bool = False) -> WeightFormat:
    """The down projection of a SwiGLU MLP whose fused up projection ``up`` holds gate rows then up
    rows [.., 2I, K]: it must take I input features and give out_features."""
    rank = 3 if experts else 2
    up_rows = logical_out_features(up, rank)
    check(up_rows % 2 == 0, f"{up_name}: expected an even number of rows (gate, then up), got shape "
                            f"{tuple(up.shape)}")
    fmt, k = _checked_weight(name, weight, scale, experts)
    inter = up_rows // 2
    check(k == inter, f"{name}: expected {inter} input features (half of {up_name}'s rows), got {k}")
    check(logical_out_features(weight, rank) == out_features,
          f"{name}: expected {out_features} output rows, got shape {tuple(weight.shape)}")
    _check_scale(name, weight, scale)
    return fmt


def check_activation(name: str, x: torch.Tensor, width: int | None = None) -> None:
    check_dtype(name, x, torch.bfloat16)
    check_shape(name, x, (None, width))


def check_cache(name: str, cache: torch.Tensor, shape: Sequence[int | None]) -> None:
    check_dtype(name, cache, CACHE_DTYPES)
    check_shape(name, cache, shape)
    check(cache.is_contiguous(), f"{name}: expected a contiguous cache, got strides {cache.stride()}")


def check_step(n, positions: torch.Tensor | None, slot_mapping: torch.Tensor | None, block_table: torch.Tensor | None,
               seq_lens: torch.Tensor | None, query_len: int | None = None) -> None:
    """Step metadata: int64 positions / slots covering the n tokens, an int32 row-contiguous block
    table and int32 seq_lens covering the n / query_len requests."""
    if positions is not None:
        check_dtype("positions", positions, STEP_DTYPES["positions"])
        check_shape("positions", positions, (n,))
    if slot_mapping is not None:
        check_dtype("slot_mapping", slot_mapping, STEP_DTYPES["slot_mapping"])
        check_shape("slot_mapping", slot_mapping, (n,))
    if block_table is not None:
        check_dtype("block_table", block_table, STEP_DTYPES["block_table"])
        check(block_table.dim() == 2, f"block_table: expected [requests, width], got shape {tuple(block_table.shape)}")
        check(block_table.stride(-1) == 1 and block_table.stride(0) == block_table.shape[1],
              f"block_table: expected a row-contiguous table, got strides {block_table.stride()}")
    if seq_lens is not None:
        check_dtype("seq_lens", seq_lens, STEP_DTYPES["seq_lens"])
        check(seq_lens.dim() == 1, f"seq_lens: expected 1 dimension, got shape {tuple(seq_lens.shape)}")
    if query_len is not None:
        check(query_len_ok(query_len), f"query_len: expected 1..{MAX_TOKENS}, got {query_len}")
        # Relations of the token count to query_len and the requests: checked whenever the sizes are
        # known (always on real tensors), not asserted on a symbolic trace-time count: a graph that
        # serves every step (vLLM) holds these ops for prefills too, which take the general path.
        check(not statically_known_true(n % query_len != 0), f"tokens: expected a multiple of query_len={query_len}, got {n}")
        if block_table is not None:
            check(not statically_known_true(block_table.shape[0] * query_len < n),
                  f"block_table: expected at least {n // query_len} rows for {n} tokens, got {block_table.shape[0]}")
        if seq_lens is not None:
            check(not statically_known_true(seq_lens.shape[0] * query_len < n),
                  f"seq_lens: expected at least {n // query_len} entries for {n} tokens, got {seq_lens.shape[0]}")
