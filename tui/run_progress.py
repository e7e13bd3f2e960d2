"""How far a run is toward its step target, and how long until it gets there, as the dashboard
and ``swarmstream status`` show it. Pure (no Textual, no sockets), so ``status`` stays light.

The target is the manifest's ``train.inner.total_steps`` (the length of the learning-rate
schedule; a node trains on past it at the minimum rate). The ETA is the steps left times the
node's mean inner step time (``StatusReported.inner_step_s``): time spent training, so it does
not count down while the node is paused, and waits for averaging results are not in it.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages_control import StatusReported


@dataclass(frozen=True, slots=True)
class RunProgress:
    step: int
    total_steps: int
    """The run's step target (> 0)."""
    eta_s: float | None
    """Seconds of training left; None until the node has timed an inner step."""

    @property
    def fraction(self) -> float:
        return min(1.0, self.step / self.total_steps)

    @property
    def steps_left(self) -> int:
        return max(0, self.total_steps - self.step)

    def text(self, paused: bool = False) -> str:
        """One line: ``step 120 of 2,000 (6%) · ETA 7 min 50 s``."""
        where = f"step {self.step:,} of {self.total_steps:,}"
        if not self.steps_left:
            return f"{where}: target reached"
        where += f" ({int(self.fraction * 100)}%)"  # floored: 100% only when reached
        if self.eta_s is None:
            return f"{where} · ETA after the first steps"
        return f"{where} · ETA {human_duration(self.eta_s)}" + (" once resumed" if paused else "")


def run_progress(st: StatusReported) -> RunProgress | None:
    """The progress of the node's run; None when it reports no step target (not in a run yet,
    or a node older than ``StatusReported.total_steps``)."""
    if st.total_steps <= 0:
        return None
    left = max(0, st.total_steps - st.step)
    return RunProgress(st.step, st.total_steps, left * st.inner_step_s if st.inner_step_s > 0 else None)


def human_duration(seconds: float) -> str:
    """``45 s``, ``7 min 50 s``, ``3 h 20 min``, ``2 d 4 h``: the two largest units."""
    s = max(1, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"
