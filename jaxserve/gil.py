"""The GIL's switch interval while jaxserve's threads contend for it.

A thread that gives the GIL up (a dispatch, a wait for the device) and wants it back waits until the
holder drops it, which CPython asks for only after the switch interval (5 ms by default). The engine
thread of the server gives the GIL up several times a step while the event loop thread streams: at 5 ms
each such hand-over can stretch the step (docs/benchmarks.md, "Serving"). (The warmup's compile threads
were not faster at 0.2 ms: the default table compiled in 72.6 s on an H200, as at 5 ms.)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

# 0.2 ms: on the 2-core development machine 64 streaming clients of a tiny model got 2.2-3.7k output tok/s
# at 0.2-1 ms against 1.1k at 5 ms; shorter (0.05 ms) was no better.
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
