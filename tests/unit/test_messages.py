"""The wire schema: round trips for every message type, and hostile bytes that must only ever
raise the protocol's own DecodeError."""

from __future__ import annotations

import dataclasses
import math
import tracemalloc
from typing import Annotated

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.config import CODEC_NAMES, DataConfig, InnerConfig, SyncConfig, TrainConfig, model_preset
from protocol.identity import Identity
from protocol.manifest import RunManifest, SwarmConfig
from protocol.messages import (
    PROTOCOL_VERSION, SMALL_MESSAGE_BYTES, DecodeError, InvalidMessage, Message, MessageTooLarge, Tag,
    VersionMismatch, decode, decode_split, encode, encode_parts, message_types,
)
from protocol.messages_rules import Bool, Bytes, ConfigOf, Float, Int, Opt, Payload, Seq, Str
from protocol.messages_control import StatusReported
from protocol.messages_swarm import EvidencePiece, GroupFormed, Heartbeat, PushSlice, SliceAveraged, StateIndex

fast = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------
# Strategies, derived from each field's Rule; types with rules across fields get their own.

peer_ids = st.binary(min_size=32, max_size=32).map(lambda s: Identity.from_seed(s).peer_id)
maddrs = st.builds(lambda a, p, pid: f"/ip4/10.0.{a}.1/tcp/{p}/p2p/{pid}",
                   st.integers(0, 255), st.integers(1, 65535), peer_ids)
safe_text_chars = st.characters(blacklist_categories=("Cc", "Cs", "Cf", "Cn"))


def rule_strategy(rule):
    if isinstance(rule, Int):
        return st.integers(rule.lo, rule.hi)
    if isinstance(rule, Float):
        return st.floats(rule.lo, rule.hi, allow_nan=False, allow_infinity=False)
    if isinstance(rule, Bool):
        return st.booleans()
    if isinstance(rule, Str):
        if rule.choices is not None:
            return st.sampled_from(rule.choices)
        if rule.pattern is not None:
            return maddrs if "/" in rule.pattern.pattern else peer_ids
        chars = st.one_of(safe_text_chars, st.just("\n")) if rule.multiline else safe_text_chars
        return st.text(chars, min_size=rule.min_len, max_size=min(rule.max_len, 30))
    if isinstance(rule, Bytes):
        return st.sampled_from(rule.sizes).flatmap(lambda n: st.binary(min_size=n, max_size=n))
    if isinstance(rule, Payload):
        return st.binary(max_size=300)
    if isinstance(rule, Seq):
        return st.lists(rule_strategy(rule.item), min_size=rule.min_len,
                        max_size=min(rule.max_len, 4)).map(tuple)
    if isinstance(rule, Opt):
        return st.none() | rule_strategy(rule.item)
    if isinstance(rule, ConfigOf):
        return train_configs if rule.cls is TrainConfig else swarm_configs
    raise AssertionError(f"no strategy for {rule!r}")


def auto_strategy(cls):
    from protocol.messages import _schema_of

    schema = _schema_of(cls)
    return st.builds(cls, **{n: rule_strategy(r) for n, r in zip(schema.names, schema.rules)})


train_configs = st.builds(
    lambda preset, seed, lr, h, p, codec, alpha: TrainConfig(
        model=model_preset(preset), data=DataConfig(seed=seed), inner=InnerConfig(lr=lr),
        sync=SyncConfig(inner_steps=h, fragments=p, overlap=min(2, h // p - 1), alpha=alpha, codec=codec)),
    st.sampled_from(["tiny", "small", "150m", "1b"]), st.integers(0, 2**32), st.floats(1e-5, 1e-1),
    st.integers(4, 1000), st.integers(1, 4), st.sampled_from(CODEC_NAMES), st.floats(0.0, 0.9))
swarm_configs = st.builds(
    lambda g, m, a: SwarmConfig(group_size=g, matchmaking_timeout_s=m, allreduce_timeout_s=a),
    st.integers(2, 256), st.floats(0.5, 600), st.floats(0.5, 3600))


@st.composite
def tensors(draw):
    codec = draw(st.sampled_from(CODEC_NAMES))
    numel = draw(st.integers(0, 400))
    shape = draw(st.sampled_from([(numel,), (1, numel), (numel, 1)]))
    size = {"fp32": 4 * numel, "fp16": 2 * numel, "bf16": 2 * numel}.get(codec)
    if size is None:
        low = (numel * (8 if codec == "int8" else 4) + 7) // 8
        size = draw(st.integers(low, low + 64))
    return dict(codec=codec, numel=numel, shape=shape, payload=draw(st.binary(min_size=size, max_size=size)))


def slice_strategy(cls):
    from protocol.messages import _schema_of

    base = {n: rule_strategy(r) for n, r in zip(_schema_of(cls).names, _schema_of(cls).rules)}
    for name in ("codec", "numel", "shape", "payload"):
        del base[name]
    if cls is SliceAveraged:
        base["contributors"] = st.sets(st.integers(0, 255), min_size=1, max_size=5).map(lambda s: tuple(sorted(s)))
    return st.builds(lambda t, **kw: cls(**t, **kw), tensors(), **base)


@st.composite
def groups(draw):
    members = draw(st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=5, unique=True))
    weights = draw(st.lists(st.floats(0, 1e9), min_size=len(members), max_size=len(members)))
    return GroupFormed(run_id=draw(st.binary(min_size=20, max_size=20)), fragment=draw(st.integers(0, 1023)),
                       round=draw(st.integers(0, 2**32 - 1)), group_id=draw(st.binary(min_size=16, max_size=16)),
                       members=tuple(members), weights=tuple(weights), numel=draw(st.integers(0, 2**40)),
                       codec=draw(st.sampled_from(CODEC_NAMES)), deadline_s=draw(st.floats(0, 600)),
                       idle=tuple(sorted(draw(st.sets(st.integers(0, len(members) - 1), max_size=len(members) // 3)))))


@st.composite
def state_indexes(draw):
    chunk = draw(st.integers(1, 1 << 20))
    n = draw(st.integers(0, 6))
    total = 0 if n == 0 else draw(st.integers((n - 1) * chunk + 1, n * chunk))
    return StateIndex(run_id=draw(st.binary(min_size=20, max_size=20)), step=draw(st.integers(0, 2**40)),
                      rounds=tuple(draw(st.lists(st.integers(0, 1000), max_size=4))), format="safetensors",
                      total_bytes=total, chunk_bytes=chunk,
                      chunk_digests=tuple(draw(st.lists(st.binary(min_size=32, max_size=32), min_size=n, max_size=n))))


STRATEGIES = {cls: auto_strategy(cls) for cls in message_types().values()}
STRATEGIES[PushSlice] = slice_strategy(PushSlice)
STRATEGIES[SliceAveraged] = slice_strategy(SliceAveraged)
STRATEGIES[GroupFormed] = groups()
STRATEGIES[StateIndex] = state_indexes()
STRATEGIES[EvidencePiece] = st.integers(2, 4096).flatmap(lambda n: st.builds(
    EvidencePiece, run_id=st.binary(min_size=20, max_size=20), whole=st.binary(min_size=32, max_size=32),
    piece=st.integers(0, n - 1), pieces=st.just(n), payload=st.binary(max_size=64)))
ALL_TYPES = sorted(message_types().values(), key=lambda c: c.TAG)
any_message = st.sampled_from(ALL_TYPES).flatmap(lambda c: STRATEGIES[c])


def heartbeat() -> Heartbeat:
    return Heartbeat(run_id=b"r" * 20, sent_at=1.7e9, state="training", step=10, tokens=1280, tokens_per_s=99.5,
                     rounds=(1, 0), state_digest=b"", reachable=True, maddrs=(), client="swarmstream/0.1.0",
                     device="cpu")


def test_every_tag_has_a_message_type_and_a_strategy():
    assert set(message_types()) == set(Tag)
    assert set(STRATEGIES) == set(message_types().values())


# ---------------------------------------------------------------------------------------
# Round trips.


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda c: c.__name__)
@fast
@given(data=st.data())
def test_round_trip(cls, data):
    msg = data.draw(STRATEGIES[cls])
    wire = encode(msg)
    back = decode(wire, expect=cls)
    assert back == msg
    assert encode(back) == wire  # one encoding per message: what signatures and run IDs rely on
    assert len(wire) <= cls.MAX_SIZE


def test_payload_is_neither_copied_on_encode_nor_on_decode():
    msg = PushSlice(run_id=b"r" * 20, fragment=0, round=1, group_id=b"g" * 16, part=0, offset=0, numel=1000,
                    shape=(1000,), dtype="float32", codec="fp16", weight=1.0, stopping=False, payload=bytes(2000))
    head, payload = encode_parts(msg)
    assert payload is msg.payload
    wire = head + payload
    back, head_len = decode_split(wire)
    assert isinstance(back.payload, memoryview) and back.payload.obj is wire
    assert head_len == len(head) and back.payload == msg.payload


def test_lists_are_stored_as_tuples_and_ints_as_floats():
    hb = heartbeat()
    again = dataclasses.replace(hb, rounds=[1, 2], tokens_per_s=3)
    assert again.rounds == (1, 2) and type(again.tokens_per_s) is float


# ---------------------------------------------------------------------------------------
# Hostile bytes.


def _decode_or_reject(data) -> Message | None:
    try:
        return decode(data)
    except DecodeError:
        return None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_only_raise_decode_error(data):
    _decode_or_reject(data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(Tag)), st.binary(max_size=300))
def test_random_fields_behind_a_valid_header_only_raise_decode_error(tag, rest):
    _decode_or_reject(bytes([0x9F, PROTOCOL_VERSION, int(tag)]) + rest)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(Tag)), st.lists(msgpack_values, max_size=14))
def test_well_formed_msgpack_of_wrong_types_only_raises_decode_error(tag, values):
    msg = _decode_or_reject(msgpack.packb([PROTOCOL_VERSION, int(tag), *values], use_bin_type=True))
    assert msg is None or msg.TAG == tag


@st.composite
def mutations(draw, wire: bytes) -> bytes:
    b = bytearray(wire)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "overwrite", "append"]))
        i = draw(st.integers(0, max(0, len(b) - 1)))
        if kind == "flip" and b:
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del b[i:]
        elif kind == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del b[i:i + draw(st.integers(1, 8))]
        elif kind == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=8))
            b[i:i + len(chunk)] = chunk
        else:
            b += draw(st.binary(min_size=1, max_size=8))
    return bytes(b)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_messages_only_raise_decode_error(data):
    wire = encode(data.draw(any_message))
    mutated = data.draw(mutations(wire))
    msg = _decode_or_reject(mutated)
    if msg is not None:  # a mutation can land on another valid message; then it must be canonical
        assert decode(encode(msg)) == msg


@pytest.mark.parametrize("crafted", [
    bytes([0x93, PROTOCOL_VERSION, Tag.HEARTBEAT]) + b"\xdd\xff\xff\xff\xff",  # array of 2**32-1
    bytes([0x93, PROTOCOL_VERSION, Tag.HEARTBEAT]) + b"\xdf\xff\xff\xff\xff",  # map of 2**32-1
    bytes([0x93, PROTOCOL_VERSION, Tag.HEARTBEAT]) + b"\xdb\xff\xff\xff\xff",  # str of 4 GiB
    bytes([0x93, PROTOCOL_VERSION, Tag.HEARTBEAT]) + b"\xc6\xff\xff\xff\xff",  # bin of 4 GiB
    bytes([0x9F, PROTOCOL_VERSION, Tag.PUSH_SLICE]) + b"\xc4\x14" + b"r" * 20 + b"\xc6\xff\xff\xff\xff",
    b"\xdd\xff\xff\xff\xff" + bytes([PROTOCOL_VERSION, Tag.HEARTBEAT]),
    b"\x91" * 5000,  # deep nesting
], ids=["array", "map", "str", "bin", "payload", "outer-array", "nesting"])
def test_announced_sizes_are_not_allocated(crafted):
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError):
            decode(crafted)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_size_limits_are_checked_before_parsing():
    with pytest.raises(MessageTooLarge):
        decode(b"\0" * 100, max_size=99)
    hb = encode(heartbeat())
    with pytest.raises(MessageTooLarge, match="Heartbeat"):
        decode(hb + b"\0" * SMALL_MESSAGE_BYTES)  # over Heartbeat's own limit


def test_rejections_name_the_problem():
    hb = encode(heartbeat())
    with pytest.raises(DecodeError, match="trailing"):
        decode(hb + b"\xc0")
    with pytest.raises(VersionMismatch, match="upgrade"):
        decode(msgpack.packb([PROTOCOL_VERSION + 1, int(Tag.HEARTBEAT)]))
    with pytest.raises(DecodeError, match="unknown message type"):
        decode(msgpack.packb([PROTOCOL_VERSION, 250]))
    with pytest.raises(DecodeError, match="fields"):
        decode(msgpack.packb([PROTOCOL_VERSION, int(Tag.GET_STATUS), 1, 2]))
    with pytest.raises(DecodeError, match="expected PushSlice"):
        decode(hb, expect=PushSlice)
    with pytest.raises(DecodeError, match="must be an integer"):
        decode(msgpack.packb([PROTOCOL_VERSION, int(Tag.GET_STATUS), True]))
    with pytest.raises(DecodeError, match="duplicate"):
        decode(msgpack.packb([PROTOCOL_VERSION, int(Tag.GET_STATUS), {"a": 1}])[:-3] + b"\x82\xa1a\x01\xa1a\x01")
    with pytest.raises(DecodeError, match="expected bytes"):
        decode("not bytes")


def test_text_from_peers_cannot_carry_terminal_escapes():
    hb = heartbeat()
    for bad in ["\x1b[2J", "name\u202egnp.exe", "a\rb", "zero\u200bwidth"]:
        with pytest.raises(InvalidMessage, match="control or invisible"):
            dataclasses.replace(hb, client=bad)


@pytest.mark.parametrize("change, reason", [
    (dict(numel=10), "elements"),
    (dict(codec="fp32"), "fp32 payload"),
    (dict(payload=b"\0" * 4000), "fp16 payload"),
    (dict(codec="fp4", payload=b"\0" * 10), "cannot be"),
    (dict(round=-1), "round must be in"),
    (dict(run_id=b"short"), "run_id must be 20 bytes"),
    (dict(dtype="int64"), "dtype must be one of"),
    (dict(weight=math.inf), "finite"),
    (dict(shape=[1000]), None),  # lists are fine
])
def test_slices_are_validated_at_construction(change, reason):
    base = dict(run_id=b"r" * 20, fragment=0, round=1, group_id=b"g" * 16, part=0, offset=0, numel=1000,
                shape=(1000,), dtype="float32", codec="fp16", weight=1.0, stopping=False, payload=bytes(2000))
    if reason is None:
        assert PushSlice(**{**base, **change}).shape == (1000,)
    else:
        with pytest.raises(InvalidMessage, match=reason):
            PushSlice(**{**base, **change})


def test_group_and_index_cross_field_rules():
    key = bytes(32)
    with pytest.raises(InvalidMessage, match="twice"):
        GroupFormed(run_id=b"r" * 20, fragment=0, round=0, group_id=b"g" * 16, members=(key, key),
                    weights=(1.0, 1.0), numel=10, codec="fp4", deadline_s=30)
    three = tuple(bytes([i]) * 32 for i in range(3))
    for idle, why in [((2, 1), "ascending"), ((1, 1), "ascending"), ((3,), "indices"), ((0, 1), "a third")]:
        with pytest.raises(InvalidMessage, match=why):
            GroupFormed(run_id=b"r" * 20, fragment=0, round=0, group_id=b"g" * 16, members=three,
                        weights=(1.0,) * 3, numel=10, codec="fp4", deadline_s=30, idle=idle)
    with pytest.raises(InvalidMessage, match="digests"):
        StateIndex(run_id=b"r" * 20, step=0, rounds=(), format="safetensors", total_bytes=10, chunk_bytes=4,
                   chunk_digests=(bytes(32),) * 2)


def test_manifests_with_absurd_models_are_rejected():
    creator = Identity.from_seed(bytes(32)).public_key
    man = RunManifest(name="x", description="", train=TrainConfig(), swarm=SwarmConfig(), creator=creator,
                      created_at=0)
    wire = encode(man)
    train = msgpack.unpackb(wire)[4]
    train["model"]["n_layers"] = 2**40
    forged = msgpack.packb([PROTOCOL_VERSION, int(Tag.RUN_MANIFEST), "x", "", train, msgpack.unpackb(wire)[5],
                            creator, 0.0], use_bin_type=True)
    with pytest.raises(DecodeError, match="n_layers"):
        decode(forged)


# ---------------------------------------------------------------------------------------
# Fields added later: a defaulted tail that an older sender leaves off.


def status_reported(**change) -> StatusReported:
    fields = dict(
        request_id=7, at=1.7e9, run_id=b"r" * 20, run_name="demo", peer_id=Identity.from_seed(bytes(32)).peer_id,
        state="training", pause_reason="", step=120, tokens=1, tokens_per_s=1.0, loss=None, heldout_loss=None,
        peers=1, rounds_done=0, upload_bps=0.0, download_bps=0.0, uptime_s=1.0, device="cpu", reachability="direct",
        inner_step_s=0.25, progress=None, progress_label="", settings_path="", settings_toml="",
        tokens_contributed=0, fragments_contributed=0, fragments_alone=0, rounds_joined=0, steps_dropped=0,
        join_address="swarmstream:" + "a" * 32 + "@/ip4/10.0.0.1/tcp/4001", total_steps=2000,
        awaiting_confirm=True, banned=("12D3KooW lied",))
    return StatusReported(**{**fields, **change})


def test_a_status_from_an_older_node_without_the_newer_fields_decodes_with_their_defaults():
    new = status_reported()
    array = msgpack.unpackb(encode(new), use_list=True)
    at = 2 + [f.name for f in dataclasses.fields(StatusReported)].index("total_steps")
    assert array[at] == 2000
    old = msgpack.packb(array[:at], use_bin_type=True)  # what a node of the version before it sends
    back = decode(old, expect=StatusReported)
    assert back == dataclasses.replace(new, total_steps=0, awaiting_confirm=False, banned=())
    at = 2 + [f.name for f in dataclasses.fields(StatusReported)].index("join_address")
    older = msgpack.packb(array[:at], use_bin_type=True)  # and one from before join_address
    assert decode(older, expect=StatusReported) == dataclasses.replace(new, join_address="", total_steps=0,
                                                                       awaiting_confirm=False, banned=())


def test_fields_at_their_defaults_at_the_end_are_left_off_so_an_older_peer_reads_the_message():
    """Found by a review: a heartbeat always carried its new list of bans, empty or not, and
    a peer of the version before it (which knows one field fewer) refused every heartbeat."""
    names = [f.name for f in dataclasses.fields(StatusReported)]
    full = msgpack.unpackb(encode(status_reported()), use_list=True)
    assert len(full) == 2 + len(names)
    short = msgpack.unpackb(encode(status_reported(banned=(), awaiting_confirm=False)), use_list=True)
    assert len(short) == 2 + names.index("awaiting_confirm")  # both trailing defaults left off
    kept = msgpack.unpackb(encode(status_reported(awaiting_confirm=False)), use_list=True)
    assert len(kept) == len(full)  # a default before a field that says something is written
    assert len(msgpack.unpackb(encode(heartbeat()))) == 2 + len(dataclasses.fields(Heartbeat)) - 1  # no bans: no list
    for msg in (status_reported(banned=(), awaiting_confirm=False), status_reported(awaiting_confirm=False), heartbeat()):
        assert decode(encode(msg)) == msg


def test_a_heartbeat_lists_its_bans_and_one_from_before_the_list_decodes_with_none():
    keys = tuple(bytes([i]) * 32 for i in range(8))
    new = dataclasses.replace(heartbeat(), banned=keys)
    assert decode(encode(new), expect=Heartbeat) == new
    array = msgpack.unpackb(encode(new), use_list=True)
    assert decode(msgpack.packb(array[:-1], use_bin_type=True), expect=Heartbeat) == heartbeat()  # an older peer's
    for bad in ([b"k" * 31], [b"k" * 32] * 9, [1]):  # a short key, more than a heartbeat lists, not bytes
        with pytest.raises(DecodeError, match="banned"):
            decode(msgpack.packb(array[:-1] + [bad], use_bin_type=True))


def test_the_defaulted_tail_is_still_strict():
    array = msgpack.unpackb(encode(status_reported()), use_list=True)
    fields = dataclasses.fields(StatusReported)
    n, required = len(fields), sum(f.default is dataclasses.MISSING for f in fields)
    at = 2 + [f.name for f in fields].index("total_steps")
    with pytest.raises(DecodeError, match=f"StatusReported has {required} to {n} fields, got {required - 1}"):
        decode(msgpack.packb(array[:1 + required], use_bin_type=True))  # the last required field is missing
    with pytest.raises(DecodeError, match=f"StatusReported has {required} to {n} fields, got {n + 1}"):
        decode(msgpack.packb(array + [1], use_bin_type=True))
    for bad in (-1, "2000", None, 1.5):
        with pytest.raises(DecodeError, match="total_steps"):
            decode(msgpack.packb(array[:at] + [bad] + array[at + 1:], use_bin_type=True))
    with pytest.raises(DecodeError, match="GetStatus has 1 fields, got 0"):
        decode(msgpack.packb([PROTOCOL_VERSION, int(Tag.GET_STATUS)]))  # no defaults: every field required


def test_defaults_only_at_the_end_and_never_beside_a_payload():
    from protocol.messages import message

    with pytest.raises(TypeError, match="fields with defaults go at the end"):
        @message(Tag.GET_STATUS)
        @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
        class Gap(Message):
            a: Annotated[int, Int(0, 9)] = 0
            b: Annotated[int, Int(0, 9)]

    with pytest.raises(TypeError, match="payload cannot have fields with defaults"):
        @message(Tag.GET_STATUS)
        @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
        class Tail(Message):
            a: Annotated[int, Int(0, 9)] = 0
            data: Annotated[bytes, Payload()] = b""
