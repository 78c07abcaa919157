"""A one-line progress bar on stderr: step, loss, the latest held-out evaluation's loss and
perplexity, and tokens per second."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, stream=sys.stderr, width: int = 24):
        self.total = total
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self.started = time.perf_counter()
        self._last_print = 0.0
        self.evaluated = ""  # the latest evaluation, as the bar shows it

    def evaluation(self, loss: float, perplexity: float) -> None:
        """The latest held-out evaluation ([eval]); shown on the bar from the next step on."""
        self.evaluated = f"  eval {loss:.4f} (ppl {perplexity:,.2f})"

    def update(self, step: int, loss: float, tokens_per_second: float) -> None:
        done = step + 1
        filled = self.width * done // self.total
        bar = "█" * filled + "·" * (self.width - filled)
        line = f"step {done:>{len(str(self.total))}}/{self.total} {bar} loss {loss:.4f}{self.evaluated}  {tokens_per_second:,.0f} tok/s"
        now = time.perf_counter()
        if self.tty:
            self.stream.write("\r" + line)
        elif done == self.total or now - self._last_print >= 5.0 or done == 1:
            self.stream.write(line + "\n")
            self._last_print = now
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own, above the bar on a terminal."""
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
        elapsed = time.perf_counter() - self.started
        self.stream.write(f"done in {elapsed:.1f}s\n")
        self.stream.flush()
