"""Peers this node does not group with, nor follow as leaders (sans-IO).

Two kinds, because two kinds of evidence come in:

- **Banned, for good**: a proven lie (``peer.bans``, on disk across restarts); for the life of
  the process, a reduced part too large for its contributions (refused in the round itself)
  and an audit answered with other inputs than the mean committed to. An honest peer makes
  none of these, but the too-large refusal is not proof: a member that under-reports its own
  norm can make an honest reducer's mean look too large (docs/THREAT_MODEL.md).
- **Suspended, for a while**: a reducer that did not show the inputs of a mean we audited
  (``peer.audit``, verdict ``UNPROVEN``). That proves nothing: a peer killed or cut off right
  after a round cannot answer, and the same peer, restarted, is honest again. Shutting it out
  for good split a two-peer run for ever (CI: the bootstrap peer was killed after a round, the
  audit of its mean went unanswered, and when it came back the other never grouped with it).
  So the first suspension lasts ``SUSPEND`` of our syncs, and each one after it twice as long
  as the one before, up to ``SUSPEND_MAX``: a reducer that withholds its inputs on purpose
  spends most of its time outside this node's groups, and a peer that crashed once is back a
  few rounds later. Each ``SUSPEND_MAX`` syncs without a new incident forgive one, so a
  volunteer whose machine dies now and then does not climb to the longest suspension.
  Counted in our syncs (``tick``, at each landing), not seconds, so that it means the same
  in a run of 2 s rounds and one of 10 min rounds; it stands still while we are paused. An
  unanswered audit is not evidence others can check, so each auditor judges for itself;
  a liar that refuses audits stays in the groups of members that did not audit it, whatever
  the length of the suspension, and lands the lies an audit would have proven in the rounds
  it is back in (docs/THREAT_MODEL.md: the price of not shutting out crashed peers).

Thread-safe: the audit's verdicts come on the network thread, the round's on the training
thread, and the matchmaking reads on the network thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

SUSPEND = 8  # our syncs (4 rounds of a 2-fragment run)
SUSPEND_MAX = 512


class Distrust:
    def __init__(self, suspend: int = SUSPEND, suspend_max: int = SUSPEND_MAX):
        self.suspend_for, self.suspend_max = suspend, suspend_max
        self.syncs = 0  # our landed syncs so far: the clock of suspensions
        self._banned: set[bytes] = set()
        self._until: dict[bytes, int] = {}  # key -> the sync count its suspension ends at
        self._began: dict[bytes, int] = {}  # key -> the sync count its last suspension began at
        self._count: dict[bytes, int] = {}  # key -> suspensions so far
        self._lock = threading.Lock()

    def tick(self) -> None:
        """One of our syncs landed."""
        with self._lock:
            self.syncs += 1

    def ban(self, key: bytes) -> bool:
        """Never group with ``key`` again (in this process). -> True if it was not banned yet."""
        with self._lock:
            new = bytes(key) not in self._banned
            self._banned.add(bytes(key))
            return new

    def ban_all(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.ban(key)

    def suspend(self, key: bytes, formed_at: int | None = None) -> int:
        """Do not group with ``key`` for a while: -> for how many of our syncs from now, if this
        starts a suspension, else 0 (banned, or the same incident as one already judged).

        ``formed_at``: our sync count when the judged round's group formed. Verdicts come an
        audit's timeout after their round, and groups form ahead of their round, so several
        rounds with the reducer are judged after the first verdict: one on a group formed
        before the last suspension began (or at the same count: we cannot tell which came
        first), and any verdict that comes while a suspension runs, is that incident again
        (each part we held from the reducer is audited alike): it neither doubles nor
        restarts it."""
        key = bytes(key)
        with self._lock:
            formed_at = self.syncs if formed_at is None else formed_at
            if key in self._banned or formed_at <= self._began.get(key, -1) or self._until.get(key, -1) > self.syncs:
                return 0
            n = self._count.get(key, 0)
            if key in self._began:  # one incident forgiven per SUSPEND_MAX syncs without one
                n = max(0, n - (self.syncs - self._began[key]) // self.suspend_max)
            length = min(self.suspend_for * 2 ** n, self.suspend_max)
            self._count[key] = n + 1
            self._began[key], self._until[key] = self.syncs, self.syncs + length
            return length

    def banned(self, key: bytes) -> bool:
        return bytes(key) in self._banned

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, (bytes, bytearray, memoryview)):
            return False
        key = bytes(key)
        with self._lock:
            return key in self._banned or self._until.get(key, -1) > self.syncs

    def active(self) -> set[bytes]:
        """Every key we do not group with now."""
        with self._lock:
            return self._banned | {k for k, t in self._until.items() if t > self.syncs}
