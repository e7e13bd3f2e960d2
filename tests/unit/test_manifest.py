"""Run manifests, run IDs, run addresses and ``swarmstream run new``."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.config import DataConfig, SyncConfig, TrainConfig
from protocol.envelope import VerificationError, seal
from protocol.errors import ConfigError, RemoteProtocolError
from protocol.identity import Identity
from protocol.manifest import (
    InvalidAddress, RunAddress, RunIdMismatch, RunManifest, SwarmConfig, format_run_id, open_manifest,
    parse_run_address, parse_run_id, run_id_of, sign_manifest,
)
from protocol.messages import InvalidMessage, encode
from tui.run_command import add_run_parser

ALICE = Identity.from_seed(bytes(range(32)))
MALLORY = Identity.from_seed(bytes(range(1, 33)))
fast = settings(max_examples=30, deadline=None)


def manifest(**change) -> RunManifest:
    base = dict(name="tiny stdlib", description="Byte-level tiny model\non the stdlib.", train=TrainConfig(),
                swarm=SwarmConfig(), creator=ALICE.public_key, created_at=1_700_000_000.0)
    return RunManifest(**{**base, **change})


manifests = st.builds(
    lambda name, desc, seed, h, group, t: manifest(
        name=name, description=desc, created_at=t, train=TrainConfig(data=DataConfig(seed=seed),
                                                                     sync=SyncConfig(inner_steps=h)),
        swarm=SwarmConfig(group_size=group)),
    st.text(st.characters(whitelist_categories=("L", "N", "Zs")), min_size=1, max_size=20),
    st.text(st.characters(whitelist_categories=("L", "N", "P", "Zs")), max_size=80),
    st.integers(0, 2**40), st.integers(1, 10_000), st.integers(2, 64), st.floats(0, 4e9))


# ---------------------------------------------------------------------------------------
# SwarmConfig.


def test_swarm_defaults_are_valid_and_bad_values_name_the_field():
    SwarmConfig()
    for bad, field in [(dict(group_size=1), "group_size"), (dict(allreduce_timeout_s=0.0), "allreduce_timeout_s"),
                       (dict(matchmaking_timeout_s=float("nan")), "matchmaking_timeout_s"),
                       (dict(heartbeat_interval_s=30.0, heartbeat_ttl_s=45.0), "heartbeat_ttl_s"),
                       (dict(state_chunk_bytes=10), "state_chunk_bytes")]:
        with pytest.raises(ConfigError, match=field):
            SwarmConfig(**bad)
    for clip in (0.5, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="sync.clip"):
            SyncConfig(clip=clip)
    assert SyncConfig(clip=0.0).clip == 0.0 and SyncConfig().clip == 1.0


# ---------------------------------------------------------------------------------------
# Run IDs and signed manifests.


@fast
@given(manifests)
def test_signed_manifests_open_and_hash_to_their_run_id(m):
    wire = sign_manifest(m, ALICE)
    opened = open_manifest(wire)
    assert opened.manifest == m
    assert opened.run_id == run_id_of(encode(m))
    assert open_manifest(wire, run_id=opened.run_id_text.upper()).run_id == opened.run_id
    assert len(opened.run_id_text) == 32 and opened.run_id_text.isalnum()


@fast
@given(manifests, manifests)
def test_a_manifest_that_does_not_hash_to_its_id_is_rejected(a, b):
    if encode(a) == encode(b):
        return
    with pytest.raises(RunIdMismatch):
        open_manifest(sign_manifest(b, ALICE), run_id=run_id_of(encode(a)))


def test_a_validly_resigned_edit_is_another_run():
    original = manifest()
    edited = dataclasses.replace(original, swarm=SwarmConfig(group_size=16))
    run_id = open_manifest(sign_manifest(original, ALICE)).run_id
    with pytest.raises(RunIdMismatch, match="altered"):
        open_manifest(sign_manifest(edited, ALICE), run_id=run_id)


def test_the_encoding_is_canonical():
    assert encode(manifest()) == encode(manifest())
    assert run_id_of(encode(manifest())) != run_id_of(encode(manifest(created_at=1_700_000_001.0)))


def test_only_the_creator_can_sign_a_manifest():
    with pytest.raises(Exception, match="creator"):
        sign_manifest(manifest(), MALLORY)
    with pytest.raises(VerificationError, match="other than its creator"):
        open_manifest(seal(manifest(), MALLORY))


def test_manifest_bit_flips_are_rejected():
    wire = sign_manifest(manifest(), ALICE)
    for i in range(0, len(wire), 7):
        flipped = bytearray(wire)
        flipped[i] ^= 0x10
        with pytest.raises(RemoteProtocolError):
            open_manifest(bytes(flipped))


def test_manifest_limits_apply_to_local_construction_too():
    with pytest.raises(InvalidMessage, match="name"):
        manifest(name="")
    with pytest.raises(InvalidMessage, match="data.source"):
        manifest(train=TrainConfig(data=DataConfig(source="evil\x1b[2J")))


@fast
@given(st.binary(min_size=20, max_size=20))
def test_run_ids_round_trip(raw):
    text = format_run_id(raw)
    assert parse_run_id(text) == raw == parse_run_id(f"  {text.upper()}\n")


@pytest.mark.parametrize("text", ["", "abc", "0" * 32, "a" * 31, "a" * 33, "8" * 32])
def test_bad_run_ids_are_refused(text):
    with pytest.raises(InvalidAddress):
        parse_run_id(text)


# ---------------------------------------------------------------------------------------
# Addresses.

maddr = st.builds(
    lambda host, port, seed: f"{host}/tcp/{port}/p2p/{Identity.from_seed(seed).peer_id}",
    st.sampled_from(["/ip4/203.0.113.7", "/ip6/::1", "/dns4/boot.example.org", "/ip4/10.0.0.2"]),
    st.integers(1, 65535), st.binary(min_size=32, max_size=32))


@fast
@given(st.binary(min_size=20, max_size=20), st.lists(maddr, max_size=4))
def test_addresses_round_trip(run_id, bootstrap):
    address = RunAddress(run_id, tuple(bootstrap))
    text = str(address)
    assert text.startswith("swarmstream:") and " " not in text
    assert parse_run_address(text) == address
    assert parse_run_address(f" {text} ") == address


def test_address_forms_a_volunteer_may_paste():
    run_id = bytes(range(20))
    bare = format_run_id(run_id)
    peer = f"/ip4/1.2.3.4/tcp/31337/p2p/{ALICE.peer_id}"
    assert parse_run_address(bare) == RunAddress(run_id)
    assert parse_run_address(f"swarmstream://{bare}@{peer}") == RunAddress(run_id, (peer,))
    for bad in [f"{bare}@", f"{bare}@/ip4/1.2.3.4/tcp/31337", f"{bare}@1.2.3.4:31337", "swarmstream:nope"]:
        with pytest.raises(InvalidAddress):
            parse_run_address(bad)


# ---------------------------------------------------------------------------------------
# swarmstream run new / show.


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="swarmstream")
    add_run_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_run_new_writes_a_signed_manifest_and_prints_its_id(tmp_path, capsys):
    key, out = tmp_path / "id.key", tmp_path / "run.swarmrun"
    code = _cli(["run", "new", "--name", "demo", "--preset", "small", "-H", "100", "-P", "4", "--tau", "2",
                 "--alpha", "0.5", "--codec", "fp4", "--group-size", "4", "--lr", "1e-3", "--outer-lr", "0.5",
                 "--seed", "7", "--lockstep", "--identity", str(key), "--out", str(out), "--created-at", "1700000000"])
    printed = capsys.readouterr().out
    assert code == 0
    opened = open_manifest(out.read_bytes())
    m = opened.manifest
    sync = m.train.sync
    assert (sync.inner_steps, sync.fragments, sync.overlap, sync.alpha, sync.codec, sync.follow, sync.gate) == (
        100, 4, 2, 0.5, "fp4", False, True)
    assert (m.train.inner.lr, m.train.outer.lr, m.train.data.seed, m.swarm.group_size) == (1e-3, 0.5, 7, 4)
    assert m.creator == Identity.from_libp2p(key.read_bytes()).public_key
    assert opened.run_id_text in printed and f"swarmstream host {out}" in printed  # what to do next
    assert _cli(["run", "show", str(out), "--run-id", opened.run_id_text]) == 0
    shown = capsys.readouterr().out
    assert "demo" in shown and "lockstep" in shown and "gate=on" in shown
    plain = tmp_path / "plain.swarmrun"
    assert _cli(["run", "new", "--name", "plain", "--no-gate", "--identity", str(key), "--out", str(plain)]) == 0
    assert open_manifest(plain.read_bytes()).manifest.train.sync.gate is False


@pytest.mark.parametrize("flags, reason", [
    (["-P", "0"], "sync.fragments"),
    (["-H", "8", "-P", "4", "--tau", "2"], "overlap"),
    (["--bootstrap", "/ip4/1.2.3.4/tcp/1"], "bootstrap multiaddr"),
    (["--name", ""], "name"),
    (["--mode", "ddp"], "every inner step"),  # a swarm run is never data-parallel
])
def test_run_new_refuses_bad_values_in_one_line(tmp_path, capsys, flags, reason):
    out = tmp_path / "run.swarmrun"
    code = _cli(["run", "new", "--name", "x", "--identity", str(tmp_path / "id.key"), "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert code == 2 and reason in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_run_new_does_not_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "run.swarmrun"
    out.write_bytes(b"keep")
    argv = ["run", "new", "--name", "x", "--identity", str(tmp_path / "id.key"), "--out", str(out)]
    assert _cli(argv) == 2 and "--force" in capsys.readouterr().err
    assert out.read_bytes() == b"keep"
    assert _cli([*argv, "--force"]) == 0


def test_run_show_rejects_a_tampered_file(tmp_path, capsys):
    out = tmp_path / "run.swarmrun"
    assert _cli(["run", "new", "--name", "x", "--identity", str(tmp_path / "id.key"), "--out", str(out)]) == 0
    data = bytearray(out.read_bytes())
    data[-5] ^= 1
    out.write_bytes(bytes(data))
    assert _cli(["run", "show", str(out)]) == 2
    assert "error:" in capsys.readouterr().err


def test_the_run_command_does_not_import_torch():
    code = ("import sys, tui.run_command, protocol.manifest, protocol.envelope, peer.identity_store; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
