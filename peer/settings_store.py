"""Reading and writing the volunteer's settings file (``protocol.settings`` has the format).

Missing file: the defaults, written out so the volunteer can find and edit it. A file that
does not parse or validate is refused with one line naming the key, and never overwritten.
Writes are atomic (a temporary file renamed over the old one), so a crash mid-write leaves
the old settings whole.
"""

from __future__ import annotations

import os
from pathlib import Path

from protocol.errors import ConfigError
from protocol.settings import Settings, parse_settings, render_settings

MAX_SETTINGS_BYTES = 64 << 10


def load_settings(path: Path, *, create: bool = True) -> Settings:
    path = Path(path)
    try:
        if path.stat().st_size > MAX_SETTINGS_BYTES:
            raise ConfigError(f"{path} is over {MAX_SETTINGS_BYTES} bytes; it is not a settings file")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        settings = Settings()
        if create:
            save_settings(path, settings)
        return settings
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the settings file {path}: {e}") from None
    return parse_settings(text, where=str(path))


def save_settings(path: Path, settings: Settings) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(render_settings(settings))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
