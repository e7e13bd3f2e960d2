"""The node's network: hivemind's libp2p daemon (``P2P``) and a DHT node, on one event loop.

hivemind's own ``hivemind.DHT`` runs the DHT in a child process and talks to it over pipes;
we run ``DHTNode`` directly on an asyncio loop in a daemon thread instead, next to the P2P
instance that the averager uses, so one process owns one daemon and one loop. The training
thread submits coroutines with ``Network.call`` (blocking, with a timeout) or ``submit``.

The libp2p identity is the volunteer's Ed25519 key file (``peer.identity_store``), so the
peer ID that others see is the key that signs our messages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, TypeVar
from collections.abc import Awaitable, Callable, Sequence

from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer

from peer.identity_store import load_or_create_identity
from protocol.envelope import verify
from protocol.manifest import RunManifest
from protocol.errors import RemoteProtocolError

log = logging.getLogger(__name__)
T = TypeVar("T")


MAX_RECORD_BYTES = 1 << 20  # a signed manifest is the largest record we write (~1 KB typical)


class RecordOwnerValidator(RecordValidatorBase):
    """Only the owner of a DHT map slot may write it; refuse everything else at store time.

    Every map record of ours has a ``bytes`` subkey ending in the writer's public key (its
    key, or run ID + key) and a signed envelope as value. Honest nodes check both before they
    store a record for someone or return one to us, so nobody can overwrite another peer's
    heartbeat or advertisement; the one exception is a run manifest, signed by the run's
    creator and republished by each of its peers. (Without this, hivemind stores whatever arrives; and one
    ``int`` subkey next to ``bytes`` ones even breaks later stores of that key, because its
    expiration heap compares subkeys.) Which message type a slot must hold, and for which
    run, is checked on read in ``peer.presence``, where it is known.
    """

    def validate(self, record: DHTRecord) -> bool:
        if len(record.value) > MAX_RECORD_BYTES:
            return False
        if record.subkey in (DHTProtocol.IS_REGULAR_VALUE, DHTProtocol.IS_DICTIONARY):
            return True
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # msgpack raises several unrelated types on junk
            return False
        if not (isinstance(subkey, bytes) and 32 <= len(subkey) <= 64 and isinstance(value, bytes)):
            return False
        try:
            checked = verify(value)
        except RemoteProtocolError:
            return False
        if checked.signer == subkey[-32:]:
            return True
        # A run's manifest is signed by its creator and republished by every peer of the run,
        # each under its own slot; it is checked against the run ID (its hash) on read, so a
        # copy in someone else's slot can only be the same manifest.
        return isinstance(checked.message, RunManifest) and len(subkey) == 32


class NetworkError(Exception):
    """The network could not start or a network call failed; the message says what to do."""


STATIC_RELAY_STARTS = 3  # daemon starts with static relays before one with discovery (see Network._start)
RELAY_PROBE_S = 3.0  # how long a bootstrap peer's TCP port has to answer before it is left out as a relay


def peer_of(maddr: str) -> str:
    """The peer ID a multiaddr names (its first ``/p2p/`` or ``/ipfs/`` part before any
    ``/p2p-circuit``), or the text itself when it names none."""
    m = re.search(r"/(?:p2p|ipfs)/([^/]+)", maddr.split("/p2p-circuit", 1)[0])
    return m[1] if m else maddr


async def answering(maddrs: Sequence[str], timeout: float = RELAY_PROBE_S, *, own: str = "") -> list[str]:
    """Our relays among the bootstrap addresses ``maddrs``: those whose TCP address takes a
    connection within ``timeout`` (probed at once, in parallel; closed unused), the first of each
    peer ID (autorelay waits for as many relays as it is given addresses, and one peer is one
    relay), never our own ID ``own``. An address that is not TCP over IP or DNS cannot be probed:
    it is taken only if no probed one answered."""
    families = {"ip4": socket.AF_INET, "dns4": socket.AF_INET, "ip6": socket.AF_INET6, "dns6": socket.AF_INET6}

    async def answers(text: str) -> bool | None:
        m = re.match(r"^/(ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d{1,5})(?:/|$)", text)
        if m is None:
            return None
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(m[2], int(m[3]), family=families.get(m[1], 0)), timeout)
        except (OSError, asyncio.TimeoutError, ValueError, OverflowError):
            return False
        writer.close()
        return True

    candidates = [t for t in maddrs if peer_of(t) != own]
    found = await asyncio.gather(*(answers(t) for t in candidates))
    answered = [t for t, ok in zip(candidates, found) if ok]
    out: dict[str, str] = {}
    for t in answered or [t for t, ok in zip(candidates, found) if ok is None]:
        out.setdefault(peer_of(t), t)
    return list(out.values())


class StaticRelaysP2P(P2P):
    """``P2P`` whose daemon takes its relays from ``trusted_relays`` only (``-relayDiscovery=0``,
    which hivemind does not expose). libp2p's autorelay then holds reservations on exactly those
    and waits for no others; with discovery on, it waits for 4 candidates, or 3 minutes: a peer
    behind a NAT in a run of fewer than 4 relay-capable peers (the common case: one host) was
    unreachable for its first 3 minutes (188 s against 3 s: ``bench/relay_start.py``)."""

    @staticmethod
    def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        return P2P._make_process_args(*args, **kwargs, relayDiscovery=False)


def circuit_maddr(base: str, relay_id: str) -> Multiaddr:
    """``base/p2p/RELAY/p2p-circuit`` as the daemon decodes it. hivemind's Multiaddr writes the
    /p2p/ part as a CID, which the daemon's connect call rejects; this writes the multihash."""
    relay = PeerID.from_base58(relay_id).to_bytes()
    if len(relay) > 127:
        raise ValueError(f"relay peer ID {relay_id[:16]}... is too long")
    return Multiaddr(Multiaddr(base).to_bytes() + b"\xa5\x03" + bytes([len(relay)]) + relay + b"\xa2\x02")


@dataclass(kw_only=True, slots=True)
class NetworkConfig:
    identity_path: str
    """libp2p private-key file: the volunteer's identity (see peer.identity_store)."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Where to listen; /ip4/127.0.0.1/tcp/0 keeps a node on this machine (tests, demo)."""
    announce_maddrs: tuple[str, ...] = ()
    """Addresses to advertise instead of the listening ones (behind port forwarding)."""
    initial_peers: tuple[str, ...] = ()
    """Bootstrap multiaddrs ending in /p2p/PEER_ID; empty to start a new swarm."""
    use_relay: bool = True
    """Let peers behind NAT reach us and others through libp2p circuit relays."""
    use_auto_relay: bool = True
    """Reserve a slot on relays (the bootstrap peers, and others found) when libp2p's AutoNAT
    finds us unreachable, so peers can reach us through them."""
    static_relays: bool = True
    """Autorelay's relays are the bootstrap peers that answer at start, and no others
    (``StaticRelaysP2P``); False: libp2p's discovery, which waits for 4 candidates or 3 minutes."""
    reachability: str = "auto"
    """``auto``: AutoNAT decides. ``public``: we have a dialable address (bootstrap and relay
    peers say so, and serve as relays at once). ``private``: we are behind a NAT or firewall that
    takes no inbound connections: a DHT client, reached through relays (``relay_maddrs``)."""
    startup_timeout_s: float = 20.0
    client_mode: bool = False
    """A DHT client stores nothing for others (for peers that cannot accept connections)."""
    extra: dict[str, Any] = field(default_factory=dict)


class Network:
    """P2P + DHTNode on a private event loop. Use as a context manager, or ``close()``."""

    def __init__(self, cfg: NetworkConfig):
        self.cfg = cfg
        # make sure the key is ours (Ed25519, 0600) before hivemind sees the path: given a
        # missing file, hivemind would write an RSA key there, which could never sign our messages
        self.identity = load_or_create_identity(cfg.identity_path)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="swarmstream-network", daemon=True)
        self._thread.start()
        self.p2p: P2P | None = None
        self.dht: DHTNode | None = None
        self.relays: list[str] = []  # the bootstrap peers that are our only relays (none: libp2p's discovery)
        self._closed = False
        try:
            self.call(self._start(), timeout=RELAY_PROBE_S + (STATIC_RELAY_STARTS + 1) * cfg.startup_timeout_s + 30)
        except BaseException:
            self.close()
            raise

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _start(self) -> None:
        cfg = self.cfg
        try:
            # our relays are the bootstrap peers that answer now: libp2p's autorelay would wait
            # 3 minutes for one listed that does not (its static relays are all it waits for)
            relays = await answering(cfg.initial_peers, own=self.identity.peer_id) if (
                cfg.use_relay and cfg.use_auto_relay and cfg.static_relays and cfg.reachability != "public") else []
            # the daemon counts a bootstrap peer that its autorelay connected to first (a private
            # peer's autorelay starts at once) as not answering, and exits when it counted none
            # (3 starts in 20 here): we try again, and start it as before after three such starts
            for attempt in ([relays] * STATIC_RELAY_STARTS + [[]]) if relays else [[]]:
                try:
                    self.p2p = await self._create_p2p(attempt)
                    self.relays = attempt
                    break
                except P2PDaemonError as e:
                    if not attempt or "failed to connect to bootstrap peers" not in str(e):
                        raise
                    log.info("the libp2p daemon found its bootstrap peers connected by its relay client "
                             "first and counted none: starting it again")
        except P2PDaemonError as e:
            if "bootstrap" in str(e):
                raise NetworkError(f"none of the bootstrap peers answered ({', '.join(cfg.initial_peers)}); "
                                   "check the run address and that those peers are online") from None
            raise NetworkError(f"the libp2p daemon did not start: {e}; check that the listen address "
                               f"({', '.join(cfg.host_maddrs)}) is free and valid") from None
        try:
            self.dht = await DHTNode.create(p2p=self.p2p, initial_peers=list(cfg.initial_peers) or None,
                                            client_mode=self.client_mode, ensure_bootstrap_success=True,
                                            record_validator=RecordOwnerValidator())
        except RuntimeError as e:
            if "bootstrap" in str(e):
                raise NetworkError(f"none of the bootstrap peers answered ({', '.join(cfg.initial_peers)}); "
                                   "check the run address and that those peers are online") from None
            raise

    # --- calling into the loop ---------------------------------------------------------

    async def _create_p2p(self, relays: list[str]) -> P2P:
        """The libp2p daemon, with ``relays`` as its only relays (none: libp2p's discovery).
        hivemind's "identity already taken" check parses key files as RSA and fails on Ed25519
        ones; a second node on the same identity is refused by our own lock instead."""
        cfg = self.cfg
        return await (StaticRelaysP2P if relays else P2P).create(
            initial_peers=list(cfg.initial_peers), host_maddrs=list(cfg.host_maddrs),
            announce_maddrs=list(cfg.announce_maddrs) or None, identity_path=cfg.identity_path,
            use_relay=cfg.use_relay, use_auto_relay=cfg.use_auto_relay, trusted_relays=relays or None,
            force_reachability=None if cfg.reachability == "auto" else cfg.reachability,
            startup_timeout=cfg.startup_timeout_s, check_if_identity_free=False,
            dht_mode="client" if self.client_mode else "server", **cfg.extra)

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        if self._closed:
            raise NetworkError("the network is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the network loop and wait for it (at most ``timeout`` seconds)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise NetworkError(f"network call did not finish within {timeout} s") from None

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    # --- facts ---------------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        assert self.p2p is not None
        return self.p2p.peer_id.to_base58()

    @property
    def client_mode(self) -> bool:
        """A peer nobody can dial stores nothing for others in the DHT."""
        return self.cfg.client_mode or self.cfg.reachability == "private"

    def relay_maddrs(self) -> list[str]:
        """Where a ``private`` peer can be reached: through each address of each of its relays (the
        bootstrap peers that answered at start, ``answering``; all of them if it runs libp2p's
        discovery), which hold a relay reservation for us (libp2p's autorelay makes it; these
        circuit addresses are not in ``visible_maddrs`` when the relays' own addresses are
        private-range ones)."""
        relays = {peer_of(r) for r in self.relays}  # every address we were given of each, as before
        return [f"{b}/p2p-circuit/p2p/{self.peer_id}" for b in self.cfg.initial_peers
                if not relays or peer_of(b) in relays]

    async def connect_relayed(self, peer_id: str, maddrs: list[str]) -> bool:
        """Open a connection to a peer through the relays in its ``/p2p-circuit`` addresses,
        so our streams to it (averaging, state downloads) reuse it. True when one worked."""
        assert self.p2p is not None
        peer = PeerID.from_base58(peer_id)
        for text in maddrs:
            try:
                relay_part = text.split("/p2p-circuit", 1)[0]
                base, relay_id = relay_part.rsplit("/p2p/", 1)
                await self.p2p._client.connect(peer, [circuit_maddr(base, relay_id)])
                return True
            except Exception as e:  # a relay that is gone, or holds no reservation for them
                log.info("no relayed connection to peer=%s via=%s reason=%s", peer_id[-8:], text, e)
        return False

    def visible_maddrs(self) -> list[str]:
        """Addresses others can dial us at, each ending in /p2p/OUR_PEER_ID."""
        assert self.p2p is not None
        maddrs = self.call(self.p2p.get_visible_maddrs(), timeout=10)
        return [str(m) if "/p2p/" in str(m) else f"{m}/p2p/{self.peer_id}" for m in maddrs]

    async def reconnect(self) -> bool | None:
        """If we lost every peer (a network outage, a laptop asleep), dial the bootstrap peers
        again and ping them back into the DHT's routing table. None: we still have peers (or no
        bootstrap peers to go back to); True/False: whether any bootstrap peer answered."""
        assert self.p2p is not None and self.dht is not None
        if not self.cfg.initial_peers or await self.p2p.list_peers():
            return None
        ok = False
        for text in self.cfg.initial_peers:
            try:
                maddr = Multiaddr(text)
                peer = PeerID.from_base58(maddr["p2p"])
                # hivemind has no public "dial"; its own bootstrap check uses the daemon client too
                await self.p2p._client.connect(peer, [maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}"))])
                ok = await self.dht.protocol.call_ping(peer) is not None or ok
            except Exception as e:  # a dead bootstrap peer is the common case here
                log.info("bootstrap peer did not answer peer=%s reason=%r", text, e)
        if ok:  # refill the routing table around our own ID, as a fresh start does
            await self.dht.find_nearest_nodes([self.dht.node_id])
        log.warning("lost every peer; %s", "reconnected through the bootstrap peers" if ok else
                    "no bootstrap peer answered, will try again")
        return ok

    def num_peers(self) -> int:
        assert self.p2p is not None
        return len(self.call(self.p2p.list_peers(), timeout=10))

    # --- shutdown ----------------------------------------------------------------------

    async def _stop(self) -> None:
        if self.dht is not None:
            await self.dht.shutdown()
        if self.p2p is not None:
            await self.p2p.shutdown()
        # background jobs (DHT refresh, stream handlers) end with the loop, not after it
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the DHT node and the libp2p daemon (no stray p2pd), then the loop. Idempotent."""
        if self._closed:
            return
        try:
            if self.loop.is_running():
                asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout)
        except Exception as e:  # shutting down: report, then make sure the daemon is gone
            log.warning("network shutdown was not clean reason=%r", e)
            if self.p2p is not None:
                self.p2p._terminate()
        finally:
            self._closed = True
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
