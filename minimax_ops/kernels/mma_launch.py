"""Host-side rules and checks of the mma-layout kernels' launches (linear_mma, qkv_mma, moe_mma): the
operands the fragment-order loads assume, when a launch reads its first weight step before its PDL
wait (mma_decode.first_blocks), and whether its weights stream evict-first."""

from __future__ import annotations

import os

import torch

from .mma_decode import TOKENS


def preloads(n_tokens: int) -> bool:
    """The rule: the mma GEMVs and w2 of an n-token step read their first weight step apart, before
    their PDL wait (``first_blocks``), in steps of one token group only (more hold it through
    several passes, and 16-token steps measured slower with it). The AOT specs follow it as is."""
    return n_tokens <= TOKENS.value


def preload_first(n_tokens: int) -> bool:
    """``preloads`` at a launch, unless MINIMAX_OPS_NO_PRELOAD=1 turns it off (read at every call:
    A/B runs switch it between rounds of one process)."""
    return preloads(n_tokens) and os.environ.get("MINIMAX_OPS_NO_PRELOAD") != "1"


def w2_two_steps(n_tokens: int, ring: int, pdl: bool, routed: bool) -> bool:
    """The rule (no switch): an n-token w2 launch reads two weight steps before its PDL wait where it is the
    fused layer's routed one-token w2 (a programmatic dependent that makes the router's top-k itself: the steps
    then load under w13's tail) with tiles that hold three steps in registers (ring 3: the ring is full at the
    wait, no spill; BENCHMARKS.md, forty-third session). The other ring-3 launches spill with two (AOT check).
    The AOT specs follow it as is."""
    return preloads(n_tokens) and pdl and routed and ring == 3


def w2_preload_steps(n_tokens: int, ring: int, pdl: bool, routed: bool) -> int:
    """The weight steps an n-token w2 launch reads before its PDL wait: ``preload_first``'s one, two where
    ``w2_two_steps`` says so, unless MINIMAX_OPS_W2_PRELOAD_STEPS=1 (read at every call: A/B runs switch it
    between rounds)."""
    if not preload_first(n_tokens):
        return 0
    two = w2_two_steps(n_tokens, ring, pdl, routed) and os.environ.get("MINIMAX_OPS_W2_PRELOAD_STEPS") != "1"
    return 2 if two else 1


def weights_evict_first(ptx: bool) -> bool:
    """Whether the mma-layout kernels' PTX launches stream their weights with L2's evict-first policy: read once,
    they then leave the rest of L2 to what is read again (activations, split-K partials, caches). The fused
    layer and the unfused chain alike (BENCHMARKS.md, thirty-sixth session); MINIMAX_OPS_EVICT_FIRST=0 (read at
    every launch: A/B runs switch it) turns it off."""
    return ptx and os.environ.get("MINIMAX_OPS_EVICT_FIRST") != "0"


def mma_operands(name: str, w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks as int32 words and the scale bytes as they are, checked (check_aligned)."""
    w = w.view(torch.int32)
    check_aligned(name, w, s)
    return w, s


def check_aligned(name: str, *tensors: torch.Tensor) -> None:
    """The fragment-order loads are 16-byte vectors only if every base is 16-byte aligned and every
    stride the kernels take (all but the last two dimensions: within a row block and a K block the
    layout is fixed) a multiple of 16 elements: Triton specialises on both (the kernels also assert
    it with tl.multiple_of), and another layout would break the inline PTX."""
    for t in tensors:
        lead = [st for st, size in zip(t.stride()[:-2], t.shape[:-2]) if size > 1]
        if t.data_ptr() % 16 or any(st % 16 for st in lead):
            raise ValueError(f"{name}: the mma-layout kernels need 16-byte aligned tensors whose outer strides are "
                             f"multiples of 16 elements, got shape {tuple(t.shape)} strides {t.stride()}")
