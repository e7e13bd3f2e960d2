"""What every benchmark records next to its numbers: the machine and the git commit."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        commit = out.stdout.strip() or os.environ.get("BENCH_COMMIT", "unknown")
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):  # no git here (a copy of the tree on another machine)
        return os.environ.get("BENCH_COMMIT", "unknown")


def machine() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def write_json(path: str | os.PathLike | None, name: str, payload: dict) -> Path:
    """Write ``payload`` plus machine/commit/time to ``path`` (default bench/results/NAME.json)."""
    out = Path(path) if path else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "commit": git_commit(), "machine": machine(),
           "unix_time": int(time.time()), **payload}
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(out)
    return out


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec such as '>10.4f')."""
    widths = [max([len(h)] + [len(format(r[k], f)) for r in rows]) for k, h, f in columns]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for r in rows:
        print("  ".join(format(r[k], f).rjust(w) for (k, _, f), w in zip(columns, widths)))
