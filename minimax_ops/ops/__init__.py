"""torch.ops.minimax.*: importing this package registers every op (and its fake)."""

from . import collectives, fused, prefill, stages  # noqa: F401
