"""The one logging setup of every swarmstream process: ``key=value`` lines on stderr."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

ROOT_LEVEL = logging.INFO
"""The root logger lets INFO through whatever the console shows, so the node's forwarder of
log lines to the dashboard (``peer.node._LogToControl``, INFO and louder) receives them."""

LEVEL_NAMES = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR",
               logging.CRITICAL: "CRITICAL"}
"""The names a record's ``levelname`` keeps (``LogRecorded.level`` accepts only these)."""


def _standard_level_names(factory):
    """A log record factory that keeps the standard level names. Importing hivemind renames
    WARNING to "WARN" for the whole process (``logging.addLevelName``), and a LogRecorded with
    level "WARN" is invalid: the node's forwarder dropped every warning on its way to the
    dashboard. A factory applies whenever hivemind is imported, before or after us."""
    def make(*args, **kwargs) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        record.levelname = LEVEL_NAMES.get(record.levelno, record.levelname)
        return record

    make._swarmstream = True  # type: ignore[attr-defined]
    return make


def init_logging(level: str | int | None = None) -> None:
    """Configure the root logger once; calling it again only changes the console's level.

    ``level`` is what the console (stderr) shows: $SWARMSTREAM_LOG, or WARNING by default.
    The root logger itself stays at INFO (DEBUG when the console asks for it): a record is
    created only if the root's level allows it, and the dashboard's Log screen needs INFO
    even while the terminal shows only warnings.

    Records keep the standard level names, WARNING included, though importing hivemind renames
    it "WARN". hivemind keeps its own handler (level $HIVEMIND_LOGLEVEL) on the ``hivemind``
    logger and does not propagate to the root, so none of its lines reach the dashboard; ours
    sets only the format and levels of the root logger and its console handler, so both stay
    readable.
    """
    factory = logging.getLogRecordFactory()
    if not getattr(factory, "_swarmstream", False):
        logging.setLogRecordFactory(_standard_level_names(factory))
    level = level or os.environ.get("SWARMSTREAM_LOG", "WARNING")
    if isinstance(level, str):
        level = level.upper()
    root = logging.getLogger()
    console = next((h for h in root.handlers if getattr(h, "_swarmstream", False)), None)
    if console is None:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        console._swarmstream = True  # type: ignore[attr-defined]
        console.setLevel(level)  # an unknown level name raises ValueError before the handler is added
        root.addHandler(console)
    console.setLevel(level)
    root.setLevel(min(console.level, ROOT_LEVEL))
