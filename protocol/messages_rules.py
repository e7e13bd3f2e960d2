"""Field rules of the wire schema: what a message field may hold.

A message field is declared ``Annotated[type, Rule]``; the rule's ``check`` runs when a message
is built locally (a failure is an ``InvalidMessage``, our bug) and when one is decoded from
outside (a ``DecodeError``, the sender's fault). ``check`` returns the value, normalized
(lists to tuples, ints to floats), or raises ``FieldError``; it never raises anything else,
whatever the value's type, because decoded values come from strangers.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from protocol.config import from_dict, to_dict
from protocol.errors import ConfigError

MAX_FRAME_BYTES = 256 << 20
"""Largest message of any kind (an envelope included). Send larger slices as several messages."""


class FieldError(Exception):
    """A field breaks its rule. Internal: turned into InvalidMessage or DecodeError."""


def describe(v: Any) -> str:
    """A short, safe rendering of a value for an error message (never the whole of it)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"an integer of {v.bit_length()} bits"
    if isinstance(v, (int, float, bool)) or v is None:
        return repr(v)
    if isinstance(v, str):
        return repr(v[:40] + "...") if len(v) > 40 else repr(v)
    return type(v).__name__


# ---------------------------------------------------------------------------------------
# Field rules. ``check`` returns the (normalized) value or raises FieldError.


class Rule:
    __slots__ = ()

    def check(self, v: Any, where: str) -> Any:
        raise NotImplementedError

    def to_wire(self, v: Any) -> Any:
        return v


@dataclasses.dataclass(frozen=True, slots=True)
class Int(Rule):
    lo: int = 0
    hi: int = 2**63 - 1

    def check(self, v: Any, where: str) -> Any:
        if type(v) is not int:
            raise FieldError(f"{where} must be an integer, got {describe(v)}")
        if not self.lo <= v <= self.hi:
            raise FieldError(f"{where} must be in [{self.lo}, {self.hi}], got {describe(v)}")
        return v


@dataclasses.dataclass(frozen=True, slots=True)
class Float(Rule):
    """A finite number (ints are accepted and stored as float)."""

    lo: float = 0.0
    hi: float = 1e18

    def check(self, v: Any, where: str) -> Any:
        if type(v) is int and abs(v) <= 2**63:
            v = float(v)
        if type(v) is not float or not math.isfinite(v):
            raise FieldError(f"{where} must be a finite number, got {describe(v)}")
        if not self.lo <= v <= self.hi:
            raise FieldError(f"{where} must be in [{self.lo:g}, {self.hi:g}], got {v!r}")
        return v


@dataclasses.dataclass(frozen=True, slots=True)
class Bool(Rule):
    def check(self, v: Any, where: str) -> Any:
        if type(v) is not bool:
            raise FieldError(f"{where} must be true or false, got {describe(v)}")
        return v


# Text a peer sends may end up in a terminal: no control characters (escape sequences), no
# bidi overrides or zero-width characters (spoofed names), no lone surrogates.
_UNSAFE_TEXT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u206f\ufeff\ud800-\udfff]")
_UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u206f\ufeff\ud800-\udfff]")


def is_one_line(text: str) -> bool:
    """True if ``text`` is safe to show as one line in a terminal."""
    return not _UNSAFE_LINE.search(text)


@dataclasses.dataclass(frozen=True, slots=True)
class Str(Rule):
    max_len: int = 256
    min_len: int = 0
    choices: tuple[str, ...] | None = None
    multiline: bool = False
    """Allow newlines and tabs (descriptions); other control characters are always refused."""
    pattern: re.Pattern[str] | None = None

    def check(self, v: Any, where: str) -> Any:
        if type(v) is not str:
            raise FieldError(f"{where} must be a string, got {describe(v)}")
        if self.choices is not None:
            if v not in self.choices:
                raise FieldError(f"{where} must be one of {', '.join(self.choices)}, got {describe(v)}")
            return v
        if not self.min_len <= len(v) <= self.max_len:
            raise FieldError(f"{where} must have {self.min_len} to {self.max_len} characters, got {len(v)}")
        if (_UNSAFE_TEXT if self.multiline else _UNSAFE_LINE).search(v):
            raise FieldError(f"{where} contains control or invisible formatting characters")
        if self.pattern is not None and not self.pattern.fullmatch(v):
            raise FieldError(f"{where} is malformed: {describe(v)}")
        return v


@dataclasses.dataclass(frozen=True, slots=True)
class Bytes(Rule):
    """A short binary field (keys, digests, IDs): exactly one of ``sizes`` long."""

    sizes: tuple[int, ...]

    def check(self, v: Any, where: str) -> Any:
        if isinstance(v, (bytearray, memoryview)):
            v = bytes(v)
        if type(v) is not bytes:
            raise FieldError(f"{where} must be bytes, got {describe(v)}")
        if len(v) not in self.sizes:
            want = " or ".join(map(str, self.sizes))
            raise FieldError(f"{where} must be {want} bytes long, got {len(v)}")
        return v


@dataclasses.dataclass(frozen=True, slots=True)
class Payload(Rule):
    """Opaque bulk bytes, kept as given (bytes, bytearray or a byte memoryview: no copy).
    Must be a message's last field."""

    max_len: int = MAX_FRAME_BYTES

    def check(self, v: Any, where: str) -> Any:
        if isinstance(v, memoryview):
            if not v.c_contiguous:
                raise FieldError(f"{where} must be a contiguous buffer")
            if v.format != "B" or v.ndim != 1:
                v = v.cast("B")
        elif not isinstance(v, (bytes, bytearray)):
            raise FieldError(f"{where} must be bytes-like, got {describe(v)}")
        if len(v) > self.max_len:
            raise FieldError(f"{where} is {len(v)} bytes, over the {self.max_len}-byte limit")
        return v


@dataclasses.dataclass(frozen=True, slots=True)
class Seq(Rule):
    """A tuple of items that follow ``item`` (lists are accepted and stored as tuples)."""

    item: Rule
    max_len: int
    min_len: int = 0

    def check(self, v: Any, where: str) -> Any:
        if type(v) not in (tuple, list):
            raise FieldError(f"{where} must be a list, got {describe(v)}")
        if not self.min_len <= len(v) <= self.max_len:
            raise FieldError(f"{where} must have {self.min_len} to {self.max_len} items, got {len(v)}")
        out = tuple(self.item.check(x, f"{where}[{i}]") for i, x in enumerate(v))
        return v if type(v) is tuple and all(a is b for a, b in zip(out, v)) else out


@dataclasses.dataclass(frozen=True, slots=True)
class Opt(Rule):
    """``None`` or a value that follows ``item``."""

    item: Rule

    def check(self, v: Any, where: str) -> Any:
        return None if v is None else self.item.check(v, where)


@dataclasses.dataclass(frozen=True, slots=True)
class ConfigOf(Rule):
    """A ``protocol.config``-style dataclass; on the wire a map with sorted keys. ``absent``:
    (dotted path, value) for fields newer than the message, taken when the map lacks them (a
    field whose default for new configs is not what older messages meant), and left off when
    they hold it, so that what an older version could say reads there as before."""

    cls: type
    absent: tuple[tuple[str, Any], ...] = ()

    def check(self, v: Any, where: str) -> Any:
        if isinstance(v, self.cls):
            return v
        if not isinstance(v, dict):
            raise FieldError(f"{where} must be a map, got {describe(v)}")
        for path, value in self.absent:
            *sections, name = path.split(".")
            at = v
            for s in sections:
                at = at.get(s) if isinstance(at, dict) else None
            if isinstance(at, dict) and name not in at:
                v = _with(v, [*sections, name], value)
        try:
            return from_dict(self.cls, v, where)
        except ConfigError as e:
            raise FieldError(str(e)) from None

    def to_wire(self, v: Any) -> Any:
        out = to_dict(v)
        for path, value in self.absent:
            *sections, name = path.split(".")
            at = out
            for s in sections:
                at = at[s]
            if at[name] == value and type(at[name]) is type(value):
                del at[name]
        return _sorted_maps(out)


def _with(d: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    """A copy of nested maps ``d`` with ``value`` at ``path`` (the given maps are left alone)."""
    head, *rest = path
    return {**d, head: _with(d[head], rest, value) if rest else value}


def _sorted_maps(d: dict[str, Any]) -> dict[str, Any]:
    # Canonical: the same config always encodes to the same bytes, whatever the field order.
    return {k: _sorted_maps(v) if isinstance(v, dict) else v for k, v in sorted(d.items())}
