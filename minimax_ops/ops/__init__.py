"""torch.ops.minimax.*: importing this package registers every op (and its fake)."""

from . import fused, prefill, stages  # noqa: F401
