"""bench/robust_mean.py runs end to end with every aggregate and liar (tiny sizes: seconds)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_robust_mean_bench_writes_a_row_per_aggregate_and_liar(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "robust_mean.py"), "--steps", "8", "-H", "4",
                           "--batch-size", "2", "--aggregates", "clip1g,clip1,trim,cclip2,gate0", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["commit"] and doc["machine"]["cpus"]
    runs = doc["runs"]
    assert [(r["aggregate"], r["liar"]) for r in runs] == [
        (a, liar) for a in ("clip1g", "clip1", "trim", "cclip2", "gate0") for liar in ("honest", "constant", "negated", "alie", "aimed")]
    assert all(0 < r["heldout_loss"] < 10 for r in runs), runs
    assert all(r["vs_honest"] == 0 for r in runs if r["liar"] == "honest")


def test_robust_mean_bench_refuses_bad_arguments_in_one_line():
    for args, said in ((["--aggregates", "clip0.5"], "unknown aggregate 'clip0.5'"),
                       (["--aggregates", "gate1"], "unknown aggregate 'gate1'"), (["--liars", "loud"], "unknown liar"),
                       (["-H", "2"], "need -H >= 4")):
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "robust_mean.py"), *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and said in proc.stderr, (args, proc.stderr[-500:])
