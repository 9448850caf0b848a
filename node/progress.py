"""Progress on the node's terminal: one live line on a TTY, plain log lines otherwise."""
from __future__ import annotations

import sys
import time


def format_metrics(metrics: dict[str, float]) -> str:
    parts = []
    for key, fmt in (("step", "step {:.0f}"), ("loss", "loss {:.4f}"), ("samples_per_s", "{:.1f} samples/s"),
                     ("utilization", "util {:.2f}"), ("test_accuracy", "test acc {:.4f}")):
        if key in metrics:
            parts.append(fmt.format(metrics[key]))
    return "  ".join(parts)


class Progress:
    def __init__(self, stream=sys.stderr, min_interval: float = 2.0):
        self.stream = stream
        self.live = stream.isatty()
        self.min_interval = min_interval
        self._last = 0.0

    def update(self, prefix: str, metrics: dict[str, float], *, final: bool = False) -> None:
        now = time.monotonic()
        if not final and not self.live and now - self._last < self.min_interval:
            return
        self._last = now
        line = f"{prefix} {format_metrics(metrics)}"
        if self.live:
            self.stream.write("\r\x1b[2K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def log(self, text: str) -> None:
        self.stream.write(("\r\x1b[2K" if self.live else "") + text + "\n")
        self.stream.flush()
