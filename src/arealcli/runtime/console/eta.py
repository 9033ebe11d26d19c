"""The time left in a run, from step times measured per phase.

A phase is a stretch of steps that runs the same calls: an SFT warm-up (`sft_warmup[0..59]`) and the RL
steps after it cost very different amounts per step, so one average over both is wrong at the switch
and for long after. Each phase's cost of a step is learned from its own recent steps (the median of the
last `WINDOW`: it follows a slow drift, an odd step does not move it); the steps that also evaluate or
save cost that much more, learned from those steps and charged where the cadence puts the next ones
(the last step saves, and evaluates when evaluation is on). A phase not reached yet is counted at the
slowest phase's rate, and the estimate is marked as a guess (RL steps usually cost more than warm-up
steps) until it has run.

    estimator = Eta(phases_of(calls, total), eval_every=20, save_every=50)
    estimator.start(step, now)
    estimator.record(step, now)            # after every step: `step` steps done
    seconds, guess = estimator.remaining(step)
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

WINDOW = 20


@dataclass(frozen=True)
class Segment:
    """Steps `start` .. `end - 1` (0-based step indices) all run the calls named in `phase`."""

    start: int
    end: int
    phase: Hashable


def phases_of(calls: Iterable, total: int) -> list[Segment]:
    """The run's steps cut where a call starts or stops (`start_step`, `end_step` of the calls)."""
    calls = list(calls)
    cuts = {0, total}
    for c in calls:
        cuts.update(s for s in (getattr(c, "start_step", 0), getattr(c, "end_step", None)) if s is not None)
    bounds = sorted(s for s in cuts if 0 <= s <= total)
    out: list[Segment] = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        active = tuple(
            c.name
            for c in calls
            if getattr(c, "start_step", 0) <= start and (getattr(c, "end_step", None) or total + 1) > start
        )
        if out and out[-1].phase == active:  # the same calls on both sides of a cut: one segment
            out[-1] = Segment(out[-1].start, end, active)
        else:
            out.append(Segment(start, end, active))
    return out or [Segment(0, total, ())]


@dataclass
class Eta:
    segments: list[Segment]
    eval_every: int | None = None
    save_every: int | None = None
    eval_at_start: bool = False  # the first step's time includes an evaluation before it
    plain: dict[Hashable, list[float]] = field(default_factory=dict)  # phase -> times of plain steps
    extra: dict[str, list[float]] = field(default_factory=dict)  # "eval" / "save" -> added seconds
    _last: tuple[int, float] | None = None

    @property
    def total(self) -> int:
        return self.segments[-1].end

    def phase(self, index: int) -> Hashable:
        for s in self.segments:
            if s.start <= index < s.end:
                return s.phase
        return self.segments[-1].phase

    def events(self, done: int) -> tuple[str, ...]:
        """What the step that brings the count to `done` does besides training."""
        last = done == self.total
        out = []
        if (self.eval_every and (done % self.eval_every == 0 or last)) or (self.eval_at_start and done == 1):
            out.append("eval")
        if (self.save_every and done % self.save_every == 0) or last:
            out.append("save")
        return tuple(out)

    def start(self, step: int, now: float) -> None:
        self._last = (step, now)

    def record(self, step: int, now: float) -> None:
        """`step` steps are done at time `now`; the time since the last record is spread over the steps
        done since (usually one)."""
        if self._last is None:
            self._last = (step, now)
            return
        last_step, last_time = self._last
        if step > last_step:
            each = (now - last_time) / (step - last_step)
            for done in range(last_step + 1, step + 1):
                phase, events = self.phase(done - 1), self.events(done)
                base = self.step_time(phase)
                if not events:
                    self.plain.setdefault(phase, []).append(each)
                elif len(events) == 1 and base is not None:  # (both at once: not attributable)
                    self.extra.setdefault(events[0], []).append(max(0.0, each - base))
        self._last = (step, now)

    def step_time(self, phase: Hashable) -> float | None:
        times = self.plain.get(phase)
        return statistics.median(times[-WINDOW:]) if times else None

    def extra_time(self, event: str) -> float:
        times = self.extra.get(event)
        return sum(times) / len(times) if times else 0.0

    def count_events(self, step: int) -> dict[str, int]:
        """How many of the steps after `step` evaluate and save."""
        total = self.total
        counts = {"eval": 0, "save": 0}
        for event, every in (("eval", self.eval_every), ("save", self.save_every)):
            n = total // every - step // every if every else 0
            if (every or event == "save") and step < total and (not every or total % every):
                n += 1  # the last step does it too
            counts[event] = n
        return counts

    def remaining(self, step: int) -> tuple[float | None, bool]:
        """(seconds left after `step` steps, whether a phase not reached yet is guessed); None before
        any step was timed."""
        known = [t for t in (self.step_time(p) for p in self.plain) if t is not None]
        if not known:
            return None, False
        left, guess = 0.0, False
        for s in self.segments:
            count = s.end - max(s.start, step)
            if count <= 0:
                continue
            rate = self.step_time(s.phase)
            if rate is None:
                rate, guess = max(known), True
            left += count * rate
        for event, n in self.count_events(step).items():
            left += n * self.extra_time(event)
        return left, guess
