"""Two validly signed keys that collude on the state: both claim to be 50 rounds ahead and
serve one self-consistent state of zeros, so two donors vouch for one digest. Peers training
in step do not take it: a claim that far ahead is believed only from peers that averaged with
them and could have got there since (``CatchUpMixin._plausibly_ahead``)."""

import time

import pytest

import swarm_peers
from peer.demo import Demo
from protocol.messages_control import FinishAndStop
from swarm_util import Events, start_process
from tui.control_client import call

pytestmark = pytest.mark.swarm


def test_two_colluding_donors_far_ahead_do_not_replace_the_model_of_peers_training_in_step(tmp_path, demos, procs):
    events = Events()
    demo = Demo(2, rounds=None, workdir=tmp_path, on_event=events,
                envs={i: {"SWARMSTREAM_LOG": "INFO"} for i in (0, 1)})
    demos.append(demo)
    demo.start()
    events.wait_for(lambda i, ev: ev.get("event") == "synced" and not ev["alone"], timeout=180)
    liars = [start_process(procs, swarm_peers.lying_donor, str(tmp_path / f"liar{k}.key"), demo.bootstrap,
                           str(tmp_path / "demo.swarmrun")) for k in (0, 1)]
    ready = [q.get(timeout=180) for q in liars]
    assert [r[0] for r in ready] == ["ready", "ready"] and ready[0][2] == ready[1][2], "one state, two vouchers"
    # both honest peers have seen each liar's claim and refused it (their logs name each once)
    logs = [tmp_path / f"peer{i}.log" for i in (0, 1)]

    def refused(text: str) -> bool:
        lines = [line for line in text.splitlines() if "not believing" in line]
        return all(any(r[1] in line for line in lines) for r in ready)

    deadline = time.monotonic() + 180
    while not all(refused(p.read_text()) for p in logs):
        assert time.monotonic() < deadline, "the peers never saw the liars' claim"
        events.wait_for(lambda i, ev: ev.get("event") == "synced", timeout=120)  # the next landing
    for i in (0, 1):
        call(demo.control_path(i), FinishAndStop)
    summary = demo.wait()
    assert summary["errors"] == [] and summary["finished"] == 2, summary
    assert not [ev for _, ev in events.drain() if ev.get("event") == "state_synced"], "nobody downloaded a state"
    assert all(s["global_digest"] for s in demo.summaries.values())
