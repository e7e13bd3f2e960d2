"""A run on a Hugging Face dataset saved to disk (no hub access): ``swarmstream run new
--dataset hf:FOLDER --shards 2`` fingerprints it into the manifest; two whole nodes read
different shards of it and land one average; a node whose copy of the data differs refuses to
start, in one line."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from peer.demo import Demo, DemoError
from peer.identity_store import load_or_create_identity
from peer.sources import shard_of
from swarm_util import Events, shared_landings

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

SEED = 7


def save_dataset(path: Path, tag: str) -> None:
    import datasets

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rows = [f"{tag} {i}: " + " ".join(words[(i * k) % len(words)] for k in range(40 + i % 30)) for i in range(600)]
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(path)


def identities_on_two_shards(workdir: Path) -> None:
    """peer0.key and peer1.key whose workers read different shards (a new key until they do)."""
    first = shard_of(load_or_create_identity(workdir / "peer0.key").public_key, SEED, 2)
    for _ in range(64):
        key = workdir / "peer1.key"
        key.unlink(missing_ok=True)
        if shard_of(load_or_create_identity(key).public_key, SEED, 2) != first:
            return
    pytest.fail("64 keys in a row landed on one shard of two")


def test_a_run_on_a_saved_dataset_shards_it_and_refuses_a_different_copy(tmp_path, demos):
    data = tmp_path / "ds"
    save_dataset(data, "doc")
    work = tmp_path / "run"
    work.mkdir()
    identities_on_two_shards(work)
    manifest = tmp_path / "hf.swarmrun"
    script = shutil.which("swarmstream", path=str(Path(sys.executable).parent))
    out = subprocess.run([script, "run", "new", "--name", "hf data", "--dataset", f"hf:{data}", "--shards", "2",
                          "--seed", str(SEED), "--heldout-fraction", "0.05", "-H", "20", "--matchmaking-timeout", "5",
                          "--allreduce-timeout", "20", "--heartbeat-interval", "3", "--heartbeat-ttl", "10",
                          "--identity", str(work / "peer0.key"), "--out", str(manifest)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"data +hf:.* \(2 shards; fingerprint hf-disk:\w+", out.stdout), out.stdout

    events = Events()
    demo = Demo(2, rounds=3, workdir=work, on_event=events, manifest=manifest.read_bytes(),
                envs={i: {"SWARMSTREAM_LOG": "INFO"} for i in range(2)})
    demos.append(demo)
    demo.start()
    summary = demo.wait()
    assert summary["errors"] == [] and summary["finished"] == 2, summary
    shards = [re.findall(r"corpus source=hf:\S+ shard=(\d)/2", (work / f"peer{i}.log").read_text()) for i in range(2)]
    assert sorted(s[0] for s in shards if s) == ["0", "1"], shards  # each read its own shard
    shared = shared_landings(events.drain(), (0, 1))
    assert shared and all(len(d) == 1 for d in shared.values()), shared

    # the same folder, other rows: another volunteer's copy that is not the run's
    shutil.rmtree(data)
    save_dataset(data, "other")
    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(work / "peer1.key", again / "peer0.key")
    late = Demo(1, rounds=1, workdir=again, manifest=manifest.read_bytes())
    demos.append(late)
    try:
        late.start()
        late.wait()
    except DemoError:
        pass  # it exited before it listened
    log = (again / "peer0.log").read_text()
    errors = [ln for ln in log.splitlines() if ln.startswith("swarmstream: error:")]
    assert len(errors) == 1 and "not the run's data" in errors[0], log[-2000:]
    assert late.procs[0].returncode == 2
