"""Wire codecs: exact sizes, error bounds, the byte layout of docs/codecs.md, hostile bytes.

The layout checks parse payloads with ``struct`` (independently of protocol.codecs) and the
reference quantizers below are the obvious whole-tensor versions of the spec, so a chunking
or packing bug in the fast path shows up as a mismatch.
"""

from __future__ import annotations

import hashlib
import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocol.codecs
from protocol.codecs import _CHUNK, E2M1_VALUES, Codec, get_codec
from protocol.config import CODEC_NAMES
from protocol.errors import LocalProtocolError, RemoteProtocolError

SIZES = [0, 1, 2, 31, 32, 33, 255, 256, 257, 511, 1000, 4097]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float64)
SMALL_CHUNK = 1024  # elements; lets tests cross chunk boundaries with small tensors


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(protocol.codecs, "_CHUNK", SMALL_CHUNK)


def expected_size(name: str, n: int) -> int:
    return {"fp32": 4 * n, "fp16": 2 * n, "bf16": 2 * n,
            "int8": 4 * math.ceil(n / 256) + n,
            "fp4": 2 * math.ceil(n / 32) + math.ceil(n / 2)}[name]


def randn(n: int, seed: int = 0, scale: float = 1e-3) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def parse_int8(b: bytes, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    nb = math.ceil(n / 256)
    scales = torch.tensor(struct.unpack(f"<{nb}f", b[: 4 * nb]), dtype=torch.float64)
    return scales, torch.tensor(struct.unpack(f"<{n}b", b[4 * nb :]), dtype=torch.float64)


def parse_fp4(b: bytes, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (nb,) scales and (n,) codes 0..15, read per the spec (bf16 = top half of an fp32)."""
    nb = math.ceil(n / 32)
    raw = struct.unpack(f"<{nb}H", b[: 2 * nb])
    scales = torch.tensor([struct.unpack("<f", struct.pack("<I", r << 16))[0] for r in raw], dtype=torch.float64)
    body = b[2 * nb :]
    codes = [(body[i // 2] >> 4) if i % 2 else (body[i // 2] & 15) for i in range(n)]
    return scales, torch.tensor(codes, dtype=torch.int64)


def code_value(codes: torch.Tensor) -> torch.Tensor:
    return E2M1[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0).double()


def ref_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec version: pad to blocks of 256, scale = absmax/127, q = round(x / scale)."""
    n = x.numel()
    xb = torch.nn.functional.pad(x, (0, -n % 256)).view(-1, 256)
    s = xb.abs().amax(1) / 127
    q = (xb / torch.where(s > 0, s, 1.0)[:, None]).round().clamp(-127, 127)
    return s, q.view(-1)[:n]


def ref_fp4_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec version: bf16 scale = absmax/6; nearest E2M1 value of x/s, ties to the even code."""
    n = x.numel()
    xb = torch.nn.functional.pad(x, (0, -n % 32)).view(-1, 32)
    s = (xb.abs().amax(1) / 6).to(torch.bfloat16).float()
    a = (xb / torch.where(s > 0, s, 1.0)[:, None]).view(-1)[:n]  # fp32 division, as specified
    dist = (a.abs().double()[:, None] - E2M1[None, :]).abs()  # (n, 8), exact in fp64
    tied = dist == dist.min(1, keepdim=True).values
    score = tied.int() + 2 * (tied & (torch.arange(8) % 2 == 0)).int()  # prefer the even code
    mag = score.argmax(1)
    return s, mag | torch.where((a < 0) & (mag > 0), 8, 0)


# --- registry and sizes ----------------------------------------------------------------------


def test_registry_matches_config():
    assert tuple(get_codec(n).name for n in CODEC_NAMES) == CODEC_NAMES
    assert all(isinstance(get_codec(n), Codec) for n in CODEC_NAMES)
    with pytest.raises(LocalProtocolError, match="fp32, fp16, bf16, int8, fp4"):
        get_codec("fp8")


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_sizes_exact(name):
    codec = get_codec(name)
    for n in SIZES + [_CHUNK - 1, _CHUNK + 257]:
        assert codec.encoded_size(n) == expected_size(name, n)
        assert len(codec.encode(randn(n, seed=n))) == expected_size(name, n), n
    assert codec.encoded_size(10**12 + 1) == expected_size(name, 10**12 + 1)
    for bad in (-1, 1.5, True):
        with pytest.raises(LocalProtocolError):
            codec.encoded_size(bad)


# --- round trips -----------------------------------------------------------------------------


def test_fp32_exact():
    x = torch.cat([randn(1000), torch.tensor([0.0, -0.0, 1e-45, -3.4e38, 3.4028235e38, 1e-40])])
    b = get_codec("fp32").encode(x)
    assert b == struct.pack(f"<{x.numel()}f", *x.tolist())
    assert torch.equal(get_codec("fp32").decode(b, x.numel()), x)


@pytest.mark.parametrize("name,dtype,rel", [("fp16", torch.float16, 2**-11), ("bf16", torch.bfloat16, 2**-8)])
def test_half_precision_round_trip(name, dtype, rel):
    codec = get_codec(name)
    g = torch.Generator().manual_seed(0)
    mant = (1 + torch.rand(5000, generator=g)) * torch.where(torch.rand(5000, generator=g) < 0.5, -1.0, 1.0)
    x = mant * torch.logspace(-4, 4, 5000)  # |x| in [1e-4, 2e4]: normal range of both formats
    y = codec.decode(codec.encode(x), x.numel())
    assert y.dtype == torch.float32 and y.shape == (5000,)
    assert torch.equal(y, x.to(dtype).float())  # bit-exact with torch's round-to-nearest-even
    assert ((y - x).abs() <= rel * x.abs()).all()


def test_bf16_ties_to_even_and_layout():
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -2.0])  # two exact ties, one plain value
    b = get_codec("bf16").encode(x)
    assert b == struct.pack("<3H", 0x3F80, 0x3F82, 0xC000)


def test_fp16_and_bf16_saturate_instead_of_inf():
    x = torch.tensor([1e5, -1e6, 65519.0, 65520.0, 1.0])
    assert get_codec("fp16").decode(get_codec("fp16").encode(x), 5).tolist() == [65504, -65504, 65504, 65504, 1]
    big = torch.tensor([3.4028235e38, -3.4e38])
    y = get_codec("bf16").decode(get_codec("bf16").encode(big), 2)
    assert torch.isfinite(y).all() and y[0] == torch.finfo(torch.bfloat16).max


@pytest.mark.parametrize("n", SIZES + [SMALL_CHUNK * 2 + 300, SMALL_CHUNK * 3])
def test_int8_matches_spec_and_error_bound(n, small_chunks):
    x = randn(n, seed=n) * torch.logspace(-4, 2, n)  # blocks of very different magnitude
    b = get_codec("int8").encode(x)
    scales, q = parse_int8(b, n)
    s_ref, q_ref = ref_int8(x)
    assert torch.equal(scales.float(), s_ref) and torch.equal(q.float(), q_ref)
    y = get_codec("int8").decode(b, n)
    s_el = scales.repeat_interleave(256)[:n]
    assert torch.equal(y, (q * s_el).float())
    assert ((y.double() - x.double()).abs() <= s_el / 2 * (1 + 1e-5)).all()


def test_int8_golden_bytes_and_ties():
    x = torch.tensor([127.0, -1.0, 0.5, 1.5, 2.5, -2.5])  # scale 1.0; ties go to even
    assert get_codec("int8").encode(x) == struct.pack("<f6b", 1.0, 127, -1, 0, 2, 2, -2)


@pytest.mark.parametrize("n", SIZES + [SMALL_CHUNK * 2 + 33, SMALL_CHUNK * 3])
def test_fp4_matches_spec_and_error_bound(n, small_chunks):
    x = randn(n, seed=n) * torch.logspace(-4, 2, n)
    b = get_codec("fp4").encode(x)
    scales, codes = parse_fp4(b, n)
    s_ref, c_ref = ref_fp4_codes(x)
    assert torch.equal(scales.float(), s_ref) and torch.equal(codes, c_ref)
    y = get_codec("fp4").decode(b, n)
    s_el = scales.repeat_interleave(32)[:n]
    assert torch.equal(y, (code_value(codes) * s_el).float())
    # Bound: half the gap between the E2M1 neighbours of |x|/s; beyond 6 (scale rounded down
    # to bf16) the excess over 6, which is at most 6 * 2**-8.
    a = (x.double() / torch.where(s_el > 0, s_el, 1.0)).abs()
    hi_i = torch.searchsorted(E2M1, a.clamp(max=6.0))
    lo_v, hi_v = E2M1[(hi_i - 1).clamp(min=0)], E2M1[hi_i]
    half_gap = torch.where(a <= 6, (hi_v - lo_v) / 2, a - 6)
    assert (a <= 6 * (1 + 2**-8)).all()
    assert ((y.double() - x.double()).abs() <= half_gap * s_el * (1 + 1e-6)).all()


def test_fp4_representable_values_are_exact():
    vals = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES[1:]))  # 15 values
    for c in (2.0**-20, 0.125, 1.0, 3.0, 2.0**30):  # scale = 6c / 6 = c is a bf16 value
        x = torch.cat([vals, vals.flip(0), torch.tensor([6.0, -6.0])]) * c  # 32: one block
        for n in (32, 17, 3):  # full block, short tail, odd count (6 must be in the block)
            xn = torch.cat([torch.tensor([6.0 * c]), x[: n - 1]])  # 6c fixes the scale at c
            assert torch.equal(get_codec("fp4").decode(get_codec("fp4").encode(xn), n), xn)


def test_fp4_ties_go_to_even_code():
    x = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -5, 0.25 + 2**-20, 0.75 - 2**-20])
    y = get_codec("fp4").decode(get_codec("fp4").encode(x), x.numel())
    assert y.tolist() == [6, 0, 1, 1, 2, 2, 4, 4, 0, -1, -4, 0.5, 0.5]


def test_fp4_golden_bytes_nibble_order():
    # scale bf16(6/6) = 0x3F80; codes 7 (6.0), 2 (1.0), 9 (-0.5); low nibble first, 0 padding
    assert get_codec("fp4").encode(torch.tensor([6.0, 1.0])) == b"\x80\x3f\x27"
    assert get_codec("fp4").encode(torch.tensor([6.0, 1.0, -0.5])) == b"\x80\x3f\x27\x09"


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_signs_zeros_and_independent_blocks(name):
    codec = get_codec(name)
    x = randn(1000, seed=1)
    x[256:512] = 0.0  # an all-zero int8 block and eight all-zero fp4 blocks
    x[768:] *= 1e-30  # tiny blocks (int8's tail, fp4's last 8) next to normal ones
    x[700] = -0.0
    y = codec.decode(codec.encode(x), x.numel())
    assert (y * x >= 0).all()  # never flips a sign
    assert (y[256:512] == 0).all() and y[700] == 0
    for n in (0, 1, 33, 300):
        assert torch.equal(codec.decode(codec.encode(torch.zeros(n)), n), torch.zeros(n))
    if name == "int8":
        assert parse_int8(codec.encode(x), 1000)[0][1] == 0  # the zero block's scale
    if name in ("int8", "fp4"):  # tiny blocks keep their own precision (fp4: <= absmax/6)
        assert ((y[768:] - x[768:]).abs() <= 0.2 * x[768:].abs().max()).all()


def test_scale_limits_are_the_largest_safe_values():
    for limit, dtype, bits, qmax in ((protocol.codecs._INT8_SCALE_MAX, torch.float32, torch.int32, 127.0),
                                     (protocol.codecs._FP4_SCALE_MAX, torch.bfloat16, torch.int16, 6.0)):
        s = torch.tensor(limit, dtype=dtype)
        assert float(s) == limit and torch.isfinite(s.float() * qmax)
        assert torch.isinf((s.view(bits) + 1).view(dtype).float() * qmax)  # the next value up


def test_subnormal_and_near_max_inputs_stay_finite():
    x = torch.tensor([1e-45, -3e-44, 1e-40, 0.0] * 8 + [3.4028235e38, -3.4e38, 1.0, 0.0] * 8)
    for name in CODEC_NAMES:
        y = get_codec(name).decode(get_codec(name).encode(x), x.numel())
        assert torch.isfinite(y).all(), name
        assert (y * x >= 0).all(), name


# --- inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_layouts_and_dtypes_accepted(name):
    codec = get_codec(name)
    m = randn(48 * 70, seed=3).view(48, 70)
    t = m.t()  # non-contiguous view; row-major order of t is what gets sent
    assert not t.is_contiguous()
    assert codec.encode(t) == codec.encode(t.contiguous()) == codec.encode(t.contiguous().view(-1))
    assert codec.encode(m[:, ::2]) == codec.encode(m[:, ::2].contiguous())
    for dt in (torch.float16, torch.bfloat16):
        h = m.to(dt)
        assert codec.encode(h) == codec.encode(h.float()) == codec.encode(h.t().contiguous().t())
    assert codec.encode(m.double()) == codec.encode(m)
    assert codec.encode(torch.tensor(0.5)) == codec.encode(torch.tensor([0.5]))  # 0-d
    assert codec.encode(m.requires_grad_()) == codec.encode(m.detach())


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_non_finite_and_non_float_inputs_rejected(name, small_chunks):
    codec = get_codec(name)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for pos in (0, 300, SMALL_CHUNK + 5, SMALL_CHUNK + 299):  # first block, middle, next chunk, tail
            x = randn(SMALL_CHUNK + 300)
            x[pos] = bad
            with pytest.raises(LocalProtocolError, match="NaN or inf"):
                codec.encode(x)
        with pytest.raises(LocalProtocolError):
            codec.encode(torch.tensor([1.0, bad], dtype=torch.float16))
    with pytest.raises(LocalProtocolError):
        codec.encode(torch.arange(4))
    with pytest.raises(LocalProtocolError):
        codec.encode([1.0, 2.0])


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_deterministic_golden(name):
    # Inputs from exact integer arithmetic, so they are identical on every machine; the
    # digest pins the wire format: change it only together with docs/codecs.md.
    i = torch.arange(1000, dtype=torch.float32)
    x = ((i * 7919) % 2003 - 1001) / 1001 * 2.0**-7 * (1 + (i % 97))
    b = get_codec(name).encode(x)
    assert b == get_codec(name).encode(x.clone())
    assert hashlib.sha256(b).hexdigest()[:16] == GOLDEN[name]


GOLDEN = {"fp32": "40a75071335f702e", "fp16": "3b58d8b21a760591", "bf16": "8fe8022f232e4092",
          "int8": "fc69c0a1d7362317", "fp4": "4cdcaa26134e8b93"}


# --- hostile bytes ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_rejects_wrong_lengths_and_types(name):
    codec = get_codec(name)
    good = codec.encode(randn(257))
    for data in (good[:-1], good + b"\0", b"", good * 2):
        with pytest.raises(RemoteProtocolError, match="bytes"):
            codec.decode(data, 257)
    with pytest.raises(RemoteProtocolError):
        codec.decode(good, 10**15)  # must be rejected by length, not by allocating
    for bad_numel in (-1, 2.0, None):
        with pytest.raises(RemoteProtocolError):
            codec.decode(good, bad_numel)
    for bad_data in ("text", None, 12):
        with pytest.raises(RemoteProtocolError):
            codec.decode(bad_data, 257)
    assert torch.equal(codec.decode(memoryview(bytearray(good)), 257), codec.decode(good, 257))
    assert torch.equal(codec.decode(memoryview(b"x" + good)[1:], 257), codec.decode(good, 257))


def test_decode_rejects_bad_scales_and_codes():
    i8, f4 = get_codec("int8"), get_codec("fp4")
    q = bytes([1, 2, 3])
    for s in (float("nan"), float("inf"), -1.0, 3e38):  # 3e38 * 127 would overflow to inf
        with pytest.raises(RemoteProtocolError, match="scale"):
            i8.decode(struct.pack("<f", s) + q, 3)
    with pytest.raises(RemoteProtocolError, match="-128"):
        i8.decode(struct.pack("<f", 1.0) + bytes([1, 0x80, 3]), 3)
    for bits in (0x7FC0, 0x7F80, 0xBF80, 0x7F00):  # nan, inf, -1.0, 1.7e38
        with pytest.raises(RemoteProtocolError, match="scale"):
            f4.decode(struct.pack("<H", bits) + b"\x27\x09", 3)
    with pytest.raises(RemoteProtocolError, match="padding"):
        f4.decode(b"\x80\x3f\x27\x19", 3)
    for name, raw in (("fp16", struct.pack("<2H", 0x3C00, 0x7C00)), ("bf16", struct.pack("<2H", 0x3F80, 0x7FC1)),
                      ("fp32", struct.pack("<2f", 1.0, float("nan")))):
        with pytest.raises(RemoteProtocolError, match="NaN or inf"):
            get_codec(name).decode(raw, 2)


@SETTINGS
@given(name=st.sampled_from(CODEC_NAMES), n=st.integers(0, 300), data=st.data())
def test_decode_random_bytes_only_remote_errors(name, n, data):
    codec = get_codec(name)
    size = codec.encoded_size(n)
    payload = data.draw(st.one_of(st.binary(min_size=size, max_size=size), st.binary(max_size=size + 8)))
    acc = torch.ones(n)
    try:
        y = codec.decode(payload, n)
    except RemoteProtocolError:
        with pytest.raises(RemoteProtocolError):
            codec.decode_add_(acc, payload, 0.5)
        assert (acc == 1).all()  # nothing half-added
        return
    assert y.dtype == torch.float32 and y.shape == (n,) and torch.isfinite(y).all()


@SETTINGS
@given(name=st.sampled_from(CODEC_NAMES), n=st.integers(1, 300), seed=st.integers(0, 2**16),
       flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4))
def test_decode_mutated_bytes_only_remote_errors(name, n, seed, flips):
    codec = get_codec(name)
    b = bytearray(codec.encode(randn(n, seed=seed, scale=10.0)))
    for pos, xor in flips:
        b[pos % len(b)] ^= xor
    try:
        y = codec.decode(bytes(b), n)
    except RemoteProtocolError:
        return
    assert y.shape == (n,) and torch.isfinite(y).all()


# --- decode_add_ -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_add_weights_in_fp32(name):
    codec = get_codec(name)
    n = 700
    acc0 = randn(n, seed=9, scale=1.0)
    p1, p2 = codec.encode(randn(n, seed=1)), codec.encode(randn(n, seed=2))
    acc = acc0.clone()
    assert codec.decode_add_(acc, p1, 0.25) is acc
    codec.decode_add_(acc, p2, weight=-1.5)
    want = acc0.double() + 0.25 * codec.decode(p1, n).double() - 1.5 * codec.decode(p2, n).double()
    assert acc.dtype == torch.float32
    assert torch.allclose(acc.double(), want, rtol=1e-6, atol=1e-9)
    ones = torch.ones(n)  # 1 + 1e-4 is 1.0 in fp16/bf16 arithmetic but not in fp32
    codec.decode_add_(ones, codec.encode(torch.full((n,), 1e-4)))
    assert ((ones - 1 - 1e-4).abs() < 1e-6).all()
    strided = torch.zeros(2 * n)[::2]  # non-contiguous accumulator takes the generic path
    codec.decode_add_(strided, p1, 2.0)
    assert torch.allclose(strided, 2 * codec.decode(p1, n))


def test_decode_add_rejects_bad_arguments():
    codec = get_codec("int8")
    p = codec.encode(randn(10))
    for acc in (torch.zeros(10, dtype=torch.float64), torch.zeros(2, 5), [0.0] * 10):
        with pytest.raises(LocalProtocolError):
            codec.decode_add_(acc, p)
    for w in (float("nan"), float("inf"), "x"):
        with pytest.raises(LocalProtocolError):
            codec.decode_add_(torch.zeros(10), p, w)
    acc = torch.zeros(11)
    with pytest.raises(RemoteProtocolError):
        codec.decode_add_(acc, p)  # payload is for 10 values
    assert (acc == 0).all()
