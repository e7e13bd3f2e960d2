"""``swarmstream doctor`` on this machine: real probes (torch, the bundled p2pd, a daemon started
for the reachability check), with the volunteer's files under a temporary SWARMSTREAM_HOME."""

import json

from tui.cli import main
from tui.doctor import classify


def run_doctor(capsys, *flags):
    code = main(["doctor", "--json", *flags])
    return code, {c["name"]: c for c in json.loads(capsys.readouterr().out)}


def test_a_healthy_machine_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SWARMSTREAM_HOME", str(tmp_path))
    code, checks = run_doctor(capsys)
    assert code == 0
    assert checks["python"]["level"] == checks["torch"]["level"] == checks["libp2p daemon"]["level"] == "ok"
    assert checks["reachability"]["level"] in ("ok", "warn")  # a daemon started; direct or behind NAT
    assert "will be created" in checks["identity"]["detail"]
    assert not (tmp_path / "data" / "identity.key").exists()  # the doctor creates nothing


def test_bad_files_fail_with_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SWARMSTREAM_HOME", str(tmp_path))
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "settings.toml").write_text('[compute]\ndevice = "gpu"\n')
    (tmp_path / "data").mkdir()
    key = tmp_path / "data" / "identity.key"
    key.write_bytes(b"x" * 68)
    key.chmod(0o644)
    code, checks = run_doctor(capsys, "--offline")
    assert code == 1
    assert checks["settings"]["level"] == "FAIL" and "compute.device" in checks["settings"]["detail"]
    assert checks["identity"]["level"] == "FAIL" and "chmod 600" in checks["identity"]["hint"]
    assert "reachability" not in checks
    assert (tmp_path / "config" / "settings.toml").read_text() == '[compute]\ndevice = "gpu"\n'  # untouched


def test_reachability_is_read_from_the_visible_addresses():
    assert classify(["/ip4/127.0.0.1/tcp/1", "/ip4/192.168.1.5/tcp/1"]) == ("behind NAT", "")
    assert classify(["/ip4/10.0.0.2/tcp/1", "/ip4/203.0.113.7/tcp/4001"])[0] == "behind NAT"  # TEST-NET
    assert classify(["/ip4/8.8.8.8/tcp/4001/p2p/x"]) == ("direct", "8.8.8.8")
    assert classify(["/ip6/2001:4860::1/tcp/1"]) == ("direct", "2001:4860::1")
