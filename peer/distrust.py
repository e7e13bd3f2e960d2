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

- **Absent**: a member that joined our groups and then sent us nothing, in ``ABSENT`` rounds in
  a row (``absent``; any frame from it in a group of ours starts the count again: ``present``),
  or a leader that wrote no record of our group that often, is suspended the same way. Each
  such group waits for it to its deadline: one key that joined every group and never took
  part cost every round a whole deadline (20 s instead of about 1.5 s) and was never shut
  out. A peer killed once is absent from the rounds formed before it died, not from 3 in a
  row once it is back; one slower than every deadline, round after round, is shut out for a
  while (suspended, never banned).

Thread-safe: the audit's verdicts come on the network thread, the round's on the training
thread, and the matchmaking reads on the network thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

SUSPEND = 8  # our syncs (4 rounds of a 2-fragment run)
SUSPEND_MAX = 512
ABSENT = 3  # rounds in a row in which a member of our groups sent us nothing: then it is suspended


class Distrust:
    def __init__(self, suspend: int = SUSPEND, suspend_max: int = SUSPEND_MAX):
        self.suspend_for, self.suspend_max = suspend, suspend_max
        self.syncs = 0  # our landed syncs so far: the clock of suspensions
        self._banned: set[bytes] = set()
        self._until: dict[bytes, int] = {}  # key -> the sync count its suspension ends at
        self._began: dict[bytes, int] = {}  # key -> the sync count its last suspension began at
        self._count: dict[bytes, int] = {}  # key -> suspensions so far
        self._absent: dict[bytes, tuple[int, int]] = {}  # key -> (rounds in a row it sent us nothing in, the last)
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

    def absent(self, key: bytes, round_: int) -> int:
        """``key`` was in our group of round ``round_`` (of any fragment) and sent us nothing,
        or led it and wrote no record of it: -> for how many of our syncs it is suspended from
        now, if this starts a suspension (absent from ``ABSENT`` rounds in a row), else 0. The
        fragments of one round count once: a peer killed mid-round is absent from the groups
        formed for it and the next one ahead, not from three rounds."""
        key = bytes(key)
        with self._lock:
            n, last = self._absent.get(key, (0, None))
            if last == round_:
                return 0
            if n + 1 < ABSENT:
                if len(self._absent) >= 4096 and key not in self._absent:
                    self._absent.clear()  # at worst, an absent key is counted afresh
                self._absent[key] = (n + 1, round_)
                return 0
            self._absent.pop(key, None)
        return self.suspend(key)

    def present(self, key: bytes) -> None:
        """``key`` took part in a group of ours."""
        with self._lock:
            self._absent.pop(bytes(key), None)

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
