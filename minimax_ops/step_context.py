"""Host-side facts of the step being run, for decisions that a compiled graph cannot guard.

vLLM drops Dynamo guards and picks a compiled graph by token count alone, so a 4-token prefill
runs the artifact compiled for a 4-request decode. The step-kind-dependent ops (indexer, attention,
the fused layers) therefore ask here at run time: when the current step is not a uniform decode of
the query length they were traced for, they compute the general (any-step) version instead. The
facts are host-side and identical on every rank (the scheduler's metadata), and reading them needs
no device sync. Under a full CUDA graph the decision is taken once at capture, per batch kind.

The current step is what ``use_step(meta)`` set (the vLLM model sets it around each step, from vLLM's
attention metadata: minimax_vllm); None outside (plain torch.compile: Dynamo guards decided already).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .cache import StepMetadata
from .step_contract import uniform_decode

_local = threading.local()


@contextmanager
def use_step(meta: StepMetadata) -> Iterator[StepMetadata]:
    previous = getattr(_local, "step", None)
    _local.step = meta
    try:
        yield meta
    finally:
        _local.step = previous


def current_step() -> StepMetadata | None:
    return getattr(_local, "step", None)


def general_step(query_len: int) -> StepMetadata | None:
    """The current step when it is NOT a uniform decode of ``query_len`` (the ops must then take
    the general path), else None."""
    step = current_step()
    if step is None or uniform_decode(step.num_prefills, step.query_len, query_len):
        return None
    return step
