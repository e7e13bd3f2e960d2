"""Butterfly all-reduce arithmetic: who reduces which slice, and what it costs on the wire.

In a group of n members, a flat vector of N elements is cut into n contiguous slices (the
first ``N % n`` slices one element longer). Member j reduces slice j: every other member
sends it its encoded slice j, member j accumulates them in fp32 with its own (unencoded)
values, encodes the weighted mean once, and sends that back to the n-1 others. Every member,
reducer included, then uses the *decoded* mean, so all members hold bit-identical results.
"""

from __future__ import annotations

from collections.abc import Callable


def slice_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of each member's slice of a vector of ``numel`` elements."""
    if n < 1 or numel < 0:
        raise ValueError(f"need n >= 1 and numel >= 0, got n={n} numel={numel}")
    base, extra = divmod(numel, n)
    out, start = [], 0
    for j in range(n):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return out


def bytes_sent(numel: int, n: int, encoded_size: Callable[[int], int]) -> list[int]:
    """Bytes each member sends in one all-reduce of ``numel`` elements among ``n`` members:
    its n-1 foreign slices to their reducers, plus its reduced slice to the n-1 others."""
    bounds = slice_bounds(numel, n)
    sizes = [encoded_size(e - s) for s, e in bounds]
    total = sum(sizes)
    return [(total - sizes[j]) + (n - 1) * sizes[j] for j in range(n)]
