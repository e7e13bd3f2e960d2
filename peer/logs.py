"""The one logging setup of every swarmstream process: ``key=value`` lines on stderr."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def init_logging(level: str | int | None = None) -> None:
    """Configure the root logger once. ``level`` defaults to $SWARMSTREAM_LOG or WARNING.

    hivemind installs its own handlers on import; ours only sets the format and level of the
    root logger, so both stay readable.
    """
    level = level or os.environ.get("SWARMSTREAM_LOG", "WARNING")
    if isinstance(level, str):
        level = level.upper()
    root = logging.getLogger()
    if not any(getattr(h, "_swarmstream", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._swarmstream = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
