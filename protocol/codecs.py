"""Wire codecs for pseudo-gradients: fp32, fp16, bf16, int8 (blockwise absmax), fp4 (E2M1).

A codec turns a float tensor into bytes for one averaging slice and back. The byte layout of
each codec is specified in ``docs/codecs.md``; this module is its reference implementation.
Everything on the wire is little-endian, and encoding is deterministic: the same input gives
the same bytes on every machine (no stochastic rounding, only IEEE-exact fp32 ops).

Encoding sits on the critical path of every outer step, so the quantizers are a handful of
vectorized torch ops on a ``(rows, block)`` matrix of blocks, never a Python loop over
blocks or elements. They walk the input in cache-sized chunks of whole blocks (``_pieces``),
then the short tail block, if any; every piece runs the same code.

``decode`` treats its arguments as remote input: a wrong length, a bad scale, a forbidden
code or a bad ``numel`` raises ``RemoteProtocolError`` before any large allocation (the
expected length is checked first). ``encode`` raises ``LocalProtocolError`` for input that
cannot be sent (NaN or inf, a non-float tensor).
"""

from __future__ import annotations

import abc
import math
import sys

import torch

from protocol.config import CODEC_NAMES
from protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = ["Codec", "get_codec"]

Buffer = bytes | bytearray | memoryview

_F32_MAX = torch.finfo(torch.float32).max
_FP16_MAX = 65504.0
_BF16_MAX = torch.finfo(torch.bfloat16).max
_LITTLE = sys.byteorder == "little"

INT8_BLOCK = 256  # elements per int8 scale: 8.125 bits/element
FP4_BLOCK = 32  # elements per fp4 scale: 4.5 bits/element (as MXFP4 / OCP microscaling)

# The 8 magnitudes of FP4 E2M1 (1 sign, 2 exponent, 1 mantissa bit), in code order:
# code c & 7 indexes this, c & 8 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# Largest scales whose decode cannot overflow: the largest fp32 s with fp32(127 s) finite
# (bits 0x7C010203) and the largest bf16 s with fp32(6 s) finite (bits 0x7E2A). Decoders
# reject larger scales; encoders clamp to them (binding only within 0.4% of fp32's max).
_INT8_SCALE_MAX = 2.6793883890187504e36
_FP4_SCALE_MAX = 5.649218982085892e37


def _fp4_encode_lut() -> torch.Tensor:
    """Code for each k = floor(4u) + ceil(4u) + 48, u = x / scale clamped to [-6, 6].

    k is 4u*2 when 4u is an integer and odd otherwise, so it tells "exactly on a multiple of
    1/4" apart from "strictly between two": every E2M1 midpoint (0.25, 0.75, 1.25, 1.75, 2.5,
    3.5, 5) is a multiple of 1/4, so one table lookup does round-to-nearest with exact
    tie handling. Ties go to the even code (mantissa bit 0), as IEEE round-half-even does.
    """
    lut = []
    for k in range(-48, 49):
        a = abs(k) / 8  # |u| if k is even, the middle of the open interval if k is odd
        dists = [abs(a - v) for v in E2M1_VALUES]
        nearest = [c for c in range(8) if dists[c] == min(dists)]  # two codes on a tie
        mag = nearest[0] if len(nearest) == 1 else next(c for c in nearest if c % 2 == 0)
        lut.append(mag | (8 if k < 0 and mag else 0))  # zero is always code 0 (+0)
    return torch.tensor(lut, dtype=torch.uint8)


_FP4_ENC_LUT = _fp4_encode_lut()  # (97,) uint8
_FP4_VALUES = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
# (256, 2) float32: byte b -> (value of low nibble, value of high nibble), decodes a pair.
# (16,) float64: code -> the largest |input / scale - value| that rounds to that code: half
# the larger E2M1 gap beside it (the top code 6 takes 5..6, and up to 6 (1 + 2^-8) when the
# bf16 scale rounded absmax / 6 down, which saturates).
_FP4_HALF_GAPS = torch.tensor((0.25, 0.25, 0.25, 0.25, 0.5, 0.5, 1.0, 1.0) * 2, dtype=torch.float64)
_FP4_MAGNITUDES = torch.tensor(E2M1_VALUES * 2, dtype=torch.float64)  # (16,) code -> |value|
_TINY_ERROR = 1e-35  # per element: the error of scales in the subnormal range (|x| < 1e-36)
_FP4_DEC_PAIRS = torch.stack([_FP4_VALUES[torch.arange(256) & 15], _FP4_VALUES[torch.arange(256) >> 4]], 1)



def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_numel(numel: object, err: type[Exception]) -> int:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise err(f"numel must be a non-negative int, got {numel!r}")
    return numel


def _flat(x: object, codec: str, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """x as a 1-D contiguous tensor (row-major) of one of ``dtypes``, on x's device.

    One pass at most: a strided or other-dtype input is gathered and converted by a single
    ``copy_``. Other float dtypes (fp64, fp8) are converted to fp32 first, with rounding.
    """
    if not isinstance(x, torch.Tensor):
        raise LocalProtocolError(f"{codec} encode needs a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise LocalProtocolError(f"{codec} encode needs a floating-point tensor, got {x.dtype}")
    x = x.detach()
    if x.dtype in dtypes and x.is_contiguous():
        return x.view(-1)
    out = torch.empty(x.shape, dtype=x.dtype if x.dtype in dtypes else torch.float32, device=x.device)
    return out.copy_(x).view(-1)


def _non_finite(t: torch.Tensor) -> bool:
    """True if t holds a NaN or inf. min/max propagate NaN and need no N-sized temporary."""
    if t.numel() == 0:
        return False
    lo, hi = torch.aminmax(t)
    return not bool(torch.isfinite(lo) & torch.isfinite(hi))


def _swap_if_big_endian_(u8: torch.Tensor, width: int) -> None:
    """Reverse each ``width``-byte group in place (wire is little-endian; a no-op on x86/ARM)."""
    if not _LITTLE and width > 1 and u8.numel():
        groups = u8.view(-1, width)
        groups.copy_(groups.flip(1))


def _to_bytes(u8: torch.Tensor) -> bytes:
    return u8.cpu().numpy().tobytes()  # the one copy into an immutable bytes object


def _read(data: object, size: int, codec: str, numel: int) -> torch.Tensor:
    """Bytes from a peer as an owned, aligned (size,) uint8 CPU tensor; checks length first."""
    try:
        mv = memoryview(data)  # type: ignore[arg-type]
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
    except (TypeError, ValueError) as e:
        raise RemoteProtocolError(f"{codec} payload is not a contiguous byte buffer: {e}") from None
    if mv.nbytes != size:
        raise RemoteProtocolError(f"{codec} payload for {numel} values must be {size} bytes, got {mv.nbytes}")
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    # A private copy: the caller's buffer may be read-only (bytes) or misaligned (a slice).
    return torch.frombuffer(bytearray(mv), dtype=torch.uint8)


def _check_scales(s: torch.Tensor, s_max: float, codec: str) -> None:
    """Remote scales must be in [0, s_max]; NaN fails both comparisons."""
    if s.numel() and not bool(((s >= 0) & (s <= s_max)).all()):
        raise RemoteProtocolError(f"{codec} payload has a negative, non-finite or oversized block scale")


# Elements per pass of the quantizers. Working a chunk at a time keeps the temporaries
# (fp4 encode: 13.5 bytes/element, so 14 MB) in L3 cache and out of fresh, page-faulting
# allocations: on a 2-core EPYC this took fp4 encode of 16 Mi elements from ~0.5 to
# ~2.7 GB/s. Much smaller chunks cost more thread syncs per op (slow on a busy machine).
# Must be a multiple of both block sizes.
_CHUNK = 1 << 20


def _pieces(numel: int, block: int):
    """Yield (first element, first block, rows, cols): chunks of whole blocks, then the tail.

    A piece is the (rows, cols) block matrix ``x[e0 : e0 + rows * cols]``; only the last
    piece may have cols < block (the short tail block, rows == 1).
    """
    full = numel // block
    per = _CHUNK // block
    for b0 in range(0, full, per):
        yield b0 * block, b0, min(per, full - b0), block
    if numel % block:
        yield full * block, full, 1, numel % block


def _absmax_rows(xr: torch.Tensor, codec: str) -> torch.Tensor:
    """(rows, cols) fp32 -> (rows,) absmax; non-finite input becomes a NaN/inf row we catch."""
    amax = torch.maximum(xr.amax(dim=1), xr.amin(dim=1).neg_())  # no |x| temporary
    if not bool(torch.isfinite(amax).all()):
        raise LocalProtocolError(f"{codec} encode: input holds NaN or inf; refusing to send it")
    return amax


def _divisor(d: float, device: torch.device) -> torch.Tensor:
    """A (1,) fp32 tensor holding ``d`` on ``device``, to divide by.

    Dividing a CUDA tensor by a Python number makes PyTorch compute ``x * (1 / d)``, which
    is off by one ulp for a few percent of inputs when 1/d is inexact (1/127: seen on an
    H100, 183 of ~1M int8 payload bytes differed from CPU). Dividing by a tensor on the same
    device is a correctly rounded IEEE division on both CPU and GPU, so bytes match.
    """
    return torch.full((1,), d, dtype=torch.float32, device=device)


class Codec(abc.ABC):
    """One wire format. Stateless: ``get_codec`` hands out shared instances."""

    name: str

    @abc.abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact byte length of ``encode`` output for ``numel`` values."""

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> bytes:
        """Any-shape float tensor (row-major) -> ``encoded_size(x.numel())`` bytes."""

    @abc.abstractmethod
    def decode(self, data: Buffer, numel: int) -> torch.Tensor:
        """Bytes -> (numel,) float32 CPU tensor; invalid bytes raise RemoteProtocolError."""

    def decode_add_(self, acc: torch.Tensor, data: Buffer, weight: float = 1.0) -> torch.Tensor:
        """acc += weight * decode(data, acc.numel()) in fp32; returns acc.

        Nothing is added unless the whole payload is valid. Codecs with scales fold
        ``weight`` into the per-block scale, so the sum may differ from
        ``acc + weight * decode(...)`` by fp32 rounding (one ulp per term).
        """
        if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32 or acc.dim() != 1:
            raise LocalProtocolError("decode_add_ needs a 1-D float32 accumulator")
        try:
            w = float(weight)
        except (TypeError, ValueError):
            raise LocalProtocolError(f"decode_add_ weight must be a number, got {weight!r}") from None
        if w != w or abs(w) == float("inf"):
            raise LocalProtocolError(f"decode_add_ weight must be finite, got {weight!r}")
        if acc.device.type == "cpu" and acc.is_contiguous():
            return self._decode_add_cpu(acc, data, w)
        return acc.add_(self.decode(data, acc.numel()).to(acc.device), alpha=w)

    def _decode_add_cpu(self, acc: torch.Tensor, data: Buffer, w: float) -> torch.Tensor:
        return acc.add_(self.decode(data, acc.numel()), alpha=w)

    @abc.abstractmethod
    def error_bound(self, data: Buffer, numel: int) -> float:
        """An upper bound on the L2 distance between ``decode(data, numel)`` and any input whose
        encoding is ``data``: how far the sender's values may lie from what we decoded,
        known from the bytes alone (``protocol.butterfly.mean_consistent`` allows for it).
        inf when a value saturated (the input may have been anything beyond the range).
        Invalid bytes raise RemoteProtocolError, as ``decode`` does."""

    def element_bounds(self, data: Buffer, numel: int) -> torch.Tensor:
        """Per element (float64), how far an input encoded as ``data`` may lie from what it
        decodes to, once clamped to the codec's range (``max_value``, if it has one: a raw
        codec's saturated value is then exact). ``protocol.audit`` compares element by element,
        so a lie cannot spend the whole part's rounding on a few values."""
        raise NotImplementedError

    def block_scales(self, data: Buffer, numel: int) -> tuple[torch.Tensor, int, float, float, float] | None:
        """For a codec with block scales: (the scales, float64; elements per block; the divisor
        an encoder takes a block's absmax by; the relative rounding of a scale, with room; the
        largest scale, at which an encoder clamps). None for a raw codec."""
        return None



class _RawCodec(Codec):
    """Values as little-endian IEEE floats; fp16/bf16 round to nearest even and saturate."""

    dtype: torch.dtype
    max_value: float  # finite inputs beyond +-max_value are clamped to it, never sent as inf

    def encoded_size(self, numel: int) -> int:
        return _check_numel(numel, LocalProtocolError) * self.dtype.itemsize

    def encode(self, x: torch.Tensor) -> bytes:
        x = _flat(x, self.name, (torch.float32, torch.float16, torch.bfloat16))
        y = x.to(self.dtype)  # round to nearest even; a no-op when the dtype already matches
        if _non_finite(y):  # rare path: either bad input or an overflow to clamp
            if _non_finite(x):
                raise LocalProtocolError(f"{self.name} encode: input holds NaN or inf; refusing to send it")
            y = x.float().clamp(-self.max_value, self.max_value).to(self.dtype)
        u8 = y.view(torch.uint8)
        if not _LITTLE:
            u8 = u8.clone()
            _swap_if_big_endian_(u8, self.dtype.itemsize)
        return _to_bytes(u8)

    def decode(self, data: Buffer, numel: int) -> torch.Tensor:
        numel = _check_numel(numel, RemoteProtocolError)
        u8 = _read(data, numel * self.dtype.itemsize, self.name, numel)
        _swap_if_big_endian_(u8, self.dtype.itemsize)
        y = u8.view(self.dtype)
        if _non_finite(y):
            raise RemoteProtocolError(f"{self.name} payload holds NaN or inf")
        return y if self.dtype == torch.float32 else y.float()  # fp32: the copy in _read is ours

    rel_error = 0.0  # of one element, relative to its decoded magnitude (with room: see error_bound)
    abs_error = 0.0  # and absolute (subnormals)

    def error_bound(self, data: Buffer, numel: int) -> float:
        if not self.rel_error and not self.abs_error:
            self.decode(data, numel)  # checked all the same
            return 0.0
        v = self.decode(data, numel).double().abs_()
        if numel and float(v.max()) >= self.max_value:
            return math.inf
        return float(torch.linalg.vector_norm(v.mul_(self.rel_error).add_(self.abs_error)))

    def element_bounds(self, data: Buffer, numel: int) -> torch.Tensor:
        return self.decode(data, numel).double().abs_().mul_(self.rel_error).add_(self.abs_error)


class Fp32Codec(_RawCodec):
    name, dtype, max_value = "fp32", torch.float32, _F32_MAX


class Fp16Codec(_RawCodec):
    name, dtype, max_value = "fp16", torch.float16, _FP16_MAX
    rel_error, abs_error = 2.0**-10, 2.0**-24  # 2x the rounding's 2^-11 and subnormals' 2^-25


class Bf16Codec(_RawCodec):
    name, dtype, max_value = "bf16", torch.bfloat16, _BF16_MAX
    rel_error, abs_error = 2.0**-7, 1e-37  # 2x the rounding's 2^-8; subnormals (fp32's range)



class Int8Codec(Codec):
    """Blocks of 256: fp32 scale = absmax / 127, q = round_half_even(x / scale) in [-127, 127].

    Layout: ceil(n / 256) fp32 scales, then n int8 values. 8.125 bits/element.
    """

    name = "int8"

    def encoded_size(self, numel: int) -> int:
        numel = _check_numel(numel, LocalProtocolError)
        return 4 * _ceil_div(numel, INT8_BLOCK) + numel

    def encode(self, x: torch.Tensor) -> bytes:
        x = _flat(x, self.name, (torch.float32,))
        n, nb = x.numel(), _ceil_div(x.numel(), INT8_BLOCK)
        out = torch.empty(4 * nb + n, dtype=torch.uint8, device=x.device)
        scales = out[: 4 * nb].view(torch.float32)  # (nb,)
        q = out[4 * nb :].view(torch.int8)  # (n,)
        y_ws = torch.empty(min(n, _CHUNK), device=x.device)  # scratch x / scale
        d127 = _divisor(127.0, x.device)
        for e0, b0, rows, cols in _pieces(n, INT8_BLOCK):
            xr = x[e0 : e0 + rows * cols].view(rows, cols)
            s = scales[b0 : b0 + rows]
            torch.div(_absmax_rows(xr, self.name), d127, out=s).clamp_(max=_INT8_SCALE_MAX)
            # All-zero blocks (and blocks so tiny that absmax/127 underflows to 0) divide by 1
            # and quantize to 0. The clamp only bites for subnormal or clamped scales.
            y = torch.div(xr, torch.where(s > 0, s, 1.0)[:, None], out=y_ws[: rows * cols].view(rows, cols))
            q[e0 : e0 + rows * cols].view(rows, cols).copy_(y.round_().clamp_(-127, 127))
        _swap_if_big_endian_(out[: 4 * nb], 4)
        return _to_bytes(out)

    def _parse(self, data: Buffer, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (nb,) fp32 scales and (numel,) int8 values, both checked."""
        numel = _check_numel(numel, RemoteProtocolError)
        nb = _ceil_div(numel, INT8_BLOCK)
        u8 = _read(data, 4 * nb + numel, self.name, numel)
        _swap_if_big_endian_(u8[: 4 * nb], 4)
        scales = u8[: 4 * nb].view(torch.float32)
        _check_scales(scales, _INT8_SCALE_MAX, self.name)
        q = u8[4 * nb :].view(torch.int8)
        if numel and int(q.min()) < -127:
            raise RemoteProtocolError("int8 payload holds -128, outside [-127, 127]")
        return scales, q

    def error_bound(self, data: Buffer, numel: int) -> float:
        """Half a scale per element (round to nearest; absmax / scale <= 127 (1 + 2^-23)), the
        scale taken as its block's largest |q| / 127 of itself: an encoder's block holds +-127
        (its absmax), so that is the scale unless the bytes were made to widen the bound (a
        block of zeros with a huge scale would otherwise allow any mean: ``mean_consistent``)."""
        scales, q = self._parse(data, numel)
        counts = torch.full((scales.numel(),), float(INT8_BLOCK), dtype=torch.float64)
        top = torch.empty(scales.numel(), dtype=torch.float64)
        for e0, b0, rows, cols in _pieces(numel, INT8_BLOCK):
            top[b0 : b0 + rows] = q[e0 : e0 + rows * cols].view(rows, cols).abs().amax(1)
        if numel % INT8_BLOCK:
            counts[-1] = numel % INT8_BLOCK
        per = scales.double() * top.div_(127.0) * 0.5 + _TINY_ERROR
        return math.sqrt(float((counts * per * per).sum()))

    def element_bounds(self, data: Buffer, numel: int) -> torch.Tensor:
        """``error_bound``'s terms, one per element."""
        scales, q = self._parse(data, numel)
        out = torch.empty(numel, dtype=torch.float64)
        for e0, b0, rows, cols in _pieces(numel, INT8_BLOCK):
            qr = q[e0 : e0 + rows * cols].view(rows, cols)
            per = scales.double()[b0 : b0 + rows] * qr.abs().amax(1).double().div_(127.0) * 0.5 + _TINY_ERROR
            out[e0 : e0 + rows * cols].view(rows, cols).copy_(per[:, None].expand(rows, cols))
        return out

    def block_scales(self, data: Buffer, numel: int) -> tuple[torch.Tensor, int, float, float, float]:
        return self._parse(data, numel)[0].double(), INT8_BLOCK, 127.0, 2.0**-20, _INT8_SCALE_MAX  # fp32 division

    def decode(self, data: Buffer, numel: int) -> torch.Tensor:
        scales, q = self._parse(data, numel)
        out = torch.empty(q.numel())
        for e0, b0, rows, cols in _pieces(q.numel(), INT8_BLOCK):
            sl = slice(e0, e0 + rows * cols)
            torch.mul(q[sl].view(rows, cols), scales[b0 : b0 + rows, None], out=out[sl].view(rows, cols))
        return out

    def _decode_add_cpu(self, acc: torch.Tensor, data: Buffer, w: float) -> torch.Tensor:
        scales, q = self._parse(data, acc.numel())
        ws = scales * w  # weight folded into the (nb,) scales: one fused pass over acc
        for e0, b0, rows, cols in _pieces(acc.numel(), INT8_BLOCK):
            sl = slice(e0, e0 + rows * cols)
            acc[sl].view(rows, cols).addcmul_(q[sl].view(rows, cols), ws[b0 : b0 + rows, None])
        return acc


class Fp4Codec(Codec):
    """FP4 E2M1 codes, blocks of 32 with a bf16 scale = RNE(absmax / 6), two codes per byte.

    Layout: ceil(n / 32) bf16 scales, then ceil(n / 2) bytes; element 2i is the low nibble
    of byte i, element 2i+1 the high nibble (zero padding when n is odd). x / scale rounds to
    the nearest E2M1 value, ties to the even code, saturating at +-6. 4.5 bits/element.
    """

    name = "fp4"

    def encoded_size(self, numel: int) -> int:
        numel = _check_numel(numel, LocalProtocolError)
        return 2 * _ceil_div(numel, FP4_BLOCK) + _ceil_div(numel, 2)

    def encode(self, x: torch.Tensor) -> bytes:
        x = _flat(x, self.name, (torch.float32,))
        n, nb = x.numel(), _ceil_div(x.numel(), FP4_BLOCK)
        dev, m = x.device, min(n, _CHUNK) + 1  # scratch length: a chunk, +1 for odd padding
        out = torch.empty(2 * nb + _ceil_div(n, 2), dtype=torch.uint8, device=dev)
        scales = out[: 2 * nb].view(torch.bfloat16)  # (nb,)
        packed = out[2 * nb :]  # (ceil(n/2),)
        lut = _FP4_ENC_LUT.to(dev)  # (97,), a no-op on CPU
        u_ws, k_ws = torch.empty(m, device=dev), torch.empty(m, device=dev)  # fp32 scratch
        ki_ws = torch.empty(m, dtype=torch.int32, device=dev)
        c_ws = torch.empty(m, dtype=torch.uint8, device=dev)  # one code per element
        hi_ws = torch.empty(m // 2, dtype=torch.uint8, device=dev)  # odd codes << 4
        d6 = _divisor(6.0, dev)
        for e0, b0, rows, cols in _pieces(n, FP4_BLOCK):
            xr, cnt = x[e0 : e0 + rows * cols].view(rows, cols), rows * cols
            s = (_absmax_rows(xr, self.name) / d6).clamp_(max=_FP4_SCALE_MAX).to(torch.bfloat16)
            scales[b0 : b0 + rows] = s
            # u = 4 * x / s, exact for normal s (dividing by s/4 is a power-of-two rescale).
            # Zero or underflowed scales divide by 1: |x| is then far below one code step.
            sf = s.float()
            quarter = (torch.where(sf > 0, sf, 1.0) * 0.25)[:, None]  # (rows, 1)
            u = torch.div(xr, quarter, out=u_ws[:cnt].view(rows, cols))
            u.clamp_(-24.0, 24.0)  # saturate at +-6; also keeps the LUT index in range
            k = torch.floor(u, out=k_ws[:cnt].view(rows, cols)).add_(48.0).add_(u.ceil_())
            codes = c_ws[: cnt + cnt % 2]  # only the tail (rows == 1) can be odd: pad a 0
            codes[cnt:] = 0
            torch.index_select(lut, 0, ki_ws[:cnt].copy_(k.view(-1)), out=codes[:cnt])
            half = codes.numel() // 2
            hi = torch.bitwise_left_shift(codes[1::2], 4, out=hi_ws[:half])
            torch.bitwise_or(codes[0::2], hi, out=packed[e0 // 2 : e0 // 2 + half])
        _swap_if_big_endian_(out[: 2 * nb], 2)
        return _to_bytes(out)

    def _parse(self, data: Buffer, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (nb,) fp32 scales and (ceil(numel/2),) uint8 packed codes, both checked."""
        numel = _check_numel(numel, RemoteProtocolError)
        nb = _ceil_div(numel, FP4_BLOCK)
        u8 = _read(data, 2 * nb + _ceil_div(numel, 2), self.name, numel)
        _swap_if_big_endian_(u8[: 2 * nb], 2)
        scales = u8[: 2 * nb].view(torch.bfloat16).float()
        _check_scales(scales, _FP4_SCALE_MAX, self.name)
        packed = u8[2 * nb :]
        if numel % 2 and int(packed[-1]) >> 4:
            raise RemoteProtocolError("fp4 payload has a non-zero padding nibble")
        return scales, packed

    def _values(self, packed: torch.Tensor, numel: int):
        """Yield (e0, b0, rows, cols, vals): a piece's (rows, cols) E2M1 values, unscaled."""
        idx_ws = torch.empty(min(numel, _CHUNK) // 2 + 1, dtype=torch.int32)
        val_ws = torch.empty(2 * idx_ws.numel())
        for e0, b0, rows, cols in _pieces(numel, FP4_BLOCK):
            cnt = rows * cols
            byts = packed[e0 // 2 : e0 // 2 + _ceil_div(cnt, 2)]
            pairs = val_ws[: 2 * byts.numel()].view(-1, 2)  # byte -> (low, high) value
            torch.index_select(_FP4_DEC_PAIRS, 0, idx_ws[: byts.numel()].copy_(byts), out=pairs)
            yield e0, b0, rows, cols, pairs.view(-1)[:cnt].view(rows, cols)

    def error_bound(self, data: Buffer, numel: int) -> float:
        """Per element, half the E2M1 gap beside its code, times its block's scale, the scale
        taken as its block's largest |code value| / 6 of itself: an encoder's block holds +-6
        (its absmax), so that is the scale unless the bytes were made to widen the bound (a
        block of zeros with a huge scale would otherwise allow any mean: ``mean_consistent``)."""
        scales, packed = self._parse(data, numel)
        total = 0.0
        for e0, b0, rows, cols in _pieces(numel, FP4_BLOCK):  # a chunk at a time: bounded scratch
            byts = packed[e0 // 2 : e0 // 2 + _ceil_div(rows * cols, 2)]
            codes = torch.stack([byts & 15, byts >> 4], 1).view(-1)[: rows * cols].long().view(rows, cols)
            top = _FP4_MAGNITUDES[codes].amax(1).div_(6.0)  # (rows,)
            scale = scales.double()[b0 : b0 + rows].mul_(top)
            per = _FP4_HALF_GAPS[codes].mul_(scale[:, None]).add_(_TINY_ERROR)
            total += float(per.square_().sum())
        return math.sqrt(total)

    def element_bounds(self, data: Buffer, numel: int) -> torch.Tensor:
        """``error_bound``'s terms, one per element."""
        scales, packed = self._parse(data, numel)
        out = torch.empty(numel, dtype=torch.float64)
        for e0, b0, rows, cols in _pieces(numel, FP4_BLOCK):
            byts = packed[e0 // 2 : e0 // 2 + _ceil_div(rows * cols, 2)]
            codes = torch.stack([byts & 15, byts >> 4], 1).view(-1)[: rows * cols].long().view(rows, cols)
            scale = scales.double()[b0 : b0 + rows].mul_(_FP4_MAGNITUDES[codes].amax(1).div_(6.0))
            out[e0 : e0 + rows * cols].view(rows, cols).copy_(_FP4_HALF_GAPS[codes].mul_(scale[:, None]).add_(_TINY_ERROR))
        return out

    def block_scales(self, data: Buffer, numel: int) -> tuple[torch.Tensor, int, float, float, float]:
        return self._parse(data, numel)[0].double(), FP4_BLOCK, 6.0, 2.0**-8, _FP4_SCALE_MAX  # bf16 RNE: 2^-9

    def decode(self, data: Buffer, numel: int) -> torch.Tensor:
        scales, packed = self._parse(data, numel)
        out = torch.empty(numel)
        for e0, b0, rows, cols, vals in self._values(packed, numel):
            torch.mul(vals, scales[b0 : b0 + rows, None], out=out[e0 : e0 + rows * cols].view(rows, cols))
        return out

    def _decode_add_cpu(self, acc: torch.Tensor, data: Buffer, w: float) -> torch.Tensor:
        scales, packed = self._parse(data, acc.numel())
        ws = scales * w  # (nb,): weight folded into the scales
        for e0, b0, rows, cols, vals in self._values(packed, acc.numel()):
            acc[e0 : e0 + rows * cols].view(rows, cols).addcmul_(vals, ws[b0 : b0 + rows, None])
        return acc


_CODECS: dict[str, Codec] = {
    c.name: c for c in (Fp32Codec(), Fp16Codec(), Bf16Codec(), Int8Codec(), Fp4Codec())
}
if tuple(_CODECS) != CODEC_NAMES:
    raise ImportError("protocol.config.CODEC_NAMES and protocol.codecs disagree")


def get_codec(name: str) -> Codec:
    """The shared codec called ``name``; an unknown name raises LocalProtocolError."""
    try:
        return _CODECS[name]
    except (KeyError, TypeError):
        raise LocalProtocolError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}") from None
