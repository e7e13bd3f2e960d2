"""Hosting and joining a run with the installed ``swarmstream`` command, as two volunteers on
two machines would (each its own SWARMSTREAM_HOME: identity, settings, control socket): run new,
host, join, status, pause, resume, stop. Plus the one-line errors of a join that cannot work."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from protocol import __version__

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

LISTEN = ["--listen", "/ip4/127.0.0.1/tcp/0"]
FAST = ["--preset", "tiny", "-H", "20", "--matchmaking-timeout", "5", "--allreduce-timeout", "20",
        "--heartbeat-interval", "3", "--heartbeat-ttl", "10"]


def script() -> str:
    found = shutil.which("swarmstream", path=str(Path(sys.executable).parent))
    assert found, f"no swarmstream console script beside {sys.executable}; install the package"
    return found


def env_of(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWARMSTREAM_", "XDG_"))}
    return dict(env, SWARMSTREAM_HOME=str(home), OMP_NUM_THREADS="1")


def swarmstream(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([script(), *args], capture_output=True, text=True, env=env_of(home), cwd=home,
                          timeout=timeout, stdin=subprocess.DEVNULL)


class Running:
    """A long-running ``swarmstream`` command; its stderr lines, read as they come."""

    def __init__(self, home: Path, *args: str):
        # as a terminal starts it: Ctrl+C not ignored (a shell's background job, like this test
        # run may be, passes SIGINT on as ignored, and Python then never raises KeyboardInterrupt)
        self.proc = subprocess.Popen([script(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env_of(home), cwd=home, stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.lines.append("<exited>")
            self.cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cond:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    if m := rx.search(line):
                        return m
                seen = len(self.lines)
                if "<exited>" in self.lines or time.monotonic() > deadline:
                    raise AssertionError(f"no line matching {pattern!r}; last lines: {self.lines[-8:]}")
                self.cond.wait(max(0.1, deadline - time.monotonic()))

    def kill(self) -> None:
        # the command's own group, and the node's (a session of its own, with its daemon)
        for group in {self.proc.pid, *children(self.proc.pid)}:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()


def children(pid: int) -> list[int]:
    """The PIDs whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture
def running():
    started: list[Running] = []

    def start(home: Path, *args: str) -> Running:
        r = Running(home, *args)
        started.append(r)
        return r

    yield start
    for r in started:
        r.kill()
        # shown with a failure: what each command said last (the other side of a failed wait)
        print(f"--- {' '.join(r.proc.args[1:3])}: last lines ---", *r.lines[-40:], sep="\n")


def status(home: Path) -> dict:
    out = swarmstream(home, "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_status(home: Path, cond, what: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while not cond(st := status(home)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}; status {st}"
        time.sleep(0.5)
    return st


def one_line_error(out: subprocess.CompletedProcess) -> str:
    lines = [line for line in out.stderr.splitlines() if line.startswith("swarmstream: error:")]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return lines[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """The samples a Prometheus server would read from ``port``: ``name{labels}`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


def host_peer(host: Running) -> str:
    """The host's peer ID, from the address it prints."""
    return next(m.group(1) for line in host.lines if (m := re.search(r"/p2p/(\w+)'", line)))


def test_host_join_status_pause_resume_stop_with_two_identities(short_tmp, running):
    # short: the control sockets under each home (xdist's popen-gwN/ lengthens tmp_path)
    host_home, joiner_home = short_tmp / "host", short_tmp / "joiner"
    host_home.mkdir()
    joiner_home.mkdir()
    new = swarmstream(host_home, "run", "new", "--name", "two machines", *FAST, "--out", "run.swarmrun")
    assert new.returncode == 0, new.stderr
    assert "swarmstream host run.swarmrun" in new.stdout  # run new says what to do next

    # the operator's Prometheus endpoint, on (the setting is read at start)
    port = free_port()
    (host_home / "config").mkdir()
    (host_home / "config" / "settings.toml").write_text(f"[metrics]\nport = {port}\n")
    host = running(host_home, "host", "run.swarmrun", "--headless", *LISTEN)
    address = host.wait_for(r"swarmstream join '(swarmstream:[^']+)'", timeout=120).group(1)

    # a run ID that nobody serves, through the same peer: refused in one line
    other = "swarmstream:" + "a" * 32 + address[address.index("@"):]
    err = one_line_error(swarmstream(joiner_home, "join", other, "--headless", *LISTEN))
    assert "no peer holds the manifest" in err

    joiner = running(joiner_home, "join", address, "--headless", *LISTEN)
    joiner.wait_for(r"fragment \d round +\d+ .* ok$", timeout=180)  # averaged with the host
    with joiner.cond:  # a sync before its first measured step shows no loss, not 'nan'
        assert not [ln for ln in joiner.lines if "train_loss" in ln and "nan" in ln.lower()], joiner.lines
    # the peers table comes from heartbeats in the DHT; on a loaded machine one can lapse for a moment
    st = wait_status(joiner_home, lambda s: s["peers"] == 2, "the host in the joiner's peers")
    assert st["state"] in ("training", "averaging", "syncing") and st["join_address"]

    run_id = address.split(":")[1].split("@")[0]
    # the host's, after it averaged with the joiner; its peers gauge, like the joiner's
    # peers table, comes from heartbeats, which can lapse for a moment on a loaded machine
    deadline = time.monotonic() + 120
    while (metrics := scrape(port))["swarmstream_peers"] < 1:
        assert time.monotonic() < deadline, f"the host never counted the joiner among its peers: {metrics}"
        time.sleep(0.5)
    assert metrics[f'swarmstream_node_info{{client="swarmstream/{__version__}",peer="{host_peer(host)}",run="{run_id}"}}'] == 1
    assert metrics['swarmstream_syncs_total{outcome="ok"}'] >= 1 and metrics["swarmstream_tokens_total"] > 0
    assert metrics['swarmstream_bytes_total{direction="sent"}'] > 0
    assert metrics["swarmstream_train_loss"] > 0 and metrics["swarmstream_banned_peers"] == 0
    assert metrics['swarmstream_audits_total{verdict="wrong"}'] == 0  # honest means are never proven wrong

    paused = swarmstream(joiner_home, "pause")
    assert paused.returncode == 0 and paused.stdout.startswith("paused"), paused.stdout + paused.stderr
    assert status(joiner_home)["state"] == "paused"  # pause returned only once the node had paused
    resumed = swarmstream(joiner_home, "resume")
    assert resumed.returncode == 0 and "resuming" in resumed.stdout
    wait_status(joiner_home, lambda s: s["state"] != "paused", "the resume")

    for home in (joiner_home, host_home):
        stop = swarmstream(home, "stop", "--wait", timeout=180)
        assert stop.returncode == 0 and stop.stdout.strip().endswith("stopped"), stop.stderr
    for proc in (joiner, host):
        assert proc.proc.wait(60) == 0, proc.lines[-5:]
        summary = json.loads(proc.proc.stdout.read().strip().splitlines()[-1])
        assert summary["syncs"] > summary["syncs_alone"] and summary["heldout_loss"] > 0


def test_a_join_that_cannot_work_says_why_in_one_line(tmp_path):
    home = tmp_path / "v"
    home.mkdir()
    address = "swarmstream:" + "b" * 32 + "@/ip4/127.0.0.1/tcp/9/p2p/12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"
    # an identity path that is a folder, and a key file that is not a key
    (home / "keydir").mkdir()
    err = one_line_error(swarmstream(home, "join", address, "--headless", "--identity", "keydir", *LISTEN))
    assert "not a regular file" in err
    (home / "bad.key").write_bytes(b"not a key")
    (home / "bad.key").chmod(0o600)
    err = one_line_error(swarmstream(home, "join", address, "--headless", "--identity", "bad.key", *LISTEN))
    assert "not a usable swarmstream key" in err
    # nobody listens at the bootstrap address
    err = one_line_error(swarmstream(home, "join", address, "--headless", *LISTEN))
    assert "bootstrap peers" in err
    # a manifest file that is not one
    (home / "junk.swarmrun").write_bytes(b"\x00" * 100)
    out = swarmstream(home, "host", "junk.swarmrun", "--headless", *LISTEN)
    assert "junk.swarmrun" in one_line_error(out)


def test_a_second_ctrl_c_stops_the_node_at_once_in_one_line(short_tmp, running):
    home = short_tmp / "v"
    home.mkdir()
    assert swarmstream(home, "run", "new", "--name", "ctrl-c", *FAST, "--out", "r.swarmrun").returncode == 0
    host = running(home, "host", "r.swarmrun", "--headless", *LISTEN)
    # no status request fails while the node starts: from the moment its control socket opens
    # (before its network is up) until it trains
    from peer.paths import control_path
    from protocol.messages_control import GetStatus
    from tui.control_client import ControlError, call

    os.environ["SWARMSTREAM_HOME"], saved = str(home), os.environ.get("SWARMSTREAM_HOME")
    try:
        sock = control_path()
    finally:
        os.environ.pop("SWARMSTREAM_HOME") if saved is None else os.environ.__setitem__("SWARMSTREAM_HOME", saved)
    answered: list[str] = []
    deadline = time.monotonic() + 180
    while not answered or answered[-1] not in ("training", "averaging"):
        assert time.monotonic() < deadline and host.proc.poll() is None, f"states seen {answered[-5:]}"
        if not sock.exists():
            continue
        try:
            answered.append(call(sock, GetStatus).state)
        except ControlError as e:
            # only not being able to connect yet is fine (the socket file is there a moment early)
            assert str(e).startswith("cannot reach the node"), f"a status request failed: {e}"
    assert answered[0] in ("joining", "syncing", "training", "averaging")
    host.wait_for(r"fragment \d round", timeout=180)  # training
    os.killpg(host.proc.pid, signal.SIGINT)  # as a terminal's Ctrl+C: to the command's process group
    host.wait_for(r"stopping after this step", timeout=60)  # the node heard the first
    os.killpg(host.proc.pid, signal.SIGINT)
    assert host.proc.wait(60) == 130, host.lines[-12:]
    text = "\n".join(host.lines)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


def test_the_installed_headless_demo_trains_and_agrees(tmp_path):
    out = swarmstream(tmp_path, "demo", "--peers", "2", "--rounds", "1", "--headless", "--workdir", "demo",
                      timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["finished"] == 2 and summary["errors"] == [] and summary["rounds"] >= 1


def test_a_corrupt_checkpoint_is_refused_in_one_line_and_kept(tmp_path):
    """step = -5 in the only checkpoint: the node says so in one line (exit 2) and leaves the
    folder as it was, for the volunteer to inspect or move aside."""
    import torch

    from peer.checkpoint import save_checkpoint
    from peer.data import ShardSampler
    from peer.worker import Worker
    from protocol.manifest import open_manifest

    home = tmp_path / "v"
    home.mkdir()
    assert swarmstream(home, "run", "new", "--name", "ckpt", *FAST, "--out", "r.swarmrun").returncode == 0
    signed = open_manifest((home / "r.swarmrun").read_bytes())
    train = signed.manifest.train
    worker = Worker(train)
    sampler = ShardSampler(torch.arange(10_000) % 256, train.model.seq_len, train.inner.batch_size, 0, b"k")
    ckpt = home / "runs" / signed.run_id_text / "checkpoint"
    save_checkpoint(ckpt, worker, sampler, run_id=signed.run_id, rounds=[0] * train.sync.fragments)
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps(dict(meta, step=-5)))
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}

    out = swarmstream(home, "host", "r.swarmrun", "--headless", "--data-dir", "runs", *LISTEN)
    err = one_line_error(out)
    assert "checkpoint" in err and "step" in err, err
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
