"""The credit ledger: what this volunteer gave a run, and what the swarm acknowledged.

One small JSON file per run next to its checkpoints (``<data dir>/<run>/credit.json``),
written atomically after every change that matters, so a crash loses at most the sync in
flight. "Acknowledged" means the group's average included our slices: the swarm took the
work. Shown in the dashboard and in ``swarmstream status``.

A ledger file that does not parse is moved aside (``credit.json.corrupt``), never
overwritten, and counting starts again from zero with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Credit:
    tokens_trained: int = 0
    """Tokens of inner training, whether or not they reached the swarm."""
    tokens_contributed: int = 0
    """Tokens behind pseudo-gradients that a group's average included (1/P of a fragment sync's tokens
    per fragment, so a full round acknowledged by every group adds the tokens trained in it)."""
    fragments_contributed: int = 0
    fragments_alone: int = 0
    """Syncs that found no group or failed: applied locally, not acknowledged."""
    rounds_joined: int = 0
    steps_dropped: int = 0
    """Inner steps replaced by a downloaded state because the run moved on (we said so)."""


class CreditLedger:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.credit = self._load()

    def _load(self) -> Credit:
        try:
            data = json.loads(self.path.read_text())
            fields = {f.name for f in dataclasses.fields(Credit)}
            if not (isinstance(data, dict) and set(data) <= fields
                    and all(type(v) is int and v >= 0 for v in data.values())):
                raise ValueError("unexpected keys or values")
            return Credit(**data)
        except FileNotFoundError:
            return Credit()
        except (OSError, ValueError) as e:
            aside = self.path.with_name(self.path.name + ".corrupt")
            os.replace(self.path, aside)
            log.warning("credit ledger unreadable (%s); kept it as %s and started a new one", e, aside)
            return Credit()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(self.credit), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def record_sync(self, tokens: int, acknowledged: bool) -> None:
        if acknowledged:
            self.credit.tokens_contributed += tokens
            self.credit.fragments_contributed += 1
        else:
            self.credit.fragments_alone += 1
        self.save()

    def record_round(self) -> None:
        self.credit.rounds_joined += 1
        self.save()

    def record_trained(self, tokens: int) -> None:
        """Count inner training (saved with the next sync; cheap to call every step)."""
        self.credit.tokens_trained += tokens

    def record_dropped(self, steps: int) -> None:
        self.credit.steps_dropped += steps
        self.save()
