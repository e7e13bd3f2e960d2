"""A real node driven through its control socket: status, pause, resume, finish-then-stop,
and one node per identity. Two `python -m peer.node` processes on 127.0.0.1 (via peer.demo)."""

import math
import re
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from peer.demo import Demo
from peer.launch import child_cwd, child_env, module_command
from protocol.messages_control import FinishAndStop, GetStatus, PauseTraining, ResumeTraining
from swarm_util import Events
from tui.cli import main as cli_main
from tui.control_client import ControlError, call

pytestmark = [pytest.mark.swarm, pytest.mark.slow]


def wait_status(sock, pred, timeout=90.0):
    """Poll the node's status until ``pred`` holds (bounded; fails with the last status)."""
    deadline = time.monotonic() + timeout
    while True:
        st = call(sock, GetStatus)
        if pred(st):
            return st
        assert time.monotonic() < deadline, f"status never matched; last: state={st.state} step={st.step}"
        time.sleep(0.2)  # polling a live process for a condition, bounded by the deadline


def test_pause_releases_the_model_resume_catches_up_and_stop_finishes_the_round(demos, capsys):
    workdir = Path(tempfile.mkdtemp(prefix="ss-ctl-", dir="/tmp"))  # short: unix socket paths
    events = Events()
    demo = Demo(2, rounds=None, workdir=workdir, on_event=events)
    demos.append(demo)
    demo.start()
    sock = demo.control_path(0)
    events.wait_for(lambda i, ev: i == 0 and ev.get("event") == "synced" and not ev["alone"])

    st = call(sock, GetStatus)
    assert st.state in ("training", "averaging") and st.step > 0 and st.peers == 2
    assert st.run_name == "local demo" and st.reachability == "direct" and st.device == "cpu"
    assert st.fragments_contributed >= 1 and st.tokens >= st.tokens_contributed > 0  # the credit ledger

    # one node per identity: a second one on peer 0's key is refused with a one-line error
    second = subprocess.run(module_command("peer.node", "--address", demo.address, "--identity",
                                           str(workdir / "peer0.key"), "--data-dir", str(workdir / "x"), "--control",
                                           str(workdir / "x.sock"), "--settings", str(workdir / "peer0.toml")),
                            capture_output=True, text=True, timeout=180, env=child_env(), cwd=child_cwd(workdir))
    # (a bound, not a wait: on a machine with more work than cores, starting Python, torch and
    # hivemind took most of a 60 s bound once, and the refusal was printed but the exit not in)
    assert second.returncode == 2 and "already runs with the identity" in second.stderr

    # pause: what is in flight is contributed, the model is dropped, the step stands still
    call(sock, PauseTraining)
    paused = wait_status(sock, lambda s: s.state == "paused")
    assert paused.pause_reason == "paused by you" and paused.device == "released (paused)"
    with pytest.raises(ControlError, match="already paused"):
        call(sock, PauseTraining)
    # nobody waits for a paused peer: peer 1 lands every fragment two rounds past the last one
    # peer 0 landed (so even a heartbeat one landing old shows it a round ahead). Events that
    # were queued before the pause count for peer 0's rounds, not as progress made without it.
    last = {0: -1, 1: -1}  # fragment -> the last round peer 0 landed (its in-flight landings too)
    ahead = {0: -1, 1: -1}  # fragment -> the last round peer 1 landed

    def moved_on(i, ev):
        if ev.get("event") == "synced":
            (last if i == 0 else ahead)[ev["fragment"]] = ev["round"]
        return all(ahead[f] >= last[f] + 2 for f in (0, 1))

    for item in events.drain():
        moved_on(*item)
    events.wait_for(moved_on)
    assert call(sock, GetStatus).step == paused.step

    # resume: the run moved on, so peer 0 downloads the swarm's state and averages with it again
    call(sock, ResumeTraining)
    events.wait_for(lambda i, ev: i == 0 and ev.get("event") == "state_synced")
    events.wait_for(lambda i, ev: i == 0 and ev.get("event") == "synced" and not ev["alone"])
    st = wait_status(sock, lambda s: s.state in ("training", "averaging"))
    assert st.step > paused.step and st.device == "cpu"

    # finish-then-stop from the command line: the node contributes its round, then exits cleanly
    rounds_before = st.rounds_done
    assert cli_main(["stop", "--control", str(sock), "--wait"]) == 0
    assert "finishing" in capsys.readouterr().out
    assert demo.procs[0].wait(60) == 0
    _, summary = events.wait_for(lambda i, ev: i == 0 and ev.get("event") == "summary", timeout=10)
    assert summary["rounds"] >= rounds_before + 1 and math.isfinite(summary["heldout_loss"])
    assert not sock.exists()  # the socket is removed on exit
    assert cli_main(["status", "--control", str(sock)]) == 1
    assert "no swarmstream node is running" in capsys.readouterr().err


def test_after_a_short_pause_the_peers_fall_back_in_step_and_agree_again(demos):
    """A pause too short for the run to move on leaves the peer out of phase: both average
    alone for a round, then the one ahead waits to meet the other, and the tie between their
    two lone states goes to the same one on both (repair), so the copies agree again: both
    land the same global copy of every fragment at one round, averaging together."""
    workdir = Path(tempfile.mkdtemp(prefix="ss-ctl-", dir="/tmp"))
    events = Events()
    demo = Demo(2, rounds=None, workdir=workdir, on_event=events)
    demos.append(demo)
    demo.start()
    sock = demo.control_path(0)
    events.wait_for(lambda i, ev: i == 0 and ev.get("event") == "synced" and not ev["alone"])
    call(sock, PauseTraining)
    wait_status(sock, lambda s: s.state == "paused")
    call(sock, ResumeTraining)
    start = len(events.drain())
    # out of phase now (unless the pause was short enough to land in the same batch); within a
    # few rounds both average together again and a repair leaves them one copy
    deadline = time.monotonic() + 180

    def agreed() -> bool:
        landed: dict[int, dict[tuple[int, int], tuple[str, bool]]] = {0: {}, 1: {}}
        for i, ev in events.seen[start:]:
            if ev.get("event") == "synced":
                landed[i][(ev["fragment"], ev["round"])] = (ev["digest"], ev["alone"])
        rounds = {r for _, r in landed[0]} & {r for _, r in landed[1]}
        return any(all((f, r) in landed[0] and (f, r) in landed[1] and landed[0][(f, r)] == landed[1][(f, r)]
                       and not landed[0][(f, r)][1] for f in (0, 1)) for r in rounds)

    while not agreed():
        assert time.monotonic() < deadline, f"no round landed as one copy on both; last events {events.seen[-4:]}"
        events.wait_for(lambda i, ev: ev.get("event") == "synced", timeout=max(1.0, deadline - time.monotonic()))
    for i in (0, 1):
        call(demo.control_path(i), FinishAndStop)
    summary = demo.wait()
    assert summary["errors"] == [] and summary["finished"] == 2
    assert summary["global_copies_agree"], "the peers still hold different global copies"


def test_a_partner_that_pauses_mid_round_does_not_make_the_other_peer_follow(demos):
    """A pause starts the rounds whose groups are forming at once, before their start step
    (``_start_forming_now``). Those pushes come early to the partner, which must not take
    that for having kept its group waiting (``peer.pace``): it would follow, and, alone in a
    swarm of two, move its counter on without training; nor start that round early, as a member
    behind its group's start does when the others started it. They are marked
    ``PushSlice.stopping``."""
    workdir = Path(tempfile.mkdtemp(prefix="ss-ctl-", dir="/tmp"))
    events = Events()
    demo = Demo(2, rounds=None, workdir=workdir, on_event=events, envs={i: {"SWARMSTREAM_LOG": "INFO"} for i in (0, 1)})
    demos.append(demo)
    demo.start()
    events.wait_for(lambda i, ev: i == 0 and ev.get("event") == "synced" and not ev["alone"])
    sock = demo.control_path(0)
    call(sock, PauseTraining)
    wait_status(sock, lambda s: s.state == "paused")
    early = re.findall(r"started fragment (\d+) round (\d+) early", (workdir / "peer0.log").read_text())
    assert early, "the pause found no group forming to start early"
    fragment, round_ = map(int, early[-1])
    events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "synced" and ev["fragment"] == fragment
                    and ev["round"] == round_)
    events.wait_for(lambda i, ev: i == 1 and ev.get("event") == "synced")  # one more: its verdict is logged by now
    log1 = (workdir / "peer1.log").read_text()
    assert "following its rounds" not in log1, "the partner of a pausing peer took itself for the straggler"
    call(demo.control_path(1), FinishAndStop)
    call(sock, ResumeTraining)
    call(sock, FinishAndStop)
    summary = demo.wait()
    assert summary["errors"] == []
    # nor did it start the paused round early as a member behind its group's start does when
    # the others started it (``_keep_pace``): the pausing peer's early pushes are no start
    log1 = (workdir / "peer1.log").read_text()
    assert f"starting fragment {fragment} round {round_} with the others" not in log1, \
        "the partner of a pausing peer took its early pushes for the group's start"
