"""Fixtures of the swarm tests. Each ends what its test started (nodes, their libp2p daemons,
temporary folders) in a finalizer, so a failed test leaves nothing running behind it."""

import shutil
import tempfile
from pathlib import Path

import pytest

from swarm_util import identity_holder, kill_process_group


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed swarm test's report ends with the last lines of each of its demo peers' logs:
    a failure on a CI machine is otherwise all one gets of what the nodes did."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for demo in item.funcargs.get("demos") or ():
        for log in sorted(Path(demo.dir).glob("peer*.log")):
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
            report.sections.append((f"{log} (last {len(lines)} lines)", "\n".join(lines)))


LOG_TAIL = 60


@pytest.fixture
def demos():
    started: list = []  # peer.demo.Demo objects
    yield started
    for d in started:
        for p in d.procs.values():
            kill_process_group(p.pid)  # the node and its libp2p daemon (each node leads its own session)
            p.wait()


@pytest.fixture
def short_tmp():
    """A fresh folder with a short path (unix socket paths are limited to ~100 bytes), removed
    afterwards."""
    path = Path(tempfile.mkdtemp(prefix="ss-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def background_nodes():
    """Identity files of nodes that a test had started detached (``swarmstream join``, the
    dashboard's Runs screen): each such node writes its PID into the lock it holds next to its
    key and leads a session of its own, so whatever still holds one of them is killed with
    its p2pd."""
    identities: list[Path] = []
    yield identities
    for key in identities:
        kill_process_group(identity_holder(key))


@pytest.fixture
def procs():
    """Helper processes started with ``swarm_util.start_process``: told to stop, then ended
    with their libp2p daemons."""
    started: list = []
    yield started
    for _, stop in started:
        stop.set()
    for p, _ in started:
        p.join(15)
        if p.is_alive():
            p.kill()
            p.join(5)
        kill_process_group(p.pid)  # its p2pd (each helper leads its own process group)
