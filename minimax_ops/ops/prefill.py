"""Attention for steps that are not uniform decodes (prefills, mixed batches): one opaque op over
requests of any query length. Its implementation is the reference (prefill speed is not this
package's concern); it exists so that the whole model still traces with fullgraph=True."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import reference as ref
from .checks import check, check_cache, check_dtype, check_step


def _check(q, index_q, kv_cache, index_cache, block_table, seq_lens, query_lens):
    check_dtype("q", q, torch.bfloat16)
    check_cache("kv_cache", kv_cache, (None, None, None, 2 * q.shape[-1]))
    check_step(q.shape[0], None, None, block_table, seq_lens)
    check(sum(query_lens) == q.shape[0], f"query_lens: expected lengths summing to {q.shape[0]} tokens, "
                                          f"got {list(query_lens)}")
    check((index_q is None) == (index_cache is None), "index_q and index_cache: give both (sparse) or neither")


@torch.library.custom_op("minimax::attention_any_step", mutates_args=())
def attention_any_step(q: Tensor, index_q: Tensor | None, kv_cache: Tensor, index_cache: Tensor | None,
                       block_table: Tensor, seq_lens: Tensor, query_lens: list[int], topk: int, k_scale: float,
                       v_scale: float) -> Tensor:
    """Causal attention for requests of any query length: block-sparse when index_q is given
    (indexer + sparse attention), dense otherwise. [n, H*D] bf16."""
    _check(q, index_q, kv_cache, index_cache, block_table, seq_lens, query_lens)
    lens = list(query_lens)
    if index_q is None:
        out = ref.dense_attention(q, kv_cache, block_table, seq_lens, 0, k_scale, v_scale, query_lens=lens)
    else:
        ids = ref.index_topk(index_q, index_cache, block_table, seq_lens, 0, topk, query_lens=lens)
        out = ref.sparse_attention(q, kv_cache, block_table, seq_lens, ids, 0, k_scale, v_scale, query_lens=lens)
    return out.reshape(q.shape[0], -1).to(torch.bfloat16)


@attention_any_step.register_fake
def _(q, index_q, kv_cache, index_cache, block_table, seq_lens, query_lens, topk, k_scale, v_scale):
    _check(q, index_q, kv_cache, index_cache, block_table, seq_lens, query_lens)
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


# ---- run-time fallbacks of the decode ops (step_context.general_step) ------------------------------------


def _real_tokens(query_lens) -> int:
    return sum(query_lens)


def general_index_topk(index_q, index_cache, block_table, seq_lens, topk, query_lens):
    """index_topk for any step; tokens past sum(query_lens) (CUDA-graph padding) get -1."""
    n, real = index_q.shape[0], _real_tokens(query_lens)
    out = torch.full((n, index_q.shape[1], topk), -1, dtype=torch.int32, device=index_q.device)
    out[:real] = ref.index_topk(index_q[:real], index_cache, block_table, seq_lens, 0, topk,
                                query_lens=list(query_lens))
    return out


def general_attention(q, kv_cache, block_table, seq_lens, block_ids, k_scale, v_scale, query_lens):
    """Sparse (block_ids given) or dense attention for any step; padding tokens get zeros."""
    n, real = q.shape[0], _real_tokens(query_lens)
    out = torch.zeros(n, q.shape[1] * q.shape[2], dtype=torch.bfloat16, device=q.device)
    lens = list(query_lens)
    if block_ids is None:
        o = ref.dense_attention(q[:real], kv_cache, block_table, seq_lens, 0, k_scale, v_scale, query_lens=lens)
    else:
        o = ref.sparse_attention(q[:real], kv_cache, block_table, seq_lens, block_ids[:real], 0, k_scale, v_scale,
                                 query_lens=lens)
    out[:real] = o.reshape(real, -1).to(torch.bfloat16)
    return out
