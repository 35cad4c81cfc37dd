"""The figures of SGLang's StorageMetrics (pages moved per batch and their speed), kept between two
get_stats() calls and handed over as SGLang's own StorageMetrics."""

from __future__ import annotations

import collections
import threading
from typing import Any

_METRICS_MAX = 4096  # figures kept between two get_stats() calls (SGLang reads them every few seconds)


class _Metrics:
    """SGLang's StorageMetrics figures, taken per call and handed over (then forgotten) by get_stats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.figures: dict[str, collections.deque[float]] = {
            k: collections.deque(maxlen=_METRICS_MAX)
            for k in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")
        }

    def record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        if pages <= 0:
            return
        with self._lock:
            self.figures[f"{kind}_pgs"].append(pages)
            self.figures[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)  # GB/s

    def take(self) -> dict[str, list[float]]:
        with self._lock:
            out = {k: list(v) for k, v in self.figures.items()}
            for v in self.figures.values():
                v.clear()
        return out

    def storage_metrics(self) -> Any:
        """The figures taken, as SGLang's StorageMetrics; None without SGLang's metrics collector."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        out = StorageMetrics()
        for name, values in self.take().items():
            getattr(out, name).extend(values)
        return out
