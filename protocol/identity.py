"""Ed25519 identities: one key per volunteer, used both to sign messages and as the libp2p
identity that hivemind's daemon runs under, so the peer ID *is* the signing key.

Pure functions over bytes; reading and writing the key file is ``peer.identity_store``'s job.

Formats (libp2p peer-id spec, https://github.com/libp2p/specs/blob/master/peer-ids/peer-ids.md):

- private key file: protobuf ``PrivateKey{Type=Ed25519 (1), Data=seed(32) || public(32)}``,
  68 bytes, which is what p2pd's ``-id`` flag (hivemind's ``identity_path``) reads;
- public key: protobuf ``PublicKey{Type=Ed25519, Data=public(32)}``, 36 bytes;
- peer ID: the identity multihash of the public-key protobuf (``0x00 0x24`` + 36 bytes),
  in base58btc. Ed25519 peer IDs therefore start with ``12D3KooW`` and embed the key, so a
  verifier can get the key back from the peer ID alone.
"""

from __future__ import annotations

import functools

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import LocalProtocolError, RemoteProtocolError

PUBLIC_KEY_BYTES = 32
SEED_BYTES = 32
SIGNATURE_BYTES = 64

# libp2p crypto.proto KeyType values; only Ed25519 is accepted, the rest are named for errors.
_KEY_TYPE_NAMES = {0: "RSA", 1: "Ed25519", 2: "Secp256k1", 3: "ECDSA"}
_ED25519 = 1
# Deterministic protobuf prefixes: field 1 (varint) = 1, field 2 (bytes) of length 64 / 32.
_PRIVATE_PREFIX = bytes([0x08, _ED25519, 0x12, 64])
_PUBLIC_PREFIX = bytes([0x08, _ED25519, 0x12, 32])
# Multihash "identity" (code 0x00) of the 36-byte public-key protobuf.
_PEER_ID_PREFIX = bytes([0x00, len(_PUBLIC_PREFIX) + PUBLIC_KEY_BYTES])
_SHA256_MULTIHASH = bytes([0x12, 0x20])

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}
_MAX_PEER_ID_CHARS = 128  # real ones are 46-53; bounds the O(n^2) base58 decode


class InvalidKey(RemoteProtocolError):
    """Bytes that should hold a key (a key file, a peer ID, a message field) do not."""


class Identity:
    """A volunteer's Ed25519 private key. ``repr`` shows the peer ID, never the secret."""

    __slots__ = ("_key", "public_key")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public_key: bytes = key.public_key().public_bytes_raw()
        """Raw 32-byte Ed25519 public key."""

    @classmethod
    def generate(cls) -> Identity:
        """A fresh key from the operating system's CSPRNG."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The key whose 32-byte RFC 8032 private seed is ``seed`` (tests use fixed seeds)."""
        if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
            raise LocalProtocolError(f"an Ed25519 seed is {SEED_BYTES} bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def from_libp2p(cls, data: bytes) -> Identity:
        """Parse a libp2p private-key protobuf (the key file format); raises InvalidKey."""
        key_data = _parse_key_protobuf(data, "private key")
        if len(key_data) != SEED_BYTES + PUBLIC_KEY_BYTES:
            raise InvalidKey(f"an Ed25519 private key holds 64 bytes (seed and public key), got {len(key_data)}")
        ident = cls.from_seed(bytes(key_data[:SEED_BYTES]))
        # p2pd trusts the stored public half; if it disagreed with the seed, the daemon would
        # announce one peer ID while we signed with another key.
        if ident.public_key != key_data[SEED_BYTES:]:
            raise InvalidKey("the public half of the private key does not match its seed")
        return ident

    def to_libp2p(self) -> bytes:
        """The 68-byte libp2p private-key protobuf that hivemind's ``identity_path`` reads."""
        return _PRIVATE_PREFIX + self.seed() + self.public_key

    @classmethod
    def from_pem(cls, data: bytes) -> Identity:
        """Parse an unencrypted PKCS#8 PEM Ed25519 key (``openssl genpkey -algorithm ed25519``)."""
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise InvalidKey(f"not an unencrypted PEM private key: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise InvalidKey(f"PEM key is {type(key).__name__}, not Ed25519")
        return cls(key)

    def to_pem(self) -> bytes:
        """Unencrypted PKCS#8 PEM, for interop with openssl and other tools."""
        return self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())

    def seed(self) -> bytes:
        """The raw 32-byte private seed. Handle with care."""
        return self._key.private_bytes_raw()

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)

    def sign(self, data: bytes) -> bytes:
        """A 64-byte Ed25519 signature over ``data``."""
        return self._key.sign(data)

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id})"


def _parse_key_protobuf(data: bytes, what: str) -> bytes:
    """``Data`` of a deterministically encoded libp2p key protobuf with ``Type=Ed25519``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidKey(f"a {what} must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < 4 or data[0] != 0x08 or data[2] != 0x12:
        raise InvalidKey(f"not a libp2p {what} (expected a key-type/data protobuf)")
    if data[1] != _ED25519:
        name = _KEY_TYPE_NAMES.get(data[1], f"type {data[1]}")
        raise InvalidKey(f"the {what} is {name}; swarmstream identities are Ed25519")
    if data[3] >= 0x80 or len(data) != 4 + data[3]:
        raise InvalidKey(f"the {what} protobuf has the wrong length ({len(data)} bytes)")
    return data[4:]


def public_key_to_libp2p(public_key: bytes) -> bytes:
    """The 36-byte libp2p public-key protobuf."""
    _check_public_key(public_key)
    return _PUBLIC_PREFIX + public_key


def public_key_from_libp2p(data: bytes) -> bytes:
    """The raw key inside a libp2p public-key protobuf; raises InvalidKey."""
    key = _parse_key_protobuf(data, "public key")
    if len(key) != PUBLIC_KEY_BYTES:
        raise InvalidKey(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(key)}")
    return key


def public_key_to_pem(public_key: bytes) -> bytes:
    """SubjectPublicKeyInfo PEM of a raw public key."""
    _check_public_key(public_key)
    return Ed25519PublicKey.from_public_bytes(public_key).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer ID (base58btc identity multihash) of a raw Ed25519 public key."""
    _check_public_key(public_key)
    return _peer_id(public_key)


@functools.lru_cache(maxsize=4096)
def _peer_id(public_key: bytes) -> str:
    # base58 is quadratic in Python; heartbeats and logs ask for the same few IDs over and over.
    return b58encode(_PEER_ID_PREFIX + _PUBLIC_PREFIX + public_key)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The raw Ed25519 key embedded in a peer ID; raises InvalidKey for any other peer ID."""
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= _MAX_PEER_ID_CHARS:
        raise InvalidKey("a peer ID is a base58 string of at most 128 characters")
    raw = b58decode(peer_id)
    if raw[:2] == _SHA256_MULTIHASH:
        raise InvalidKey(f"peer ID {peer_id} is a hash of a non-Ed25519 key; it does not embed a public key")
    if raw[:2] != _PEER_ID_PREFIX:
        raise InvalidKey(f"{peer_id} is not an Ed25519 libp2p peer ID")
    return public_key_from_libp2p(raw[2:])


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True if ``signature`` is ``public_key``'s Ed25519 signature over ``data``.

    Never raises for bad signatures or keys that are not curve points; they are simply not valid.
    """
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        _public_key_object(bytes(public_key)).verify(bytes(signature), data)
    except InvalidSignature:
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _public_key_object(public_key: bytes) -> Ed25519PublicKey:
    # Parsing a key costs about as much as half a verification; peers sign many messages.
    return Ed25519PublicKey.from_public_bytes(public_key)


def _check_public_key(public_key: bytes) -> None:
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
        raise InvalidKey(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} raw bytes")


def b58encode(data: bytes) -> str:
    """Base58btc (Bitcoin alphabet), as libp2p prints peer IDs."""
    zeros = len(data) - len(data.lstrip(b"\0"))
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58_ALPHABET[r])
    return "1" * zeros + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    """Inverse of ``b58encode``; raises InvalidKey on characters outside the alphabet."""
    n = 0
    for c in text:
        digit = _B58_INDEX.get(c)
        if digit is None:
            raise InvalidKey(f"{c!r} is not a base58 character")
        n = n * 58 + digit
    zeros = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * zeros + body
