"""The Textual dashboard (``swarmstream`` with no arguments, ``join``, ``demo``)."""

from tui.dashboard.app import SwarmstreamApp

__all__ = ["SwarmstreamApp"]
