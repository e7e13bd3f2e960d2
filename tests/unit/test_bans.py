"""Evidence of a lie and the bans kept on it (protocol.evidence, peer.bans), without a network."""

import logging

import pytest
import torch

from peer.bans import Bans
from protocol.codecs import get_codec
from protocol.envelope import seal
from protocol.evidence import offence
from protocol.identity import Identity
from protocol.messages_swarm import PushSlice, SliceAveraged

RUN = b"\x05" * 20
LIAR = Identity.from_seed(b"\x11" * 32)
OTHER = Identity.from_seed(b"\x12" * 32)


def push(payload: bytes, numel: int = 256, shape: tuple = (256,), codec: str = "fp32", run_id: bytes = RUN,
         signer: Identity = LIAR, weight: float = 1.0) -> bytes:
    return seal(PushSlice(run_id=run_id, fragment=0, round=1, group_id=b"g" * 16, part=0, offset=0, numel=numel,
                          shape=shape, dtype="float32", codec=codec, weight=weight, stopping=False, payload=payload), signer)


GOOD = torch.randn(256, generator=torch.Generator().manual_seed(0))
NAN = GOOD.clone()
NAN[3] = float("nan")


def test_a_signed_frame_no_honest_client_sends_proves_its_signer_lied():
    assert offence(push(NAN.numpy().tobytes()), RUN)[0] == LIAR.public_key
    assert "shape" in offence(push(GOOD.numpy().tobytes(), shape=(1, 256)), RUN)[1]
    inf_scale = bytearray(get_codec("fp4").encode(GOOD))
    inf_scale[:2] = bytes.fromhex("807f")  # the first block's bf16 scale: +inf
    assert offence(push(bytes(inf_scale), codec="fp4"), RUN) is not None
    mean = seal(SliceAveraged(run_id=RUN, fragment=0, round=1, group_id=b"g" * 16, part=0, offset=0, numel=256,
                              shape=(256,), dtype="float32", codec="fp32", weight=2.0, payload=NAN.numpy().tobytes(),
                              contributors=(0, 1), inputs=b"i" * 32, own=b"o" * 32), LIAR)
    assert offence(mean, RUN)[0] == LIAR.public_key  # a reducer's lie too


@pytest.mark.parametrize("frame", [
    push(GOOD.numpy().tobytes()),  # honest
    push(GOOD.numpy().tobytes(), weight=1e12),  # wrong only for some group: proves nothing to others
    push(NAN.numpy().tobytes(), run_id=b"\x06" * 20),  # another run's
    bytes(push(NAN.numpy().tobytes())[:-1]) + b"\x00",  # the signature no longer matches
    b"\x00" * 64,
])
def test_anything_else_proves_nothing(frame):
    assert offence(frame, RUN) is None


def test_a_ban_is_saved_with_its_evidence_and_holds_after_a_restart(tmp_path):
    bans = Bans(tmp_path / "bans", RUN)
    bad = push(NAN.numpy().tobytes())
    assert not bans.add(OTHER.public_key, "x", bad)  # the frame does not prove anything against OTHER
    assert not bans.add(LIAR.public_key, "x", push(GOOD.numpy().tobytes()))  # nor against LIAR
    assert bans.add(LIAR.public_key, "ignored: the reason is the evidence's", bad)
    assert not bans.add(LIAR.public_key, "again", bad)
    assert bans.peer_ids == {LIAR.peer_id} and "NaN" in bans.reason(LIAR.public_key)
    again = Bans(tmp_path / "bans", RUN)
    again.load()
    assert again.peer_ids == {LIAR.peer_id} and again.reason(LIAR.public_key) == bans.reason(LIAR.public_key)
    assert [b.peer_id for b in again.items()] == [LIAR.peer_id]
    assert again.evidence(LIAR.public_key) == (bad,)  # what a banned member's groups are handed
    assert again.evidence(OTHER.public_key) is None
    (tmp_path / "bans" / f"{LIAR.peer_id}.frame").unlink()
    assert again.evidence(LIAR.public_key) is None  # gone: nothing to hand on, still banned
    assert LIAR.peer_id in again.peer_ids


def test_evidence_that_proves_nothing_bans_nobody_and_is_left_in_place(tmp_path, caplog):
    d = tmp_path / "bans"
    d.mkdir()
    (d / f"{LIAR.peer_id}.frame").write_bytes(push(GOOD.numpy().tobytes()))  # an honest frame
    (d / f"{OTHER.peer_id}.frame").write_bytes(push(NAN.numpy().tobytes()))  # LIAR's lie, filed under OTHER
    (d / "junk.frame").write_bytes(b"\xff" * 10)
    bans = Bans(d, RUN)
    with caplog.at_level(logging.WARNING, logger="peer.bans"):
        bans.load()
    assert len(bans) == 0 and bans.peer_ids == set()
    assert sum("proves nothing" in r.getMessage() for r in caplog.records) == 3
    assert len(list(d.iterdir())) == 3
