"""Honest peers under CPU load, one of them starved outright: members time out on each other
asymmetrically, and the agreement within the round must still leave them all landing one
result."""

import subprocess
import sys

import pytest

from peer.demo import Demo, demo_manifest
from swarm_util import TIMED, Events, shared_landings

# its busy loops would starve a timed test on the other worker: they share one group
pytestmark = [pytest.mark.swarm, pytest.mark.slow, TIMED]

D = 5.0  # the run's all-reduce deadline: reduced parts are due 1.5 D after a round starts, reports by 2.5 D
STALL_UNTIL = 1.6  # x D: past the reduced parts' deadline, with 0.9 D (4.5 s) left for the agreement


def test_a_member_starved_of_cpu_past_the_deadlines_still_lands_what_the_others_land(tmp_path, demos):
    """Three honest peers with two busy loops beside them on this machine's cores. In fragment
    0's round 2, peer 1's network thread stops from right after its pushes went out and it
    reduced its part until 1.6 D into the round (``SWARMSTREAM_FAULT=stall:...``): its part
    reaches the others after their deadline, and it reads their parts after its own.
    The reports repair it within the round: every group the three landed together from one
    copy has one result."""
    manifest = tmp_path / "run.swarmrun"
    manifest.write_bytes(demo_manifest(3, tmp_path / "peer0.key", swarm={"allreduce_timeout_s": D}))
    events = Events()
    log = {"SWARMSTREAM_LOG": "INFO"}
    demo = Demo(3, rounds=8, workdir=tmp_path, on_event=events, manifest=manifest.read_bytes(),
                envs={0: log, 1: {**log, "SWARMSTREAM_FAULT": f"stall:0:2:{STALL_UNTIL}"}, 2: log})
    demos.append(demo)
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        demo.start()
        summary = demo.wait()
    finally:
        for p in load:
            p.kill()
            p.wait()
    assert summary["errors"] == [] and summary["finished"] == 3, summary
    seen = events.drain()
    logs = [(tmp_path / f"peer{i}.log").read_text() for i in range(3)]
    assert any("timeout:reduced part" in text for text in logs), "nobody timed out on a reduced part"
    assert any("forwarding reduced part" in text for text in logs), "no part was forwarded in the agreement"
    shared = shared_landings(seen, (0, 1, 2))
    assert shared, "the three peers never landed a group together from one copy"
    assert all(len(d) == 1 for d in shared.values()), f"members of a group landed different results: {shared}"
