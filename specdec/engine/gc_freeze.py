"""A serving process's start-up objects and Python's cyclic garbage collector.

Why: a process that has imported torch, transformers and pydantic and loaded the demo pair tracks
~430,000 container objects (functions, tuples, dicts of the libraries' modules), and a full
(generation 2) collection walks every one: ~250 ms on the 2-core Zen 4, during which no forward runs
and every session of the batch waits. In a 3-minute in-process run of 8-client groups 15 full
collections took 2.8 s in all, landing in whichever arm was running; the adaptive arm, which keeps
more objects alive between forwards, met more of them (its verify seconds 1-7 % above K = 0's with
K = 0 on every step in session 28's goal run). :func:`freeze_startup_objects` moves everything alive
at the end of start-up into CPython's permanent generation (``gc.freeze``: frozen objects are
ignored by every later collection, still freed by reference counting), after which a full
collection walks only what serving created since (~0 ms right after the freeze).
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect once, then freeze every object alive (``gc.collect()``, ``gc.freeze()``): call in a
    serving process once its models are loaded (again after a warm-up or calibration: each call
    collects only what came since the last). A frozen object that later becomes part of unreachable
    reference cycles is not reclaimed, nor what only such cycles reach (``gc.unfreeze`` undoes it),
    so not after every model load in a process that loads many (tests load hundreds of tiny
    models).

    Returns:
        the number of objects frozen (``gc.get_freeze_count()``).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
