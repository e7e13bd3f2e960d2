"""When a peer joins a round, so that it meets the others (``peer.matchmaking``, "Phase"):
``Matchmaker.wait_for_others`` for a node slower than the swarm, which joins when the others
do, and ``Matchmaker.align_delay`` for one that averaged alone, which waits for the peers that
joined its lonely round later than it did. Reads the joins through the matchmaker's
``_read_joins`` and notes what it waited in ``_waited`` (its ``_alone`` holds the lonely rounds)."""

from __future__ import annotations

import asyncio
import math
from typing import Any
from collections.abc import Callable

from hivemind.utils import get_dht_time

from peer.batches import batch_of, busiest_batch

ALIGN_HISTORY = 3  # lonely rounds of a fragment whose join times align_delay looks back on


class PhaseMixin:
    """``Matchmaker``'s timing of its joins (see the module docstring). Uses its ``identity``,
    ``swarm``, ``gap_s``, ``span_s``, ``poll_s``, ``distrusted``, ``_alone``, ``_waited`` and
    ``_read_joins``."""

    identity: Any
    swarm: Any
    gap_s: float
    span_s: float
    poll_s: float
    distrusted: Any
    _alone: dict[int, dict[int, float]]
    _waited: dict[int, dict[int, float]]

    async def wait_for_others(self, fragment: int, round: int, numel: int, timeout_s: float, *,
                              now: Callable[[], float] = get_dht_time) -> str:
        """Wait until a peer other than us has joined (fragment, round), reading the joins every
        ``poll_s``, at most ``timeout_s``. -> ``"joined"`` (join now: we land in their batch),
        ``"late"`` (two or more others joined it in a batch that closes before ours would: we
        cannot meet them this round) or ``"none"`` (nobody came). A node slower than the swarm
        joins its rounds when the others do (``peer.pace``), not by its own step counter.

        A join time is its writer's to choose (backdated, say): one join alone never makes us
        give a round up, it only makes us keep looking; giving up takes a closed batch of two
        or more keys (a Sybil's price, see docs/THREAT_MODEL.md)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        me = self.identity.public_key
        while True:
            others = {k: j.joined_at for k, j in (await self._read_joins(fragment, round, numel, now())).items()
                      if k != me}
            if others:
                t = now()
                batch, _ = batch_of({**others, me: t}, me, self.gap_s, self.span_s)
                if len(batch) > 1:
                    return "joined"
                closed = [k for k in others if batch_of({**others, me: t}, k, self.gap_s, self.span_s)[1] < t]
                if len(closed) >= 2:
                    return "late"
            if loop.time() >= end:
                return "none"
            await asyncio.sleep(min(self.poll_s, max(0.0, end - loop.time())))

    async def align_delay(self, fragment: int, round: int, numel: int, *,
                          now: Callable[[], float] = get_dht_time) -> float:
        """How long to wait before joining ``round`` so as to meet the peers that joined our
        previous, lonely round of this fragment later than we did (0: we were not alone, or
        nobody came later). Bounded by ``matchmaking_timeout_s``.

        A peer about a round behind joins our previous round about when we join this one, so
        its join may not be readable yet: then the lonely round before tells the same offset
        (less what we waited since). Without that, two peers a round apart would never meet.
        A peer more than 1.5 of our rounds behind is not waited for: it is rounds behind, not
        out of step, and downloads the swarm's state (``peer.node.catchup``); waiting for it
        would only keep it from falling far enough behind to do so. The wait goes to the start
        of the batch most of them joined in (``busiest_batch``), not to the latest join: a join
        time is its writer's choice."""
        alone = self._alone.get(fragment, {})
        waited = self._waited.setdefault(fragment, {})
        me = self.identity.public_key
        delay = 0.0
        q = round - 1
        while q in alone and q > round - 1 - ALIGN_HISTORY:  # our lonely rounds, latest first, back to back
            joins = await self._read_joins(fragment, q, numel, now())
            others = [j.joined_at for k, j in joins.items() if k != me and k not in self.distrusted]
            if others:
                if later := [t for t in others if t > alone[q]]:
                    # where most of them joined, not the latest join: one key's join, dated
                    # just under T after ours, kept a peer waiting T and alone every round
                    delay = busiest_batch(later, self.gap_s, self.span_s) - alone[q] \
                        - sum(waited.get(x, 0.0) for x in range(q + 1, round))
                    period = alone[q + 1] - alone[q] if q + 1 in alone else alone[q] - alone.get(q - 1, -math.inf)
                    if delay > 1.5 * period:  # a round or more behind: it catches up by download, not by our waits
                        delay = 0.0
                break
            q -= 1  # nobody's join of that round readable yet: look one round further back
        delay = min(max(delay, 0.0), self.swarm.matchmaking_timeout_s)
        waited[round] = delay
        for notes in (alone, waited):
            for old in [x for x in notes if x <= round - ALIGN_HISTORY]:
                del notes[old]
        return delay
