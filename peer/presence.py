"""What a run keeps in the DHT: its manifest, its live peers, and the public list of runs.

Keys (all under ``swarmstream/v1/``), each a map whose subkeys are the writers' public keys,
so one writer can only ever overwrite its own slot and a forged record cannot hide a true one:

- ``run/<run id hex>/manifest``: the signed manifest, re-published by every peer of the run;
- ``run/<run id hex>/peers``: each peer's signed ``Heartbeat``, expiring after the run's
  ``heartbeat_ttl_s``;
- ``runs``: signed ``RunAdvertised`` entries (subkey: run ID + advertiser) for the run browser.

Everything read back is verified (signature, type, run, that the subkey is the signer, and
freshness). A bad record is skipped, logged with the writer's peer ID, and counted in
``Presence.rejected``; it never raises into the caller.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any
from collections.abc import Callable

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from protocol.envelope import seal, verify
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity, peer_id_from_public_key
from protocol.manifest import SignedManifest, format_run_id, open_manifest
from protocol.messages_swarm import Heartbeat, RunAdvertised

log = logging.getLogger(__name__)

PREFIX = "swarmstream/v1"
RUNS_KEY = f"{PREFIX}/runs"
MANIFEST_TTL_S = 6 * 3600.0  # re-published by live peers long before it runs out
CLOCK_SKEW_S = 30.0  # a heartbeat "from the future" by more than this is refused


class RunNotFound(Exception):
    """No peer in the DHT holds a manifest for the run ID."""


def manifest_key(run_id: bytes) -> str:
    return f"{PREFIX}/run/{run_id.hex()}/manifest"


def peers_key(run_id: bytes) -> str:
    return f"{PREFIX}/run/{run_id.hex()}/peers"


def _entries(found: Any) -> list[tuple[Any, Any]]:
    """(subkey, value) pairs of a DHT map record (``get`` returns None if there is none).
    Subkeys are whatever a writer chose; the callers reject those that are not ours."""
    if found is None or not isinstance(found.value, dict):
        return []
    return [(k, v.value) for k, v in found.value.items()]


def _check_subkey(sub: Any, length: int) -> None:
    if not isinstance(sub, bytes) or len(sub) != length:
        raise RemoteProtocolError(f"record stored under a malformed subkey ({type(sub).__name__})")


class Presence:
    def __init__(self, dht: DHTNode, identity: Identity, clock: Callable[[], float] = get_dht_time):
        self.dht = dht
        self.identity = identity
        self.clock = clock
        self.rejected: Counter[str] = Counter()  # peer ID -> records of theirs we refused

    def _reject(self, writer: Any, what: str, err: Exception) -> None:
        who = peer_id_from_public_key(writer) if isinstance(writer, bytes) and len(writer) == 32 else repr(writer)[:60]
        self.rejected[who] += 1
        log.warning("rejected DHT record kind=%s peer=%s reason=%s", what, who, err)

    # --- manifests -----------------------------------------------------------------------

    async def publish_manifest(self, signed: bytes, run_id: bytes) -> bool:
        open_manifest(signed, run_id=run_id)  # never publish what we would refuse to read
        return await self.dht.store(manifest_key(run_id), signed, self.clock() + MANIFEST_TTL_S,
                                    subkey=self.identity.public_key)

    async def fetch_manifest(self, run_id: bytes) -> tuple[SignedManifest, bytes]:
        """The run's manifest (verified against ``run_id``) and its signed bytes."""
        found = await self.dht.get(manifest_key(run_id), latest=True)
        refused = ""
        for writer, value in _entries(found):
            try:
                _check_subkey(writer, 32)
                return open_manifest(value, run_id=run_id), bytes(value)
            except RemoteProtocolError as e:
                self._reject(writer, "manifest", e)
                refused = str(e)
        if refused:
            raise RunNotFound(f"the manifest of run {format_run_id(run_id)} was found but refused: {refused}")
        raise RunNotFound(f"no peer holds the manifest of run {format_run_id(run_id)}; check the run ID, or "
                          "join through a peer of that run (swarmstream join RUN_ID@MULTIADDR)")

    # --- heartbeats ----------------------------------------------------------------------

    async def announce(self, heartbeat: Heartbeat, ttl_s: float) -> bool:
        return await self.dht.store(peers_key(heartbeat.run_id), seal(heartbeat, self.identity),
                                    self.clock() + ttl_s, subkey=self.identity.public_key)

    async def peers(self, run_id: bytes, ttl_s: float) -> dict[bytes, Heartbeat]:
        """Live peers of the run: public key -> their latest verified, fresh heartbeat."""
        found = await self.dht.get(peers_key(run_id), latest=True)
        now = self.clock()
        out: dict[bytes, Heartbeat] = {}
        for writer, value in _entries(found):
            try:
                _check_subkey(writer, 32)
                hb = verify(value, expect=Heartbeat, run_id=run_id, sender=writer).message
                if not (now - ttl_s <= hb.sent_at <= now + CLOCK_SKEW_S):
                    raise RemoteProtocolError(f"heartbeat sent at {hb.sent_at:.0f} is not within "
                                              f"{ttl_s:.0f} s of now ({now:.0f})")
            except RemoteProtocolError as e:
                self._reject(writer, "heartbeat", e)
                continue
            out[writer] = hb  # type: ignore[assignment]
        return out

    # --- the public list of runs -------------------------------------------------------

    async def advertise(self, ad: RunAdvertised, ttl_s: float) -> bool:
        return await self.dht.store(RUNS_KEY, seal(ad, self.identity), self.clock() + ttl_s,
                                    subkey=ad.run_id + self.identity.public_key)

    async def list_runs(self, max_age_s: float = 600.0) -> list[RunAdvertised]:
        """Advertised runs, one entry per run (the most recent), newest first."""
        found = await self.dht.get(RUNS_KEY, latest=True)
        now = self.clock()
        best: dict[bytes, RunAdvertised] = {}
        for sub, value in _entries(found):
            writer = sub[-32:] if isinstance(sub, bytes) and len(sub) == 52 else sub
            try:
                _check_subkey(sub, 52)
                ad = verify(value, expect=RunAdvertised, sender=writer).message
                assert isinstance(ad, RunAdvertised)
                if sub[:20] != ad.run_id:
                    raise RemoteProtocolError("advertisement stored under another run's slot")
                if not (now - max_age_s <= ad.sent_at <= now + CLOCK_SKEW_S):
                    raise RemoteProtocolError(f"advertisement sent at {ad.sent_at:.0f} is stale or from the future")
            except RemoteProtocolError as e:
                self._reject(writer, "run advertisement", e)
                continue
            if ad.run_id not in best or ad.sent_at > best[ad.run_id].sent_at:
                best[ad.run_id] = ad
        return sorted(best.values(), key=lambda a: -a.sent_at)
