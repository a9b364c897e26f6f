"""Flagged words: a handoff between two kernels of the fused layer without a grid wait (opt-in:
``MINIMAX_OPS_FLAGGED_HANDOFF``, kernels/decode_layer.py).

A producer stores each 32-bit value in an int64 word whose high half is the layer call's tag; a consumer
launched as a programmatic dependent reads the words it needs with volatile loads until every one carries
its tag, instead of waiting (``griddepcontrol.wait``) for the producer's whole grid to complete and flush.
One store, no fence, no counter: a word is written in one access, so a word with the right tag holds its
value. (The arrival counters measured before, benchmarks/handoff_latency.py's ``spin``, paid a release fence
per program and polled one address with atomics from every program.)

The tag is ``TAG | (epoch & EPOCH_MASK)``, epoch a per-device int32 counter (``epoch``) that the layer's first
kernel (the input norm) bumps once per call, after its PDL wait: every kernel of the previous call that reads the
epoch has completed by then, and every kernel of this call reads it after. So each layer call of a step, and
each replay of a CUDA graph, tags its words differently, and a word an earlier call left at the same address
never passes for this call's. The high half is a quiet-NaN pattern with the epoch as payload, which no finite float
nor any id or count the layer stores has. A word that never gets its tag (a bug) stops the kernel with a trap after
POLL_LIMIT reads instead of hanging the GPU.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from .aot import KernelSpec

TAG = tl.constexpr(0x7FC00000)
EPOCH_MASK = tl.constexpr(0x3FFFFF)
POLL_LIMIT = tl.constexpr(1 << 22)

_EPOCHS: dict[torch.device, torch.Tensor] = {}


def epoch(device: torch.device) -> torch.Tensor:
    """The device's int32 [1] epoch counter, made at the first call outside a CUDA graph capture (one made
    inside a capture would be zeroed again at every replay, so an earlier replay's words would pass)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # one counter per GPU, however the device is named
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _EPOCHS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("flags.epoch: the flagged handoff's counter is made outside a CUDA graph capture "
                               "(run the fused layer once before capturing it)")
        _EPOCHS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _EPOCHS[device]


def check_epoch(epoch: torch.Tensor, device: torch.device) -> None:
    if epoch.dtype != torch.int32 or epoch.shape != (1,) or epoch.device != torch.device(device):
        raise ValueError(f"epoch: expected flags.epoch's int32 [1] counter on {device}, got {epoch.dtype} "
                         f"shape {tuple(epoch.shape)} on {epoch.device}")


@triton.jit
def flag_tag(epoch_ptr):
    """This layer call's tag, as the int64 high half of a flagged word."""
    e = tl.load(epoch_ptr, volatile=True)
    return ((e & EPOCH_MASK) | TAG).to(tl.int64) << 32


@triton.jit
def flag_words(tag, bits):
    """int32 bits -> flagged int64 words."""
    return tag | (bits.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _trap(x):
    return tl.inline_asm_elementwise("trap; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def poll_words(ptrs, mask, tag):
    """The int32 bits of the words at ptrs (masked-off lanes: 0) once every unmasked word carries tag."""
    w = tl.load(ptrs, mask=mask, other=tag, volatile=True)
    ready = tl.min(((w >> 32) == (tag >> 32)).to(tl.int32), axis=None)
    polls = 1
    while (ready == 0) & (polls < POLL_LIMIT):
        w = tl.load(ptrs, mask=mask, other=tag, volatile=True)
        ready = tl.min(((w >> 32) == (tag >> 32)).to(tl.int32), axis=None)
        polls += 1
    if ready == 0:
        _trap(ready)
    return (w & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def bump_epoch(epoch_ptr):
    """The next layer call's epoch (one program calls this, after every reader of the current one)."""
    tl.store(epoch_ptr, tl.load(epoch_ptr, volatile=True) + 1)


def flagged_specs(specs: list[KernelSpec], wanted,
                  variants: dict[str, tuple[dict, tuple[str, ...]]]) -> list[KernelSpec]:
    """CUDA-only copies of the PDL specs ``wanted`` picks (the flagged forms run only as programmatic dependents),
    one per variant: name suffix -> (constexprs to set, pointer arguments that hold int64 flagged words). Their
    epoch_ptr is the int32 counter (unflagged launches pass a stand-in of another type, never read)."""
    return [replace(s, constexprs={**s.constexprs, **set_},
                    signature={**s.signature, "epoch_ptr": "*i32", **{p: "*i64" for p in words}},
                    name=f"{s.label()}_{suffix}", targets=("cuda",))
            for s in specs if s.constexprs.get("PDL") and wanted(s) for suffix, (set_, words) in variants.items()]


def aot_specs() -> list:
    """None of its own: these are helpers, compiled (and covered) through the kernels that call them."""
    return []
