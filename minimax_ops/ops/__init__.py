"""torch.ops.minimax.*: importing this package registers every op (and its fake)."""

from . import prefill, stages  # noqa: F401
