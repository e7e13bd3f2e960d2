"""Run manifests, run IDs and joinable run addresses.

A manifest is everything a volunteer needs to join a run: the training content
(``protocol.config.TrainConfig``), the swarm settings (``SwarmConfig``), a name, a
description, the creator's public key and the creation time. Its creator signs it
(``protocol.envelope``), and the run ID is derived from its bytes::

    run_id = sha256(b"swarmstream/run-id/v1\\0" + manifest_bytes)[:20]

written as 32 lowercase base32 characters. A manifest fetched by ID is therefore checked by
hashing it: ``open_manifest(data, run_id=...)``.

A joinable address is one string a volunteer can paste::

    swarmstream:<run id>@<multiaddr>[,<multiaddr>...]

with each multiaddr ending in ``/p2p/<peer id>`` (what hivemind needs to dial a bootstrap
peer). The part from ``@`` on is optional: a bare run ID joins through peers already known.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any

from protocol.config import TrainConfig
from protocol.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from protocol.envelope import VerificationError, seal, verify
from protocol.identity import Identity
from protocol.messages import (
    MAX_ADDRS, MAX_FRAGMENTS, MAX_GROUP_SIZE, RUN_ID_BYTES, ConfigOf, FieldError, Message, PublicKey, Str, Tag,
    UnixTime, message,
)
from protocol.messages_rules import is_one_line

RUN_ID_DOMAIN = b"swarmstream/run-id/v1\0"
ADDRESS_SCHEME = "swarmstream:"
MANIFEST_SUFFIX = ".swarmrun"
"""File name suffix of a signed manifest (the envelope's bytes)."""


class RunIdMismatch(RemoteProtocolError):
    """A manifest does not hash to the run ID it was fetched under."""


class InvalidAddress(LocalProtocolError):
    """A run ID or run address given by the user is malformed."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True, kw_only=True, slots=True)
class SwarmConfig:
    """How the peers of a run find each other and average: the network half of a manifest.
    Every wait in the swarm has one of these deadlines, so no round can hang."""

    group_size: int = 8
    """Most peers in one averaging group; a larger swarm forms several groups, reshuffled every
    round. Bigger groups mix faster but each member then waits for the slowest of more peers."""
    matchmaking_timeout_s: float = 15.0
    """How long a ready peer waits to be placed in a group before averaging alone this round.
    Raise it if rounds often end with groups of one while the swarm has several peers."""
    allreduce_timeout_s: float = 60.0
    """Deadline for a group's slices, from the group's formation; members that miss it are
    dropped from the round and the rest finish re-weighted. Must cover a slice transfer on the
    slowest link you want to keep."""
    state_chunk_timeout_s: float = 30.0
    """Deadline for one state-sync chunk from one donor before asking another."""
    state_chunk_bytes: int = 16 << 20
    """Size of state-sync chunks; each is hashed and can come from a different donor."""
    heartbeat_interval_s: float = 10.0
    """How often a peer refreshes its heartbeat in the DHT."""
    heartbeat_ttl_s: float = 45.0
    """Expiration of a heartbeat: a peer silent for this long is considered gone."""

    def __post_init__(self) -> None:
        _check(2 <= self.group_size <= MAX_GROUP_SIZE,
               f"swarm.group_size must be in [2, {MAX_GROUP_SIZE}], got {self.group_size}")
        for name in ("matchmaking_timeout_s", "allreduce_timeout_s", "state_chunk_timeout_s",
                     "heartbeat_interval_s", "heartbeat_ttl_s"):
            value = getattr(self, name)
            _check(math.isfinite(value) and 0 < value <= 86400, f"swarm.{name} must be in (0, 86400] s, got {value}")
        _check(1 << 16 <= self.state_chunk_bytes <= 1 << 28,
               f"swarm.state_chunk_bytes must be in [64 KiB, 256 MiB], got {self.state_chunk_bytes}")
        _check(self.heartbeat_ttl_s >= 2 * self.heartbeat_interval_s,
               f"swarm.heartbeat_ttl_s ({self.heartbeat_ttl_s}) must be at least twice "
               f"swarm.heartbeat_interval_s ({self.heartbeat_interval_s}) so one lost refresh is not a departure")


# Limits a manifest from a stranger must respect on top of TrainConfig's own rules, so it
# cannot make a volunteer allocate a model no machine holds or loop for 2**63 steps.
_MAX_PARAMS = 10**12
_INT_CAPS = {
    "model.n_layers": 1024, "model.d_model": 1 << 16, "model.n_heads": 1024, "model.d_ff": 1 << 18,
    "model.vocab_size": 1 << 22, "model.seq_len": 1 << 20, "inner.warmup_steps": 1 << 40,
    "inner.total_steps": 1 << 40, "inner.batch_size": 1 << 16, "inner.grad_accum": 1 << 16,
    "sync.inner_steps": 1 << 31, "sync.fragments": MAX_FRAGMENTS, "sync.overlap": 1 << 31,
    "data.seed": (1 << 63) - 1,
}


def check_train_limits(train: TrainConfig) -> None:
    """Raise FieldError if ``train`` is valid but beyond what a swarm run may ask for."""
    if train.sync.method == "ddp":
        # data-parallel needs an all-reduce of every gradient at every inner step: a datacenter
        # network, not the internet. It stays a baseline of the in-process simulation.
        raise FieldError("sync.method 'ddp' averages gradients at every inner step, which a swarm over the "
                         "internet cannot keep up with; use --mode streaming or diloco (-H 1 for the closest "
                         "to data-parallel), or compare with ddp in `swarmstream simulate --mode ddp`")
    for path, cap in _INT_CAPS.items():
        section, name = path.split(".")
        value = getattr(getattr(train, section), name)
        if value > cap:
            raise FieldError(f"train.{path} = {value} is over the limit of {cap}")
    if train.model.num_params() > _MAX_PARAMS:
        raise FieldError(f"the model has {train.model.num_params():,} parameters, over the limit of {_MAX_PARAMS:,}")
    for name in ("source", "tokenizer"):
        text = getattr(train.data, name)
        if text is not None and (len(text) > 1024 or not is_one_line(text)):
            raise FieldError(f"train.data.{name} must be one line of at most 1024 printable characters")


@message(Tag.RUN_MANIFEST)
@dataclass(frozen=True, kw_only=True, slots=True)
class RunManifest(Message):
    """Everything a volunteer needs to join a run. Never edit one: any change is a new run."""

    name: Annotated[str, Str(min_len=1, max_len=64)]
    """Short human name shown in run lists."""
    description: Annotated[str, Str(max_len=4000, multiline=True)]
    train: Annotated[TrainConfig, ConfigOf(TrainConfig, absent=(("sync.gate", False),))]
    """Model, data (source, seed, held-out split), inner and outer optimizers, and the sync
    schedule: H, P, tau, alpha and the codec. A manifest made before ``sync.gate`` existed
    lacks it and keeps the rules it was made with: no gate."""
    swarm: Annotated[SwarmConfig, ConfigOf(SwarmConfig)]
    creator: PublicKey
    """The creator's raw Ed25519 key; the manifest's envelope must be signed by it."""
    created_at: UnixTime

    def check(self) -> None:
        check_train_limits(self.train)


# ---------------------------------------------------------------------------------------
# Run IDs.


def run_id_of(manifest_bytes: bytes | memoryview) -> bytes:
    """The 20-byte run ID of an encoded manifest (``messages.encode(manifest)``)."""
    return hashlib.sha256(RUN_ID_DOMAIN + bytes(manifest_bytes)).digest()[:RUN_ID_BYTES]


def format_run_id(run_id: bytes) -> str:
    """32 lowercase base32 characters: unambiguous, case-insensitive, double-click selectable."""
    if not isinstance(run_id, bytes) or len(run_id) != RUN_ID_BYTES:
        raise LocalProtocolError(f"a run ID is {RUN_ID_BYTES} bytes")
    return base64.b32encode(run_id).decode().lower()


def parse_run_id(text: str) -> bytes:
    """Inverse of ``format_run_id`` (any case, surrounding spaces ignored); raises InvalidAddress."""
    text = text.strip().upper() if isinstance(text, str) else ""
    if len(text) != 32:
        raise InvalidAddress(f"a run ID is 32 characters (a-z, 2-7), got {len(text)}; copy it again")
    try:
        return base64.b32decode(text)
    except binascii.Error:
        raise InvalidAddress("a run ID has only the characters a-z and 2-7; copy it again") from None


# ---------------------------------------------------------------------------------------
# Signed manifests.


@dataclass(frozen=True, slots=True)
class SignedManifest:
    manifest: RunManifest
    run_id: bytes

    @property
    def run_id_text(self) -> str:
        return format_run_id(self.run_id)


def sign_manifest(manifest: RunManifest, identity: Identity) -> bytes:
    """The signed manifest's bytes (what a ``.swarmrun`` file and the DHT record hold)."""
    if manifest.creator != identity.public_key:
        raise LocalProtocolError("a manifest must be signed by the key named as its creator")
    return seal(manifest, identity)


def open_manifest(data: Any, *, run_id: bytes | str | None = None) -> SignedManifest:
    """Verify a signed manifest: its signature, that its creator signed it, and, when given,
    that it hashes to ``run_id``. Raises RemoteProtocolError subclasses only (and
    InvalidAddress for a malformed ``run_id`` text)."""
    want = parse_run_id(run_id) if isinstance(run_id, str) else run_id
    checked = verify(data, expect=RunManifest)
    manifest = checked.message
    assert isinstance(manifest, RunManifest)
    if checked.signer != manifest.creator:
        raise VerificationError(f"manifest {manifest.name!r} is signed by someone other than its creator")
    got = run_id_of(checked.body)
    if want is not None and got != want:
        raise RunIdMismatch(f"the manifest fetched for run {format_run_id(want)} hashes to "
                            f"{format_run_id(got)}; it was altered or is another run")
    return SignedManifest(manifest=manifest, run_id=got)


# ---------------------------------------------------------------------------------------
# Joinable addresses.

_MADDR = re.compile(r"(/[A-Za-z0-9._~:%+=-]+)+/(p2p|ipfs)/[1-9A-HJ-NP-Za-km-z]{20,128}")


@dataclass(frozen=True, slots=True)
class RunAddress:
    """A run ID and the bootstrap peers to reach the run through."""

    run_id: bytes
    bootstrap: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        format_run_id(self.run_id)
        if len(self.bootstrap) > MAX_ADDRS:
            raise InvalidAddress(f"at most {MAX_ADDRS} bootstrap addresses, got {len(self.bootstrap)}")
        for maddr in self.bootstrap:
            if not isinstance(maddr, str) or len(maddr) > 512 or not _MADDR.fullmatch(maddr):
                raise InvalidAddress(f"{str(maddr)[:80]!r} is not a bootstrap multiaddr like "
                                     "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...")

    def __str__(self) -> str:
        text = ADDRESS_SCHEME + format_run_id(self.run_id)
        return text + ("@" + ",".join(self.bootstrap) if self.bootstrap else "")


def parse_run_address(text: str) -> RunAddress:
    """Parse what a volunteer pasted: an address or a bare run ID; raises InvalidAddress."""
    if not isinstance(text, str) or len(text) > 16 * 1024:
        raise InvalidAddress("a run address is a line of text")
    text = text.strip()
    if text.lower().startswith(ADDRESS_SCHEME):
        text = text[len(ADDRESS_SCHEME):].lstrip("/")
    run_part, at, peers = text.partition("@")
    bootstrap = tuple(p.strip() for p in peers.split(",") if p.strip()) if at else ()
    if at and not bootstrap:
        raise InvalidAddress("nothing after '@'; add a bootstrap multiaddr or drop the '@'")
    return RunAddress(parse_run_id(run_part), bootstrap)
