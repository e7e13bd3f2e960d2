"""Streaming DiLoCo fragments: which parameters travel together, and when.

Assignment (strided over transformer blocks, as in Douillard et al. 2025):

- every parameter under ``layers.{i}.`` belongs to fragment ``i % P``;
- the token embedding ``tok_emb.*`` joins fragment 0 (with block 0, the block that reads it);
- the final norm ``norm.*`` and an untied output head ``head.*`` join the fragment of the
  last block, ``(n_layers - 1) % P`` (the block that feeds them).

Schedule: fragment ``p`` starts a sync after the inner steps ``s`` where
``s = offset_p + r * H`` for round ``r = 0, 1, 2, ...`` and ``offset_p = (p + 1) * H // P``.
So every fragment syncs exactly once every H steps, the starts spread evenly by H/P, and the
last fragment syncs at H, 2H, ... (with P = 1 this is plain DiLoCo: a sync every H steps).
The averaged result of a sync started after step ``s`` is applied after step ``s + tau``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Iterable, Sequence

from protocol.errors import LocalProtocolError

_LAYER = re.compile(r"layers\.(\d+)\.")


def fragment_of(name: str, n_layers: int, fragments: int) -> int:
    """The fragment that parameter ``name`` belongs to."""
    m = _LAYER.match(name)
    if m:
        layer = int(m.group(1))
        if layer >= n_layers:
            raise LocalProtocolError(f"parameter {name!r} names layer {layer} but the model has {n_layers}")
        return layer % fragments
    if name.startswith("tok_emb."):
        return 0
    if name.startswith(("norm.", "head.")):
        return (n_layers - 1) % fragments
    raise LocalProtocolError(f"parameter {name!r} has no fragment rule; see protocol/fragments.py")


def assign_fragments(names: Iterable[str], n_layers: int, fragments: int) -> list[list[str]]:
    """Group parameter names by fragment, keeping the given order inside each fragment."""
    if fragments < 1 or fragments > n_layers:
        raise LocalProtocolError(f"fragments must be in [1, n_layers={n_layers}], got {fragments}")
    out: list[list[str]] = [[] for _ in range(fragments)]
    for name in names:
        out[fragment_of(name, n_layers, fragments)].append(name)
    return out


@dataclass(frozen=True, slots=True)
class SyncSchedule:
    """When each fragment's sync starts and when its result lands. Steps count completed inner
    steps from 1; "after step s" means once the s-th inner step has finished."""

    inner_steps: int  # H
    fragments: int  # P
    overlap: int = 0  # tau

    def __post_init__(self) -> None:
        if not (1 <= self.fragments <= self.inner_steps):
            raise LocalProtocolError(f"need 1 <= P <= H, got P={self.fragments} H={self.inner_steps}")
        if self.overlap < 0 or (self.overlap > 0 and self.overlap >= self.inner_steps // self.fragments):
            raise LocalProtocolError(f"need 0 <= tau < H/P, got tau={self.overlap}")

    def offset(self, fragment: int) -> int:
        """The first step after which ``fragment`` syncs (its round 0)."""
        return (fragment + 1) * self.inner_steps // self.fragments

    def starts_after(self, step: int) -> list[int]:
        """Fragments whose sync starts after inner step ``step``."""
        H = self.inner_steps
        return [p for p in range(self.fragments)
                if step >= self.offset(p) and (step - self.offset(p)) % H == 0]

    def lands_after(self, step: int) -> list[int]:
        """Fragments whose averaged result is applied after inner step ``step``."""
        return self.starts_after(step - self.overlap) if step - self.overlap >= 1 else []

    def round_of(self, fragment: int, step: int) -> int:
        """The round of ``fragment`` whose sync starts after ``step`` (a sync step only)."""
        r, rem = divmod(step - self.offset(fragment), self.inner_steps)
        if r < 0 or rem:
            raise LocalProtocolError(f"fragment {fragment} does not sync after step {step}")
        return r

    def step_of(self, rounds: Sequence[int]) -> int:
        """Where a global state that has done ``rounds`` (per fragment) stands: the step right
        before the first sync it has not done. The same on every peer that holds it, whatever
        step each landed it at (a late landing, a follower), so that they serve and vouch for one
        state digest; a joiner starts there."""
        return max(0, min(self.offset(p) + r * self.inner_steps for p, r in enumerate(rounds)) - 1)

    def next_start(self, fragment: int, step: int) -> int:
        """The first step >= ``step`` after which ``fragment`` starts a sync."""
        off = self.offset(fragment)
        if step <= off:
            return off
        return off + -(-(step - off) // self.inner_steps) * self.inner_steps
