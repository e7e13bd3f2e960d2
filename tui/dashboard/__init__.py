"""The Textual dashboard (``swarmstream`` with no arguments, ``join``, ``demo``)."""

from tui.dashboard.app import SwarmstreamApp, run_dashboard

__all__ = ["SwarmstreamApp", "run_dashboard"]
