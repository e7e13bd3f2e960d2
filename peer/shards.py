"""Presence for many peers: heartbeats spread over DHT shards, and which of them a node reads
(sans-IO; ``peer.presence`` does the reads and writes).

One DHT key for all of a run's heartbeats, read whole by every node every interval, costs each
node O(N) bytes per interval and puts the whole run on the few DHT nodes nearest that key. So
the key is split as the run grows:

- **Levels.** At level L the run's heartbeats live under 2^L shard keys; a peer's shard is the
  first L bits of ``sha256(tag, run, its public key)``. Level 0 is the single key
  ``run/<id>/peers`` (a small run works exactly as before); level L > 0 is
  ``run/<id>/peers/<L>/<shard>``.
- **Writes.** A node at level L writes its heartbeat to its shard at L - 1, L and L + 1: three
  stores an interval whatever N is. So readers whose level is one off from the writer's (levels
  move one step at a time, from slightly different counts) still find it.
- **Reads.** A node reads its own shard at its level and ``read_shards`` random others (new
  ones every interval): about ``(1 + read_shards) * target`` heartbeats, a sample of the run
  whose size does not grow with N.
- **The level.** The mean count of the shards read, times 2^L, estimates N (the run's peers,
  this node among them). A node moves up a level when its shards hold ``2 * target`` or more
  on average and down when they hold fewer than ``target / 2``: a shard holds between half
  and twice the target, and a level changes only after N doubled or halved.
- **Finding the level.** A node that starts (or finds nobody where it reads) reads its own
  shard at every level once (one ``get_many``) and starts at the level the counts there say;
  the fullest level is the lowest one written to (every writer at or below L + 1 writes at L).

Per node and interval: 3 stores and ``1 + read_shards`` reads of at most ~``2 * target``
heartbeats each, against one read of N heartbeats before; a DHT lookup itself costs O(log N)
hops. So presence traffic per node grows with log N at most (``bench/presence.py``).

What a sample changes for the node (``peer.node.peers``): the peers table and the pace median
use the sample; counts (the dashboard's, an advertisement's, how many vouchers a state needs)
use the estimate; matchmaking closes a batch early on "everyone we expect is in" only at level
0, where the view is whole; a group member outside the sample is looked up in its own shard.
Only peers in shard 0 of the level advertise the run in the public list, so that list holds
about ``target`` entries per run, not N.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field

SHARD_TARGET = 32  # heartbeats a shard holds at about the middle of its band
READ_SHARDS = 2  # random shards read every interval besides our own
MAX_LEVEL = 16  # 2^16 shards: millions of peers at the target size
PROBE_EVERY = 6  # reads between two probes of every level


def shard_of(run_id: bytes, key: bytes, level: int) -> int:
    """The shard of ``key``'s heartbeats at ``level``: the first ``level`` bits of a hash."""
    if level <= 0:
        return 0
    h = int.from_bytes(hashlib.sha256(b"swarmstream/shard/v1\0" + run_id + key).digest()[:4], "big")
    return h >> (32 - level)


@dataclass
class ShardView:
    """One node's shards of one run: where it writes, what it reads, the level and the run's
    size (see the module docstring)."""

    run_id: bytes
    me: bytes
    target: int = SHARD_TARGET
    read_shards: int = READ_SHARDS
    rng: random.Random = field(default_factory=random.Random)
    level: int = 0
    estimate: float = 1.0  # peers in the run, this node included
    _reads: int = PROBE_EVERY  # since the last probe of every level (the first read probes)
    _own: list[int] = field(init=False, repr=False)  # our shard at each level 0..MAX_LEVEL

    def __post_init__(self):
        if self.target < 1:
            raise ValueError(f"the shard target must be at least 1 peer, got {self.target}")
        self._own = [shard_of(self.run_id, self.me, lv) for lv in range(MAX_LEVEL + 1)]

    def writes(self) -> list[tuple[int, int]]:
        """(level, shard) pairs our heartbeat goes to."""
        return [(lv, self._own[lv]) for lv in range(max(0, self.level - 1), min(MAX_LEVEL, self.level + 1) + 1)]

    def probing(self) -> bool:
        """Whether the next read should probe every level: the first, and every
        ``PROBE_EVERY``-th (peers two levels apart do not see each other where they read:
        a late cohort that started low, say; a probe brings them together)."""
        return self._reads >= PROBE_EVERY

    def to_read(self) -> list[tuple[int, int]]:
        """(level, shard) pairs to read now: our own shard at every level when probing, else
        our own shard at our level and up to ``read_shards`` others, drawn afresh."""
        if self.probing():
            return list(enumerate(self._own))
        own = self._own[self.level]
        shards = 1 << self.level
        others = [s for s in self.rng.sample(range(shards), min(shards, self.read_shards + 1)) if s != own]
        return [(self.level, own)] + [(self.level, s) for s in others[:self.read_shards]]

    def observe(self, counts: dict[tuple[int, int], int]) -> None:
        """Take what a read found: (level, shard) -> distinct fresh heartbeats there (ours
        counted, whether or not our own store is readable yet)."""
        own = self._own
        counts = {(lv, s): max(c, 1) if s == own[lv] else c for (lv, s), c in counts.items()}
        if self.probing():
            self._reads = 0
            found = {lv: c for (lv, s), c in counts.items() if s == own[lv] and c > 1}
            if not found:
                self.estimate, self.level = 1.0, 0
                return
            # each level's count, scaled by its shards, undercounts whoever does not write
            # there: the largest is the run's size; counts below the target (at high levels)
            # are noise that the scaling multiplies
            sure = {lv: c for lv, c in found.items() if c >= max(3, self.target)} or \
                {max(found, key=found.get): max(found.values())}
            self.estimate = float(max(c << lv for lv, c in sure.items()))
            fit = max(min(found), min(max(found), self._fit(self.estimate)))
            if abs(fit - self.level) >= 2 or self.estimate <= 1:
                self.level = fit  # one level off is what the reads' hysteresis settles
            return
        self._reads += 1
        at = [c for (lv, _), c in counts.items() if lv == self.level]
        if not at:
            return
        mean = sum(at) / len(at)
        self.estimate = mean * (1 << self.level)
        if mean >= 2 * self.target and self.level < MAX_LEVEL:
            self.level += 1
        elif mean < self.target / 2 and self.level > 0:
            self.level -= 1

    def _fit(self, n: float) -> int:
        """The level at which n peers fill shards to about the target."""
        return max(0, min(MAX_LEVEL, round(math.log2(max(n, 1.0) / self.target))))

    def whole(self) -> bool:
        """Whether our reads cover the whole run (level 0: one key holds every heartbeat)."""
        return self.level == 0

    def advertises(self) -> bool:
        """Whether we put the run in the public list: peers in shard 0 of our level (all of
        them at level 0), so that list holds about ``target`` entries per run."""
        return self._own[self.level] == 0


@dataclass
class Simulated:
    """What ``simulate`` measured, per node and interval, over the last interval."""

    peers: int
    levels: dict[int, int]  # level -> nodes at it
    records_read: float  # heartbeats read per node (mean)
    records_read_max: int
    stores: float  # heartbeat stores per node (mean)
    estimate_low: float  # the lowest and highest estimate of N over the nodes, over N
    estimate_high: float
    seen_share: float  # of the others, the share a node saw in its last read (mean)


def simulate(n: int, intervals: int, *, target: int = SHARD_TARGET, ttl: int = 4, ramp: int = 0,
             seed: int = 0) -> Simulated:
    """Run ``n`` shard views against a model DHT (a dict: no network, no losses) for
    ``intervals`` heartbeat intervals: each interval every node writes its heartbeat where its
    view says and reads what its view says; a record lives ``ttl`` intervals. With ``ramp``,
    nodes join evenly over the first ``ramp`` intervals (a run that grows), else all at once.
    For ``bench/presence.py`` and the tests: the same ``ShardView`` the node runs."""
    rng = random.Random(seed)
    run_id = b"\x07" * 20
    keys = [rng.randbytes(32) for _ in range(n)]
    views = [ShardView(run_id, k, target=target, rng=random.Random(rng.random())) for k in keys]
    store: dict[tuple[int, int], dict[bytes, int]] = {}
    read = stores = 0
    read_max = 0
    seen = 0.0
    for t in range(intervals):
        live = views[: n if not ramp else max(1, min(n, n * (t + 1) // ramp))]
        read = stores = read_max = 0
        seen = 0.0
        for v in live:
            for where in v.writes():
                store.setdefault(where, {})[v.me] = t
                stores += 1
        for v in live:
            where = v.to_read()
            found = {w: {k for k, at in store.get(w, {}).items() if t - at < ttl} for w in where}
            v.observe({w: len(ks | ({v.me} if w[1] == shard_of(run_id, v.me, w[0]) else set()))
                       for w, ks in found.items()})
            got = sum(len(ks) for ks in found.values())
            read, read_max = read + got, max(read_max, got)
            seen += len(set().union(*found.values()) - {v.me}) / max(1, len(live) - 1)
    live_n = len(live)
    levels: dict[int, int] = {}
    for v in live:
        levels[v.level] = levels.get(v.level, 0) + 1
    est = [v.estimate / live_n for v in live]
    return Simulated(live_n, dict(sorted(levels.items())), read / live_n, read_max, stores / live_n,
                     min(est), max(est), seen / live_n)
