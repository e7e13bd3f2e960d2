"""A ban reaches the whole run: a peer that holds proof against a key hands it to the peers
whose heartbeats do not list that ban (``Audits.gossip``), whether or not the liar ever joins
their groups."""

import pytest
import torch

from peer.bans import Bans
from peer.demo import Demo, demo_manifest
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.manifest import open_manifest
from protocol.messages_control import FinishAndStop
from protocol.messages_swarm import PushSlice
from swarm_util import Events
from tui.control_client import call

pytestmark = pytest.mark.swarm


def test_a_proof_held_by_one_peer_reaches_a_peer_the_liar_never_met(tmp_path, demos):
    """Peer 0 starts with a saved proof against a key that is not in the run at all (a NaN
    slice it signed, as ``bans/<peer>.frame``). Peer 1's heartbeat lists no ban, so peer 0
    hands it the proof; peer 1 checks it, bans the key with the evidence saved in its own data
    dir, and lists the ban in its heartbeat from then on."""
    manifest = demo_manifest(2, tmp_path / "peer0.key")
    signed = open_manifest(manifest)
    liar = Identity.from_seed(b"\x77" * 32)
    nan = torch.full((64,), float("nan")).numpy().tobytes()
    frame = seal(PushSlice(run_id=signed.run_id, fragment=0, round=0, group_id=b"g" * 16, part=0, offset=0,
                           numel=64, shape=(64,), dtype="float32", codec="fp32", weight=1.0, stopping=False,
                           payload=nan), liar)
    bans0 = tmp_path / "peer0" / signed.run_id_text / "bans"
    bans0.mkdir(parents=True)
    assert Bans(bans0, signed.run_id).add(liar.public_key, "test", frame)

    events = Events()
    demo = Demo(2, rounds=None, workdir=tmp_path, manifest=manifest, on_event=events,
                envs={i: {"SWARMSTREAM_LOG": "INFO"} for i in (0, 1)})
    demos.append(demo)
    demo.start()
    _, ev = events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "banned", timeout=180)
    assert ev["peer"] == liar.peer_id and "NaN" in ev["reason"], ev
    for i in (0, 1):
        call(demo.control_path(i), FinishAndStop)
    summary = demo.wait()
    assert summary["errors"] == [] and summary["finished"] == 2, summary
    assert (tmp_path / "peer1" / signed.run_id_text / "bans" / f"{liar.peer_id}.frame").is_file()
    said = [(tmp_path / f"peer{i}.log").read_text() for i in (0, 1)]
    assert said[0].count(f"handing our proof against peer={liar.peer_id}") == 1, "once, then peer 1 lists it"
    assert f"proves that peer={liar.peer_id} lied" in said[1]
