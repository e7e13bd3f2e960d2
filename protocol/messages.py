"""The wire format: tagged, versioned msgpack messages, checked against a schema on decode.

Every message swarmstream puts on the wire, into the DHT or on the control socket is a frozen
dataclass registered here with a tag. Its bytes are one msgpack array::

    [PROTOCOL_VERSION, tag, field_1, ..., field_n]

in field order. A type may end with fields that have defaults, and a sender may leave off
any number of its last defaulted fields: so a field added at the end with a default is read
from an older sender (the control socket's ``StatusReported`` grows this way, and a new
dashboard reads an older node). ``encode`` leaves off every trailing field that holds its
default, so an older peer reads a newer one's message too whenever the new fields say nothing
(a ``Heartbeat`` without bans). Signatures and run IDs are computed over the bytes as
received, never over a re-encoding; types with a payload take no defaults.

A message with a tensor payload (``PushSlice``, ``StateChunk``, ...) keeps the
payload as its *last* field, always written as ``bin32``; the decoder does not copy it but
returns a ``memoryview`` into the input, and ``encode_parts`` returns it without copying, so a
64 MB slice is copied at most once on its way to the socket and never on the way in.

Input is hostile. ``decode`` checks the total size before reading anything, caps every
msgpack string, binary, array and map length, rejects unknown tags, other protocol versions,
trailing bytes and duplicate map keys, and validates every field's type and range; the only
exceptions it raises are ``DecodeError`` and its subclasses. Building a message with a bad
field raises ``InvalidMessage`` instead: the same rules, but the fault is ours.

Field rules are declared with ``Annotated`` (``Int``, ``Str``, ``Bytes``... from
``protocol.messages_rules``), so one declaration serves construction and decoding. The
catalogue lives in ``protocol.messages_swarm`` (between peers), ``protocol.messages_control``
(dashboard <-> node), ``protocol.manifest`` and ``protocol.envelope``; every tag is listed in
``Tag`` below, and docs/protocol.md describes them all.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import re
import typing
from typing import Annotated, Any, ClassVar

import msgpack

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.messages_rules import (  # noqa: F401  (re-exported: message modules import rules from here)
    MAX_FRAME_BYTES, Bool, Bytes, ConfigOf, FieldError, Float, Int, Opt, Payload, Rule, Seq, Str, describe,
)

PROTOCOL_VERSION = 1
"""Bumped on any change to a message's fields or meaning (except a new last field with a
default, which older senders may leave off); peers on other versions are refused."""

MAX_HEAD_BYTES = 1 << 20
"""Largest encoding of a message without its payload."""
SMALL_MESSAGE_BYTES = 64 << 10
"""Default size limit of messages without a payload."""

RUN_ID_BYTES = 20
KEY_BYTES = 32
SIGNATURE_BYTES = 64
DIGEST_BYTES = 32
GROUP_ID_BYTES = 16
MAX_FRAGMENTS = 1024
MAX_GROUP_SIZE = 256
MAX_ADDRS = 16
MAX_STATE_CHUNKS = 16384

# Field types shared by the catalogue.
RunId = Annotated[bytes, Bytes((RUN_ID_BYTES,))]
"""A run ID: the first 20 bytes of the SHA-256 of the run's manifest (see protocol.manifest)."""
PublicKey = Annotated[bytes, Bytes((KEY_BYTES,))]
"""A raw Ed25519 public key; the libp2p peer ID is derived from it (protocol.identity)."""
Digest = Annotated[bytes, Bytes((DIGEST_BYTES,))]
MaybeDigest = Annotated[bytes, Bytes((0, DIGEST_BYTES))]
GroupId = Annotated[bytes, Bytes((GROUP_ID_BYTES,))]
U8 = Annotated[int, Int(0, 2**8 - 1)]
U32 = Annotated[int, Int(0, 2**32 - 1)]
U64 = Annotated[int, Int(0, 2**63 - 1)]  # msgpack ints are 64-bit; stay signed-safe
UnixTime = Annotated[float, Float(0.0, 1e11)]
"""Seconds since the epoch, by the *sender's* clock; never trust it to order events."""
Seconds = Annotated[float, Float(0.0, 1e9)]
Rate = Annotated[float, Float(0.0, 1e15)]
Weight = Annotated[float, Float(0.0, 1e18)]
Line = Annotated[str, Str(max_len=256)]
"""One line of human text: a name, a reason."""
PeerIdText = Annotated[str, Str(max_len=128, pattern=re.compile("[1-9A-HJ-NP-Za-km-z]{1,128}"))]
"""A libp2p peer ID in base58 (Ed25519 ones start with 12D3KooW)."""
Multiaddrs = Annotated[tuple[str, ...], Seq(Str(max_len=512, pattern=re.compile(r"(/[A-Za-z0-9._~:%+=@-]+)+")),
                                            max_len=MAX_ADDRS)]
"""Where a peer can be reached, e.g. ``/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...``."""

# msgpack limits for anything outside a payload tail; they bound allocation before validation.
_MAX_STR = 16 << 10
_MAX_BIN = 64 << 10
_MAX_ARRAY = MAX_STATE_CHUNKS
_MAX_MAP = 64
_FIRST_FEED = 4096  # heads of payload messages are ~200 bytes; feed more only when needed


class Tag(enum.IntEnum):
    """Every message type, in one place. Never reuse a number; bump PROTOCOL_VERSION instead."""

    ENVELOPE = 0
    # records and requests between peers (signed)
    RUN_MANIFEST = 1
    HEARTBEAT = 2
    RUN_ADVERTISED = 3
    REJECTED = 4
    JOIN_GROUP = 16
    GROUP_FORMED = 17
    PUSH_SLICE = 18
    SLICE_AVERAGED = 19
    PARTS_HELD = 20
    AUDIT_REQUEST = 21
    EVIDENCE = 22
    EVIDENCE_PIECE = 23
    REQUEST_STATE_INDEX = 32
    STATE_INDEX = 33
    REQUEST_STATE_CHUNK = 34
    STATE_CHUNK = 35
    # control socket, dashboard -> node (commands)
    GET_STATUS = 64
    SUBSCRIBE_EVENTS = 65
    PAUSE_TRAINING = 66
    RESUME_TRAINING = 67
    FINISH_AND_STOP = 68
    LEAVE_RUN = 69
    UPDATE_SETTINGS = 70
    # control socket, node -> dashboard (replies and events)
    COMMAND_ACCEPTED = 96
    COMMAND_FAILED = 97
    STATUS_REPORTED = 98
    STATE_CHANGED = 99
    PEER_JOINED = 100
    PEER_LEFT = 101
    FRAGMENT_SYNCED = 102
    FRAGMENT_SYNC_FAILED = 103
    LOSS_MEASURED = 104
    LOG_RECORDED = 105
    PEER_UPDATED = 106


class InvalidMessage(LocalProtocolError):
    """We tried to build or encode a message that breaks its schema."""


class DecodeError(RemoteProtocolError):
    """Bytes from outside are not a valid message: reject them and count it against the sender."""


class MessageTooLarge(DecodeError):
    """The input is over the size limit; nothing of it was parsed."""


class VersionMismatch(DecodeError):
    """The sender speaks another protocol version (one of us should upgrade swarmstream)."""


# ---------------------------------------------------------------------------------------
# Messages and the registry.


class Message:
    """Base of every message. Subclasses are ``@message(Tag.X)`` frozen, slotted dataclasses
    whose fields are annotated ``Annotated[type, Rule]``; cross-field rules go in ``check``.

    The fields named ``run_id``, ``round``, ``fragment`` and ``group_id`` are the message's
    *context*: what a signature binds besides the bytes, so a replay elsewhere fails.
    """

    __slots__ = ()
    TAG: ClassVar[Tag]
    MAX_SIZE: ClassVar[int]
    HAS_PAYLOAD: ClassVar[bool]

    def __post_init__(self) -> None:
        schema = _schema_of(type(self))
        try:
            for name, rule in zip(schema.names, schema.rules):
                value = getattr(self, name)
                checked = rule.check(value, name)
                if checked is not value:
                    object.__setattr__(self, name, checked)
            self.check()
        except FieldError as e:
            raise InvalidMessage(f"{type(self).__name__}: {e}") from None

    def check(self) -> None:
        """Rules that span several fields; raise FieldError."""

    def context(self) -> tuple[bytes, int | None, int | None, bytes | None]:
        """``(run_id, round, fragment, group_id)``; b"" / None where the type has no such field."""
        return (getattr(self, "run_id", b""), getattr(self, "round", None),
                getattr(self, "fragment", None), getattr(self, "group_id", None))


@dataclasses.dataclass(frozen=True, slots=True)
class _Schema:
    cls: type
    tag: Tag
    names: tuple[str, ...]
    rules: tuple[Rule, ...]
    has_payload: bool
    max_size: int
    required: int
    """Fields a sender must write; the rest (a tail with defaults) may be left off."""
    defaults: tuple[Any, ...] = ()
    """The default of each field from ``required`` on."""


_BY_TAG: dict[int, _Schema] = {}
_BY_CLASS: dict[type, _Schema] = {}


def message(tag: Tag, *, max_size: int | None = None) -> typing.Callable[[type], type]:
    """Register a message dataclass under ``tag``. ``max_size`` bounds its whole encoding
    (default: ``SMALL_MESSAGE_BYTES``, or ``MAX_FRAME_BYTES`` for messages with a payload)."""

    def register(cls: type) -> type:
        if not (dataclasses.is_dataclass(cls) and issubclass(cls, Message)):
            raise TypeError(f"{cls.__name__} must be a dataclass subclass of Message")
        hints = typing.get_type_hints(cls, include_extras=True)
        names, rules, required = [], [], None
        for i, f in enumerate(dataclasses.fields(cls)):
            defaulted = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if defaulted and required is None:
                required = i
            elif not defaulted and required is not None:
                raise TypeError(f"{cls.__name__}.{f.name} has no default but follows a field with one; "
                                "fields with defaults go at the end")
            found = [m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, Rule)]
            if len(found) != 1:
                raise TypeError(f"{cls.__name__}.{f.name} needs exactly one Rule in Annotated[...]")
            names.append(f.name)
            rules.append(found[0])
        payloads = [i for i, r in enumerate(rules) if isinstance(r, Payload)]
        if payloads not in ([], [len(rules) - 1]):
            raise TypeError(f"{cls.__name__}: a Payload must be the one and last field")
        if payloads and required is not None:
            raise TypeError(f"{cls.__name__}: a message with a payload cannot have fields with defaults")
        if int(tag) in _BY_TAG:
            raise TypeError(f"tag {tag!r} is already used by {_BY_TAG[int(tag)].cls.__name__}")
        size = max_size or (MAX_FRAME_BYTES if payloads else SMALL_MESSAGE_BYTES)
        if size > (MAX_FRAME_BYTES if payloads else MAX_HEAD_BYTES):
            raise TypeError(f"{cls.__name__}: max_size {size} is over the decoder's limits")
        fields = dataclasses.fields(cls)[len(names) if required is None else required:]
        schema = _Schema(cls, Tag(tag), tuple(names), tuple(rules), bool(payloads), size,
                         len(names) if required is None else required,
                         tuple(f.default if f.default is not dataclasses.MISSING else f.default_factory()
                               for f in fields))
        _BY_TAG[int(tag)] = _BY_CLASS[cls] = schema
        cls.TAG, cls.MAX_SIZE, cls.HAS_PAYLOAD = schema.tag, size, schema.has_payload
        return cls

    return register


def _schema_of(cls: type) -> _Schema:
    try:
        return _BY_CLASS[cls]
    except KeyError:
        raise TypeError(f"{cls.__name__} is not a registered message (use @message(Tag.X))") from None


def message_types() -> dict[Tag, type]:
    """Every registered message class by tag."""
    _import_catalogue()
    return {s.tag: s.cls for s in _BY_TAG.values()}


# ---------------------------------------------------------------------------------------
# Encoding.


def frame_head(tag: Tag, values: list[Any], payload_len: int | None) -> bytes:
    """The bytes of ``[PROTOCOL_VERSION, tag, *values]`` followed by a bin32 header of
    ``payload_len`` bytes when given (the payload itself comes next)."""
    packer = msgpack.Packer(use_bin_type=True)
    count = 2 + len(values) + (payload_len is not None)
    parts = [packer.pack_array_header(count), packer.pack(PROTOCOL_VERSION), packer.pack(int(tag))]
    parts += [packer.pack(v) for v in values]
    if payload_len is not None:
        parts.append(b"\xc6" + payload_len.to_bytes(4, "big"))
    return b"".join(parts)


def encode_parts(msg: Message) -> tuple[bytes, bytes | bytearray | memoryview]:
    """``(head, payload)``: the message is their concatenation. The payload is the caller's
    object, not a copy (b"" for types without one); write both parts to a stream as they are."""
    schema = _schema_of(type(msg))
    rules = schema.rules[:-1] if schema.has_payload else schema.rules
    count = len(rules)
    # trailing fields at their defaults are left off: a peer of an older version, which knows
    # fewer fields, still reads the message whenever the newer fields say nothing
    while count > schema.required and getattr(msg, schema.names[count - 1]) == schema.defaults[count - 1 - schema.required]:
        count -= 1
    values = [rule.to_wire(getattr(msg, name)) for name, rule in zip(schema.names[:count], rules[:count])]
    payload = getattr(msg, schema.names[-1]) if schema.has_payload else b""
    head = frame_head(schema.tag, values, len(payload) if schema.has_payload else None)
    if len(head) > MAX_HEAD_BYTES or len(head) + len(payload) > schema.max_size:
        raise InvalidMessage(f"{schema.cls.__name__} of {len(head) + len(payload)} bytes is over its "
                             f"{schema.max_size}-byte limit; split it")
    return head, payload


def encode(msg: Message) -> bytes:
    """The message's bytes (one copy of the payload, if any)."""
    head, payload = encode_parts(msg)
    return b"".join((head, payload)) if len(payload) else head


def digest(*parts: bytes | bytearray | memoryview) -> bytes:
    """SHA-256 of the concatenated parts: the hash used for payloads, state chunks and
    envelopes (OpenSSL's, ~2 GB/s with SHA-NI, and it releases the GIL)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.digest()


# ---------------------------------------------------------------------------------------
# Decoding.


def _no_duplicates(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate map key")
    return out


def byte_view(data: Any) -> memoryview:
    """A flat byte view of ``data`` without copying; raises DecodeError for non-buffers."""
    try:
        view = memoryview(data)
    except TypeError:
        raise DecodeError(f"expected bytes, got {type(data).__name__}") from None
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise DecodeError("expected a contiguous byte buffer")
        view = view.cast("B")
    return view


def decode(data: Any, *, max_size: int = MAX_FRAME_BYTES,
           expect: type | tuple[type, ...] | None = None) -> Message:
    """Parse and validate one message; its payload, if any, is a memoryview into ``data``.

    Raises only DecodeError (or MessageTooLarge / VersionMismatch)."""
    msg, _ = decode_split(data, max_size=max_size)
    if expect is not None and not isinstance(msg, expect):
        names = ", ".join(c.__name__ for c in (expect if isinstance(expect, tuple) else (expect,)))
        raise DecodeError(f"expected {names}, got {type(msg).__name__}")
    return msg


def decode_split(data: Any, *, max_size: int = MAX_FRAME_BYTES) -> tuple[Message, int]:
    """The message, and the length of its head: the payload starts there (``len(data)``
    for types without a payload)."""
    _import_catalogue()
    view = byte_view(data)
    n = len(view)
    if n > max_size:
        raise MessageTooLarge(f"message of {n} bytes is over the {max_size}-byte limit")
    unpacker = msgpack.Unpacker(
        raw=False, use_list=False, strict_map_key=True, object_pairs_hook=_no_duplicates,
        max_buffer_size=MAX_HEAD_BYTES, read_size=_FIRST_FEED, max_str_len=_MAX_STR, max_bin_len=_MAX_BIN,
        max_array_len=_MAX_ARRAY, max_map_len=_MAX_MAP, max_ext_len=0)
    fed = min(n, _FIRST_FEED)
    unpacker.feed(view[:fed])
    try:
        count = unpacker.read_array_header()
        version = unpacker.unpack()
        tag = unpacker.unpack()
    except Exception as e:  # msgpack raises many types for malformed input
        raise DecodeError(f"not a swarmstream message ({type(e).__name__}: {e})") from None
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise VersionMismatch(f"message uses protocol version {describe(version)}, we speak "
                              f"{PROTOCOL_VERSION}; the older side should upgrade swarmstream")
    schema = _BY_TAG.get(tag) if type(tag) is int else None
    if schema is None:
        raise DecodeError(f"unknown message type {describe(tag)}")
    if n > schema.max_size:
        raise MessageTooLarge(f"{schema.cls.__name__} of {n} bytes is over its {schema.max_size}-byte limit")
    if not schema.required <= count - 2 <= len(schema.names):
        want = (f"{len(schema.names)}" if schema.required == len(schema.names) else
                f"{schema.required} to {len(schema.names)}")
        raise DecodeError(f"{schema.cls.__name__} has {want} fields, got {count - 2}")
    names = schema.names[:count - 2]  # a sender of an older version leaves the defaulted tail off
    head_limit = min(n, MAX_HEAD_BYTES) if schema.has_payload else n
    values = []
    for name in names[:-1] if schema.has_payload else names:
        while True:
            try:
                values.append(unpacker.unpack())
                break
            except msgpack.OutOfData:
                if fed >= head_limit:
                    raise DecodeError(f"{schema.cls.__name__} is truncated at field {name!r}") from None
                unpacker.feed(view[fed:head_limit])
                fed = head_limit
            except Exception as e:
                raise DecodeError(f"{schema.cls.__name__}.{name}: {type(e).__name__}: {e}") from None
    end = unpacker.tell()
    head_len = n
    size = None
    if schema.has_payload:
        size, header = _bin_header(view, end, schema.cls.__name__)
        head_len = end + header
        end = head_len + size
        if end > n:
            raise DecodeError(f"{schema.cls.__name__} payload is truncated: {size} bytes announced, "
                              f"{n - head_len} present")
    if end != n:
        raise DecodeError(f"{n - end} trailing bytes after {schema.cls.__name__}")
    # One message, one encoding: the head as ``frame_head`` writes it (msgpack's shortest forms,
    # a bin32 payload header). Else the same signed message could travel as other bytes (an
    # envelope's own fields are not signed), and bytes are what digests and evidence compare.
    try:
        canonical = frame_head(tag, values, size)
    except (TypeError, ValueError, OverflowError) as e:
        raise DecodeError(f"{schema.cls.__name__}: {type(e).__name__}: {e}") from None
    if view[:head_len] != canonical:
        raise DecodeError(f"{schema.cls.__name__} is not in canonical form (msgpack's shortest encoding of each "
                          f"field, a bin32 payload header)")
    if schema.has_payload:
        values.append(view[head_len:end])
    try:
        msg = schema.cls(**dict(zip(names, values)))
    except InvalidMessage as e:
        raise DecodeError(str(e)) from None
    return msg, head_len


def _bin_header(view: memoryview, pos: int, what: str) -> tuple[int, int]:
    """``(length, header size)`` of the msgpack bin object at ``pos``."""
    marker = view[pos] if pos < len(view) else None
    width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(marker)  # type: ignore[arg-type]
    if width is None or pos + 1 + width > len(view):
        raise DecodeError(f"{what} payload is missing or not binary")
    return int.from_bytes(view[pos + 1:pos + 1 + width], "big"), 1 + width


_catalogue_loaded = False


def _import_catalogue() -> None:
    # Message types register themselves on import; make sure decode knows all of them
    # whichever module the caller imported first.
    global _catalogue_loaded
    if not _catalogue_loaded:
        import protocol.envelope  # noqa: F401
        import protocol.manifest  # noqa: F401
        import protocol.messages_control  # noqa: F401
        import protocol.messages_swarm  # noqa: F401

        _catalogue_loaded = True
