"""minimax-m3-ops: MiniMax-M3's fused decode as a torch.compile citizen.

``import minimax_ops`` registers the ``torch.ops.minimax`` ops (with fake implementations) so
that torch.compile can trace the decode vocabulary and the graph pass can fuse it.
"""

from . import ops  # noqa: F401  (registers torch.ops.minimax.*)
from .cache import LayerCache, StepMetadata, allocate_caches, build_step
from .config import MiniMaxM3Config, preset
from .constants import MAX_CONTEXT, MAX_TOKENS, SPARSE_BLOCK, TOPK_BLOCKS

__all__ = ["LayerCache", "StepMetadata", "allocate_caches", "build_step", "MiniMaxM3Config", "preset",
           "MAX_CONTEXT", "MAX_TOKENS", "SPARSE_BLOCK", "TOPK_BLOCKS"]
