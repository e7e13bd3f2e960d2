"""A node that trains as a torch.distributed group (two gloo processes on CPU, DDP or FSDP) in a
real swarm: it averages with a single-process peer, both land bit-identical global copies, and
pause, resume (a checkpoint saved and loaded) and finish work for the whole group."""

import tempfile
from pathlib import Path

import pytest

from peer.demo import Demo
from protocol.messages_control import FinishAndStop, GetStatus, PauseTraining, ResumeTraining
from swarm_util import Events, last_landings_shared, shared_landings
from tui.control_client import call

pytestmark = pytest.mark.swarm


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_a_two_process_node_averages_with_a_single_process_peer_and_pauses_as_one(demos, sharding):
    workdir = Path(tempfile.mkdtemp(prefix="ss-rep-", dir="/tmp"))  # short: unix socket paths
    events = Events()
    demo = Demo(2, rounds=None, workdir=workdir, on_event=events, args={1: ["--gpus", "2", "--sharding", sharding]})
    demos.append(demo)
    demo.start()
    _, listening = events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "listening")
    assert listening["processes"] == 2
    _, built = events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "built")
    assert built == {"event": "built", "processes": 2, "sharding": sharding}
    events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "synced" and not ev["alone"])

    # a pause gives every process's model back; resume builds them again from the checkpoint
    sock = demo.control_path(1)
    call(sock, PauseTraining)
    events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "state" and ev["state"] == "paused")
    paused_step = call(sock, GetStatus).step
    call(sock, ResumeTraining)
    events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "synced" and not ev["alone"]
                    and ev["step"] > paused_step, timeout=180)

    for i in (0, 1):  # each finishes its round and contributes it, so the final copies agree
        call(demo.control_path(i), FinishAndStop)
    summary = demo.wait()
    assert summary["errors"] == [] and summary["finished"] == 2
    seen = events.drain()
    # every group both landed from one copy, they landed one result; and the final copies agree
    # when the last round of each fragment was such a group (two peers told to finish at once
    # each stop after their own current round: under load they may end a round apart)
    assert all(len(d) == 1 for d in shared_landings(seen, (0, 1)).values()), shared_landings(seen, (0, 1))
    if last_landings_shared(seen, (0, 1)):
        assert summary["global_copies_agree"], summary
    together = [k for k, d in demo.landed[1].items() if demo.landed[0].get(k) == d]
    assert len(together) >= 2  # fragments landed bit-identical on both, from rounds averaged together
    assert demo.procs[1].returncode == 0  # torchrun: every process of the group exited cleanly
