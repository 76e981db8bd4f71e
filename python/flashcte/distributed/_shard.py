"""How a sequence is split over the ranks of a context-parallel group, and back.

Three splits of ``seqlen`` tokens over ``world_size`` ranks:

* ``"contiguous"``: rank r holds one run of tokens. :func:`split_lengths` gives the near-even
  lengths (the first ``seqlen % world_size`` ranks one token more); the distributed functions
  accept any lengths (exchanged at the start of each call).
* ``"strided"``: rank r holds tokens ``r, r + P, r + 2P, ...`` (Neuron's
  ``cp_strided_q_slicing``), ``ceil((seqlen - r) / P)`` of them: causal work is balanced.
* ``"zigzag"``: the sequence cut into ``2P`` equal chunks, rank r holds chunks ``r`` and
  ``2P - 1 - r`` back to back (ring-flash-attention's zigzag): causal work is balanced.
  ``seqlen`` must be a multiple of ``2P``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import ArgumentError

LAYOUTS = ("contiguous", "strided", "zigzag")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout: must be one of {LAYOUTS}, got {layout!r}")


def split_lengths(seqlen: int, world_size: int, layout: str = "contiguous") -> list[int]:
    """The number of tokens each rank holds."""
    _check_layout(layout)
    if world_size < 1:
        raise ArgumentError(f"world_size: must be >= 1, got {world_size}")
    if layout == "zigzag":
        if seqlen % (2 * world_size):
            raise ArgumentError(
                f"zigzag: seqlen {seqlen} must be a multiple of 2 * world_size = {2 * world_size}"
            )
        return [seqlen // world_size] * world_size
    if layout == "strided":
        return [max(0, -(-(seqlen - r) // world_size)) for r in range(world_size)]
    base, extra = divmod(seqlen, world_size)
    return [base + (r < extra) for r in range(world_size)]


def positions(lengths: list[int], rank: int, layout: str) -> np.ndarray:
    """The global positions (increasing int64) of rank ``rank``'s tokens, given every rank's
    length under ``layout``."""
    _check_layout(layout)
    world = len(lengths)
    n = lengths[rank]
    if layout == "contiguous":
        start = int(sum(lengths[:rank]))
        return np.arange(start, start + n, dtype=np.int64)
    if layout == "strided":
        return rank + world * np.arange(n, dtype=np.int64)
    c = n // 2
    return np.concatenate(
        [
            np.arange(rank * c, (rank + 1) * c, dtype=np.int64),
            np.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c, dtype=np.int64),
        ]
    )


def shard(x: Any, rank: int, world_size: int, layout: str = "contiguous", dim: int = 1) -> Any:
    """Rank ``rank``'s part of the full tensor ``x`` (torch or numpy) along ``dim``, contiguous,
    with :func:`split_lengths`' lengths."""
    lengths = split_lengths(x.shape[dim], world_size, layout)
    index = positions(lengths, rank, layout)
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(np.take(x, index, axis=dim))
    import torch

    return torch.index_select(x, dim, torch.from_numpy(index)).contiguous()


def unshard(parts: list, layout: str = "contiguous", dim: int = 1) -> Any:
    """The full tensor from every rank's part (the inverse of :func:`shard`, any lengths for
    ``"contiguous"``)."""
    lengths = [p.shape[dim] for p in parts]
    world = len(parts)
    order = np.concatenate([positions(lengths, r, layout) for r in range(world)])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    if isinstance(parts[0], np.ndarray):
        return np.take(np.concatenate(parts, axis=dim), inverse, axis=dim)
    import torch

    return torch.index_select(torch.cat(parts, dim), dim, torch.from_numpy(inverse))
