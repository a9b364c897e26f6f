"""The tensor-parallel all-reduce of the decode vocabulary, and rank agreement for refusals.

    torch.ops.minimax.all_reduce(x, group_name) -> sum of x over the ranks of the group

A tensor-parallel model calls it twice per layer (after o_proj, after the FFN: the spec's points);
the graph pass takes both into the fused layer, which then performs them inside its body. The
group is named, never held, so graphs and pickled configs carry only a string, resolved at run time:

- ``VLLM_TP_GROUP`` ("vllm:tp"): vLLM's tensor-parallel group (``vllm.distributed.get_tp_group()``),
  through vLLM's own communicator (custom all-reduce / pynccl, capturable in its CUDA graphs);
- any other name: a ``torch.distributed`` process group's ``group_name`` (``dist.group.WORLD``'s
  is "0"), through torch's functional collective, on the current stream;
- "": no tensor parallelism; the model does not call the op then, and the fused ops skip it.

Partial sums arrive in fp32 (the chain's ``out_fp32``; bf16 is accepted too), are summed in fp32
and rounded to bf16 once: the result is what one rank computing the whole sum would round, up to
fp32 reassociation, and every rank receives the same bits (one reduction, one rounding).
No wait here is unbounded: each backend's own timeout applies (the group's ``timeout``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check

VLLM_TP_GROUP = "vllm:tp"


def _vllm_tp_group():
    from vllm.distributed import get_tp_group

    return get_tp_group()


def group_size(group_name: str) -> int:
    """Ranks in the named group (1 for "")."""
    if not group_name:
        return 1
    if group_name == VLLM_TP_GROUP:
        return _vllm_tp_group().world_size
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def reduce_sum(x: Tensor, group_name: str, *, in_place: bool = False) -> Tensor:
    """The sum over the group's ranks, in fp32 (no-op for ""). ``in_place``: x is an fp32 partial sum the
    caller drops after the call (the fused layer's o_proj and FFN outputs), summed in place where the
    backend can (torch's functional all_reduce_: no copy of x first); vLLM's communicator returns a new
    tensor."""
    if not group_name:
        return x
    if in_place:
        check(x.dtype == torch.float32, f"x: expected an fp32 partial sum, got {x.dtype}")
    wide = x.float()
    if group_name == VLLM_TP_GROUP:
        return _vllm_tp_group().all_reduce(wide)
    reduce = torch.ops._c10d_functional.all_reduce_ if in_place else torch.ops._c10d_functional.all_reduce
    return torch.ops._c10d_functional.wait_tensor(reduce(wide, "sum", group_name))


def _check_all_reduce(x: Tensor, group_name: str) -> None:
    check(x.dim() == 2, f"x: expected [tokens, hidden], got shape {tuple(x.shape)}")
    check(x.dtype in (torch.float32, torch.bfloat16),
          f"x: expected dtype torch.float32 or torch.bfloat16, got {x.dtype}")
    check(bool(group_name), "group_name: expected a process group name (or 'vllm:tp'), got ''")


@torch.library.custom_op("minimax::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group_name: str) -> Tensor:
    """Sum of x over the ranks of the named group (see the module docstring), bf16."""
    _check_all_reduce(x, group_name)
    return reduce_sum(x, group_name).to(torch.bfloat16)


@all_reduce.register_fake
def _(x, group_name):
    _check_all_reduce(x, group_name)
    return torch.empty_like(x, dtype=torch.bfloat16)


def any_rank(flag: bool, group_name: str, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank of the group: one small all-reduce and a host sync, so only
    for paths that sync anyway (value validation, checked mode). Every rank then takes the same path:
    a refusal seen by one rank is a refusal on all, and no rank is left waiting in a collective."""
    if not group_name:
        return flag
    votes = reduce_sum(torch.tensor([1.0 if flag else 0.0], device=device), group_name)
    return bool(votes.item() > 0)
