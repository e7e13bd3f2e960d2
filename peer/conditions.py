"""When the volunteer lets the node run: mains power, an idle machine, a daily window.

The readers ask the OS and return None where it does not tell (then the condition is not
enforced, and the node logs that once):

| platform | on mains power                         | user idle                                  |
| -------- | -------------------------------------- | ------------------------------------------ |
| Linux    | /sys/class/power_supply (Mains/battery) | systemd-logind IdleHint (`loginctl`)       |
| macOS    | `pmset -g batt`                         | `ioreg -c IOHIDSystem` HIDIdleTime         |
| WSL, other | not told                             | not told                                   |

``pause_reason`` is pure: the node calls it every heartbeat with what the readers saw.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from protocol.settings import ScheduleSettings, in_window, parse_window

IDLE_AFTER_S = 300.0  # no keyboard or mouse for this long counts as idle
_POWER = Path("/sys/class/power_supply")


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=2).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def on_mains_power(power_dir: Path = _POWER) -> bool | None:
    if sys.platform == "darwin":
        out = _run(["pmset", "-g", "batt"])
        if out is None:
            return None
        return "AC Power" in out if ("AC Power" in out or "Battery Power" in out) else None
    if not power_dir.is_dir():
        return None
    mains, batteries = [], []
    for dev in power_dir.iterdir():
        try:
            kind = (dev / "type").read_text().strip()
            if kind == "Mains":
                mains.append((dev / "online").read_text().strip() == "1")
            elif kind == "Battery":
                batteries.append((dev / "status").read_text().strip())
        except OSError:
            continue
    if mains:
        return any(mains)
    if batteries:
        return not all(s == "Discharging" for s in batteries)
    return None  # a desktop or a server: no power supply info at all


def user_idle_s() -> float | None:
    if sys.platform == "darwin":
        out = _run(["ioreg", "-c", "IOHIDSystem"])
        m = re.search(r'"HIDIdleTime" = (\d+)', out or "")
        return int(m[1]) / 1e9 if m else None
    out = _run(["loginctl", "show-session", "auto", "-p", "IdleHint", "-p", "IdleSinceHintMonotonic"])
    if not out or "IdleHint=" not in out:
        return None
    hint = re.search(r"IdleHint=(\w+)", out)
    return IDLE_AFTER_S if hint and hint[1] == "yes" else 0.0


def pause_reason(s: ScheduleSettings, minute_of_day: int, mains: bool | None, idle_s: float | None) -> str:
    """Why the node must pause now ("" if it may run). Unknown readings never pause it."""
    if not in_window(parse_window(s.window), minute_of_day):
        return f"outside your schedule ({s.window})"
    if s.only_on_ac_power and mains is False:
        return "on battery"
    if s.only_when_idle and idle_s is not None and idle_s < IDLE_AFTER_S:
        return "the machine is in use"
    return ""
