"""Peak resident memory of a block of code, sampled from /proc (Linux) in a thread.

`ru_maxrss` only grows over a process's life, so it cannot tell methods apart inside one run;
sampling the RSS every few milliseconds gives each timed call its own peak above its start.
"""

from __future__ import annotations

import os
import threading
import time
from types import TracebackType

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


class PeakRSS:
    """Context manager; after exit, `.peak_mb` is the highest RSS above the entry level, in MiB."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self._stop = threading.Event()

    def _watch(self) -> None:
        peak = self._base
        while not self._stop.is_set():
            peak = max(peak, rss_bytes())
            time.sleep(self.interval_s)
        self.peak_mb = max(0, max(peak, rss_bytes()) - self._base) / 2**20

    def __enter__(self) -> PeakRSS:
        self._base = rss_bytes()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
