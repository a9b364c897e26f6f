"""Thread-block clusters (CUDA sm_90+): programs launched in groups of CLUSTER that read each other's
shared memory (distributed shared memory, ``mapa`` + ``ld.shared::cluster``) and meet at a hardware
barrier (``barrier.cluster``), with no round trip through global memory and no arrival counter.

Triton compiles a kernel for one program (num_ctas = 1); ``launch_clustered`` launches that compiled
kernel with a cluster dimension along the grid's first axis: a grid (X, Y, Z) becomes X * CLUSTER
programs along the first axis, each consecutive CLUSTER of them one cluster, so ``tl.program_id(0) %
CLUSTER`` is a program's rank in its cluster. The kernel's own shared buffer is declared by its inline
PTX (``shared_buffer``: static, up to the 48 KB a launch takes without opting in, beside Triton's own).

Only NVIDIA sm_90+ runs these helpers (``clusters_supported``); kernels keep a portable form (the
interpreter, AMD) behind a constexpr.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

MAX_CLUSTER = 16  # the largest cluster an H100 / H200 launches (above 8 needs the non-portable opt-in)


@functools.lru_cache(maxsize=None)
def clusters_supported(device: torch.device) -> bool:
    """Cluster launches: NVIDIA sm_90+ (MINIMAX_OPS_NO_CLUSTER=1 turns them off)."""
    if device.type != "cuda" or torch.version.hip is not None or os.environ.get("MINIMAX_OPS_NO_CLUSTER") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _clustered(compiled, cluster: int) -> None:
    """Make every launch of ``compiled`` (one specialisation of a kernel) a launch of clusters of
    ``cluster`` programs: Triton's CUDA launcher reads (num_warps, num_ctas, shared) from the compiled
    kernel at each launch and launches num_ctas-wide clusters, X * num_ctas programs along the first axis."""
    packed = compiled.packed_metadata
    meta = compiled.metadata
    if not (isinstance(packed, tuple) and len(packed) == 3 and packed[1] in (1, cluster)
            and getattr(meta, "num_ctas", 1) == 1 and not getattr(meta, "global_scratch_size", 0)
            and not getattr(meta, "profile_scratch_size", 0)):
        raise RuntimeError(f"{compiled.name}: this Triton's launch metadata {packed!r} is not the (num_warps, "
                           f"num_ctas, shared) a cluster launch is made from")
    compiled.packed_metadata = (packed[0], cluster, packed[2])


def launch_clustered(kernel, grid: tuple[int, int, int], cluster: int, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` as clusters of ``cluster`` programs along the first axis (the
    launch has grid[0] * cluster programs there). The specialisation is compiled (or found) first, so
    that no launch of it, the first included, goes out unclustered."""
    if not 1 <= cluster <= MAX_CLUSTER:
        raise ValueError(f"cluster: expected 1..{MAX_CLUSTER} programs, got {cluster}")
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    _clustered(compiled, cluster)
    kernel[grid](*args, **kwargs)


# ---- device side (inline PTX; every thread of every program of a cluster must reach each barrier) -------


@triton.constexpr_function
def _declare_asm(nbytes):
    return f"{{\n.shared .align 16 .b8 minimax_cluster_buffer[{nbytes}];\nmov.u32 $0, minimax_cluster_buffer;\n}}"


@triton.jit
def shared_buffer(NBYTES: tl.constexpr):
    """The shared address of the kernel's cluster buffer of NBYTES (declared here: call it once a kernel)."""
    return tl.inline_asm_elementwise(_declare_asm(NBYTES), "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def store_shared(addr, value):
    """value (fp32) at the shared addresses addr (int32, same shape) of this program's buffer."""
    tl.inline_asm_elementwise("st.shared.f32 [$1], $2;\nmov.b32 $0, 0;", "=r,r,f", [addr, value.to(tl.float32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def load_cluster_shared(addr, rank):
    """The fp32 at shared address addr of the cluster's program ``rank`` (int32 tensors, broadcast)."""
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 r;\nmapa.shared::cluster.u32 r, $1, $2;\nld.shared::cluster.f32 $0, [r];\n}", "=f,r,r",
        [addr, rank], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _per_thread(asm: tl.constexpr, NT: tl.constexpr):
    """``asm`` once in each of the program's NT threads, ordered with the other side-effecting asm."""
    tl.inline_asm_elementwise(asm + "\nmov.b32 $0, 0;", "=r,r", [tl.arange(0, NT)[:, None]], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def cluster_arrive(NT: tl.constexpr):
    """This program's arrival at the cluster barrier: its shared stores (and loads) before it are done."""
    _per_thread("barrier.cluster.arrive.release.aligned;", NT)


@triton.jit
def cluster_wait(NT: tl.constexpr):
    """Wait until every program of the cluster arrived; their shared stores before it are visible."""
    _per_thread("barrier.cluster.wait.acquire.aligned;", NT)


def aot_specs() -> list:
    """None of its own: helpers compiled (and covered) through the kernels that call them."""
    return []
