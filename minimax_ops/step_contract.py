"""The fused decode's step contract, in one place: what a step must be for the decode ops to serve it.

Read by the model's Python branch (model.decode_eligible, Dynamo guards under plain torch.compile), the
graph pass's step guards on FakeTensor metadata (graph_passes/guards.py), the ops' input checks
(ops/checks.py) and the run-time choice of the general path (step_context.general_step).
"""

from __future__ import annotations

import torch

from .constants import MAX_TOKENS

# dtypes of the step metadata the decode ops take
STEP_DTYPES = {"positions": torch.int64, "slot_mapping": torch.int64, "index_slot_mapping": torch.int64,
               "block_table": torch.int32, "seq_lens": torch.int32}


def query_len_ok(query_len) -> bool:
    """A decode query length the fused ops take: 1..MAX_TOKENS tokens per request."""
    return 1 <= query_len <= MAX_TOKENS


def uniform_decode(num_prefills: int, step_query_len: int, query_len: int) -> bool:
    """Host facts of a step that make it the uniform decode of ``query_len`` tokens per request."""
    return num_prefills == 0 and step_query_len == query_len and query_len_ok(query_len)


def fusable_token_count(num_tokens: int, query_len: int) -> bool:
    """1..MAX_TOKENS tokens, whole requests of query_len each."""
    return 1 <= num_tokens <= MAX_TOKENS and query_len_ok(query_len) and num_tokens % query_len == 0
