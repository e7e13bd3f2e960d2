"""``swarmstream demo``: a small local swarm, N real peers on 127.0.0.1.

Each peer is its own process (``python -m peer.node``) with its own identity, libp2p daemon
and checkpoint folder under a temporary directory. Peer 0 creates the run from a manifest
(tiny preset, ``stdlib`` corpus, Streaming DiLoCo); the others join by its run address, as a
volunteer would. Every node prints JSON lines; the demo relays progress and, with
``rounds``, collects each node's summary into one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any
from pathlib import Path
from collections.abc import Callable

from peer.identity_store import load_or_create_identity
from peer.launch import child_cwd, child_env, module_command
from peer.settings_store import save_settings
from protocol.config import DataConfig, InnerConfig, SyncConfig, TrainConfig, model_preset
from protocol.manifest import RunAddress, RunManifest, SwarmConfig, open_manifest, sign_manifest
from protocol.settings import ClientSettings, Settings

LOCALHOST = "/ip4/127.0.0.1/tcp/0"


class DemoError(Exception):
    """A demo peer failed to start or exited with an error."""


def demo_manifest(peers: int, identity_path: Path, swarm: dict[str, Any] | None = None, **sync: Any) -> bytes:
    """The demo run: tiny preset, stdlib text, Streaming DiLoCo with short rounds and deadlines
    (``sync``, ``swarm``: other SyncConfig and SwarmConfig fields, for tests)."""
    ident = load_or_create_identity(identity_path)
    sync = {"inner_steps": 20, "fragments": 2, "overlap": 1, "alpha": 0.5, "codec": "fp4", **sync}
    train = TrainConfig(model=model_preset("tiny"), data=DataConfig(source="stdlib"),
                        inner=InnerConfig(lr=3e-3, warmup_steps=20, total_steps=2000, batch_size=8),
                        sync=SyncConfig(**sync))
    swarm_config = SwarmConfig(**{"group_size": 8, "matchmaking_timeout_s": 5.0, "allreduce_timeout_s": 20.0,
                                  "heartbeat_interval_s": 3.0, "heartbeat_ttl_s": 10.0, **(swarm or {})})
    manifest = RunManifest(name="local demo", description=f"{peers} peers on this machine", train=train,
                           swarm=swarm_config, creator=ident.public_key, created_at=time.time())
    return sign_manifest(manifest, ident)


class Demo:
    def __init__(self, peers: int, rounds: int | None, workdir: Path | None = None,
                 on_event: Callable[[int, dict], None] | None = None, checkpoint_every_s: float = 120.0,
                 envs: dict[int, dict[str, str]] | None = None, listen: dict[int, str] | None = None,
                 manifest: bytes | None = None, device: str = "cpu",
                 launcher: dict[int, list[str]] | None = None, args: dict[int, list[str]] | None = None):
        if peers < 1:
            raise DemoError("a demo needs at least one peer")
        self.peers, self.rounds, self.checkpoint_every_s = peers, rounds, checkpoint_every_s
        self.envs = envs or {}  # per-peer extra environment (fault injection in tests)
        self.listen = listen or {}  # per-peer listen multiaddr (default 127.0.0.1, any port)
        self.manifest, self.device = manifest, device  # another run than the demo's (benchmarks)
        self.launcher = launcher or {}  # per-peer command prefix, e.g. ["ip", "netns", "exec", "ss3"]
        self.args = args or {}  # per-peer extra node flags, e.g. ["--reachability", "private"]
        self.dir = Path(workdir).resolve() if workdir else Path(tempfile.mkdtemp(prefix="swarmstream-demo-"))
        self.on_event = on_event or (lambda i, ev: None)
        self.procs: dict[int, subprocess.Popen] = {}
        self.readers: list[threading.Thread] = []
        self.summaries: dict[int, dict] = {}
        self.landed: dict[int, dict[tuple[int, int], str]] = {}  # peer -> (fragment, round) -> digest
        self.errors: dict[int, str] = {}
        self._listening = threading.Event()
        self._first_maddrs: list[str] = []
        self.bootstrap: list[str] = []
        """Peer 0's multiaddrs once started: a way into the demo's swarm (listing its run, joining)."""

    def _spawn(self, i: int, source: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen:
        # N peers share the cores: one torch thread each
        env = child_env(OMP_NUM_THREADS="1", **(env_extra or {}))
        cmd = [*self.launcher.get(i, []), *module_command("peer.node"), *source,
               "--identity", str(self.dir / f"peer{i}.key"),
               "--data-dir", str(self.dir / f"peer{i}"), "--listen", self.listen.get(i, LOCALHOST),
               "--device", self.device]
        cmd += ["--checkpoint-every", str(self.checkpoint_every_s)]
        # each peer has its own control socket (the dashboard attaches to one) and settings; the
        # demo trains on this machine only, so there is nothing for the volunteer to confirm
        settings = self.dir / f"peer{i}.toml"
        if not settings.exists():
            save_settings(settings, Settings(client=ClientSettings(confirmed=True)))
        cmd += ["--control", str(self.control_path(i)), "--settings", str(settings)]
        if i < self.peers:  # the peers that start together wait for each other; later ones join a live run
            cmd += ["--min-peers", str(self.peers)]
        if self.rounds is not None:
            cmd += ["--rounds", str(self.rounds)]
        cmd += self.args.get(i, [])
        log = open(self.dir / f"peer{i}.log", "ab")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env,
                                cwd=child_cwd(self.dir), start_new_session=True)  # Ctrl+C reaches the demo, which stops peers in order
        self.procs[i] = proc
        reader = threading.Thread(target=self._read, args=(i, proc), daemon=True)
        reader.start()
        self.readers.append(reader)
        return proc

    def control_path(self, i: int) -> Path:
        return self.dir / f"peer{i}.sock"

    def _read(self, i: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") == "listening" and i == 0:
                self._first_maddrs = list(ev.get("maddrs", []))
                self._listening.set()
            elif ev.get("event") == "summary":
                self.summaries[i] = ev
            elif ev.get("event") == "synced":
                self.landed.setdefault(i, {})[(ev["fragment"], ev["round"])] = ev["digest"]
            self.on_event(i, ev)
        code = proc.wait()
        if code != 0 and i not in self.summaries and code != -signal.SIGKILL:
            self.errors[i] = f"peer {i} exited with code {code}; see {self.dir / f'peer{i}.log'}"
        if i == 0:
            self._listening.set()

    def start(self) -> None:
        manifest_path = self.dir / "demo.swarmrun"
        manifest_path.write_bytes(self.manifest or demo_manifest(self.peers, self.dir / "peer0.key"))
        run_id = open_manifest(manifest_path.read_bytes()).run_id
        self._spawn(0, ["--manifest", str(manifest_path)], self.envs.get(0))
        if not self._listening.wait(90) or not self._first_maddrs:
            raise DemoError(self.errors.get(0, f"peer 0 did not start; see {self.dir / 'peer0.log'}"))
        self.bootstrap = list(self._first_maddrs)
        self.address = str(RunAddress(run_id, tuple(self.bootstrap[:1])))
        for i in range(1, self.peers):
            self._spawn(i, ["--address", self.address], self.envs.get(i))

    def add_peer(self, i: int | None = None, env: dict[str, str] | None = None) -> int:
        """Start peer ``i`` (a new one by default, or a killed one again with its identity and
        checkpoints) joining by the run address."""
        i = len(self.procs) if i is None else i
        self.summaries.pop(i, None)
        self._spawn(i, ["--address", self.address], env)
        return i

    def kill(self, i: int) -> None:
        """kill -9 peer ``i`` and its libp2p daemon."""
        os.killpg(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait()

    def wait(self) -> dict:
        """Wait for every peer to exit; return the one-line summary of the swarm."""
        for p in self.procs.values():
            p.wait()
        for reader in self.readers:  # each reads its peer's stdout to EOF
            reader.join(10)
        s = [self.summaries[i] for i in sorted(self.summaries)]
        if len(s) == len(self.procs) and s and len({x["global_digest"] for x in s}) == 1:
            agree, agreed_round = True, min(x["rounds"] for x in s)  # the final copies, repairs included
        else:  # stopped at different points (Ctrl+C): compare where all of them were
            agree, agreed_round = self._agreement()
        return {
            "peers": len(self.procs), "finished": len(s), "rounds": min((x["rounds"] for x in s), default=0),
            "heldout_loss": round(sum(x["heldout_loss"] for x in s) / len(s), 4) if s else None,
            "bytes_sent_per_peer": int(sum(x["bytes_sent"] for x in s) / len(s)) if s else 0,
            "syncs_alone": sum(x["syncs_alone"] for x in s),
            "dropped_peers": sum(x["dropped_peers"] for x in s),
            "global_copies_agree": agree, "compared_at_round": agreed_round,
            "errors": [self.errors[i] for i in sorted(self.errors)],
            "workdir": str(self.dir),
        }

    def _agreement(self) -> tuple[bool, int | None]:
        """Whether every peer held the same global copy of every fragment at the newest round
        that all of them landed (peers stopped by Ctrl+C stop at different rounds, so their
        final copies may differ by a round), and that round (None: no common round)."""
        if len(self.landed) < len(self.procs) or not self.landed:
            return False, None
        common = set.intersection(*(set(d) for d in self.landed.values()))
        fragments = {f for f, _ in common}
        full = [r for r in {r for _, r in common} if all((f, r) in common for f in fragments)]
        if not full:
            return False, None
        r = max(full)
        return all(len({d[(f, r)] for d in self.landed.values()}) == 1 for f in fragments), r

    def stop(self, timeout: float = 20.0) -> None:
        """Ask every peer to finish (SIGINT), then kill what is left after ``timeout``."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
