"""Pausing Python's cyclic garbage collector while an update runs.

A process that imports torch holds a million or more tracked objects, and a
full (generation-2) collection then takes ~100 ms. Registering, gathering and
updating a checkpoint of thousands of tensors allocates enough small objects
to trigger several such collections in the middle of the work (measured: two
~110 ms pauses inside one 5,000-tensor update). The pause below defers them to
after the update; set PS_PAUSE_GC=0 to keep the collector running.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

from ckpt_core._settings import gc_pause_enabled

_lock = threading.Lock()
_depth = 0          # nested / concurrent pauses: the collector resumes when the last one ends
_resume = False     # whether it was enabled when the first pause began


@contextmanager
def gc_paused():
    """Disable the cyclic collector for the block (re-entrant, thread-safe); a no-op with PS_PAUSE_GC=0."""
    global _depth, _resume
    if not gc_pause_enabled():
        yield
        return
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
