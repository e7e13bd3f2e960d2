"""A node's view of its run's peers: its heartbeat and the run's advertisement, the live peers
read from the DHT (without blocking training), reconnecting when alone, reaching peers behind
a NAT through their relays, and waiting for a starting swarm."""

from __future__ import annotations

import datetime
import logging
import time

from peer import conditions
from protocol import __version__
from protocol.identity import peer_id_from_public_key, public_key_from_peer_id
from protocol.messages_control import (
    PeerJoined,
    PeerLeft,
)
from protocol.messages_swarm import MAX_HEARTBEAT_BANS, Heartbeat, RunAdvertised

log = logging.getLogger("peer.node")  # one logger name for the whole node, also under python -m

MIN_PEERS_POLL_S = 0.5  # between DHT reads while waiting for --min-peers
LAST_PEER_POLL_S = 0.1  # the same once only one peer is missing
BAN_FANOUT = 2  # proofs we hand over per heartbeat interval to peers whose heartbeats lack the ban


class PeersMixin:
    """The peers view and presence of ``peer.node.Node`` (a part of it)."""

    def _refresh_peers(self, swarm) -> None:
        """Diff the run's live peers against the last view (without blocking training: the DHT
        read runs on the network thread and is picked up at the next heartbeat)."""
        fut = self._peers_future
        if fut is not None and fut.done():
            try:
                live = fut.result()
            except Exception as e:
                log.info("could not read the peers reason=%r", e)
                live = None
            if live is not None:
                self._update_peers(live)
                self._take_verdicts()  # a proof handed to us between rounds: banned before the next
                self._hand_over_bans(swarm)
            self._peers_future = None
        if self._peers_future is None:
            self._peers_future = self.net.submit(self.presence.peers(self.run_id, swarm.heartbeat_ttl_s))
        if not self._peers and (self._reconnecting is None or self._reconnecting.done()):
            self._reconnecting = self.net.submit(self.net.reconnect())  # alone: maybe we lost the network

    def _update_peers(self, live: dict[bytes, Heartbeat]) -> None:
        """Take a read of the run's heartbeats as the new view. A peer leaves the view when its
        last heartbeat expires, not when one read misses it: a DHT read under load can come back
        short or empty, and that is no reason to show every peer as gone. In a large run the
        read is a sample (``peer.shards``): peers come and go from it as shards are drawn, so
        joins and departures are told only while the view is whole."""
        now = time.time()
        view = self.presence.view(self.run_id)
        whole = view.whole()
        if view.level != self._presence_level:
            self._presence_level = view.level
            log.info("presence level=%d estimate=%.0f seen=%d (peer.shards)", view.level, view.estimate, len(live))
        ttl = self.signed.manifest.swarm.heartbeat_ttl_s if self.signed else 0.0
        live = {k: hb for k, hb in live.items() if k != self.identity.public_key}
        for k, hb in self._peers.items():
            if k not in live and now - hb.sent_at <= ttl:
                live[k] = hb  # not in this read, but its last heartbeat is still fresh
        for k, hb in live.items():
            self._clock.observe(k, hb.sent_at, hb.tokens, hb.state, hb.tokens_per_s)
        self._clock.forget(self._peers.keys() - live.keys())
        for k in self._peers.keys() - live.keys() if whole else ():
            self._remember(PeerLeft(at=now, peer_id=peer_id_from_public_key(k), reason="heartbeat expired"))
        for k, hb in live.items():
            if k not in self._peers and whole:
                self._remember(PeerJoined(at=now, peer_id=peer_id_from_public_key(k), device=hb.device))
            self._emit(self._peer_row(k, hb, now))
        # peers nobody can dial, and the relays that reach them (not through ourselves)
        me = f"/p2p/{self.identity.peer_id}/p2p-circuit"
        self._relay_routes = {peer_id_from_public_key(k): [m for m in hb.maddrs if "/p2p-circuit" in m and me not in m]
                              for k, hb in live.items() if not hb.reachable}
        self._peers = live

    def _ban_list(self) -> tuple[bytes, ...]:
        """The keys we banned for a proven lie, our latest first, as our heartbeat lists them."""
        bans = self.bans.items() if self.bans is not None else []
        return tuple(public_key_from_peer_id(b.peer_id) for b in list(reversed(bans))[:MAX_HEARTBEAT_BANS])

    def _hand_over_bans(self, swarm) -> None:
        """Live peers whose heartbeats do not list a ban we hold proof for get the proof, a
        few per heartbeat interval (``Audits.gossip``), so a ban reaches the whole run rather
        than only the groups the liar joins beside one of us."""
        ours = self._ban_list()
        audits = getattr(self.averager, "audits", None)
        if not ours or audits is None:
            return
        # a full list shows only a peer's latest bans: what it leaves out, it may hold already
        lacking = [(peer_id_from_public_key(k), key) for k, hb in self._peers.items()
                   if hb.state != "leaving" and len(hb.banned) < MAX_HEARTBEAT_BANS
                   for key in ours if key != k and key not in hb.banned]
        if lacking:
            partners = frozenset(peer_id_from_public_key(k) for k in self._partners)
            self.net.submit(audits.gossip(lacking, BAN_FANOUT, swarm.allreduce_timeout_s, prefer=partners))

    def _expected_joiners(self, fragment: int, round_: int) -> set[bytes]:
        """The other peers we expect to join ``round_`` of ``fragment`` (``Matchmaker.expected``):
        every live one, by its heartbeat (one that is paused, behind or downloading will not
        come, and then the batch window runs as before: every peer that knows it waits alike).
        None in a large run, where we see a sample (``peer.shards``): the window runs."""
        return set(self._peers) if self.presence.view(self.run_id).whole() else set()

    def _run_size(self) -> int:
        """Peers in the run, us included: those we see, or the shards' estimate in a large run."""
        seen = len(self._peers.keys() - {self.identity.public_key}) + 1
        presence, run_id = getattr(self, "presence", None), getattr(self, "run_id", None)
        if presence is None or run_id is None or presence.view(run_id).whole():
            return seen  # (asked before the network is up, too: the control socket starts first)
        return max(seen, round(presence.estimate(run_id)))

    async def _reconnect_relayed(self, peer_id: str) -> bool:
        """The averager could not open a stream to ``peer_id``: if it is behind a NAT, connect
        to it through its relays. Only on such a failure: dialing circuits on every heartbeat
        put libp2p dial backoffs on the relays and dropped group members. A peer outside our
        sample of a large run (``peer.shards``): its heartbeat is read from its own shard."""
        routes = self._relay_routes.get(peer_id)
        if routes is None:
            hb = await self.presence.heartbeat_of(self.run_id, public_key_from_peer_id(peer_id),
                                                  self.signed.manifest.swarm.heartbeat_ttl_s)
            me = f"/p2p/{self.identity.peer_id}/p2p-circuit"
            routes = [m for m in hb.maddrs if "/p2p-circuit" in m and me not in m] if hb and not hb.reachable else []
        if not routes:
            return False
        ok = await self.net.connect_relayed(peer_id, routes)
        log.info("%s peer=%s through its relays", "connected to" if ok else "could not reach", peer_id)
        return ok

    def _wait_for_peers(self, swarm) -> None:
        if self.cfg.min_peers <= 1:
            return
        deadline = time.monotonic() + self.cfg.min_peers_wait_s
        self._beat(swarm)
        last_beat = time.monotonic()
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            live = self.net.call(self.presence.peers(self.run_id, swarm.heartbeat_ttl_s), timeout=30)
            self._update_peers(live)
            if len(live) >= self.cfg.min_peers:
                return
            if time.monotonic() - last_beat >= swarm.heartbeat_interval_s:
                self._beat(swarm)
                last_beat = time.monotonic()
            # poll the DHT (Ctrl+C ends the wait at once); faster once only the last peer is
            # missing: the peers start when each sees it, so the poll is how far apart they
            # start, which the first round's fastest member then waits out at its landing step
            self.stop_event.wait(MIN_PEERS_POLL_S if len(live) < self.cfg.min_peers - 1 else LAST_PEER_POLL_S)
        log.warning("started with fewer peers than min_peers=%d after %.0f s", self.cfg.min_peers,
                    self.cfg.min_peers_wait_s)

    def _beat(self, swarm) -> None:
        self._harvest_published()
        now = time.time()
        w = self.worker
        step = w.step if w else self._last_step()
        tput = self._tokens_per_s()
        try:
            # behind a NAT, our listening addresses are no use to anyone: we are reached
            # through the relays we hold reservations on
            self._maddrs = (self.net.relay_maddrs() if self.cfg.reachability == "private"
                            else self.net.visible_maddrs())
        except Exception as e:
            log.info("could not read our addresses reason=%r", e)
        # the rounds our vouched-for digest is at (a publish may still be under way for the latest)
        rounds = self.state_rounds if self.state_digest else tuple(self.stats.rounds)
        hb = Heartbeat(run_id=self.run_id, sent_at=now, state=self.state, step=step,
                       tokens=self.ledger.credit.tokens_trained, tokens_per_s=tput, rounds=rounds,
                       state_digest=self.state_digest, reachable=self.reachability() == "direct",
                       maddrs=tuple(self._maddrs)[:8], client=f"swarmstream/{__version__}",
                       device=self._device_name() or "none", banned=self._ban_list())
        self.net.submit(self.presence.announce(hb, swarm.heartbeat_ttl_s))
        ad = RunAdvertised(run_id=self.run_id, sent_at=now, name=self.signed.manifest.name,
                           num_params=self.signed.manifest.train.model.num_params(), peers=self._run_size(),
                           step=step)
        self.net.submit(self.presence.advertise(ad, swarm.heartbeat_ttl_s))

    def _conditions_reason(self) -> str:
        sched = self.settings.schedule
        if not (sched.window or sched.only_on_ac_power or sched.only_when_idle):
            return ""
        now = datetime.datetime.now()
        mains = conditions.on_mains_power() if sched.only_on_ac_power else None
        idle = conditions.user_idle_s() if sched.only_when_idle else None
        if sched.only_on_ac_power and mains is None or sched.only_when_idle and idle is None:
            if not getattr(self, "_told_unsupported", False):
                self._told_unsupported = True
                log.warning("this machine does not tell whether it is %s; that setting is not enforced",
                            "on mains power" if mains is None and sched.only_on_ac_power else "idle")
        return conditions.pause_reason(sched, now.hour * 60 + now.minute, mains, idle)
