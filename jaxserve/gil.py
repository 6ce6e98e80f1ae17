"""The GIL's switch interval while jaxserve's threads contend for it.

A thread that gives the GIL up (a dispatch, a wait for the device) and wants it back waits until the
holder drops it, which CPython asks for only after the switch interval (5 ms by default). The engine
thread of the server gives the GIL up several times a step while the event loop thread streams: at 5 ms
each such hand-over can stretch the step (docs/log/2026-benchmarks.md, "Serving"). The warmup's compile
threads keep the default interval: they were not faster at a short one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

# 0.2 ms: the shortest interval that helped streaming clients; shorter was no better
# (docs/log/2026-benchmarks.md, "Serving").
SHORT_SWITCH_INTERVAL_S = 0.0002


@contextlib.contextmanager
def short_switch_interval(seconds: float = SHORT_SWITCH_INTERVAL_S) -> Iterator[None]:
    """sys.setswitchinterval(min(current, seconds)) inside the block; the previous interval after it."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(previous)
