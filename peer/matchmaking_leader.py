"""A group whose leader is not there in time (``peer.matchmaking``, step 4): its followers go
on without it, led by the member ranked next (``_without_leader``), and a leader whose record
came after their deadlines averages alone rather than wait in a group nobody joined
(``_left_without_us``). Uses the matchmaker's ``identity``, ``swarm``, windows (``span_s``,
``gap_s``, ``settle_s``, ``poll_s``), ``distrusted`` and its record reads and writes
(``_mine``, ``_read_groups``, ``_lead``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from protocol.identity import peer_id_from_public_key
from protocol.messages_swarm import GroupFormed

if TYPE_CHECKING:
    from peer.matchmaking import _Join

log = logging.getLogger("peer.matchmaking")

FORMATION_MARGIN_S = 1.0  # for the DHT round trips of forming a group, on top of the windows


class LeaderlessMixin:
    """``Matchmaker``'s groups without their leader (see the module docstring)."""

    identity: Any
    swarm: Any
    distrusted: Any
    span_s: float
    gap_s: float
    settle_s: float
    poll_s: float
    _alone: dict[int, dict[int, float]]

    async def _without_leader(self, fragment: int, round: int, numel: int, codec: str, seed: bytes,
                              mine: tuple[bytes, ...], joins: dict[bytes, _Join],
                              now: Callable[[], float]) -> GroupFormed | None:
        """Our group's leader wrote no record we could follow by our deadline (it left, or it is
        a key that joins every round and leads none: no record, or one we refuse): the rest of
        the group averages without it. Until the last member's deadline (``latest``) the
        leader's record is still followed should it come; then the member ranked next of those
        its records did not take (a record names a member with the weight it joined with: that
        member follows it) writes the record of the others, as their leader, and they look for
        it until a settle time, a gap and two polls later, taking it only if it names members of
        our group with the weights they joined with (a second key gets no more say than that).
        Followers used to average alone there: a key ranked first in about one group in k left
        its followers apart (different copies, then downloads) every time. Before our deadline
        nothing changes, so an honest leader that is slow, not gone, is followed as before."""
        me, leader, own = self.identity.public_key, mine[0], joins[self.identity.public_key]
        latest = max(joins[k].joined_at for k in mine) + self.swarm.matchmaking_timeout_s
        while now() < latest:  # a member whose deadline is later still follows the leader's record
            found = await self._mine(fragment, round, numel, codec, seed, own, leader, now)
            if found is not None:
                return found
            await asyncio.sleep(min(self.poll_s, max(0.0, latest - now())))
        led = [f for f in await self._read_groups(fragment, round, numel, codec, seed) if f.members[0] == leader]
        for f in led:  # one read for both: a record that landed since our last look is followed, not raced
            if me in f.members and f.weights[f.members.index(me)] == own.weight and leader not in self.distrusted:
                return f
        taken = {k for f in led for k, w in zip(f.members, f.weights) if k in joins and joins[k].weight == w}
        rest = tuple(k for k in mine[1:] if k not in taken)
        if me not in rest or len(rest) < 2:
            return None
        if rest[0] == me:
            log.warning("no record of our group's leader by its members' deadlines: leading the rest fragment=%d "
                        "round=%d leader=%s members=%d", fragment, round, peer_id_from_public_key(leader), len(rest))
            return await self._lead(fragment, round, numel, codec, seed, rest, joins, now)
        until = latest + self.settle_s + self.gap_s + 2 * self.poll_s  # its store, and clocks apart
        while True:
            for f in await self._read_groups(fragment, round, numel, codec, seed):
                if (f.members[0] == rest[0] and me in f.members and set(f.members) <= set(mine[1:])
                        and f.weights == tuple(joins[k].weight for k in f.members)):  # (its view of
                    # what the leader took may differ from ours: a member it names that went
                    # with the leader is dropped by the all-reduce, at its deadline)
                    log.info("following the member ranked next: no record of our group's leader fragment=%d "
                             "round=%d leader=%s", fragment, round, peer_id_from_public_key(leader))
                    return f
            if now() >= until:
                return None
            await asyncio.sleep(min(self.poll_s, max(0.0, until - now())))

    async def _left_without_us(self, fragment: int, round: int, numel: int, codec: str, seed: bytes,
                               mine: tuple[bytes, ...], joins: dict[bytes, _Join],
                               now: Callable[[], float]) -> bool:
        """Whether the group we lead went on without us: our record was stored after every
        member's deadline (our network stalled, under load), and the member ranked next then
        led all the others (``_without_leader``; a record naming them all, with the weights
        they joined with). We then average alone at once: following our own record we waited
        a whole agreement (2.5 D) in a group nobody joined, and came to our next round so late
        that its others had landed it without us (CI). If some of them may follow ours (a
        record of the rest without one of them, or none by the time theirs would be written)
        we stay: a member missing from it is dropped at the push deadline."""
        latest = max(joins[k].joined_at for k in mine) + self.swarm.matchmaking_timeout_s
        if len(mine) < 3 or now() <= latest:
            return False
        others = set(mine[1:])
        until = latest + self.settle_s + self.gap_s + 2 * self.poll_s  # as long as they look for it
        while True:
            for f in await self._read_groups(fragment, round, numel, codec, seed):
                if (set(f.members) == others and f.members[0] not in self.distrusted
                        and f.weights == tuple(joins[k].weight for k in f.members)):
                    log.warning("our group's record came after its members' deadlines and they went on without us: "
                                "averaging alone this round fragment=%d round=%d", fragment, round)
                    return True
            if now() >= until:
                return False
            await asyncio.sleep(min(self.poll_s, max(0.0, until - now())))

    def leaderless_s(self) -> float:
        """How much longer than ``matchmaking_timeout_s`` ``form_group`` may take: a group whose
        leader wrote no record waits for its last member's deadline (a batch's span after ours
        at most), then for its next member's record (``_without_leader``)."""
        return self.span_s + self.settle_s + self.gap_s + 2 * self.poll_s + FORMATION_MARGIN_S
