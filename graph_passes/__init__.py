"""FX passes that fuse MiniMax-M3 decode layers.

``minimax_m3_decode_pass`` is the ready instance that vLLM's ``inductor_passes`` dotted name and
plain torch.compile's ``post_grad_custom_post_pass`` option both take.
"""

import minimax_ops  # noqa: F401  (registers torch.ops.minimax.*)

from .deployment import Deployment, deployment_refusal
from .fused_decode_pass import MiniMaxM3DecodePass, uncached_compiles

minimax_m3_decode_pass = MiniMaxM3DecodePass()

__all__ = ["Deployment", "deployment_refusal", "MiniMaxM3DecodePass", "minimax_m3_decode_pass", "uncached_compiles"]
