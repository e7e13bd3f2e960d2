"""A whole node that lies (``SWARMSTREAM_FAULT=lie:...``, ``peer.node.faults``) among honest
whole nodes: what the honest ones land, and how far the lies move their model."""

import math
import shutil
from pathlib import Path

import pytest

from peer.batches import rank, round_seed
from peer.demo import Demo, demo_manifest
from peer.distrust import SUSPEND
from peer.identity_store import load_or_create_identity
from protocol.identity import Identity, peer_id_from_public_key
from protocol.manifest import open_manifest
from swarm_util import Events, kill_process_group, shared_landings

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

ROUNDS = 10


def run(workdir: Path, demos, peers: int, setup: Path, envs=None, rounds: int = ROUNDS) -> tuple[Demo, list]:
    """``peers`` nodes of the run in ``setup`` (its manifest, and the keys of peers 0..3): the
    same model, data and identities in every run, so two runs differ only by what their peers
    do (and, on a loaded machine, by a round some peer averaged alone)."""
    workdir.mkdir()
    for i in range(peers):
        shutil.copy(setup / f"peer{i}.key", workdir / f"peer{i}.key")
    events = Events()
    demo = Demo(peers, rounds=rounds, workdir=workdir, on_event=events, envs=envs,
                manifest=(setup / "demo.swarmrun").read_bytes())
    demos.append(demo)
    demo.start()
    summary = demo.wait()
    assert summary["errors"] == [] and summary["finished"] == peers, summary
    # lockstep (sync.follow false): every peer trained every step of its rounds, so two runs
    # differ only by what was averaged
    assert all(demo.summaries[i]["steps_skipped"] == 0 for i in range(peers)), demo.summaries
    return demo, events.drain()


def _setup(tmp_path: Path, **sync) -> Path:
    """A run's manifest and the keys of its peers 0..3, shared by the runs of one test."""
    setup = tmp_path / "setup"
    setup.mkdir()
    # fixed keys: a peer's key picks its data (and the groups' order), so with fresh keys every
    # run of the test trained on other samples and its losses moved by ~1.5% from run to run
    for i in range(4):
        key = setup / f"peer{i}.key"
        key.write_bytes(Identity.from_seed(bytes([i + 1]) * 32).to_libp2p())
        key.chmod(0o600)
    (setup / "demo.swarmrun").write_bytes(_manifest(setup, **sync))
    return setup


def _manifest(setup: Path, **sync) -> bytes:
    # a shorter all-reduce deadline than the demo's 20 s: a round in which a member never
    # joins the group its leader formed (an honest one that distrusts the liar leading it)
    # costs the others 2.5 x that
    # the attacked run is compared with a baseline, so what the lies do not cause must not move
    # the loss: results land at s + tau (sync.late_share 0), not when they come, and no peer
    # follows the others (sync.follow false, lockstep): on a shared machine equal peers that
    # were waited for once followed for a while, skipping steps, and the steps skipped (3-7 of
    # 200 in a baseline, 15-39 beside the liar, with two busy loops) moved the loss by 4%
    return demo_manifest(4, setup / "peer0.key", swarm={"allreduce_timeout_s": 8.0},
                         **{"late_share": 0.0, "follow": False, **sync})


def _leading(setup: Path, peer: int, rounds: int) -> list[tuple[int, int]]:
    """A manifest (written to ``setup``) of a run in which peer ``peer`` ranks first of the four,
    so leads their group, in at least one round after each fragment's first: -> those
    (fragment, round). The ranks follow from the run ID, which the manifest's time changes."""
    keys = [load_or_create_identity(setup / f"peer{i}.key").public_key for i in range(4)]
    for _ in range(1000):
        data = _manifest(setup)
        run_id = open_manifest(data).run_id
        firsts = [(f, r) for f in range(2) for r in range(1, rounds)
                  if min(keys, key=lambda k: rank(round_seed(run_id, f, r), k)) == keys[peer]]
        if firsts:
            (setup / "demo.swarmrun").write_bytes(data)
            return firsts
    raise AssertionError(f"no manifest in 1000 in which peer {peer} leads a round")


def _agreed(seen, honest) -> None:
    shared = shared_landings(seen, honest)
    assert shared, "the honest peers never landed a group together from one copy"
    assert all(len(d) == 1 for d in shared.values()), f"honest members of a group landed different results: {shared}"


HONEST = (0, 1, 2)
COMBINATIONS = {
    # pushes x1000, its reduced part x1000 to everyone, and withheld from one member, whom its
    # report also tells that its pushes were 1000 times smaller than it tells the others: clipped,
    # refused by every member alike (the one withheld from and lied to too, at once, not at the
    # deadline)
    # (a member may ban it first, on the proof another member hands on, before its own screen's
    # distrust: either way it stops grouping with it)
    "lie:push1000+mean1000+withhold+misreport": [(any, "clipped slice"), (any, "reduced part too large"),
                                       (all, ("not grouping with peer={liar}", "banned peer={liar}"))],
    # pushes of 1e30, each 256 elements short and sent with the previous round's, and another
    # mean to one member than to the others: the short chunk, off the grid, drops it at once
    # (the old group's frames are dropped quietly), and its signed means prove it lied to every
    # member, who all fall back on that part and ban it: by the two different means, or by the
    # one sent to a member that its committed inputs cannot give (whichever proof a member
    # checks first: both are sound, and which comes first is a race between the witnesses)
    "lie:push1e30+short+replay+equivocate": [(any, "is not on the run's grid"),
                                             (all, "banned peer={liar} reason=SliceAveraged: ")],
}


@pytest.fixture(scope="module")
def honest_run(tmp_path_factory):
    """The run's setup, and the held-out loss of its three honest peers without the liar: the
    baseline every combination of lies is measured against. A fourth node trains beside them
    in a run of its own, as the liar does beside them in the attacked runs: four nodes share
    the machine's cores in both. The runs are lockstep (``_setup``), so every honest peer
    trains all 200 steps in both and what differs is what was averaged. With followers, the
    steps skipped differed from run to run as well (3-7 of 200 in a baseline, 15-39 beside the
    liar), and the loss by up to +4.9%."""
    root = tmp_path_factory.mktemp("liars")
    setup = _setup(root)
    started: list = []
    beside = root / "beside"
    beside.mkdir()
    try:
        other = Demo(1, rounds=ROUNDS, workdir=beside, manifest=demo_manifest(1, beside / "peer0.key"))
        started.append(other)
        other.start()
        baseline, _ = run(root / "honest", started, 3, setup)
        other.wait()
    finally:
        for d in started:
            for p in d.procs.values():
                kill_process_group(p.pid)
                p.wait()
    return setup, sum(baseline.summaries[i]["heldout_loss"] for i in HONEST) / 3


@pytest.mark.xdist_group("liar_baseline")  # one worker runs the shared baseline, once
@pytest.mark.timeout(600)  # the first also builds the baseline (a run of its own) in its setup
@pytest.mark.parametrize("lies", sorted(COMBINATIONS))
def test_a_node_lying_several_ways_at_once_leaves_the_honest_ones_agreeing_finite_and_within_5pct(
        tmp_path, demos, honest_run, lies):
    """Peer 3 tells ``lies`` every round (see ``COMBINATIONS``). The three honest peers see
    through each, stop grouping with it, and land one result in every group they share. Their
    held-out loss stays finite and at most 5% above that of the same three peers training
    without it (same model, data and keys, lockstep: see ``honest_run``). The issue asks for
    2%, and on average the lies cost less (below), but one run of this setup cannot show it:
    which member index the liar gets in its round-0 groups (so which part of each fragment
    falls back), whom it withholds from, and the group order of the honest rounds differ from
    run to run, and the loss after 10 rounds moves with them. Lockstep, beside two busy
    loops, 7 attacked runs against their baseline: -1.5% to +3.4%, mean -0.03%; the baseline
    alone 2.801 to 2.831. ``bench/liar.py`` (5 quiet pairs, each a run of its own): mean
    +0.93% (95% CI -0.74% to +2.61%), range -0.63% to +2.86%; the two runs of one pair's
    manifest repeat to the last digit.
    Undefended, these lies gave +60% or NaN."""
    setup, base = honest_run
    demo, seen = run(tmp_path / "attacked", demos, 4, setup, envs={3: {"SWARMSTREAM_FAULT": lies}})
    with_liar = [ev for i, ev in seen if i in HONEST and ev.get("event") == "synced" and ev["group_size"] == 4]
    assert with_liar, "the liar was never in a group with the honest peers"
    logs = [(tmp_path / "attacked" / f"peer{i}.log").read_text() for i in HONEST]
    liar = peer_id_from_public_key(load_or_create_identity(setup / "peer3.key").public_key)
    for which, text in COMBINATIONS[lies]:
        texts = [t.format(liar=liar) for t in ((text,) if isinstance(text, str) else text)]
        assert which(any(t in log for t in texts) for log in logs), f"{which.__name__} honest peers should log {texts!r}"
    _agreed(seen, HONEST)
    attacked = [demo.summaries[i]["heldout_loss"] for i in HONEST]
    assert all(math.isfinite(h) and h > 0 for h in attacked), attacked
    mean = sum(attacked) / 3
    print(f"held-out loss after {ROUNDS} rounds ({lies}): honest peers beside the liar {mean:.4f}, without it {base:.4f}")
    assert mean - base <= 0.05 * base, (mean, base)


def test_a_reducer_whose_mean_does_not_follow_from_its_inputs_is_proven_and_banned_by_every_auditor(tmp_path, demos):
    """Peer 3 returns its reduced part negated to everyone, every round: a mean of plausible
    size, which no norm bound catches. In a group of 4 its two witnesses vouch for its own
    slice (``peer.round_witness``), so the screen inside the round refuses the mean on every
    honest member alike (without them it seldom could: ``bench/witness.py``), and audits it. With
    ``sync.audit`` = 0.5 each honest peer also fetches the inputs of half the other reducers'
    means and recomputes them: honest means pass; a peer that proves the liar's mean wrong bans it with the frames
    that prove it saved in its data dir (``bans/<peer>.frames``), stops grouping with it, and
    hands the proof on to the group's other members, who check it and do the same. The honest
    peers land one result in every group they share, and their loss stays finite."""
    honest = HONEST
    setup = _setup(tmp_path, audit=0.5)
    demo, seen = run(tmp_path / "attacked", demos, 4, setup, envs={
        3: {"SWARMSTREAM_FAULT": "lie:negate"}, **{i: {"SWARMSTREAM_LOG": "INFO"} for i in honest}}, rounds=6)
    logs = [(tmp_path / "attacked" / f"peer{i}.log").read_text() for i in honest]
    liar = peer_id_from_public_key(load_or_create_identity(setup / "peer3.key").public_key)
    assert any("audit passed" in text for text in logs), "no honest mean was audited"
    for i, text in zip(honest, logs):
        assert f"banned peer={liar} reason=SliceAveraged: a mean of part" in text, f"peer {i} did not ban the liar"
        assert list((tmp_path / "attacked" / f"peer{i}").rglob(f"bans/{liar}.frames")), f"peer {i} kept no evidence"
    wrong = [line for text in logs for line in text.splitlines() if "signed a wrong mean" in line]
    assert wrong and all(f"reducer={liar}" in line for line in wrong), wrong  # never an honest reducer
    # the screen inside the round refused the negated mean, and never an honest one
    screened = [line for text in logs for line in text.splitlines() if "contributions cannot give" in line]
    assert screened and all(f"reducer={liar}" in line for line in screened), screened
    _agreed(seen, honest)
    attacked = [demo.summaries[i]["heldout_loss"] for i in honest]
    assert all(math.isfinite(h) and h > 0 for h in attacked), attacked
    print(f"held-out loss after 6 rounds beside a negating reducer: {sum(attacked) / 3:.4f}; "
          f"refused in the round {len(screened)} time(s)")


def _banned_by_every_honest_peer(tmp_path: Path, setup: Path, reason: str) -> list[str]:
    """Assert that every honest peer of the attacked run banned peer 3, and only it, for a lie
    whose reason starts with ``reason``, keeping the frames in its data dir. -> their logs."""
    logs = [(tmp_path / "attacked" / f"peer{i}.log").read_text() for i in HONEST]
    liar = peer_id_from_public_key(load_or_create_identity(setup / "peer3.key").public_key)
    for i, text in zip(HONEST, logs):
        assert f"banned peer={liar} reason={reason}" in text, f"peer {i} did not ban the liar"
        assert list((tmp_path / "attacked" / f"peer{i}").rglob(f"bans/{liar}.frames")), f"peer {i} kept no evidence"
    assert not any("banned peer=" in line and liar not in line for text in logs for line in text.splitlines())
    return logs


def test_a_reducer_that_tells_its_witnesses_another_own_slice_than_it_averages_is_proven_and_banned(tmp_path, demos):
    """Peer 3 averages its true own slice, and commits to it in its mean (``SliceAveraged.own``),
    but sends its two witnesses (``protocol.butterfly.witnesses_of``) that slice negated
    (``lie:disown``): what a reducer would do to have its witnesses vouch for a slice that
    makes its lie fit the screen. Each witness holds the reducer's signed mean and its signed
    push of its own part, which contradict each other: proof, which it keeps and hands on. So
    every honest peer bans it, with the frames in its data dir, and vouches for nothing it
    said; the honest peers land one result in every group they share."""
    setup = _setup(tmp_path)
    demo, seen = run(tmp_path / "attacked", demos, 4, setup, envs={3: {"SWARMSTREAM_FAULT": "lie:disown"}}, rounds=4)
    logs = _banned_by_every_honest_peer(tmp_path, setup, "PushSlice: its own slice of part")
    assert any("own slice contradicts its mean" in text for text in logs), "no witness caught the liar"
    _agreed(seen, HONEST)
    assert all(math.isfinite(demo.summaries[i]["heldout_loss"]) for i in HONEST)


def test_a_member_that_tells_members_different_finals_is_proven_by_the_relays_and_banned(tmp_path, demos):
    """Peer 3 tells the member after it in each group that it fell back on every part, and the
    others what it landed (``lie:finals``): different words to different members about what it
    landed. The member lied to relays that final (it names other parts than it landed), and a
    member holding the other final holds proof (two finals the liar signed for one round): it
    bans the liar and hands the pair on, so every honest peer bans it, with the frames in its
    data dir. The honest peers land one result in every group they share."""
    setup = _setup(tmp_path)
    demo, seen = run(tmp_path / "attacked", demos, 4, setup, envs={3: {"SWARMSTREAM_FAULT": "lie:finals"}}, rounds=4)
    _banned_by_every_honest_peer(tmp_path, setup, "PartsHeld: two different finals")
    _agreed(seen, HONEST)
    assert all(math.isfinite(demo.summaries[i]["heldout_loss"]) for i in HONEST)


def test_a_reducer_that_keeps_its_own_slice_from_its_witnesses_has_its_means_audited_and_is_banned(tmp_path, demos):
    """Peer 3 negates its mean and sends its witnesses nothing (``lie:negate+blind``), so none
    can vouch for its own slice and the screen has the room it had before witnesses (in groups
    of 4 a negated mean passes it). With audits off (``sync.audit`` = 0), a witness that got the
    mean and not the own slice audits the part anyway: it proves the mean wrong, bans the liar
    and hands the proof on, so every honest peer bans it. The honest peers land one result in
    every group they share."""
    setup = _setup(tmp_path, audit=0.0)
    demo, seen = run(tmp_path / "attacked", demos, 4, setup, rounds=4, envs={
        3: {"SWARMSTREAM_FAULT": "lie:negate+blind"}, **{i: {"SWARMSTREAM_LOG": "INFO"} for i in HONEST}})
    logs = [(tmp_path / "attacked" / f"peer{i}.log").read_text() for i in HONEST]
    liar = peer_id_from_public_key(load_or_create_identity(setup / "peer3.key").public_key)
    assert any("witnessed part not vouched for" in text for text in logs), "no witness noticed"
    for i, text in zip(HONEST, logs):
        assert f"banned peer={liar} reason=SliceAveraged: a mean of part" in text, f"peer {i} did not ban the liar"
    assert not any("banned peer=" in line and liar not in line for text in logs for line in text.splitlines())
    _agreed(seen, HONEST)
    assert all(math.isfinite(demo.summaries[i]["heldout_loss"]) for i in HONEST)


def test_a_reducer_that_never_shows_its_inputs_is_suspended_by_its_auditors_then_grouped_with_again(tmp_path, demos):
    """Peer 2 averages honestly but answers no audit (``lie:mute``): to its auditors it looks
    like a peer killed right after a round. With ``sync.audit`` = 1 the honest peers audit its
    means; an unanswered audit proves nothing, so each suspends it for ``SUSPEND`` of its own
    syncs (it used to be for good, and a bootstrap peer killed and restarted was then never
    grouped with again) and, after them, groups with it again. Nobody bans it: it told no lie
    anyone can prove. The honest peers land one result in every group they share."""
    setup = _setup(tmp_path, audit=1.0)
    workdir = tmp_path / "run"
    workdir.mkdir()
    for i in range(3):
        shutil.copy(setup / f"peer{i}.key", workdir / f"peer{i}.key")
    liar = peer_id_from_public_key(load_or_create_identity(setup / "peer2.key").public_key)
    events = Events()
    demo = Demo(3, rounds=None, workdir=workdir, on_event=events, manifest=(setup / "demo.swarmrun").read_bytes(),
                envs={2: {"SWARMSTREAM_FAULT": "lie:mute"}, **{i: {"SWARMSTREAM_LOG": "INFO"} for i in (0, 1)}})
    demos.append(demo)
    demo.start()
    judge, ev = events.wait_for(lambda i, ev: i in (0, 1) and ev.get("event") == "suspended", timeout=240)
    assert ev["peer"] == liar and ev["syncs"] == SUSPEND, ev
    syncs_since = []

    def back_in_its_groups(i: int, ev: dict) -> bool:
        if i != judge or ev.get("event") != "synced":
            return False
        syncs_since.append(ev["group_size"])
        return len(syncs_since) > SUSPEND and ev["group_size"] == 3  # the liar is in its groups again

    events.wait_for(back_in_its_groups, timeout=240)
    print(f"peer {judge}'s group sizes from its suspension of the liar until it grouped with it again: {syncs_since}")
    for i in (0, 1):
        text = (workdir / f"peer{i}.log").read_text()
        assert f"banned peer={liar}" not in text and f"reducer={liar}" in text, f"peer {i}: {text[-2000:]}"
    _agreed(events.drain(), (0, 1))


def test_a_ghost_that_joins_every_group_and_sends_nothing_is_waited_for_once_then_briefly(tmp_path, demos):
    """Peer 3 joins every round the honest peers join, follows the group record and then sends
    nothing at all; ranked first, it writes no record (``lie:ghost+nolead``). Nothing it does is
    a proven lie, so nobody bans it; each honest peer waits the push deadline for it once, then
    marks it quiet (``peer.quiet``), and in its later groups with it drops it soon after the
    others pushed, as late. In the rounds it leads, the honest peers go on without it (they
    used to average alone, apart). The honest peers land one result in every group they share."""
    setup = _setup(tmp_path)
    led = _leading(setup, 3, rounds=4)
    demo, seen = run(tmp_path / "attacked", demos, 4, setup, rounds=4,
                     envs={3: {"SWARMSTREAM_FAULT": "lie:ghost+nolead"},
                           **{i: {"SWARMSTREAM_LOG": "INFO"} for i in HONEST}})
    in_led = [ev for i, ev in seen if i in HONEST and ev.get("event") == "synced"
              and (ev["fragment"], ev["round"]) in led]
    assert any(ev["group_size"] == 3 for ev in in_led), (led, in_led)  # not one alone each: together
    assert any("no record of our group's leader by its members' deadlines: leading the rest" in
               (tmp_path / "attacked" / f"peer{i}.log").read_text() for i in HONEST)
    with_ghost = [ev for i, ev in seen if i in HONEST and ev.get("event") == "synced" and ev["group_size"] == 4]
    assert with_ghost, "the ghost was never in a group with the honest peers"
    ghost = peer_id_from_public_key(load_or_create_identity(setup / "peer3.key").public_key)
    texts = [(tmp_path / "attacked" / f"peer{i}.log").read_text() for i in HONEST]
    for i, text in zip(HONEST, texts):  # a whole deadline once
        assert f"reason=timeout:slice not received in time peer={ghost}" in text, f"peer {i}: {text[-2000:]}"
        assert f"banned peer={ghost}" not in text
    # then a short wait (by each peer that had it in a later group: the rounds the ghost leads
    # are averaged without it)
    assert any(f"reason=timeout:slice not received, quiet: silent in our last round with it too peer={ghost}" in text
               for text in texts)
    # a group an honest peer leads once it knows the ghost is quiet gives it no slice
    # (GroupFormed.idle): nothing falls back there; before that the ghost's slice does, and
    # nothing else (the ghost leads no group: it writes no record)
    assert all(ev["fallback"] <= 1 for ev in with_ghost)
    assert any(ev["fallback"] == 0 and ev["dropped"] == 1 for ev in with_ghost), with_ghost
    _agreed(seen, HONEST)


def test_a_member_that_pushes_and_then_falls_silent_is_waited_for_once_then_briefly(tmp_path, demos):
    """Peer 3 pushes its slices and then sends nothing more: no reduced part, no report
    (``lie:hush``). Each honest peer waits the agreement's deadline for its report once, then
    marks it quiet (``peer.quiet``) and in its later groups with it gives its report up soon
    after everyone else's; nobody bans it, and the honest peers end on one state (they compare
    states after each round it was in, which is not agreed)."""
    setup = _setup(tmp_path)
    demo, seen = run(tmp_path / "attacked", demos, 4, setup, rounds=4,
                     envs={3: {"SWARMSTREAM_FAULT": "lie:hush"}, **{i: {"SWARMSTREAM_LOG": "INFO"} for i in HONEST}})
    hush = peer_id_from_public_key(load_or_create_identity(setup / "peer3.key").public_key)
    assert [ev for i, ev in seen if i in HONEST and ev.get("event") == "synced" and ev["group_size"] == 4]
    waived = 0
    for i in HONEST:
        text = (tmp_path / "attacked" / f"peer{i}.log").read_text()
        waived += text.count(f"report not waited for peer={hush} reason=quiet")
        assert f"banned peer={hush}" not in text
    assert waived, "no honest peer ever gave the silent member's report up early"
    _agreed(seen, HONEST)
