"""The run's end: before a finished node goes, it ends on the final copy that the peers
finished at its rounds hold (``SettleMixin._settle_final``). A run that has ended has no later
round to mix copies again or to repair, so two peers that averaged their last round apart would
otherwise keep different final models. The vote (``final_vote``) and its limits
(``settle_limits``) are pure; the download itself is ``peer.node.catchup``'s."""

from __future__ import annotations

import logging
import time
from typing import Any

from peer.allreduce import ROUND_SPAN
from peer.globalstate import choose_digest
from peer.node.catchup import download_s

log = logging.getLogger("peer.node")  # one logger name for the whole node, also under python -m

SETTLE_POLL_S = 0.5  # between reads of the finishing peers' heartbeats (_settle_final)


def final_vote(done: dict[bytes, bytes], me: bytes, ours: bytes, taken: int = 0,
               trusted: frozenset[bytes] = frozenset()) -> tuple[bytes, list[bytes], bool]:
    """Of the final copies of the peers finished at our rounds (``done``: key -> digest) and
    ours, the one the most hold, a tie going to the run's creator's (``trusted``), then to the
    smallest key's; its holders; and whether
    we should take it: it is not ours, and more peers hold it than held the copy we took last
    (``taken``; 0 before the first). A liar adds one holder to a copy, so it can move us at
    most once per finisher: to a copy an honest finisher holds, or, winning a tie with its
    smallest key, to its own (which it must then serve, and which must lie near ours)."""
    best, holders = choose_digest({**done, me: ours}, min_vouchers=1, trusted=trusted, tie_by_key=True) or (ours, [me])
    return best, holders, best != ours and len(holders) > taken


def settle_limits(swarm, began: float) -> tuple[float, float]:
    """(deadline, limit) of comparing final copies (``_settle_copy``), begun at ``began``
    (monotonic): no download starts after the deadline, which leaves a partner its last
    all-reduce at its longest (``ROUND_SPAN``, 3.5 deadlines) and two heartbeats to show it; a
    download, ours or one from us, holds us until the limit at most, one download later."""
    deadline = began + ROUND_SPAN * swarm.allreduce_timeout_s + 2 * swarm.heartbeat_interval_s
    return deadline, deadline + download_s(swarm)


class SettleMixin:
    """The run's-end settle of ``peer.node.Node`` (a part of it; the download is
    ``CatchUpMixin._download``)."""

    def _settle_final(self, swarm) -> None:
        """``_settle_copy``, after serving our final copy; whatever a peer sent us, what we
        trained is saved after it."""
        try:
            self._publish_state(self.worker)
            self._settle_copy(swarm)
        except Exception:
            log.exception("comparing our final copy with the other finishers' failed")

    def _settle_copy(self, swarm) -> None:
        """Finished (a finish, or ``--rounds``): before we go, end on the copy that the peers
        finished at our rounds hold. A run that has ended has no later round to mix copies again or
        to repair: two peers that averaged their last round apart (alone under load, or in different
        groups) would keep different final models. Among us and the peers whose heartbeat says they
        finished at our exact rounds (state ``finished``, which ours says from now on), the copy the
        most hold wins, a tie going to the smallest key's (``choose_digest``: the same choice on
        every peer); a node holding another downloads that copy (only that digest, from its holders;
        checked as a repair is: finite, near ours); a tie (won by a key) only once no partner of our
        last rounds is on its way to them (or at the last heartbeat before the deadline below). It
        downloads again only to a copy held by strictly more peers than the one it last took
        (``final_vote``), in two tries each: peers still on their way may turn a tie into a majority
        (two peers that averaged alone first, three that averaged together after), and a liar, which
        adds one holder to a copy, cannot walk us more than once per finisher. Holders that did not
        serve the copy they claim in two tries (a liar's made-up digest that won a tie, or peers
        gone) are left out of the vote from then on. Published states carry the step their rounds
        imply (``SyncSchedule.step_of``), so one copy has one digest on every peer.

        We beat so that the others see our final digest, and go when every such peer shows the
        winner, nobody is still on the way to our rounds (``_on_way_to``) and nobody is
        downloading from us. At the latest (``settle_limits``): no download starts after
        3.5 all-reduce deadlines (the longest an honest partner's last round may take) and two
        heartbeat intervals, and neither ours nor one from us holds us past that plus one
        download. A failed read of the peers concludes nothing, nor does one that does not show
        our own final heartbeat (a DHT lookup under load may come back empty instead of failing);
        a peer missing from one read is kept until its heartbeat would have expired, and a peer
        that averaged with us lately counts as on its way until a read shows otherwise or a
        heartbeat's life has passed since (it may be in our last round still, unread so far)."""
        self.state = "finished"
        self._harvest_published(wait_s=swarm.state_chunk_timeout_s)
        mine = tuple(self.stats.rounds)
        if not self.state_digest or self.state_rounds != mine:
            log.warning("not comparing our final copy with the other finishers': its publish did not finish")
            return
        began = time.monotonic()
        deadline, limit = settle_limits(swarm, began)
        me = self.identity.public_key
        banned = self.matchmaker.distrusted.banned  # a peer proven to lie neither votes nor holds us back (one
        # suspended for an unanswered audit, which proves nothing, still does)
        view: dict[bytes, tuple[Any, float]] = {k: (hb, began) for k, hb in self._peers.items()
                                                if k != me and not banned(k)}
        for k, at in self._partners.items():  # averaged with us lately: on its way until it shows otherwise
            if k not in view and k != me and not banned(k):
                view[k] = (None, at)
        heard: set[bytes] = set()  # peers whose heartbeat changed since we began
        taken, tries = 0, 0  # holders of the copy we last took (none yet), and tries at the target
        target: tuple[bytes, int] | None = None  # the copy we try to take, and its holders' count
        refused: set[bytes] = set()  # peers that did not serve the copy they claimed: out of the vote
        beat_at, beat_digest = 0.0, b""
        while not self.stop_event.is_set():
            now = time.monotonic()
            if self.state_digest != beat_digest or now - beat_at >= swarm.heartbeat_interval_s:
                self._beat(swarm)
                beat_at, beat_digest = now, self.state_digest
            try:
                read = self.net.call(self.presence.peers(self.run_id, swarm.heartbeat_ttl_s), timeout=30)
            except Exception as e:  # a DHT read under load: conclude nothing from it
                log.info("could not read the peers to compare final copies reason=%r", e)
                read = None
            now = time.monotonic()  # a read under load may take longer than a heartbeat interval
            for k, hb in (read or {}).items():
                if k == me or banned(k):
                    continue
                if k in view and view[k][0] is not None and hb.sent_at != view[k][0].sent_at:
                    heard.add(k)
                view[k] = (hb, now)
            for k in [k for k, (_, seen) in view.items() if now - seen > swarm.heartbeat_ttl_s]:
                del view[k]  # expired: gone
            peers = {k: hb for k, (hb, _) in view.items() if hb is not None}
            done = {k: hb.state_digest for k, hb in peers.items()
                    if hb.state == "finished" and tuple(hb.rounds) == mine and hb.state_digest and k not in refused}
            on_way = [k for k, (hb, _) in view.items() if hb is None or self._on_way_to(mine, hb, heard=k in heard)]
            # a read that does not show our own final heartbeat (a DHT lookup under load can come
            # back empty rather than fail) is no view of the others either: it concludes nothing
            ours = (read or {}).get(me)
            seen_us = ours is not None and ours.state == "finished" and ours.state_digest == self.state_digest
            best, holders, take = final_vote(done, me, self.state_digest, taken, self._trusted)
            if target != (best, len(holders)):
                target, tries = (best, len(holders)), 0
            # a tie is not taken while partners of our last rounds are on their way, until the
            # last heartbeat before the deadline: they may hold our copy, and a copy taken now
            # counts us as its holder for those who come later. A ghost that averaged its rounds
            # alone won a tie with the first honest finisher by its key, and every honest peer
            # after it ended on the ghost's model (a review's runs, 2 of 19). A majority is taken
            # at once, and only partners hold a tie back: a stranger saying it is on its way, then
            # finished with the other copy, could make two finishers decide at different moments
            # on different votes (a review of the first version, which held any take back)
            tie = take and len(holders) == 1 + sum(d == self.state_digest for d in done.values())
            held = tie and any(k in self._partners for k in on_way) and now < deadline - swarm.heartbeat_interval_s
            if take and now < deadline and not held:
                log.warning("our final copy differs from the one %d of %d peers finished at rounds %s hold; "
                            "downloading theirs", len(holders), len(done) + 1, list(mine))
                tries += 1
                if self._download(swarm, holders, fast_forward=False, min_donors=1, at_rounds=mine,
                                  want=best, until=limit):
                    taken = len(holders)
                    continue  # show it at once: the others wait for us to
                if tries >= 2:  # they claim a copy they do not serve (a liar's, or gone): vote without them
                    log.warning("%d peer(s) did not serve the final copy they claim: leaving them out", len(holders))
                    refused.update(holders)
            elif (seen_us and not on_way and not self.state_server.serving and best == self.state_digest
                  and all(d == best for d in done.values())):
                log.info("final copy agreed with %d finished peer(s) at rounds %s", len(done), list(mine))
                return
            # a peer downloading our copy may take as long as a download may
            if time.monotonic() >= (limit if self.state_server.serving else deadline):
                log.warning("stopping without agreeing on the final copy: %d peer(s) still on their way, %d of %d "
                            "finished at our rounds hold another", len(on_way),
                            sum(d != self.state_digest for d in done.values()), len(done))
                return
            self.stop_event.wait(SETTLE_POLL_S)  # the DHT's next view of their heartbeats

    @staticmethod
    def _on_way_to(mine: tuple[int, ...], hb, *, heard: bool) -> bool:
        """Whether a peer may still come to our final rounds, so that a node that finished
        there waits for its copy. Not one paused, leaving or finished, nor one ahead of us.
        One we have not heard from since we began: its heartbeat, up to an interval old (or
        more, while its last round lands), may show rounds long past; a dead one's expires.
        One we have heard from if it trains at our rounds or is up to two rounds behind (its
        rounds are those of its last published state, a landing or two old)."""
        behind = sum(mine) - sum(hb.rounds)
        if hb.state in ("paused", "leaving", "finished") or behind < 0:
            return False
        return not heard or behind <= 2 * len(mine)
