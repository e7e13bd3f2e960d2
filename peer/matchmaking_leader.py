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
        late = None
        while now() < latest:  # a member whose deadline is later still follows the leader's record
            late = await self._mine(fragment, round, numel, codec, seed, own, leader, now)
            if late is not None and now() < latest - self.settle_s:
                return late
            if late is not None:  # a read begun before the deadline, that saw a record stored after it
                break
            await asyncio.sleep(min(self.poll_s, max(0.0, latest - now())))
        until = latest + self.settle_s + self.gap_s + 2 * self.poll_s  # its store, and clocks apart
        t0 = now()
        read = await self._read_groups(fragment, round, numel, codec, seed)
        late = late or self._leaders(read, leader, own)
        if late is not None:  # one read for both: a record that landed since our last look is followed, not
            # raced; unless the member ranked next, which did not see it, leads all the rest
            return await self._after_deadline(late, fragment, round, numel, codec, seed, mine, joins, now)
        # a record of a leader we distrust takes nobody: we refuse it, and so does every member
        # that banned it with us (an audit's proof is handed on); one that still follows it is
        # dropped from the rest's group at its deadline. Counting its members as taken left
        # nobody to go on with, and each member averaged alone (a review's whole-node runs)
        led = [f for f in read if f.members[0] == leader and leader not in self.distrusted]
        taken = {k for f in led for k, w in zip(f.members, f.weights) if k in joins and joins[k].weight == w}
        rest = tuple(k for k in mine[1:] if k not in taken)
        if me not in rest or len(rest) < 2:
            return None
        if rest[0] == me:
            log.warning("no record of our group's leader by its members' deadlines: leading the rest fragment=%d "
                        "round=%d leader=%s members=%d", fragment, round, peer_id_from_public_key(leader), len(rest))
            return await self._lead(fragment, round, numel, codec, seed, rest, joins, now)
        while True:
            for f in read:
                if (f.members[0] == rest[0] and me in f.members and set(f.members) <= set(mine[1:])
                        and f.weights == tuple(joins[k].weight for k in f.members)):  # (its view of
                    # what the leader took may differ from ours: a member it names that went
                    # with the leader is dropped by the all-reduce, at its deadline)
                    log.info("following the member ranked next: no record of our group's leader fragment=%d "
                             "round=%d leader=%s", fragment, round, peer_id_from_public_key(leader))
                    return f
            if t0 >= until:  # the member ranked next followed the leader's late record: so do we
                return self._leaders(read, leader, own)
            await asyncio.sleep(min(self.poll_s, max(0.0, until - now())))
            t0 = now()
            read = await self._read_groups(fragment, round, numel, codec, seed)

    async def _after_deadline(self, found: GroupFormed, fragment: int, round: int, numel: int, codec: str,
                              seed: bytes, mine: tuple[bytes, ...], joins: dict[bytes, _Join],
                              now: Callable[[], float]) -> GroupFormed:
        """``found``, our leader's record, seen only once every member's deadline had passed:
        the member ranked next may not have seen it by then, and then leads all the rest
        (``_without_leader``), and the leader, seeing that, averages alone
        (``_left_without_us``). So until that record would have come (``until``: we stop only
        after a read begun then, as a read that lags may miss a record stored while it ran) we
        take it if it comes, and ``found`` if not. The member ranked next saw ``found``: it
        leads nobody, and follows it at once. "Only once" starts a settle time before the
        deadline: members' clocks differ (a member whose clock was 0.1 s behind followed the
        leader while the member ranked next led the rest: a review's simulation). Left: a
        liar ranked next that writes that record early takes with it a member whose reads of
        the leader's (on time) lag past the deadline."""
        latest = max(joins[k].joined_at for k in mine) + self.swarm.matchmaking_timeout_s
        if (len(mine) < 3 or found.members[0] != mine[0] or self.identity.public_key == mine[1]
                or now() < latest - self.settle_s):
            return found
        until = latest + self.settle_s + self.gap_s + 2 * self.poll_s
        while True:
            t0 = now()
            if (rest := self._rest_of(await self._read_groups(fragment, round, numel, codec, seed), mine, joins)) is not None:
                break
            if t0 >= until:
                return found
            await asyncio.sleep(min(self.poll_s, max(0.0, until - now())))
        log.info("following the member ranked next: our leader's record came after our deadlines fragment=%d round=%d",
                 fragment, round)
        return rest

    def _leaders(self, read: list[GroupFormed], leader: bytes, own: _Join) -> GroupFormed | None:
        """Our leader's record in ``read`` that names us with our weight (not a leader we distrust)."""
        me = self.identity.public_key
        return next((f for f in read if f.members[0] == leader and me in f.members
                     and f.weights[f.members.index(me)] == own.weight and leader not in self.distrusted), None)

    @staticmethod
    def _rest_of(read: list[GroupFormed], mine: tuple[bytes, ...], joins: dict[bytes, _Join]) -> GroupFormed | None:
        """The record of all our group but its leader (``mine[1:]``, led by the member ranked
        next, with the weights they joined with): what that member writes when it saw no record
        of the leader's by its deadline."""
        return next((f for f in read if tuple(f.members) == mine[1:]
                     and f.weights == tuple(joins[k].weight for k in f.members)), None)

    async def _left_without_us(self, fragment: int, round: int, numel: int, codec: str, seed: bytes,
                               mine: tuple[bytes, ...], joins: dict[bytes, _Join],
                               now: Callable[[], float]) -> bool:
        """Whether the group we lead went on without us: our record was stored after every
        member's deadline (our network stalled, under load), and the member ranked next, which
        did not see it, led all the others (``_without_leader``; the record of ``mine[1:]``).
        A member that saw our record only after its deadline takes that one instead, as long as
        it looks for it (``until``), and so do we: we average alone at once. Following our own
        record we waited a whole agreement (2.5 D) in a group nobody joined, and came to our
        next round so late that its others had landed it without us (CI). With no such record
        by then we keep our group: the member ranked next followed ours, and so did the rest.
        "After" starts a settle time before it, as for the members (``_after_deadline``); we
        stop looking only after a read begun at ``until``. Left: a member that read our record
        well before its deadline while the member ranked next, whose reads lag, did not see it
        by then (the DHT's views differ) stays with our record alone; and a liar ranked next
        can send us alone whenever we are late."""
        latest = max(joins[k].joined_at for k in mine) + self.swarm.matchmaking_timeout_s
        if len(mine) < 3 or now() <= latest - self.settle_s:  # (as a member's clock may see it)
            return False
        until = latest + self.settle_s + self.gap_s + 2 * self.poll_s  # as long as they look for it
        while True:
            t0 = now()
            if self._rest_of(await self._read_groups(fragment, round, numel, codec, seed), mine, joins) is not None:
                log.warning("our group's record came after its members' deadlines and they went on without us: "
                            "averaging alone this round fragment=%d round=%d", fragment, round)
                return True
            if t0 >= until:
                return False
            await asyncio.sleep(min(self.poll_s, max(0.0, until - now())))

    def leaderless_s(self) -> float:
        """How much longer than ``matchmaking_timeout_s`` ``form_group`` may take: a group whose
        leader wrote no record waits for its last member's deadline (a batch's span after ours
        at most), then for its next member's record (``_without_leader``)."""
        return self.span_s + self.settle_s + self.gap_s + 2 * self.poll_s + FORMATION_MARGIN_S
