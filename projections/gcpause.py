"""Pause Python's cyclic garbage collector while folding a batch of events.

A fold allocates many small objects that live on (the state) or die by reference counting
(decoded events): none of them form garbage cycles. With the collector on, a fold of a long log
keeps triggering full collections (one each time the heap grows by a quarter) that scan the
whole, growing state: a third of a 577k-event replay went there (measured with gc.callbacks).

Bulk folds (replay, rebuild, audit, time travel) pause it from start to end. Pausing per batch
is not enough: the full collections then fire between batches. While one runs, cyclic garbage
made by other tasks waits for the collector, which resumes (and catches up) when the fold ends.
Nesting and several threads (rebuild folds on the database thread) are handled with a count.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_pausers = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    global _pausers, _was_enabled
    with _lock:
        if _pausers == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pausers += 1
    try:
        yield
    finally:
        with _lock:
            _pausers -= 1
            if _pausers == 0 and _was_enabled:
                gc.enable()
