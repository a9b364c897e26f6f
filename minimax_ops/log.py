"""The package logger; refusal reasons are logged once per reason, never per step."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("minimax_ops")
_seen: set[str] = set()
_lock = threading.Lock()


def log_once(reason: str, level: int = logging.INFO) -> bool:
    """Log reason the first time it is seen in this process; returns whether it was logged."""
    with _lock:
        if reason in _seen:
            return False
        _seen.add(reason)
    logger.log(level, "%s", reason)
    return True


def reset_log_once() -> None:
    """Forget what was logged (tests)."""
    with _lock:
        _seen.clear()
