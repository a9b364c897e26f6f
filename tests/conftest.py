"""Test setup: on a machine without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before any kernel module is imported, hence here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def minimax_log(caplog):
    """Each refusal reason is logged once per process: forget earlier ones, capture the logger."""
    import logging

    from minimax_ops.log import reset_log_once
    reset_log_once()
    caplog.set_level(logging.INFO, logger="minimax_ops")
    return caplog


def minimax_reasons(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "minimax_ops"]
