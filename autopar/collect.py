"""Planning defers CPython's full garbage collections: the one home of that policy.

A plan imports torch (and transformers for an HF model), builds and traces the model on meta and
searches over the graph: hundreds of thousands of long-lived objects (modules, functions,
classes, the graph's nodes) sit in the oldest generation, and every full collection walks all of
them, for almost no garbage (the young collections, which still run, free the short-lived
cycles of tracing and search). On a 2-core machine that was 0.89 s of a Llama-3-70B plan's 7.10
CPU seconds and 0.96 s of a Llama 3.1 405B plan's 9.18 (``python benchmarks/planning_time.py
--gc both``, 2026-12-05). So the planning entry points (the ``plan`` command, ``plan_model_file``,
``auto_parallelize``, ``why_not``) run under :func:`full_collections_deferred`, which restores the
caller's thresholds on the way out; the collections deferred run then, as usual.

Python versions whose collector ignores the third threshold (an incremental old generation)
simply collect as they always do.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["full_collections_deferred"]

_DEFERRED = 1 << 30
"""The oldest generation's threshold while planning: young collections that must run before a
full one (never reached by a plan)."""


@contextmanager
def full_collections_deferred() -> Iterator[None]:
    """Within: no full (oldest-generation) collection; the young generations' thresholds and an
    explicit ``gc.collect()`` are unchanged. Nests, and decorates (a fresh one per call); the
    thresholds found on entry are restored on exit, also on an exception."""
    before = gc.get_threshold()
    gc.set_threshold(*before[:2], _DEFERRED)
    try:
        yield
    finally:
        gc.set_threshold(*before)
