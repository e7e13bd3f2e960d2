"""bench/audit_cost.py runs end to end (a small part: seconds): colluders on the gate's line make
the audit try more sets, the honest mean still passes and the negated one is still proven."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_audit_cost_bench_times_honest_and_negated_audits_with_and_without_colluders(tmp_path):
    out = tmp_path / "a.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "audit_cost.py"), "--elements", "16384", "--members", "6",
                           "--repeats", "1", "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["commit"] and doc["machine"]["cpus"]
    rows = {(r["colluders"], r["mean"]): r for r in doc["rows"]}
    assert set(rows) == {(0, "honest"), (0, "negated"), (4, "honest"), (4, "negated")}
    assert all(r["verdict"] == ("ok" if r["mean"] == "honest" else "wrong") for r in rows.values()), rows
    assert rows[(0, "honest")]["sets"] == 1 and rows[(4, "negated")]["sets"] > 1  # 4 on the line, 2 may go: 11 sets


def test_audit_cost_bench_refuses_bad_arguments_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "audit_cost.py"), "--members", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--members must be in 3..64" in proc.stderr, proc.stderr[-500:]
