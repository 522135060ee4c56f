"""Pause Python's cyclic garbage collector while folding a batch of events.

A fold allocates many small objects that live on (the state) or die by reference counting
(decoded events): none of them form garbage cycles. With the collector on, a fold of a long log
keeps triggering full collections (one each time the heap grows by a quarter) that scan the
whole, growing state: a third of a 577k-event replay went there (measured with gc.callbacks).

Bulk folds (replay, rebuild, audit, time travel, diff) pause it from start to end. Pausing per batch
is not enough: the full collections then fire between batches. While one runs, cyclic garbage
made by other tasks waits for the collector, which resumes when the fold ends - after everything
tracked has been moved to the oldest generation, so that the first collection does not rescan the
whole new state (4% of a 577k-event replay).
Nesting and several threads (rebuild folds on the database thread) are handled with a count.

A process that folds often - a service answering time-travel questions, audits, diffs - would
otherwise never collect the cycles it makes: folds overlapping one another keep the collector off
for good, and back to back each end promotes the cycles made during it uncounted, so that no full
collection is ever due. So a pause begins with one full collection when :data:`FULL_EVERY` seconds
have passed since the last it ran: at its start, before the fold has made its state, the heap is
the application's (and an overlapping fold's).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: at most this often (seconds), a pause begins with a full collection: what the application's
#: cyclic garbage may pile up to while folds keep the collector paused or promote it uncounted
FULL_EVERY = 60.0

_lock = threading.Lock()
_pausers = 0
_was_enabled = False
_promote = False  # (some pauser of the current pause wants the promotion at its end)
_next_full = time.monotonic() + FULL_EVERY


@contextmanager
def gc_paused(promote: bool = True) -> Iterator[None]:
    """``promote=False``: for short pauses that run often (a page of a read): moving everything to
    the oldest generation each time would keep the application's cyclic garbage from ever being
    collected (objects moved there uncounted never trigger the full collection)."""
    global _pausers, _was_enabled, _promote, _next_full
    with _lock:
        if _pausers == 0:
            _was_enabled = gc.isenabled()
            _promote = False
            gc.disable()
        _pausers += 1
        _promote = _promote or promote
        now = time.monotonic()
        collect = _was_enabled and now >= _next_full  # (a host that turned it off: never)
        if collect:
            _next_full = now + FULL_EVERY
    if collect:
        gc.collect()
    try:
        yield
    finally:
        with _lock:
            _pausers -= 1
            if _pausers == 0:
                if _promote and gc.get_freeze_count() == 0:
                    # What the fold allocated sits in the youngest generation; the first
                    # collection after resuming would scan all of it. freeze + unfreeze moves every
                    # tracked object to the oldest generation without scanning (skipped when the
                    # host keeps frozen objects of its own).
                    gc.freeze()
                    gc.unfreeze()
                if _was_enabled:
                    gc.enable()
