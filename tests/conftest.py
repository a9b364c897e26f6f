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
