"""What a run keeps in the DHT: its manifest, its live peers, and the public list of runs.

Keys (all under ``swarmstream/v1/``), each a map whose subkeys are the writers' public keys,
so one writer can only ever overwrite its own slot and a forged record cannot hide a true one:

- ``run/<run id hex>/manifest``: the signed manifest, re-published by every peer of the run;
- ``run/<run id hex>/peers`` (and, in a large run, ``.../peers/<level>/<shard>``: the shards of
  ``peer.shards``): each peer's signed ``Heartbeat``, expiring after the run's
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
from peer.shards import SHARD_TARGET, ShardView, shard_of

log = logging.getLogger(__name__)

PREFIX = "swarmstream/v1"
RUNS_KEY = f"{PREFIX}/runs"
MANIFEST_TTL_S = 6 * 3600.0  # re-published by live peers long before it runs out
CLOCK_SKEW_S = 30.0  # a heartbeat "from the future" by more than this is refused


class RunNotFound(Exception):
    """No peer in the DHT holds a manifest for the run ID."""


def manifest_key(run_id: bytes) -> str:
    return f"{PREFIX}/run/{run_id.hex()}/manifest"


def peers_key(run_id: bytes, level: int = 0, shard: int = 0) -> str:
    """The key of one shard of the run's heartbeats (``peer.shards``); level 0 is the one key."""
    base = f"{PREFIX}/run/{run_id.hex()}/peers"
    return base if level <= 0 else f"{base}/{level}/{shard}"


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
    def __init__(self, dht: DHTNode, identity: Identity, clock: Callable[[], float] = get_dht_time,
                 shard_target: int = SHARD_TARGET):
        self.dht = dht
        self.identity = identity
        self.clock = clock
        self.shard_target = shard_target
        self.rejected: Counter[str] = Counter()  # peer ID -> records of theirs we refused
        self._views: dict[bytes, ShardView] = {}

    def view(self, run_id: bytes) -> ShardView:
        """Our shards of ``run_id``: where we write, what we read, the run's estimated size."""
        if run_id not in self._views:
            self._views[run_id] = ShardView(bytes(run_id), self.identity.public_key, target=self.shard_target)
        return self._views[run_id]

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
        """Store our heartbeat in our shards (``peer.shards``: three levels around ours, or the
        run's one key and level 1's shard in a small run). True if every store landed."""
        sealed, exp = seal(heartbeat, self.identity), self.clock() + ttl_s
        keys = [peers_key(heartbeat.run_id, lv, sh) for lv, sh in self.view(heartbeat.run_id).writes()]
        done = await self.dht.store_many(keys, [sealed] * len(keys), exp, subkeys=[self.identity.public_key] * len(keys))
        return all(done.values())

    async def peers(self, run_id: bytes, ttl_s: float) -> dict[bytes, Heartbeat]:
        """Live peers of the run that our shards show (all of them in a run at level 0, else a
        sample: ``peer.shards``): public key -> their latest verified, fresh heartbeat. Each
        call also moves our view's level and estimate of the run's size on."""
        view = self.view(run_id)
        where = view.to_read()
        keys = [peers_key(run_id, lv, sh) for lv, sh in where]
        found = await self.dht.get_many(keys, sufficient_expiration_time=float("inf"))
        me = self.identity.public_key
        out: dict[bytes, Heartbeat] = {}
        counts: dict[tuple[int, int], int] = {}
        for (lv, sh), key in zip(where, keys):
            shard = self._heartbeats(run_id, found.get(key), ttl_s, lv, sh)
            # we are in our own shard even before our store there is readable
            counts[(lv, sh)] = len(shard.keys() | ({me} if sh == shard_of(run_id, me, lv) else set()))
            if lv == view.level or view.probing():
                out.update(shard)
        view.observe(counts)
        return out

    async def heartbeat_of(self, run_id: bytes, key: bytes, ttl_s: float) -> Heartbeat | None:
        """One peer's fresh heartbeat, read from its shards at our level and the ones beside it
        (a group member outside our sample, say), or None."""
        view = self.view(run_id)
        levels = range(max(0, view.level - 1), view.level + 2)
        keys = [peers_key(run_id, lv, shard_of(run_id, key, lv)) for lv in levels]
        found = await self.dht.get_many(keys, sufficient_expiration_time=float("inf"))
        for lv, k in zip(levels, keys):
            hb = self._heartbeats(run_id, found.get(k), ttl_s, lv, shard_of(run_id, key, lv)).get(key)
            if hb is not None:
                return hb
        return None

    def _heartbeats(self, run_id: bytes, found: Any, ttl_s: float, level: int, shard: int) -> dict[bytes, Heartbeat]:
        """The verified, fresh heartbeats of one shard's record: public key -> heartbeat. A
        heartbeat stored in a shard its writer does not belong to is refused (the writer picks
        its key, not its shard: a flood of one shard costs one key each)."""
        now = self.clock()
        out: dict[bytes, Heartbeat] = {}
        for writer, value in _entries(found):
            try:
                _check_subkey(writer, 32)
                hb = verify(value, expect=Heartbeat, run_id=run_id, sender=writer).message
                if not (now - ttl_s <= hb.sent_at <= now + CLOCK_SKEW_S):
                    raise RemoteProtocolError(f"heartbeat sent at {hb.sent_at:.0f} is not within "
                                              f"{ttl_s:.0f} s of now ({now:.0f})")
                if shard_of(run_id, writer, level) != shard:
                    raise RemoteProtocolError(f"heartbeat stored in shard {shard} of level {level}, not its own")
            except RemoteProtocolError as e:
                self._reject(writer, "heartbeat", e)
                continue
            out[writer] = hb  # type: ignore[assignment]
        return out

    def estimate(self, run_id: bytes) -> float:
        """The run's estimated size, us included, from our last read of its shards."""
        return self.view(run_id).estimate

    # --- the public list of runs -------------------------------------------------------

    async def advertise(self, ad: RunAdvertised, ttl_s: float) -> bool:
        """Put the run in the public list, if we are one of its advertisers (``peer.shards``:
        about ``shard_target`` peers of a large run are; all of a small one)."""
        if not self.view(ad.run_id).advertises():
            return True
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
