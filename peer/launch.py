"""How a swarmstream process starts another one (a node, ``swarmstream runs``).

``python -m peer.node`` puts its working directory first on ``sys.path``: started from a clone
of the repository, the child would import the clone's files rather than the installed package
the parent runs. Children therefore start in a directory of ours (``cwd``) with
``PYTHONSAFEPATH=1`` (Python 3.11+ then adds no directory at all), so parent and child always
run the same code. ``PYTHONPATH`` is passed on unchanged, for development checkouts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args...`` with this process's interpreter."""
    return [sys.executable, "-m", module, *args]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: ours, unbuffered, without the working directory on
    its import path."""
    return dict(os.environ, PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1", **extra)


def child_cwd(preferred: Path | None = None) -> str:
    """A working directory for a child: ``preferred`` (created if needed) or the home folder.
    Never the caller's: that may be a source checkout with other versions of our packages."""
    if preferred is not None:
        Path(preferred).mkdir(parents=True, exist_ok=True)
        return str(preferred)
    return str(Path.home()) if Path.home().is_dir() else "/"
