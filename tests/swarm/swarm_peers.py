"""Entry points of peer processes started by the swarm tests (spawned, so importable here)."""

from __future__ import annotations

import time

from hivemind.utils import get_dht_time

from swarm_util import own_process_group


def creator(identity_path: str, manifest_bytes: bytes, run_id: bytes, out_q, stop_evt) -> None:
    """Publish a run's manifest, a heartbeat and an advertisement; serve until told to stop."""
    own_process_group()
    from peer.identity_store import load_or_create_identity
    from peer.network import Network, NetworkConfig
    from peer.presence import Presence
    from protocol.messages_swarm import Heartbeat, RunAdvertised

    ident = load_or_create_identity(identity_path)
    with Network(NetworkConfig(identity_path=identity_path, host_maddrs=("/ip4/127.0.0.1/tcp/0",))) as net:
        pres = Presence(net.dht, ident)
        net.call(pres.publish_manifest(manifest_bytes, run_id), timeout=30)
        now = get_dht_time()
        hb = Heartbeat(run_id=run_id, sent_at=now, state="training", step=42, tokens=1000, tokens_per_s=10.0,
                       rounds=(1, 0), state_digest=b"", reachable=True, maddrs=(), client="swarmstream/test",
                       device="cpu")
        net.call(pres.announce(hb, 60), timeout=30)
        ad = RunAdvertised(run_id=run_id, sent_at=now, name="test run", num_params=1234, peers=1, step=42)
        net.call(pres.advertise(ad, 60), timeout=30)
        out_q.put(("ready", net.visible_maddrs(), ident.public_key))
        stop_evt.wait(120)


def forger(identity_path: str, initial_peers: list[str], run_id: bytes, victim_key: bytes, out_q, stop_evt) -> None:
    """Write hostile records: a manifest that is another run, a heartbeat in someone else's
    slot, a heartbeat whose bytes were altered, and junk under odd subkeys."""
    own_process_group()
    from peer.identity_store import load_or_create_identity
    from peer.network import Network, NetworkConfig
    from peer.presence import manifest_key, peers_key
    from protocol.config import TrainConfig
    from protocol.envelope import seal
    from protocol.manifest import RunManifest, SwarmConfig, sign_manifest
    from protocol.messages_swarm import Heartbeat

    ident = load_or_create_identity(identity_path)
    with Network(NetworkConfig(identity_path=identity_path, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                               initial_peers=tuple(initial_peers))) as net:
        exp = get_dht_time() + 60
        other = RunManifest(name="impostor", description="", train=TrainConfig(), swarm=SwarmConfig(),
                            creator=ident.public_key, created_at=time.time())
        net.call(net.dht.store(manifest_key(run_id), sign_manifest(other, ident), exp, subkey=ident.public_key), 30)
        hb = Heartbeat(run_id=run_id, sent_at=get_dht_time(), state="training", step=1, tokens=10 ** 12,
                       tokens_per_s=1.0, rounds=(), state_digest=b"", reachable=True, maddrs=(),
                       client="swarmstream/evil", device="cpu")
        sealed = seal(hb, ident)
        net.call(net.dht.store(peers_key(run_id), sealed, exp, subkey=victim_key), 30)  # someone else's slot
        tampered = bytearray(sealed)
        tampered[-5] ^= 1
        net.call(net.dht.store(peers_key(run_id), bytes(tampered), exp, subkey=ident.public_key), 30)
        net.call(net.dht.store(peers_key(run_id), b"\xc1junk", exp, subkey=12345), 30)
        # properly signed and in its own slot, but for another run: only a reader can tell
        import dataclasses
        wrong_run = dataclasses.replace(hb, run_id=bytes(20))
        net.call(net.dht.store(peers_key(run_id), seal(wrong_run, ident), exp, subkey=ident.public_key), 30)
        out_q.put(("done", ident.peer_id))
        stop_evt.wait(120)


def lying_donor(identity_path: str, initial_peers: list[str], manifest_path: str, out_q, stop_evt) -> None:
    """A validly signed member of the run that lies about the state: its heartbeat claims 50
    rounds more than anyone has done, and it serves a self-consistent state of zeros under
    that digest (fine by every hash and signature check)."""
    own_process_group()
    from pathlib import Path

    import torch

    from peer.globalstate import GlobalState, snapshot
    from peer.identity_store import load_or_create_identity
    from peer.network import Network, NetworkConfig
    from peer.presence import Presence
    from peer.statesync import StateServer
    from peer.worker import Worker
    from protocol.manifest import open_manifest
    from protocol.messages_swarm import Heartbeat

    signed = open_manifest(Path(manifest_path).read_bytes())
    train, swarm = signed.manifest.train, signed.manifest.swarm
    rounds = (50,) * train.sync.fragments
    real = snapshot(Worker(train), rounds)
    zeros = GlobalState({k: torch.zeros_like(v) for k, v in real.tensors.items()}, rounds,
                        50 * train.sync.inner_steps)
    ident = load_or_create_identity(identity_path)
    with Network(NetworkConfig(identity_path=identity_path, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                               initial_peers=tuple(initial_peers))) as net:
        server = StateServer(net.p2p, ident, signed.run_id, chunk_bytes=swarm.state_chunk_bytes)
        net.call(server.start(), 30)
        digest = net.call(server.publish(zeros), 60)
        presence = Presence(net.dht, ident)
        announced = False
        while not stop_evt.is_set():
            hb = Heartbeat(run_id=signed.run_id, sent_at=get_dht_time(), state="training", step=zeros.step,
                           tokens=10 ** 9, tokens_per_s=1e6, rounds=rounds, state_digest=digest, reachable=True,
                           maddrs=tuple(net.visible_maddrs()), client="swarmstream/liar", device="cpu")
            net.call(presence.announce(hb, swarm.heartbeat_ttl_s), 30)
            if not announced:
                out_q.put(("ready", ident.peer_id, digest))
                announced = True
            stop_evt.wait(swarm.heartbeat_interval_s)
        net.call(server.shutdown(), 10)
