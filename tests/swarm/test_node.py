"""Whole nodes in a real swarm: N `python -m peer.node` processes on 127.0.0.1 (via peer.demo)."""

import math
import os
import re
import signal
import time

import pytest
import torch

from peer.demo import Demo
import swarm_peers
from swarm_util import TIMED, Events, last_landings_shared, start_process
from peer.identity_store import load_or_create_identity
from peer.network import Network, NetworkConfig
from peer.presence import Presence
from peer.simulation import SimulationConfig, run_simulation
from protocol.identity import public_key_from_peer_id
from protocol.manifest import open_manifest
from protocol.messages_control import FinishAndStop
from tui.control_client import call

pytestmark = pytest.mark.swarm


def clean_rounds(events, peers: int) -> dict[tuple[int, int], set[str]]:
    """The digests each peer landed for (fragment, round), for the rounds that all ``peers``
    averaged in one group with nobody dropped and that every peer entered holding the same
    copy of that fragment (its previous landing's digest, or the common initial model; a peer
    that downloaded a state since then is left out of the comparison)."""
    held: dict[tuple[int, int], str | None] = {}  # (peer, fragment) -> digest; None: the initial copy
    unknown: set[tuple[int, int]] = set()  # replaced by a download: not comparable until it lands again
    landed: dict[tuple[int, int], dict[int, tuple[str | None, dict]]] = {}
    for i, ev in events:
        if ev.get("event") == "state_synced":
            unknown |= {(i, f) for f in range(len(ev["rounds"]))}
        elif ev.get("event") == "synced":
            key = (i, ev["fragment"])
            before = "?" if key in unknown else held.get(key)
            landed.setdefault((ev["fragment"], ev["round"]), {})[i] = (before, ev)
            held[key] = ev["digest"]
            unknown.discard(key)
    out = {}
    for fr, by_peer in landed.items():
        evs = [ev for _, ev in by_peer.values()]
        befores = {b for b, _ in by_peer.values()}
        if (len(by_peer) == peers and all(ev["group_size"] == peers and not ev["dropped"] for ev in evs)
                and len(befores) == 1 and "?" not in befores):
            out[fr] = {ev["digest"] for ev in evs}
    return out


def finish_after_a_clean_round(demo, events, peers: int, within_s: float, failure: str) -> None:
    """Wait until ``clean_rounds`` finds a round that all ``peers`` averaged as one group from
    one copy (load decides how many rounds that takes), then tell every peer to finish."""
    deadline = time.monotonic() + within_s
    while not clean_rounds(events.seen, peers):
        left = deadline - time.monotonic()
        assert left > 0, f"{failure}; last events {events.seen[-8:]}"
        events.wait_for(lambda i, ev: ev.get("event") == "synced", timeout=left)
    for i in range(peers):
        call(demo.control_path(i), FinishAndStop)


def run_until_four_average_as_one(demo, events, demos) -> dict:
    """Start four peers, run at least 3 rounds and until all four averaged as one group from
    one copy (load decides how many rounds that takes), finish them: -> the demo's summary."""
    demos.append(demo)
    demo.start()
    events.wait_for(lambda i, ev: ev.get("event") == "synced" and ev["fragment"] == 1 and ev["round"] == 2,
                    timeout=300)
    finish_after_a_clean_round(demo, events, 4, 300, "the four peers never averaged as one group")
    return demo.wait()


def test_four_peers_agree_bit_for_bit_every_round_and_track_the_simulation(tmp_path, demos):
    """On a busy machine a peer may reach a sync more than the matchmaking gap after the others
    and average alone (or be dropped from a slow all-reduce); the protocol allows that and
    repairs it later. What holds every round: the members of a group who held the same copy
    land the same result, bit for bit. The run goes on for at least 3 rounds and until all four
    have averaged as one group, rather than for a fixed number of rounds that load could leave
    without one."""
    events = Events()
    demo = Demo(4, rounds=None, workdir=tmp_path, on_event=events)
    summary = run_until_four_average_as_one(demo, events, demos)
    assert summary["errors"] == [] and summary["finished"] == 4 and summary["rounds"] >= 2
    seen = events.drain()
    clean = clean_rounds(seen, 4)
    print(f"lone syncs {summary['syncs_alone']}; rounds all four averaged together from one copy: {sorted(clean)}")
    assert clean, "the four peers never averaged as one group"
    assert all(len(d) == 1 for d in clean.values()), f"a group landed different results: {clean}"
    perturbed = summary["syncs_alone"] or any(ev.get("event") == "synced" and ev["dropped"] for _, ev in seen)
    if not perturbed:  # every sync found its group of four, nobody dropped: nothing to repair
        assert summary["global_copies_agree"]

    train = open_manifest((tmp_path / "demo.swarmrun").read_bytes()).manifest.train
    steps = max(s["steps"] for s in demo.summaries.values())
    # one torch thread, as each demo peer has: on a busy 2-core machine a second OpenMP thread
    # spins against the others and made this in-process simulation take over five minutes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sim = run_simulation(SimulationConfig(train=train, workers=4, steps=steps, eval_batches=8))
    finally:
        torch.set_num_threads(threads)
    swarm_loss = summary["heldout_loss"]
    print(f"held-out loss after {steps} steps: swarm {swarm_loss:.4f}, simulate {sim.heldout_loss:.4f}, "
          f"gap {swarm_loss - sim.heldout_loss:+.4f}")
    assert swarm_loss < math.log(256) - 1.0, "the swarm learned"
    assert abs(swarm_loss - sim.heldout_loss) < 0.35


@pytest.mark.timeout(600)  # as the late-joiner test: it runs until the restarted peer averaged in a group again
def test_a_peer_killed_mid_allreduce_is_dropped_expires_and_resumes_from_its_checkpoint(tmp_path, demos):
    events = Events()
    demo = Demo(3, rounds=None, workdir=tmp_path, on_event=events, checkpoint_every_s=0,
                envs={0: {"SWARMSTREAM_LOG": "INFO"}, 1: {"SWARMSTREAM_LOG": "INFO"},
                      2: {"SWARMSTREAM_FAULT": "die-after-group:0:1"}})
    demos.append(demo)
    demo.start()
    _, listening = events.wait_for(lambda i, ev: i == 2 and ev.get("event") == "listening")
    victim = public_key_from_peer_id(listening["peer"])
    assert demo.procs[2].wait(120) == -signal.SIGKILL  # it vanished right after its group formed

    # the others finish that round with the victim dropped, and keep training
    # (under load a slow member may be dropped from an earlier round too, the victim's own
    # syncs included: the round we look for is a survivor's, from round 1 on)
    i, ev = events.wait_for(lambda i, ev: i in (0, 1) and ev.get("event") == "synced" and ev["fragment"] == 0
                            and ev["round"] >= 1 and ev["dropped"])
    assert math.isfinite(ev["train_loss"])
    died_in = ev["round"]
    events.wait_for(lambda i, ev: ev.get("event") == "synced" and ev["round"] == died_in + 1 and i in (0, 1))

    # its heartbeat expires (the demo run's heartbeat_ttl_s is 10 s)
    key = tmp_path / "observer.key"
    with Network(NetworkConfig(identity_path=str(key), host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                               initial_peers=(demo.address.split("@")[1],))) as net:
        pres = Presence(net.dht, load_or_create_identity(key))
        run_id = open_manifest((tmp_path / "demo.swarmrun").read_bytes()).run_id
        deadline = time.monotonic() + 40
        while victim in net.call(pres.peers(run_id, ttl_s=10), timeout=30):
            assert time.monotonic() < deadline, "the killed peer's heartbeat did not expire"
            time.sleep(1)  # polling the DHT for a condition, bounded by the deadline

    # restarted with the same identity and data dir, it resumes from its checkpoint and rejoins
    demo.add_peer(2)
    _, resumed = events.wait_for(lambda i, ev: i == 2 and ev.get("event") == "resumed")
    assert resumed["step"] > 0 and min(resumed["rounds"]) >= 1
    # the run goes on until it has averaged in a group again (a fixed number of rounds could end,
    # on a busy machine, before the restarted peer is back in step), then everyone finishes
    events.wait_for(lambda i, ev: i == 2 and ev.get("event") == "synced" and not ev["alone"], timeout=300)
    for i in range(3):
        call(demo.control_path(i), FinishAndStop)
    summary = demo.wait()
    assert set(demo.summaries) == {0, 1, 2}
    survivors = [demo.summaries[i] for i in (0, 1)]
    if last_landings_shared(events.drain(), (0, 1)):
        assert survivors[0]["global_digest"] == survivors[1]["global_digest"]
    # (the one whose sync we saw dropped it; the other may have met the victim in no group then)
    assert any(s["dropped_peers"] >= 1 for s in survivors), demo.summaries
    assert all(math.isfinite(s["heldout_loss"]) for s in survivors)
    assert demo.summaries[2]["syncs"] > demo.summaries[2]["syncs_alone"], "the restarted peer averaged again"
    assert summary["errors"] == []


@pytest.mark.timeout(600)  # its own waits allow minutes: a busy machine splits rounds, and the run goes on until a clean one
def test_a_late_joiner_downloads_the_state_and_then_matches_the_others_bit_for_bit(tmp_path, demos, procs):
    """From its download on, the joiner holds what the others hold: in every round that all
    four averaged as one group with nobody dropped, having entered it with one copy, they land
    one digest. On a busy machine a round may split or drop a slow member (the protocol allows
    that and repairs it), so the run goes on until the joiner has averaged in such a round,
    rather than for a fixed number of rounds that load could leave without one.

    Meanwhile a validly signed liar claims to be 50 rounds ahead and serves a state of zeros:
    nobody else vouches for it, so neither the peers in the run nor the joiner take it."""
    events = Events()
    demo = Demo(3, rounds=None, workdir=tmp_path, on_event=events)
    demos.append(demo)
    demo.start()
    # the liar comes once the three are in the run: a liar that is there before anyone else
    # is a swarm of two to the first peer (docs/THREAT_MODEL.md), not what this test is about
    training: set[int] = set()
    events.wait_for(lambda i, ev: ev.get("event") == "state" and ev["state"] == "training"
                    and (training.add(i) or len(training) == 3))
    liar = start_process(procs, swarm_peers.lying_donor, str(tmp_path / "liar.key"), demo.bootstrap,
                         str(tmp_path / "demo.swarmrun"))
    # a helper process that imports torch, builds the model and starts a DHT: beside a loaded CI
    # run and two busy loops it was not ready within 60 s
    assert liar.get(timeout=180)[0] == "ready"
    events.wait_for(lambda i, ev: i == 0 and ev.get("event") == "synced" and ev["fragment"] == 1 and ev["round"] == 1)
    demo.add_peer()  # peer 3 joins after 2 full rounds
    _, synced = events.wait_for(lambda i, ev: i == 3 and ev.get("event") == "state_synced", timeout=180)
    assert 2 <= min(synced["rounds"]) and max(synced["rounds"]) < 50  # the swarm's state, not the liar's
    finish_after_a_clean_round(demo, events, 4, 420, "the joiner never averaged in a full group with nobody dropped")
    summary = demo.wait()
    assert summary["errors"] == [] and set(demo.summaries) == {0, 1, 2, 3}
    clean = clean_rounds(events.drain(), 4)
    assert all(len(d) == 1 for d in clean.values()), {k: d for k, d in clean.items() if len(d) > 1}
    digests = {i: s["global_digest"] for i, s in demo.summaries.items()}
    if all(not s["dropped_peers"] and not s["syncs_alone"] for s in demo.summaries.values()):
        assert len(set(digests.values())) == 1, digests
    seen = events.seen
    assert not [ev for i, ev in seen if ev.get("event") == "state_synced" and max(ev["rounds"]) >= 50]
    logs = "".join((tmp_path / f"peer{i}.log").read_text() for i in range(4))
    # the liar's claim was seen, and refused: one voucher is not enough, and a claim that far
    # ahead from a key that never averaged with the peers is not believed at all
    assert "no two vouch for one state" in logs or "not believing" in logs


@TIMED
def test_ctrl_c_stops_a_node_within_seconds_with_its_work_saved_and_no_daemon_left(tmp_path, demos):
    events = Events()
    demo = Demo(2, rounds=None, workdir=tmp_path, on_event=events)
    demos.append(demo)
    demo.start()
    events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "synced")
    node = demo.procs[1]
    t0 = time.monotonic()
    node.send_signal(signal.SIGINT)
    assert node.wait(30) == 0
    elapsed = time.monotonic() - t0
    print(f"node stopped {elapsed:.1f} s after Ctrl+C")
    assert elapsed < 20
    _, summary = events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "summary", timeout=10)
    assert summary["steps"] > 0 and math.isfinite(summary["heldout_loss"])
    with pytest.raises(ProcessLookupError):  # nothing of that node's process group is left: no p2pd
        os.killpg(node.pid, 0)
    assert list(tmp_path.glob("peer1/*/checkpoint/meta.json")), "the node checkpointed what it trained"


def test_a_peer_that_lost_every_peer_reconnects_through_its_bootstrap_peer(tmp_path, demos):
    import socket

    with socket.socket() as s:  # a free port, so the bootstrap peer can come back at the same address
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    events = Events()
    demo = Demo(2, rounds=None, workdir=tmp_path, on_event=events, listen={0: f"/ip4/127.0.0.1/tcp/{port}"},
                envs={i: {"SWARMSTREAM_LOG": "INFO"} for i in range(2)})
    demos.append(demo)
    demo.start()
    events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "synced" and not ev["alone"])
    demo.kill(0)  # the bootstrap peer (peer 1's only peer) vanishes
    events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "synced" and ev["alone"])
    demo._spawn(0, ["--manifest", str(tmp_path / "demo.swarmrun")], demo.envs[0])  # back, at the same address
    _, ev = events.wait_for(lambda i, ev: i == 0 and ev.get("event") == "state_synced")
    events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "synced" and not ev["alone"])
    assert "reconnected through the bootstrap peers" in (tmp_path / "peer1.log").read_text()


def test_a_peer_at_a_third_of_the_speed_averages_in_the_others_groups_with_the_steps_it_managed(tmp_path, demos):
    """Peer 2 trains a third of the time (its volunteer setting compute.duty_cycle). Counting
    rounds on its own steps, it would reach each round three times as late, find every group
    gone and average alone. It finds itself slower than the swarm (peer.pace), joins each
    round when the others do and hands over its pseudo-gradient when their group has formed,
    with the inner steps it managed (a smaller weight): it averages in the others' groups."""
    from peer.settings_store import save_settings
    from protocol.config import DataConfig, InnerConfig, SyncConfig, TrainConfig, model_preset
    from protocol.manifest import RunManifest, SwarmConfig, sign_manifest
    from protocol.settings import ClientSettings, ComputeSettings, Settings

    creator = load_or_create_identity(tmp_path / "creator.key")
    train = TrainConfig(model=model_preset("tiny"), data=DataConfig(source="stdlib"),
                        inner=InnerConfig(lr=3e-3, warmup_steps=20, total_steps=2000, batch_size=8),
                        sync=SyncConfig(inner_steps=40, fragments=2, overlap=1, alpha=0.5, codec="fp4"))
    swarm = SwarmConfig(group_size=8, matchmaking_timeout_s=5.0, allreduce_timeout_s=20.0,
                        heartbeat_interval_s=3.0, heartbeat_ttl_s=10.0)
    manifest = sign_manifest(RunManifest(name="a slow peer", description="tests/swarm/test_node.py", train=train,
                                         swarm=swarm, creator=creator.public_key, created_at=time.time()), creator)
    save_settings(tmp_path / "peer2.toml", Settings(compute=ComputeSettings(duty_cycle=0.34),
                                                    client=ClientSettings(confirmed=True)))
    events = Events()
    demo = Demo(3, rounds=None, workdir=tmp_path, on_event=events, manifest=manifest)
    demos.append(demo)
    demo.start()
    # the slow peer lands a round in one group with both others (it starts out behind them)
    events.wait_for(lambda i, ev: i == 2 and ev.get("event") == "synced" and ev["round"] >= 2
                    and ev["group_size"] == 3 and not ev["alone"], timeout=300)
    for i in range(3):
        call(demo.control_path(i), FinishAndStop)
    summary = demo.wait()
    assert summary["errors"] == [] and summary["finished"] == 3
    fast, slow = [demo.summaries[0], demo.summaries[1]], demo.summaries[2]
    print(f"slow peer: {slow['steps_trained']} steps trained, its counter moved on {slow['steps_skipped']}, "
          f"{slow['syncs'] - slow['syncs_alone']} of {slow['syncs']} syncs in a group; "
          f"fast peers: {[s['steps_trained'] for s in fast]} steps trained")
    assert slow["steps_skipped"] > 0, "the slow peer never started a sync when the others did"
    assert slow["steps_trained"] < 0.8 * min(s["steps_trained"] for s in fast)  # it trained fewer steps


def test_a_run_whose_presence_is_sharded_trains_as_one_and_estimates_its_size(tmp_path, demos):
    """With a shard target of one peer, four nodes behave as a run of thousands does
    (peer.shards): they move up to levels where each reads a sample of the run's heartbeats,
    and still find each other, average as one group, land one result and estimate their number."""
    events = Events()
    demo = Demo(4, rounds=None, workdir=tmp_path, on_event=events,
                args={i: ["--shard-target", "1"] for i in range(4)},
                envs={i: {"SWARMSTREAM_LOG": "INFO"} for i in range(4)})
    summary = run_until_four_average_as_one(demo, events, demos)
    assert summary["errors"] == [] and summary["finished"] == 4
    clean = clean_rounds(events.drain(), 4)
    assert clean and all(len(d) == 1 for d in clean.values()), f"a group landed different results: {clean}"
    for i in range(4):
        log = (tmp_path / f"peer{i}.log").read_text()
        levels = [(int(m.group(1)), float(m.group(2)))
                  for m in re.finditer(r"presence level=(\d+) estimate=([\d.]+)", log)]
        assert levels and max(lv for lv, _ in levels) >= 1, f"peer {i} never sharded its presence: {levels}"
        assert all(1 <= est <= 16 for lv, est in levels if lv >= 1), f"peer {i} estimated {levels}"


def test_peers_that_averaged_their_last_round_apart_end_on_one_copy(tmp_path, demos):
    """A run ends (``--rounds 3``) right after a round the two peers averaged apart: peer 1 is
    cut off from fragment 1's last round (it joins no group; so peer 0 averages it alone too),
    and no later round mixes their copies again. Before they go, they compare final copies
    (``Node._settle_final``): the tie goes to the smallest key's copy, the other peer downloads
    it, and both end, checkpoint included, on one model."""
    logs = {"SWARMSTREAM_LOG": "INFO"}
    demo = Demo(2, rounds=3, workdir=tmp_path, envs={0: logs, 1: {**logs, "SWARMSTREAM_FAULT": "alone:1:2"}})
    demos.append(demo)
    demo.start()
    summary = demo.wait()
    assert summary["errors"] == [] and summary["finished"] == 2, summary
    assert demo.landed[0][(1, 2)] != demo.landed[1][(1, 2)], "their last round was not averaged apart"
    assert summary["global_copies_agree"], [s["global_digest"] for s in demo.summaries.values()]
    said = [(tmp_path / f"peer{i}.log").read_text() for i in (0, 1)]
    assert sum("downloading theirs" in s for s in said) == 1, "exactly one of them takes the other's copy"
    assert all("final copy agreed" in s for s in said)
