"""Forming averaging groups per (run, fragment, round) through hivemind's DHT.

Records (keys under ``peer.presence.PREFIX``, each a map whose subkey is the writer's public
key, so a writer can only fill its own slot; see ``peer.network.RecordOwnerValidator``):

- ``run/<run>/avg/<fragment>/<round>/joins``: every ready peer's signed ``JoinGroup``
  (weight, numel), expiring ``JOIN_TTL_FACTOR * matchmaking_timeout_s`` after it was written;
- ``run/<run>/avg/<fragment>/<round>/groups``: each group leader's signed ``GroupFormed``.

The scheme, as each peer runs it (``T = matchmaking_timeout_s``, ``gap = GAP_FRACTION * T``,
``span = SPAN_FRACTION * T``):

1. Write our JoinGroup. Its *join time* is its expiration minus the fixed TTL (the DHT keeps
   the expiration with each subkey, so no extra field is needed).
2. Batches: sort the joins of (run, fragment, round) by join time and chain them into
   batches: a batch starts at the earliest join not yet in a batch and takes each next join
   that comes within ``gap`` seconds of the one before it, up to ``span`` seconds after its
   first. Peers that reach a round a few seconds apart, one after another, so land in one
   batch (fixed windows cut them apart at arbitrary points, and two half-swarms then average
   separately). Wait until our batch has closed (``gap`` after its last join, or at its span),
   plus ``settle`` seconds for the last stores to land, then read the joins one final time.
3. Groups: rank the batch's peers by ``sha256(seed || public key)`` with
   ``seed = sha256(run, fragment, round)``, and deal them out to ``ceil(n / group_size)``
   groups round-robin (sizes differ by at most one, none above ``group_size``). Member order
   is rank order; the first member is the group's leader; the group ID is a hash of the seed
   and the members. A new round gives a new seed, so groups reshuffle every round and
   averages mix across the swarm.
4. The leader of a group of two or more writes its ``GroupFormed`` and returns it; the others
   poll the groups key until a verified ``GroupFormed`` that names them appears and follow it.
   A group of one (an odd peer out, or a lonely peer) gets ``None`` soon after its window (a
   settle time and two polls later): no later join can enter a closed batch. A follower that
   no leader names gets ``None`` at the deadline.

Why it converges: batches and groups are pure functions of the set of joins, and the final
read happens after the window has closed, so peers that see the same joins compute the same
groups. Nobody has to *agree* through the DHT beyond that: members follow the one signed
record their leader wrote, so each group has exactly one member list and order. Why nobody
hangs: every wait for a leader's record ends at ``join time + T``; a group whose leader wrote
none by then goes on without it, its member ranked next leading, which ends a batch's span, a
gap, a settle time and two polls later at most (``peer.matchmaking_leader``). If views differ (a store that landed late), two
leaders may name the same peer; it follows its own leader's record, or the one its fresh read
of the joins confirms, ranked first (the same rule on every peer), and the other group's
all-reduce drops the missing member at its deadline. A peer
named by nobody returns ``None`` and keeps its own value this round.

Phase: peers in step meet because a shared all-reduce ends at the same moment for all of
them. Peers that drifted apart in time (a pause, a restart, a slow step) by more than ``gap``
land in separate batches, average alone, and, with equal round times, would stay apart for
ever. So a peer that averaged alone looks, at its next round of that fragment, at when the
others joined the round it spent alone (``align_delay``): if they joined later, it waits that
long (at most ``T``; the rest at the round after) before joining, and the two meet from then
on (any group we form, of any fragment, puts us back in step, and clears what we noted). A
peer about a whole round behind joins our lonely round only about when we join the next one,
too late to be read then: the lonely round before it tells the same offset. Only the peer ahead
waits; one behind cannot speed up. The lone rounds leave the two with different copies,
which the node's repair settles (``peer.node.catchup``: the side most peers hold, or the
smallest key's, taken at the rounds the taker is at).

Ahead of the sync (pipelined): the node calls ``form_group`` as soon as the fragment's
previous round has landed (``peer.node.syncs._lead_steps``), with the weight the sync will
carry, so the group is there when the pseudo-gradient is and the batch windows above cost no
training time. Peers in step land a round together (the end of one all-reduce) and so join
the next one together; everything above holds unchanged, only earlier. A node slower than the others
(``peer.pace``) joins when another peer has joined the round (``wait_for_others``), so it
lands in their batch; if their batch has closed already, it averages alone at once, to be
ready for the next round.

Checked on read: signature, message type, run, fragment and round (the signed context), that
the subkey is the signer, numel, codec and deadline against ours, that a group's leader is its
first member and its ID is the hash of its members, and a join time not in the future beyond
``CLOCK_SKEW_S``. A record that fails is ignored and logged (``reason=... peer=...``). A
``GroupFormed`` that passes is still only a claim (any key can write one naming anyone): a
peer follows its own leader's (the first of its group by its view), or one that is the group
the batch rule gives its leader over the joins it reads afresh (a leader whose view was fuller
than ours; ``Matchmaker._consistent``); a leader gives its group up only for such a record,
ranked before it. A key that names members of other groups, joined or not, is followed by
nobody.

Closing early: the batch window is a floor under every sync (``gap + settle``, 2.5 s at the
demo's T = 5 s), which a round shorter than that cannot hide however early it joins. So a
node tells its matchmaker which other peers it expects in a round (``expected``: every live
peer, by its heartbeat), and once all of them are in its batch it closes the batch at once.
Peers in step see the same complete set of joins, so they close on the same batch, a little
apart; a peer that joins and was expected by nobody (a newcomer
whose heartbeat is not read yet) may find the batch closed by some and not by others: it
follows the group that names it (leaders with the fuller view write it), or averages alone
this round, as after any difference in views. A peer that does not come (paused, behind, a
follower waiting for the others) leaves the window as it was.

Tuning: raise ``matchmaking_timeout_s`` if peers that are ready at about the same time end up
in separate batches (gap and span are fractions of it); on a slow DHT, raise it as well, since
the settle time is a fraction of it too. ``span + settle`` stays below ``T``, so the first
member of a batch still has time to see its group before its own deadline.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from peer.allreduce import Group
from peer.batches import assign_groups, batch_of, group_id_of, groups_key, joins_key, rank, round_seed
from peer.distrust import Distrust
from peer.matchmaking_leader import FORMATION_MARGIN_S, LeaderlessMixin
from peer.matchmaking_phase import PhaseMixin
from protocol.butterfly import max_idle
from protocol.envelope import seal, verify
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.identity import Identity, peer_id_from_public_key
from protocol.manifest import SwarmConfig
from protocol.messages import KEY_BYTES
from protocol.messages_swarm import GroupFormed, JoinGroup

__all__ = ["Matchmaker", "assign_groups", "batch_of", "group_id_of", "groups_key", "joins_key", "round_seed"]

log = logging.getLogger(__name__)

GAP_FRACTION = 0.4  # of matchmaking_timeout_s: a join this soon after the batch's last one extends it
SPAN_FRACTION = 0.7  # of matchmaking_timeout_s: no batch stays open longer than this after its first join
SETTLE_FRACTION = 0.1  # of matchmaking_timeout_s, at most SETTLE_MAX_S: for late stores to land
SETTLE_MAX_S = 2.0
JOIN_TTL_FACTOR = 2.0  # joins outlive every window they can be part of
CLOCK_SKEW_S = 30.0


@dataclass(frozen=True, slots=True)
class _Join:
    weight: float
    numel: int
    joined_at: float


class Matchmaker(PhaseMixin, LeaderlessMixin):
    """Forms this peer's averaging groups for one run. Call ``form_group`` from the event loop
    that runs ``dht`` (see the module docstring for the scheme)."""

    def __init__(self, dht: DHTNode, identity: Identity, run_id: bytes, swarm: SwarmConfig, *,
                 poll_s: float = 0.5, max_weight: float = 1e18):
        self.dht = dht
        self.max_weight = max_weight  # the run's most tokens one sync may cover
        self.identity = identity
        self.run_id = bytes(run_id)
        self.swarm = swarm
        self.poll_s = poll_s
        t = swarm.matchmaking_timeout_s
        self.gap_s = GAP_FRACTION * t
        self.span_s = SPAN_FRACTION * t
        self.settle_s = min(SETTLE_FRACTION * t, SETTLE_MAX_S)
        self.join_ttl_s = JOIN_TTL_FACTOR * t
        self._alone: dict[int, dict[int, float]] = {}  # fragment -> {round we averaged alone: our join time}
        self._waited: dict[int, dict[int, float]] = {}  # fragment -> {round: how long we waited to join it}
        self.expected: Callable[[int, int], set[bytes]] | None = None
        """(fragment, round) -> the keys of the other peers we expect to join that round (the
        node's live peers). Once all of them are in our batch, the
        batch closes at once instead of ``gap`` after its last join: everyone we know of is
        in, and waiting only delays the group (see the module docstring)."""
        self.quiet: Callable[[str], bool] | None = None
        """Whether a peer ID let our averager down in its last round with it (``peer.quiet``):
        in the groups we lead, it reduces no slice (``_idle``)."""
        self.distrusted = Distrust()
        """Keys we do not group with, nor follow as leaders: banned for a proven lie or a
        reduced part we refused, or suspended for an audit they did not answer (``peer.distrust``;
        ``peer.node`` and ``peer.audit`` fill it). A leader that does not know drops nothing: we
        follow its group, and check what it brings."""

    def formation_s(self) -> float:
        """About how long ``form_group`` takes for peers that join together: the batch gap and
        settle time, a follower's poll, and a margin for the DHT's reads and writes. A node
        joins that long before a sync starts, so its group is there when its update is."""
        return self.gap_s + self.settle_s + self.poll_s + FORMATION_MARGIN_S

    def _reject(self, writer: Any, kind: str, err: Exception) -> None:
        who = peer_id_from_public_key(writer) if isinstance(writer, bytes) and len(writer) == KEY_BYTES \
            else repr(writer)[:60]
        log.warning("rejected matchmaking record kind=%s reason=%s peer=%s", kind, err, who)

    async def _entries(self, key: str) -> list[tuple[Any, Any, float]]:
        found = await self.dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        return [(sub, v.value, v.expiration_time) for sub, v in found.value.items()]

    async def _read_joins(self, fragment: int, round: int, numel: int, now: float) -> dict[bytes, _Join]:
        out: dict[bytes, _Join] = {}
        for writer, value, expiration in await self._entries(joins_key(self.run_id, fragment, round)):
            try:
                if not isinstance(writer, bytes) or len(writer) != KEY_BYTES:
                    raise RemoteProtocolError("malformed subkey")
                msg = verify(value, expect=JoinGroup, run_id=self.run_id, fragment=fragment, round=round,
                             sender=writer).message
                assert isinstance(msg, JoinGroup)
                joined_at = expiration - self.join_ttl_s
                if joined_at > now + CLOCK_SKEW_S:
                    raise RemoteProtocolError(f"join time {joined_at:.0f} is in the future (now {now:.0f})")
                if msg.numel != numel:
                    raise RemoteProtocolError(f"numel {msg.numel} is not ours ({numel})")
                if not 0 < msg.weight <= self.max_weight:
                    raise RemoteProtocolError(f"weight {msg.weight:g} is not in (0, {self.max_weight:g}] tokens")
            except (RemoteProtocolError, TypeError) as e:
                self._reject(writer, "join", e)
                continue
            out[writer] = _Join(msg.weight, msg.numel, joined_at)
        return out

    async def _read_groups(self, fragment: int, round: int, numel: int, codec: str,
                           seed: bytes) -> list[GroupFormed]:
        out = []
        for writer, value, _ in await self._entries(groups_key(self.run_id, fragment, round)):
            try:
                if not isinstance(writer, bytes) or len(writer) != KEY_BYTES:
                    raise RemoteProtocolError("malformed subkey")
                msg = verify(value, expect=GroupFormed, run_id=self.run_id, fragment=fragment, round=round,
                             sender=writer).message
                assert isinstance(msg, GroupFormed)
                if msg.members[0] != writer:
                    raise RemoteProtocolError("the writer is not the group's first member")
                if not 2 <= len(msg.members) <= self.swarm.group_size:
                    raise RemoteProtocolError(f"{len(msg.members)} members, not in [2, {self.swarm.group_size}]")
                if msg.group_id != group_id_of(seed, msg.members, msg.idle):
                    raise RemoteProtocolError("the group ID is not the hash of its members")
                if msg.numel != numel or msg.codec != codec:
                    raise RemoteProtocolError(f"numel/codec {msg.numel}/{msg.codec} are not ours ({numel}/{codec})")
                if msg.deadline_s != self.swarm.allreduce_timeout_s:
                    raise RemoteProtocolError(f"deadline {msg.deadline_s} s is not the run's")
                if not sum(msg.weights) > 0 or max(msg.weights) > self.max_weight:
                    raise RemoteProtocolError(f"weights must have a positive sum and none over {self.max_weight:g}")
            except (RemoteProtocolError, TypeError) as e:
                self._reject(writer, "group", e)
                continue
            out.append(msg)
        return out

    async def _mine(self, fragment: int, round: int, numel: int, codec: str, seed: bytes, own: _Join,
                    leader: bytes, now: Callable[[], float]) -> GroupFormed | None:
        """The record to follow, of those naming us with our weight (none led by a key we
        distrust): our own leader's (``leader``: the first of our group by our view of the
        joins), whatever its view; else one that is the group the batch rule gives its leader
        over the joins we read now (``_consistent``), the leader ranked first. A record is a
        claim, not a fact: any key can write one naming anyone, and following one by its rank
        alone let a key that never joined pull peers out of their groups every round."""
        me = self.identity.public_key
        ours = [f for f in await self._read_groups(fragment, round, numel, codec, seed)
                if me in f.members and f.weights[f.members.index(me)] == own.weight
                and f.members[0] not in self.distrusted]
        led = [f for f in ours if f.members[0] == leader]
        if led or not ours:
            return led[0] if led else None
        joins = await self._read_joins(fragment, round, numel, now())  # afresh: a late store may have landed
        joins.setdefault(me, own)  # our own store may not be readable yet
        ok = [f for f in ours if self._consistent(f, seed, joins)]
        return min(ok, key=lambda f: rank(seed, f.members[0]), default=None)

    def _consistent(self, f: GroupFormed, seed: bytes, joins: dict[bytes, _Join]) -> bool:
        """Whether record ``f`` is a group that the batch rule gives its leader over ``joins``
        (all of them, or without the keys we distrust: its leader may distrust them too), every
        member having joined with the weight it names. A leader whose view was fuller than ours
        writes such a record once its extra joins reach us; a key that names whom it likes
        does not."""
        if any(m not in joins or joins[m].weight != w for m, w in zip(f.members, f.weights)):
            return False
        views = [joins, {k: j for k, j in joins.items() if k not in self.distrusted or k in f.members}]
        for view in views:
            batch, _ = batch_of({k: j.joined_at for k, j in view.items()}, f.members[0], self.gap_s, self.span_s)
            if tuple(f.members) in assign_groups(seed, batch, self.swarm.group_size):
                return True
        return False

    async def _lead(self, fragment: int, round: int, numel: int, codec: str, seed: bytes,
                    members: tuple[bytes, ...], joins: dict[bytes, _Join], now: Callable[[], float]) -> GroupFormed:
        """Write the record of the group we lead (``members``, we first) and return it."""
        idle = self._idle(members)
        if idle:
            log.info("quiet members reduce nothing fragment=%d round=%d idle=%s", fragment, round, list(idle))
        formed = GroupFormed(run_id=self.run_id, fragment=fragment, round=round,
                             group_id=group_id_of(seed, members, idle), members=members,
                             weights=tuple(joins[k].weight for k in members), numel=numel, codec=codec,
                             deadline_s=self.swarm.allreduce_timeout_s, idle=idle)
        expiration = now() + self.swarm.matchmaking_timeout_s + self.swarm.allreduce_timeout_s
        if not await self.dht.store(groups_key(self.run_id, fragment, round), seal(formed, self.identity),
                                    expiration, subkey=self.identity.public_key):
            log.warning("could not store our GroupFormed fragment=%d round=%d", fragment, round)
        return formed

    def _idle(self, members: tuple[bytes, ...]) -> tuple[int, ...]:
        """The members of the group we lead that reduce nothing (``GroupFormed.idle``): those
        that let us down in our last round with them (``quiet``), up to ``max_idle``. A
        ghost's slice would fall back every round: its part's update lost on every member."""
        if self.quiet is None:
            return ()
        return tuple(i for i, k in enumerate(members) if i and self.quiet(peer_id_from_public_key(k)))[:max_idle(len(members))]

    def _group(self, f: GroupFormed, late: bool = False) -> Group:
        self._alone.clear()  # we are in step with a group again: old offsets no longer apply
        self._waited.clear()
        return Group(run_id=self.run_id, fragment=f.fragment, round=f.round, group_id=bytes(f.group_id),
                     members=tuple(bytes(m) for m in f.members), weights=tuple(f.weights), numel=f.numel,
                     codec=f.codec, deadline_s=f.deadline_s, formed_at=self.distrusted.syncs, idle=tuple(f.idle),
                     late=late)

    async def form_group(self, fragment: int, round: int, weight: float, numel: int, codec: str, *,
                         now: Callable[[], float] = get_dht_time) -> Group | None:
        """Our group for (fragment, round), or None if nobody joined us before the deadline
        (``matchmaking_timeout_s`` after this call; ``leaderless_s`` more where our leader
        wrote no record): then keep the local value this round."""
        if not (math.isfinite(weight) and 0 < weight <= self.max_weight):
            raise LocalProtocolError(f"weight must be a positive number up to {self.max_weight:g}, got {weight}")
        me = self.identity.public_key
        seed = round_seed(self.run_id, fragment, round)
        t_me = now()
        deadline = t_me + self.swarm.matchmaking_timeout_s
        join = JoinGroup(run_id=self.run_id, fragment=fragment, round=round, weight=weight, numel=numel)
        jkey = joins_key(self.run_id, fragment, round)
        if not await self.dht.store(jkey, seal(join, self.identity), t_me + self.join_ttl_s, subkey=me):
            log.warning("could not store our JoinGroup fragment=%d round=%d; others may not see us", fragment, round)

        # Wait until our batch's window has closed (and settled), refreshing our view of it.
        while True:
            joins = await self._read_joins(fragment, round, numel, now())
            joins = {k: j for k, j in joins.items() if k not in self.distrusted}  # we group without them
            joins.setdefault(me, _Join(weight, numel, t_me))  # our own store may not be readable yet
            batch, close = batch_of({k: j.joined_at for k, j in joins.items()}, me, self.gap_s, self.span_s)
            wake = min(close + self.settle_s, deadline)
            if now() >= wake:
                break
            expected = self.expected(fragment, round) - self.distrusted.active() - {me} if self.expected else set()
            if expected and expected <= set(batch):
                wake = now()  # everyone we expect is in our batch: nothing left to wait for
                break
            await asyncio.sleep(min(self.poll_s, wake - now()))

        groups = assign_groups(seed, batch, self.swarm.group_size)
        mine = next(g for g in groups if me in g)
        log.info("batch fragment=%d round=%d peers=%d groups=%s ours=%d leader=%s", fragment, round, len(batch),
                 [len(g) for g in groups], len(mine), mine[0] == me)
        if len(mine) >= 2 and mine[0] == me:
            taken = await self._mine(fragment, round, numel, codec, seed, joins[me], me, now)
            if taken is not None and rank(seed, taken.members[0]) < rank(seed, me):
                return self._group(taken)  # a leader ranked before us already named us: follow it
            formed = await self._lead(fragment, round, numel, codec, seed, mine, joins, now)
            late = now() > max(joins[k].joined_at for k in mine) + self.swarm.matchmaking_timeout_s
            if await self._left_without_us(fragment, round, numel, codec, seed, mine, joins, now):
                self._alone.setdefault(fragment, {})[round] = t_me
                return None
            return self._group(formed, late=late)

        # A follower (or a group of one, which may still be named by a leader whose view differs).
        # The leader closed the same window a moment ago and is storing its record now: look
        # again soon, then back off to poll_s (the whole group waits for its last follower).
        # Alone in our group (alone in our batch, or the odd one out), nothing can change any
        # more: a later join starts a batch of its own, and one that came before ours has
        # closed; only a leader that saw a join we never saw could name us, and it would have by
        # now (unless that join's store landed more than a settle time late: then its group
        # drops us at the push deadline). So stop looking a settle time and two polls after the
        # window, not at the deadline: waiting there only delays our landing, and with it our
        # join of the fragment's next round, which would then come too late for the others'
        # batch as well (a peer alone once would stay alone).
        give_up = deadline if len(mine) > 1 else min(deadline, wake + self.settle_s + 2 * self.poll_s)
        delay = self.poll_s / 8
        while True:
            found = await self._mine(fragment, round, numel, codec, seed, joins[me], mine[0], now)
            if found is not None:  # (a read that ended after every member's deadline: maybe not theirs)
                return self._group(await self._after_deadline(found, fragment, round, numel, codec, seed, mine,
                                                              joins, now))
            if now() >= give_up:
                if len(mine) >= 3:  # our leader wrote no record we can follow: the rest go on without it
                    found = await self._without_leader(fragment, round, numel, codec, seed, mine, joins, now)
                    if found is not None:
                        return self._group(found)
                log.info("no group fragment=%d round=%d: averaging alone this round", fragment, round)
                self._alone.setdefault(fragment, {})[round] = t_me
                return None
            await asyncio.sleep(max(0.0, min(delay, give_up - now())))
            delay = min(2 * delay, self.poll_s)
