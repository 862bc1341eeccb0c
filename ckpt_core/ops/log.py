"""Loggers that say which rank and which phase."""

from __future__ import annotations

import logging

_root = logging.getLogger("ckpt_core")


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"[{self.extra['who']}] {msg}", kwargs


def rank_logger(who: str) -> RankAdapter:
    """``who`` is e.g. ``"ps rank 1/2"`` or ``"worker cuda:0"``."""
    return RankAdapter(_root, {"who": who})
