"""Identities: key formats, peer IDs, signatures, and the key file on disk."""

from __future__ import annotations

import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.identity_store import IdentityFileError, create_identity, load_identity, load_or_create_identity
from protocol.errors import ProtocolError
from protocol.identity import (
    Identity, InvalidKey, b58decode, b58encode, peer_id_from_public_key, public_key_from_libp2p,
    public_key_from_peer_id, public_key_to_libp2p, public_key_to_pem, verify_signature,
)

# Test vector of the libp2p peer-id spec (Ed25519 private key protobuf and its public key).
SPEC_PRIVATE = bytes.fromhex(
    "080112407e0830617c4a7de83925dfb2694556b12936c477a0e1feb2e148ec9da60fee7d"
    "1ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e")
SPEC_PUBLIC = bytes.fromhex("080112201ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e")

seeds = st.binary(min_size=32, max_size=32)
fast = settings(max_examples=40, deadline=None)


def test_spec_vector_parses_and_serializes_back():
    ident = Identity.from_libp2p(SPEC_PRIVATE)
    assert ident.to_libp2p() == SPEC_PRIVATE
    assert public_key_to_libp2p(ident.public_key) == SPEC_PUBLIC
    assert public_key_from_libp2p(SPEC_PUBLIC) == ident.public_key


def test_peer_id_is_identity_multihash_in_base58():
    base58 = pytest.importorskip("base58")  # an independent base58 (a hivemind dependency)
    ident = Identity.from_libp2p(SPEC_PRIVATE)
    expected = base58.b58encode(bytes([0x00, 36]) + SPEC_PUBLIC).decode()
    assert ident.peer_id == expected
    assert ident.peer_id.startswith("12D3KooW")


@fast
@given(seeds)
def test_key_round_trips(seed):
    ident = Identity.from_seed(seed)
    again = Identity.from_libp2p(ident.to_libp2p())
    assert again.seed() == seed and again.public_key == ident.public_key
    assert Identity.from_pem(ident.to_pem()).seed() == seed
    assert public_key_from_peer_id(ident.peer_id) == ident.public_key
    assert b"PUBLIC KEY" in public_key_to_pem(ident.public_key)
    assert "seed" not in repr(ident) and seed.hex() not in repr(ident)


@fast
@given(seeds, st.binary(max_size=200), st.integers(min_value=0, max_value=511))
def test_signatures_verify_and_any_bit_flip_breaks_them(seed, data, bit):
    ident = Identity.from_seed(seed)
    sig = ident.sign(data)
    assert verify_signature(ident.public_key, sig, data)
    flipped = bytearray(sig)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert not verify_signature(ident.public_key, bytes(flipped), data)
    assert not verify_signature(ident.public_key, sig, data + b"x")
    other = Identity.from_seed(bytes(31) + b"\x01" if seed != bytes(31) + b"\x01" else bytes(32))
    assert not verify_signature(other.public_key, sig, data)


def test_verify_signature_rejects_malformed_inputs_without_raising():
    ident = Identity.from_seed(bytes(32))
    sig = ident.sign(b"m")
    assert not verify_signature(ident.public_key[:31], sig, b"m")
    assert not verify_signature(ident.public_key, sig[:63], b"m")
    assert not verify_signature(b"\xff" * 32, sig, b"m")  # not a curve point


@pytest.mark.parametrize("data, reason", [
    (b"", "not a libp2p"),
    (b"\x08\x00\x12\x04abcd", "RSA"),
    (b"\x08\x02\x12\x04abcd", "Secp256k1"),
    (SPEC_PRIVATE[:-1], "wrong length"),
    (SPEC_PRIVATE + b"\0", "wrong length"),
    (SPEC_PRIVATE[:-1] + bytes([SPEC_PRIVATE[-1] ^ 1]), "does not match"),
    (SPEC_PUBLIC, "64 bytes"),
])
def test_corrupt_private_keys_are_refused_with_a_reason(data, reason):
    with pytest.raises(InvalidKey, match=reason):
        Identity.from_libp2p(data)


@fast
@given(st.binary(max_size=100))
def test_parsing_random_key_bytes_raises_only_invalid_key(data):
    try:
        Identity.from_libp2p(data)
    except InvalidKey:
        pass
    try:
        public_key_from_libp2p(data)
    except InvalidKey:
        pass


@fast
@given(st.binary(max_size=64))
def test_base58_round_trips_including_leading_zeros(data):
    assert b58decode(b58encode(data)) == data


@fast
@given(st.text(max_size=80))
def test_peer_id_parsing_raises_only_invalid_key(text):
    try:
        key = public_key_from_peer_id(text)
    except InvalidKey:
        return
    assert peer_id_from_public_key(key) == text


def test_hashed_peer_ids_do_not_embed_a_key():
    rsa_style = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    with pytest.raises(InvalidKey, match="does not embed"):
        public_key_from_peer_id(rsa_style)


def test_local_misuse_is_a_local_error():
    with pytest.raises(ProtocolError):
        Identity.from_seed(b"short")
    with pytest.raises(InvalidKey):
        peer_id_from_public_key(b"short")


# ---------------------------------------------------------------------------------------
# The key file.


def test_first_start_creates_a_private_key_file_and_later_starts_load_it(tmp_path):
    path = tmp_path / "data" / "identity.key"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.read_bytes() == first.to_libp2p()
    assert load_or_create_identity(path).seed() == first.seed()
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]  # no temp file left behind


def test_create_never_overwrites_an_existing_key(tmp_path):
    path = tmp_path / "identity.key"
    first = create_identity(path)
    second = create_identity(path)
    assert second.seed() == first.seed()


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_key_file_others_can_read_is_refused_with_the_fix(tmp_path, mode):
    path = tmp_path / "identity.key"
    create_identity(path)
    path.chmod(mode)
    with pytest.raises(IdentityFileError, match=f"chmod 600 {path}"):
        load_or_create_identity(path)
    assert path.exists()  # refused, not replaced


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_a_read_only_key_file_is_fine(tmp_path):
    path = tmp_path / "identity.key"
    ident = create_identity(path)
    path.chmod(0o400)  # what hivemind itself writes
    assert load_identity(path).seed() == ident.seed()


@pytest.mark.parametrize("content", [b"", b"garbage", b"\x08\x00\x12\x03abc", b"x" * 5000])
def test_a_corrupt_key_file_is_refused_and_kept(tmp_path, content):
    path = tmp_path / "identity.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(IdentityFileError) as info:
        load_or_create_identity(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert "move it away" in message or "key file" in message
    assert path.read_bytes() == content


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_at_the_key_path_does_not_hang(tmp_path):
    path = tmp_path / "identity.key"
    os.mkfifo(path, 0o600)
    with pytest.raises(IdentityFileError, match="not a regular file"):
        load_identity(path)
