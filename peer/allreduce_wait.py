"""The waits of one member's round (``peer.allreduce.Averager``): for the pushes of our slice,
for the reduced parts, and for the agreement's reports. Each stops at its deadline, or once it
waits only for quiet members (``peer.quiet``: they did not do their part in our last round with
them), a grace after everyone else's frames were in."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from peer.allreduce_round import Round
from peer.quiet import QUIET_PART
from peer.quiet import grace as quiet_grace
from protocol.envelope import seal_parts
from protocol.messages_swarm import PartsHeld

log = logging.getLogger("peer.allreduce")

ELSEWHERE_GRACE = 0.1  # of deadline_s: a part others reported holding this long is not waited for


class WaitMixin:
    """``Averager``'s waits. Uses its identity and ``_report``/``_forward`` (``SendMixin``)."""

    async def _agree(self, rnd: Round) -> None:
        """Tell every member which parts we hold, forward the ones they lack, and wait for what
        they hold and we lack, until every member we wait for has reported (see
        ``peer.allreduce_round``) or the agreement's deadline."""
        g = rnd.group
        rnd.agreeing = True
        rnd.early = not rnd.heard_from_anyone() and not g.late
        rnd.reported = rnd.digests()
        report = PartsHeld(run_id=g.run_id, fragment=g.fragment, round=g.round, group_id=g.group_id,
                           digests=rnd.reported, norms=tuple(rnd.norms), dots=rnd.my_dots(),
                           witness=rnd.witness_report())
        frames = [seal_parts(report, self.identity)]
        for i in range(rnd.n):
            if i != rnd.me and not rnd.dropped.get(i, "").startswith("unreachable"):
                rnd.tasks.append(asyncio.create_task(self._report(rnd, i, frames)))
        self._forward(rnd, rnd.tasks)  # reports that came before ours
        await self._wait(rnd, rnd.agreed, rnd.agree_deadline, rnd.agreed_but_quiet)
        if rnd.agreed():
            return
        if rnd.agreed_but_quiet() and asyncio.get_running_loop().time() < rnd.agree_deadline:
            rnd.waived |= {i for i in rnd.took_part() if i not in rnd.reports}  # not agreed: states compared after
            for i in sorted(rnd.waived):
                log.info("report not waited for peer=%s reason=quiet: no report in our last round with it group=%s",
                         rnd.peer_ids[i], g.group_id.hex())
        else:
            rnd.agree_timed_out = True

    async def _wait(self, rnd: Round, done: Any, deadline: float, but_quiet: Any = None) -> None:
        """Until ``done()`` or the deadline; while ``but_quiet()`` holds (done but for silent
        quiet members, ``peer.quiet``), at most ``peer.quiet.grace`` from when it began to."""
        loop = asyncio.get_running_loop()
        start, cut = loop.time(), math.inf
        while not done():
            now = loop.time()
            if not (rnd.quiet and but_quiet is not None and but_quiet()):
                cut = math.inf  # (again) waiting for a member that is not quiet, or one that spoke
            elif cut == math.inf:
                cut = now + quiet_grace(rnd.group.deadline_s, now - start, rnd.grace_share)
            remaining = min(deadline, cut) - now
            if remaining <= 0:
                return
            rnd.changed.clear()  # nothing can arrive between done() and here: no await
            try:
                await asyncio.wait_for(rnd.changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def _wait_means(self, rnd: Round, deadline: float) -> None:
        """Until we hold every reduced part, or the deadline; or until each part we lack was
        reported held, alike, by two other members ``ELSEWHERE_GRACE`` ago: its reducer sent it
        to the others and not (yet) to us (one member's report is not enough: a liar's would
        make an honest reducer on its way count as late, which a false final then exploits). A
        reducer that withholds its part from one member would otherwise hold that member, and
        the agreement of the whole group, to the deadline; the agreement forwards the part now
        (and the reducer's own frames are still taken). Nor do we wait for parts whose reducers'
        finals are in (``Round.lacking_finished``): a reducer finishes once its sends to its
        contributors were acknowledged or timed out, so we were not one of them, or its send
        failed; we ask for the part in our report at once, which its finished round answers
        (CI: a member that came to a round after the others had landed it waited the means'
        deadline, and reported after they had left the run)."""
        loop = asyncio.get_running_loop()
        grace = ELSEWHERE_GRACE * rnd.group.deadline_s
        start, cut = loop.time(), math.inf
        while not rnd.means_done() and not rnd.lacking_finished():
            now = loop.time()
            quiet = rnd.means_done_but_quiet() if rnd.quiet else []  # only quiet reducers' parts missing
            cut = (now + quiet_grace(rnd.group.deadline_s, now - start, rnd.grace_share) if cut == math.inf else cut) if quiet \
                else math.inf
            until = min(deadline, rnd.held_elsewhere_at(grace), cut)
            if now >= until:
                if now >= cut and now < deadline:
                    for j in quiet:
                        rnd.waived.add(j)
                        rnd.drop(j, QUIET_PART)
                return
            rnd.changed.clear()  # nothing can arrive between means_done() and here: no await
            try:
                await asyncio.wait_for(rnd.changed.wait(), until - now)
            except asyncio.TimeoutError:
                pass
