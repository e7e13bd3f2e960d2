"""Make the test suite exercise the *installed* swarmstream, not this checkout's files.

``python -m pytest`` puts the checkout first on ``sys.path``, so ``import tui`` would find
``./tui`` even when a wheel is installed, and a file the wheel leaves out (the dashboard's
stylesheet, once) would go unnoticed. Here the checkout moves to the end of ``sys.path``:
an installed wheel (CI) or an editable install (development) is what the tests import, and
only the ``tests`` helpers, which are not installed, still come from the checkout. Nodes the
tests start as subprocesses import what the node launchers import (see ``peer.launch``).

With ``SWARMSTREAM_EXPECT_INSTALLED=1`` (``.ci/run`` sets it) the run stops at once unless
the three packages come from outside the checkout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# No per-example deadline: CI runs beside other work, and a slow example is not a failing one
# In CI (``CI`` set, as .ci/run does), the same examples every run: a counterexample that random
# exploration finds is a bug to fix, but on a developer's run, not as a CI run that fails for a
# change that did not touch it (a run here found an honest fp4 mean that the audit refused)
settings.register_profile("swarmstream", deadline=None, derandomize=os.environ.get("CI", "").lower() not in ("", "0", "false"))
settings.load_profile("swarmstream")

# One torch thread in the test processes: the two workers share the cores with the swarm tests'
# nodes, and OpenMP's threads spinning beside other work slowed a torch run many times over
# (tests/bench/test_quality_smoke.py). The nodes the tests start choose their own (peer.demo).
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent
_here = {str(ROOT), "", "."}
_moved = [p for p in sys.path if p in _here or (p and Path(p).resolve() == ROOT)]
sys.path[:] = [p for p in sys.path if p not in _moved] + [str(ROOT)]

_PACKAGES = ("protocol", "peer", "tui", "swarmstream")


def _origins() -> dict[str, Path]:
    import importlib.util

    return {name: Path(importlib.util.find_spec(name).origin).resolve().parent for name in _PACKAGES}


def pytest_configure(config) -> None:
    if os.environ.get("SWARMSTREAM_EXPECT_INSTALLED") == "1":
        inside = [f"{n} ({p})" for n, p in _origins().items() if p.parent == ROOT]
        if inside:
            raise pytest.UsageError("SWARMSTREAM_EXPECT_INSTALLED=1, but these import from the checkout, not the installed "
                             f"package: {', '.join(inside)}; install the wheel (pip install dist/*.whl)")


def pytest_report_header(config) -> str:
    tui = _origins()["tui"]
    where = "this checkout (editable or uninstalled)" if tui.parent == ROOT else "the installed package"
    return f"swarmstream under test: {tui.parent} ({where})"
