"""Where swarmstream keeps its files on this machine (no torch here: the dashboard imports it).

- data dir (``platformdirs.user_data_path``): the identity key, checkpoints, the credit ledger,
  node logs. ``~/.local/share/swarmstream`` on Linux, ``~/Library/Application Support/swarmstream``
  on macOS. ``SWARMSTREAM_HOME`` moves all of it (tests, several volunteers on one machine).
- config dir: ``settings.toml`` (``protocol.settings``).
- runtime dir: the node's control socket ``node.sock`` (owner-only, gone after a reboot).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "swarmstream"
SOCKET_NAME = "node.sock"
MAX_SOCKET_PATH = 100  # sun_path holds 104 (macOS) or 108 (Linux) bytes with its terminator


def _home() -> Path | None:
    home = os.environ.get("SWARMSTREAM_HOME")
    return Path(home) if home else None


def data_dir() -> Path:
    home = _home()
    return home / "data" if home else platformdirs.user_data_path(APP_NAME, appauthor=False)


def config_dir() -> Path:
    home = _home()
    return home / "config" if home else platformdirs.user_config_path(APP_NAME, appauthor=False)


def runtime_dir() -> Path:
    """The user's runtime dir when the OS has one that exists (``$XDG_RUNTIME_DIR`` on Linux),
    else a private folder in the cache dir."""
    home = _home()
    if home:
        return home / "run"
    if os.environ.get("XDG_RUNTIME_DIR") and Path(os.environ["XDG_RUNTIME_DIR"]).is_dir():
        return Path(os.environ["XDG_RUNTIME_DIR"]) / APP_NAME
    return platformdirs.user_cache_path(APP_NAME, appauthor=False) / "run"


def settings_path() -> Path:
    return config_dir() / "settings.toml"


def control_path() -> Path:
    """The control socket of the volunteer's node (``swarmstream status`` talks to it)."""
    return runtime_dir() / SOCKET_NAME


def identity_path() -> Path:
    return data_dir() / "identity.key"
