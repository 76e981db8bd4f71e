"""torch.distributed plumbing shared by the strategies: the group, timeouts, agreement on the
call across ranks (every rank raises the same error when any rank fails), byte buffers.

Agreement. Every distributed call starts with :func:`agree`: each rank checks its own arguments
(any exception is caught, not raised) and all ranks exchange a small JSON record (4 KiB per rank,
one all_gather) holding either that rank's description of the call or its error. Every rank
then sees the same records, so every rank raises the same exception (the failing rank's type and
message, prefixed with its rank) or none does; cross-rank checks (shapes that must match, lengths
the split must balance) run on those records on every rank alike. A call ends with
:func:`settle`, a second exchange carrying any error raised while computing, so a failure on one
rank mid-call raises on every rank too, after the communication every rank takes part in.

Timeouts. Every collective and point-to-point operation is waited on with ``timeout`` (seconds or
a timedelta; None: the process group's own timeout, the ``timeout`` of
``init_process_group``). A peer that never arrives (it died, hangs, or raised before the call)
turns into a RuntimeError naming the operation instead of a hang.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._errors import ArgumentError, ArgumentTypeError

_RECORD_BYTES = 4096
# A rank's error by its class name, raised again on every rank (other classes: RuntimeError).
_ERROR_TYPES = {
    "ArgumentError": ArgumentError,
    "ArgumentTypeError": ArgumentTypeError,
    "ValueError": ValueError,
    "TypeError": TypeError,
}


@dataclass
class Group:
    """The resolved process group: this rank, the group's size and the waits' timeout."""

    group: Any
    rank: int
    size: int
    timeout: datetime.timedelta | None

    def global_rank(self, rank: int) -> int:
        if self.group is None:
            return rank
        return dist.get_global_rank(self.group, rank)

    def wait(self, work: Any, what: str) -> None:
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(timeout=self.timeout)
        except RuntimeError as e:  # gloo: timeouts, closed connections (DistBackendError too)
            within = "" if self.timeout is None else f" within {self.timeout.total_seconds():g} s"
            raise RuntimeError(
                f"flashcte.distributed: rank {self.rank} of {self.size}: {what} did not "
                f"complete{within}; a peer did not take part (it failed before this call, "
                f"hangs, died, or called with another group): {e}"
            ) from e


def resolve_group(group: Any, timeout: Any) -> Group:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "flashcte.distributed: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group('gloo', ...) on every rank first"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ArgumentError("group: this process is not a member of the process group it passed")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        try:
            seconds = float(timeout)
        except (TypeError, ValueError):
            raise ArgumentTypeError(
                f"timeout: must be seconds or a datetime.timedelta, got {timeout!r}"
            ) from None
        if not seconds > 0:
            raise ArgumentError(f"timeout: must be positive, got {timeout!r}")
        timeout = datetime.timedelta(seconds=seconds)
    return Group(group, rank, dist.get_world_size(group), timeout)


def _encode(record: dict) -> torch.Tensor:
    data = json.dumps(record).encode()
    if len(data) > _RECORD_BYTES - 4 and record.get("error"):
        kind, message = record["error"]
        keep = max(0, len(message) - (len(data) - (_RECORD_BYTES - 4)) - 16)
        record = dict(record, error=[kind, message[:keep] + " [truncated]"])
        data = json.dumps(record).encode()
    if len(data) > _RECORD_BYTES - 4:
        data = json.dumps({"error": ["RuntimeError", "call description too long"]}).encode()
    buf = torch.zeros(_RECORD_BYTES, dtype=torch.uint8)
    buf[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    buf[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def _decode(buf: torch.Tensor) -> dict:
    raw = buf.numpy().tobytes()
    n = int.from_bytes(raw[:4], "little")
    return json.loads(raw[4 : 4 + n].decode())


def exchange(g: Group, record: dict, what: str) -> list[dict]:
    """Every rank's record, in rank order (one all_gather of 4 KiB per rank)."""
    buf = _encode(record)
    if g.size == 1:
        return [_decode(buf)]
    bufs = [torch.empty_like(buf) for _ in range(g.size)]
    g.wait(dist.all_gather(bufs, buf, group=g.group, async_op=True), what)
    return [_decode(b) for b in bufs]


def _raise_failures(g: Group, records: list[dict], local: BaseException | None, what: str):
    failures = [(r, rec["error"]) for r, rec in enumerate(records) if rec.get("error")]
    if not failures:
        return
    kinds = {kind for _, (kind, _) in failures}
    cls = _ERROR_TYPES.get(kinds.pop(), RuntimeError) if len(kinds) == 1 else RuntimeError
    parts = [f"rank {r}: {kind}: {message}" for r, (kind, message) in failures]
    message = (
        f"flashcte.distributed.{what}: {len(failures)} of {g.size} ranks failed "
        f"(this is rank {g.rank}); " + "; ".join(parts)
    )
    raise cls(message) from local


def _error_of(e: BaseException | None) -> list | None:
    if e is None:
        return None
    return [type(e).__name__, str(e)]


def agree(g: Group, describe: Any, what: str) -> list[dict]:
    """Runs ``describe()`` (this rank's checks, returning a JSON-able description of the call),
    exchanges the results and returns every rank's description, or raises on every rank when
    any rank's ``describe`` raised."""
    local: BaseException | None = None
    meta = None
    try:
        meta = describe()
    except Exception as e:  # noqa: BLE001 - reported to every rank
        local = e
    records = exchange(g, {"error": _error_of(local), "meta": meta}, f"{what} (agreement)")
    _raise_failures(g, records, local, what)
    return [rec["meta"] for rec in records]


def settle(g: Group, local: BaseException | None, what: str) -> None:
    """The closing exchange: raises on every rank when any rank's computation raised."""
    records = exchange(g, {"error": _error_of(local)}, f"{what} (completion)")
    _raise_failures(g, records, local, what)


def fail_unless_same(metas: list[dict], key: str, what: str) -> None:
    """Raises ValueError (on every rank alike) unless every rank's ``meta[key]`` is rank 0's."""
    first = metas[0][key]
    for r, meta in enumerate(metas):
        if meta[key] != first:
            fields = first.keys() if isinstance(first, dict) else [None]
            for f in fields:
                a = first if f is None else first.get(f)
                b = meta[key] if f is None else meta[key].get(f)
                if a != b:
                    name = key if f is None else f
                    raise ArgumentError(
                        f"flashcte.distributed.{what}: every rank must pass the same {name}: "
                        f"rank 0 has {a!r}, rank {r} has {b!r}"
                    )
            raise ArgumentError(f"flashcte.distributed.{what}: ranks 0 and {r} disagree on {key}")


def byte_view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A typed view of ``buf`` (flat uint8) at byte ``offset``."""
    n = 1
    for s in shape:
        n *= int(s)
    size = torch.empty((), dtype=dtype).element_size()
    return buf[offset : offset + n * size].view(dtype).view(shape)


def nbytes(shape: tuple, dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= int(s)
    return n


def allgather_seq(
    g: Group, tensors: list, lengths: list[int], index_of: Any, what: str
) -> tuple[list | None, BaseException | None]:
    """All-gathers tensors whose axis 1 is this rank's tokens (one message: their bytes packed
    back to back, padded to the longest rank's) and puts every rank's tokens at the indices
    ``index_of(r)`` of the whole sequence's axis 1. Every rank takes part in the all_gather even
    when its packing failed; the error is returned for :func:`settle`."""
    dtype = tensors[0].dtype
    rest = [tuple(int(s) for s in t.shape[2:]) for t in tensors]
    lead = int(tensors[0].shape[0])
    per_token = [lead * nbytes(r, dtype) for r in rest]
    max_bytes = max(lengths) * sum(per_token)
    send = torch.zeros(max_bytes, dtype=torch.uint8)
    error: BaseException | None = None
    n = lengths[g.rank]
    try:
        offset = 0
        for t, r, b in zip(tensors, rest, per_token):
            byte_view(send, offset, dtype, (lead, n) + r).copy_(t)
            offset += n * b
    except Exception as e:  # noqa: BLE001 - reported by settle()
        error = e
    parts = [send]
    if g.size > 1:
        parts = [torch.empty_like(send) for _ in range(g.size)]
        g.wait(dist.all_gather(parts, send, group=g.group, async_op=True), f"{what}: all_gather")
    if error is not None:
        return None, error
    total = sum(lengths)
    try:
        fulls = [torch.empty((lead, total) + r, dtype=dtype) for r in rest]
        for rank, part in enumerate(parts):
            m = lengths[rank]
            index = torch.from_numpy(index_of(rank))
            offset = 0
            for full, r, b in zip(fulls, rest, per_token):
                full[:, index] = byte_view(part, offset, dtype, (lead, m) + r)
                offset += m * b
        return fulls, None
    except Exception as e:  # noqa: BLE001 - reported by settle()
        return None, e
