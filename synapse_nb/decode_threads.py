"""DecodeThreads: the thread count of decode steps, chosen by their measured time.

A decode step (one token) runs about 200 short parallel regions, each of which waits for its
slowest thread. With a busy process beside us on a 2-core machine, one of our two threads is
descheduled for a time slice at a time, and a step takes 2.5x longer than on one thread
(SmolLM2, measured: 66 tok/s on 2 threads, 166 on 1; llama.cpp does the same: 51 and 164).
Results do not depend on the thread count (every output is computed by the same operations
whatever the split), so the count can change between steps at no cost but time.

So a Session with n > 1 threads decodes with n threads and, in each period of PERIOD steps,
times PROBES steps with the other count (1, or n when it runs on 1); it switches when each of
those took less than MARGIN times the median of its recent steps (an idle machine's 1-thread
step takes 1.4-1.6x its 2-thread one: noise does not switch it). The probes cost PROBES / PERIOD
of the steps at the other speed (under 1% of decode time on an idle machine); under load a step
takes the 1-thread time instead of collapsing, and the n threads come back within a period of
the load going away. The first period is FIRST_PERIOD steps, so that a run that starts on a busy
machine moves within 16 steps, not 128 (measured, `llama-decode -t 2 -n 64` with one busy process
beside it, three pairs: SmolLM2 61-69 -> 108-117 tok/s, Qwen2.5 32-33 -> 39-42; idle, four
pairs: SmolLM2 45-94 -> 99-105, Qwen2.5 38-49 -> 41-51, a 2-thread run being as noisy as that
here). Batches (prefill) always use n threads: their regions are long.
"""

from __future__ import annotations

import statistics
from collections import deque


class DecodeThreads:
    """Choice of the thread count for decode steps (see the module's docstring).

    n: the session's thread count (> 1). threads() gives the count for the next step; record(t,
    seconds) reports the step's wall time with t threads. Pure bookkeeping: never raises.
    """

    PERIOD = 128  # steps per period, the last PROBES of them with the other count
    FIRST_PERIOD = 16  # the first period's steps: a busy machine is seen within 16 steps
    PROBES = 2
    MARGIN = 0.8  # switch when every probe is below this share of the recent median
    RECENT = 16  # recent steps of the current count kept for its median

    def __init__(self, n: int):
        self.n = n
        self.current, self.other = n, 1
        self._step = 0
        self._recent = deque(maxlen=self.RECENT)
        self._probes = []

    def _in_period(self, step: int) -> tuple[int, int]:
        """(position of step in its period, that period's length)."""
        if step < self.FIRST_PERIOD:
            return step, self.FIRST_PERIOD
        return (step - self.FIRST_PERIOD) % self.PERIOD, self.PERIOD

    def threads(self) -> int:
        """The thread count for the next decode step."""
        pos, length = self._in_period(self._step)
        return self.other if pos >= length - self.PROBES else self.current

    def record(self, t: int, seconds: float) -> None:
        """Report the last decode step: t threads, seconds of wall time."""
        (self._recent if t == self.current else self._probes).append(seconds)
        self._step += 1
        if self._in_period(self._step)[0]:
            return
        if self._probes and len(self._recent) >= self.PROBES:
            if max(self._probes) < self.MARGIN * statistics.median(self._recent):
                self.current, self.other = self.other, self.current
                self._recent.clear()
        self._probes = []
