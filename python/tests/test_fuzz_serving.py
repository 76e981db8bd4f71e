"""Property-based fuzzing of the Python serving API (issue 41): flashcte.quantize_kv,
flash_attn_with_kvcache, flash_attn_varlen_func (packed and over pages) and paged_attention, on
random valid and invalid inputs drawn by hypothesis: shapes (zero sizes included), memory layouts
(slices of padded buffers whose padding holds a NaN / out-of-range sentinel, permuted storage,
negative strides), dtypes (float32, float16, bfloat16, the 8-bit cache formats, and wrong ones),
page tables (shuffled, shared, out of range, negative, of the wrong dtype), lengths (past the
capacity, negative, left padding), masks, soft-capping, ALiBi, sinks, scales and thread counts.

The property, for every call, whatever its inputs:

* it returns, its results match the float64 reference (conftest's NaN-aware rules), what it
  writes in place (the appended cache slots and their scales, quantize_kv's dst, ``output``)
  holds what the reference wrote there, and nothing else the caller owns changed by a byte
  (the padding around a sliced argument included); or
* it raises ValueError or TypeError whose message names one of the call's arguments, and every
  array the caller passed is byte for byte as it was;

never another exception, never a crash. Each target also encodes the documented contract
(:class:`Contract`): calls it allows must succeed, calls it refuses must raise, and a few cases it
leaves open (zero sizes, queries beyond a sequence's keys, out-of-range entries of pages never
read, ...) may go either way but must match the reference when they succeed.

The targets, one test each:

* ``quantize_kv``: src of every float dtype and magnitude (subnormals, NaN, infinities) into
  each 8-bit format, per-tensor / per-head / per-token scales; the codes bit for bit.
* ``flash_attn_with_kvcache``: dense, cache_batch_idx and paged caches (float and 8-bit), the
  append with rotary, cache_seqlens as an int / list / array / None, left padding.
* ``flash_attn_varlen_func``: packed sequences (query and key lengths of 0 to 33, rows past the
  last offset, self- and cross-attention), ALiBi both on the one packed attention_cte call and on
  the mixed-batch call it falls back to, cu_seqlens of int32 / int64 / lists, max_seqlen_*.
* ``flash_attn_varlen_func(block_table=...)`` and ``paged_attention``: one mixed-batch draw
  (decode steps and prefill chunks over a shuffled page pool with shared prefix pages and -1
  past the used pages, seqused_k / seq_lens or cu_seqlens_k), in FlashAttention's names and
  NHD pages, or in vLLM's with HND or NHD pages, 8-bit caches and their scales, sinks and
  ``output`` in place.

Library bugs the fuzzer found and that are not fixed are listed in :data:`KNOWN_BUGS`: the calls
that hit one are held to the rest of the property only; the list is the
report, and deleting an entry turns its check back on.

Seeded and budgeted for CI: ``FLASHCTE_FUZZ_SEED`` and ``FLASHCTE_FUZZ_EXAMPLES`` examples per
target (defaults in conftest.py, which prints both before the tests run); no example database, no
deadline. A failure prints hypothesis' falsifying draws, the example's summary (``note``) and a
``@reproduce_failure`` blob; a crash kills pytest first, and ``FLASHCTE_FUZZ_TRACE=1`` prints
every call before it is made.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import flashcte
import numpy as np
import pytest
from conftest import FUZZ_EXAMPLES, FUZZ_SEED, assert_close, assert_stat_close, check_allclose
from semantics import (
    BF16,
    f64,
    fa_rotary,
    flash_attn_varlen_ref,
    kvcache_ref,
    varlen_kvcache_ref,
)

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")
from hypothesis import HealthCheck, event, given, note, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# Default budget (conftest.py): 500 examples per target, measured at 26 s for the whole file
# with seed 41 (30 to 38 s with seeds 1 to 3; the targets 2 to 8 s each) on a 2-core AMD EPYC
# (Zen 4, AVX3) while another build shared the machine: well under CI's ~90 s. The knobs are in
# the module docstring.
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    derandomize=False,  # the seed below makes the run reproducible
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# FLASHCTE_FUZZ_TRACE=1 prints every call's summary to stderr before it is made, so that a crash
# (which kills the process before hypothesis prints anything) shows the call that made it.
TRACE = os.environ.get("FLASHCTE_FUZZ_TRACE", "0") != "0"

FLOATS = ("float32", "float16", "bfloat16")
FORMATS = {
    "int8": np.dtype(np.int8),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
TOP = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}  # largest finite code
# Head dims around the SIMD widths (tails of 1, 7, 15 lanes) and a few ordinary ones.
DIMS = (1, 2, 3, 4, 7, 8, 15, 16, 17, 32, 33, 64)
WRONG_FLOAT = ("float64", "int64", "int32", "int8")
WRONG_INT = ("int64", "int16", "uint32", "float32")
LAYOUTS = ("contiguous", "contiguous", "padded", "permuted", "reversed")


def dtype_of(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else FORMATS.get(name) or np.dtype(name)


def name_of(a: Any) -> str:
    return a.dtype.name if isinstance(a, np.ndarray) else type(a).__name__


# ---- the contract and the property -------------------------------------------------------------


VALID, EITHER, INVALID = "valid", "either", "invalid"


class Contract:
    """The documented contract's verdict on one call: valid unless a rule refuses it (invalid),
    or leaves it open (either: the call may raise, and must match the reference if it does
    not)."""

    def __init__(self):
        self.refused: list[str] = []
        self.open: list[str] = []
        self.known: list[str] = []  # KNOWN_BUGS keys the call runs into

    def known_bug(self, key: str) -> None:
        assert key in KNOWN_BUGS, key
        self.known.append(key)

    def known_kind(self, kind: str) -> list[str]:
        return [k for k in self.known if KNOWN_BUGS[k][0] == kind]

    def refuse(self, why: str) -> None:
        self.refused.append(why)

    def leave_open(self, why: str) -> None:
        self.open.append(why)

    @property
    def verdict(self) -> str:
        return INVALID if self.refused else EITHER if self.open else VALID

    def __repr__(self) -> str:
        known = "".join(f" (known bug: {k})" for k in self.known)
        return f"{self.verdict}: {'; '.join(self.refused + self.open) or 'as documented'}{known}"


# Library bugs this fuzzer found, reported and not fixed yet, by kind: "unnamed", a refusal whose
# message names none of the call's arguments (the call must still raise ValueError/TypeError, be
# one the contract refuses and leave every array as it was: only the naming is waived);
# "accepts", a call the contract refuses that returns (every array must still be as it was);
# "refuses", a call the contract allows that raises (naming an argument, every array as it was).
# A crash is fixed, not listed (as attention_cte's SIGFPE on 0 query heads over KV heads was). A
# call's contract marks the ones it runs into (Contract.known_bug). Delete an entry once its bug
# is fixed, and the targets hold the library to the whole property again. Fixed so far (issue
# 41): paged_attention's and flash_attn_varlen_func(block_table=...)'s messages named the native
# call's arguments (seqused_k for seq_lens, k_cache for k); a batch of no query row skipped the
# rules of each sequence's call; flash_attn_with_kvcache refused a read-only k_scale it only
# reads.
KNOWN_BUGS: dict[str, tuple[str, str]] = {
}


@dataclass
class Call:
    """One call of a target: its arguments, the contract's verdict, the arguments it may write
    (whose views `check` verifies; the rest of their buffers must not change) and the check of
    a successful call's results, given the arguments' values before the call."""

    fn: Callable
    kwargs: dict
    contract: Contract
    check: Callable[[Any, dict, dict], None]
    written: tuple[str, ...] = ()
    # The native call's names for arguments the target spells otherwise (paged_attention's
    # seq_lens is the native seqused_k): no message may use them.
    foreign: frozenset = frozenset()
    summary: dict = field(default_factory=dict)


def root(a: np.ndarray) -> np.ndarray:
    """The buffer a generated array views (each argument owns one, C-contiguous)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def view_mask(a: np.ndarray) -> np.ndarray:
    """The bytes of root(a) that the view `a` covers (a flat bool mask)."""
    base = root(a)
    assert base.flags.c_contiguous
    mask = np.zeros(base.nbytes, np.bool_)
    if a.size:
        start = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        cover = np.lib.stride_tricks.as_strided(
            mask[start:], shape=a.shape + (a.itemsize,), strides=a.strides + (1,)
        )
        cover[...] = True
    return mask


def names_an_argument(message: str, names: set) -> bool:
    """The library's "<argument>: <rule>" form, or at least an argument named in the message."""
    head = re.match(r"^(\w+):", message)
    if head and head.group(1) in names:
        return True
    return any(re.search(rf"\b{re.escape(n)}\b", message) for n in names)


def run(call: Call) -> None:
    """The property (module docstring) for one call."""
    note(f"call: {call.fn.__name__}({call.summary})")
    note(f"contract: {call.contract!r}")
    arrays = {n: a for n, a in call.kwargs.items() if isinstance(a, np.ndarray)}
    before = {n: root(a).tobytes() for n, a in arrays.items()}
    snapshot = {n: (a.copy() if isinstance(a, np.ndarray) else a) for n, a in call.kwargs.items()}
    names = set(inspect.signature(call.fn).parameters)
    if TRACE:  # before the call: a crash kills the process before hypothesis reports anything
        print(f"\ncall: {call.fn.__name__}({call.summary})", file=sys.stderr, flush=True)
        print(f"contract: {call.contract!r}", file=sys.stderr, flush=True)
    try:
        result = call.fn(**call.kwargs)
    except (ValueError, TypeError) as e:
        message = f"{type(e).__name__}: {e}"
        event(f"{call.fn.__name__}: refused ({call.contract.verdict})")
        note(f"raised {message}")
        if call.foreign and names_an_argument(str(e), set(call.foreign)):
            raise AssertionError(f"the message names the native call's arguments: {message}")
        if not names_an_argument(str(e), names):
            if call.contract.known_kind("unnamed"):
                event(f"{call.fn.__name__}: known bug {call.contract.known_kind('unnamed')}")
            else:
                raise AssertionError(f"the message names no argument: {message}") from e
        for n, a in arrays.items():
            assert root(a).tobytes() == before[n], f"{n}: changed by a call that raised {message}"
        if call.contract.known_kind("refuses"):
            event(f"{call.fn.__name__}: known bug {call.contract.known_kind('refuses')}")
        else:
            assert call.contract.verdict != VALID, f"refused a call the contract allows: {message}"
        return
    except Exception as e:  # noqa: BLE001 - any other exception is the failure
        raise AssertionError(f"raised {type(e).__name__} (not ValueError/TypeError): {e}") from e
    event(f"{call.fn.__name__}: accepted ({call.contract.verdict})")
    if call.contract.known_kind("accepts"):
        event(f"{call.fn.__name__}: known bug {call.contract.known_kind('accepts')}")
    else:
        assert call.contract.verdict != INVALID, (
            f"accepted a call the contract refuses: {call.contract}"
        )
    for n, a in arrays.items():
        after = np.frombuffer(root(a).tobytes(), np.uint8)
        old = np.frombuffer(before[n], np.uint8)
        keep = ~view_mask(a) if n in call.written else np.ones(after.size, np.bool_)
        changed = np.flatnonzero((after != old) & keep)
        assert changed.size == 0, (
            f"{n}: {changed.size} bytes changed {'outside its view' if n in call.written else ''}"
            f" (first at byte {changed[:1].tolist()})"
        )
    if call.contract.verdict != INVALID:
        call.check(result, snapshot, call.kwargs)


# ---- drawing arrays ----------------------------------------------------------------------------


def draw_heads(draw) -> tuple[int, int, int, int]:
    """(kv_heads, heads, d, dv): GQA groups of 1 to 3, head dims around the SIMD widths."""
    hk = draw(st.integers(1, 3), label="heads_k")
    heads = hk * draw(st.sampled_from([1, 1, 2, 3]), label="group")
    d = draw(st.sampled_from(DIMS), label="d")
    dv = d if draw(st.booleans(), label="dv == d") else draw(st.sampled_from(DIMS), label="dv")
    return hk, heads, d, dv


def sentinel(dtype: np.dtype):
    """What fills the padding around a sliced argument: a value that shows up if read."""
    if dtype == np.int8:
        return -128  # outside the codes a cache holds (+-127)
    if np.issubdtype(dtype, np.integer):
        return np.iinfo(dtype).max  # out of range as a page, a length or an offset
    return np.nan  # floats, bfloat16 and float8


def place(draw, a: np.ndarray, layout: str | None = None) -> np.ndarray:
    """`a`'s values in a fresh buffer of a drawn layout: contiguous; a slice (maybe every other
    row) of a larger buffer padded with the sentinel; storage in permuted axis order read
    through a transposed view; or storage reversed along an axis read with a negative stride."""
    layout = layout or draw(st.sampled_from(LAYOUTS), label="layout")
    if a.ndim == 0 or layout == "contiguous":
        return a.copy()
    if layout == "padded":
        axis = draw(st.integers(0, a.ndim - 1), label="padded axis")
        step = draw(st.sampled_from([1, 1, 2]), label="step")
        before, after = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        shape = list(a.shape)
        shape[axis] = before + step * a.shape[axis] + after
        big = np.empty(shape, a.dtype)
        big[...] = sentinel(a.dtype)
        index = [slice(None)] * a.ndim
        index[axis] = slice(before, before + step * a.shape[axis], step)
        view = big[tuple(index)]
        view[...] = a
        return view
    if layout == "permuted":
        perm = draw(st.permutations(range(a.ndim)), label="storage order")
        return np.ascontiguousarray(a.transpose(perm)).transpose(np.argsort(perm))
    axis = draw(st.integers(0, a.ndim - 1), label="reversed axis")
    return np.flip(np.ascontiguousarray(np.flip(a, axis)), axis)


def negative_strides(a: Any) -> bool:
    """A negative stride, which _tensors.viewable copies away (even over one element): an
    argument written in place is then refused."""
    return isinstance(a, np.ndarray) and any(s < 0 for s in a.strides)


def values(rng, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dtype_of(dtype))


def kv8_scales(rng, fmt: str, shape) -> np.ndarray:
    """Dequantization scales that make codes() values of magnitude ~1 (0.25 to 2 times its
    spread's inverse), as a real cache's: far larger values make the scores hundreds, whose
    softmax amplifies float32 rounding past the output rule (max|ref|-relative) by itself."""
    return (rng.uniform(0.25, 2.0, shape) * 8 / TOP[fmt]).astype(np.float32)


def codes(rng, shape, fmt: str) -> np.ndarray:
    """Random 8-bit cache codes: int8 in [-127, 127], float8 of a spread of magnitudes."""
    if fmt == "int8":
        return rng.integers(-127, 128, shape).astype(np.int8)
    return (rng.standard_normal(shape) * (TOP[fmt] / 8)).astype(FORMATS[fmt])


def rng_of(draw) -> np.random.Generator:
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="values seed"))


def retype(draw, a: np.ndarray, wrong: tuple) -> np.ndarray:
    dtype = draw(st.sampled_from(wrong), label="wrong dtype")
    return f64(a).astype(dtype) if dtype != "int8" else f64(a).astype(np.int8)


def is_float(a: Any) -> bool:
    return isinstance(a, np.ndarray) and name_of(a) in FLOATS


def int_table(a: Any) -> np.ndarray | None:
    """An int32 table argument as an array (None for the wrong kind): lists become int32."""
    if isinstance(a, (list, tuple)):
        return np.asarray(a, np.int32)
    if isinstance(a, np.ndarray) and a.dtype == np.int32:
        return a
    return None


# ---- 8-bit caches: quantize_kv's contract in float64 -------------------------------------------


def quantized(x: np.ndarray, fmt: str, scale) -> np.ndarray:
    """x / scale (float64) rounded to nearest even and saturated to the format's largest value
    of its sign (infinities too, except in float8_e5m2, which has them); NaN stays NaN."""
    with np.errstate(all="ignore"):
        y = f64(x) / np.asarray(scale, np.float64)
    top = TOP[fmt]
    if fmt == "float8_e5m2":
        y = np.where(np.isfinite(y), np.clip(y, -top, top), y)
    else:
        y = np.clip(y, -top, top)
    if fmt == "int8":
        return np.rint(y).astype(np.int8)
    return y.astype(FORMATS[fmt])  # ml_dtypes rounds float64 to nearest even


def token_scales(x: np.ndarray, fmt: str) -> np.ndarray:
    """Per-token scales of rows x (..., d): the largest finite |x| over the format's largest
    value, 1 for a row without one."""
    x = f64(x)
    largest = np.where(np.isfinite(x), np.abs(x), 0.0).max(axis=-1, initial=0.0)
    return np.where(largest > 0, (largest / TOP[fmt]).astype(np.float32), np.float32(1.0))


def check_token_scales(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Written scales: want within an ulp; where want underflows float32 (a row of tiny
    subnormals), any positive subnormal (the codes are then checked against it)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    under = want == 0
    assert np.all((got[under] > 0) & (got[under] < 2.0**-126)), f"{what}: {got[under]}"
    check_allclose(got[~under], want[~under], rtol=2e-7, atol=2.0**-149, what=what)


def check_codes(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """8-bit codes bit for bit (signed zeros included), any NaN code where NaN is wanted."""
    got_nan, want_nan = np.isnan(f64(got)), np.isnan(f64(want))
    assert np.array_equal(got_nan, want_nan), (
        f"{what}: NaN codes at {np.argwhere(got_nan != want_nan)[:3].tolist()}"
    )
    bad = (got.view(np.uint8) != want.view(np.uint8)) & ~want_nan
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} codes differ, first at {np.argwhere(bad)[0].tolist()}: "
        f"{f64(got)[bad][0]} != {f64(want)[bad][0]}"
    )


def scale_contract(c: Contract, name: str, s: Any, shapes: dict, written: bool) -> str | None:
    """An 8-bit cache's scale argument: its granularity ("tensor", "head", "token") or None."""
    rule = c.refuse
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        if not (np.isfinite(s) and s > 0):
            rule(f"{name} = {s} is not finite and > 0")
        return "tensor"
    if not isinstance(s, np.ndarray):
        c.refuse(f"{name} is a {type(s).__name__}")
        return None
    if s.dtype != np.float32:
        (rule if is_float(s) else c.refuse)(f"{name} is {s.dtype.name}, not float32")
        return None
    kind = {shape: k for k, shape in shapes.items()}.get(s.shape)
    if kind is None:
        rule(f"{name} has shape {s.shape}, not one of {sorted(shapes.values())}")
        return None
    if kind != "token" and not (np.all(np.isfinite(s)) and np.all(s > 0)):
        rule(f"{name} holds an entry that is not finite and > 0")
    if written and (not s.flags.writeable or negative_strides(s)):
        c.refuse(f"{name} is read-only or negatively strided, and the append takes it as writable")
    return kind


# ---- faults the targets share -------------------------------------------------------------------

# As factories over the argument names a target has: each returns a
# mutation (draw, rng, kwargs) that changes kwargs in place.


def heads_of(kw: dict) -> int:
    """q's heads: axis 2 of (batch, seqlen_q, heads, d), axis 1 of (total_q, heads, d)."""
    q = kw["q"]
    return q.shape[-2] if isinstance(q, np.ndarray) and q.ndim >= 2 else 1


def mutation(name: str, fn: Callable) -> Callable:
    fn.__name__ = name
    return fn


def dtype_fault(*names: str) -> Callable:
    """One float argument in a dtype it must not have (float16 / float32 against q's)."""

    def fault(draw, rng, kw):
        name = draw(st.sampled_from(names))
        if isinstance(kw.get(name), np.ndarray):
            kw[name] = retype(draw, kw[name], WRONG_FLOAT + ("float16", "float32"))

    return mutation("dtype", fault)


def shape_fault(*names: str) -> Callable:
    """One array one shorter along an axis, or with an inserted axis (one more rank)."""

    def fault(draw, rng, kw):
        name = draw(st.sampled_from(names))
        x = kw.get(name)
        if isinstance(x, np.ndarray):
            axis = draw(st.integers(0, max(x.ndim - 1, 0)))
            index = [slice(None)] * x.ndim
            if x.ndim and draw(st.booleans()):
                index[axis] = slice(0, max(x.shape[axis] - 1, 0))
            else:
                index.insert(axis, None)
            kw[name] = x[tuple(index)]

    return mutation("shape", fault)


def read_only_fault(*names: str) -> Callable:
    def fault(draw, rng, kw):
        name = draw(st.sampled_from(names))
        if isinstance(kw.get(name), np.ndarray):
            kw[name].flags.writeable = False

    return mutation("read_only", fault)


def table_fault(draw, rng, kw):
    """block_table: an entry out of range (or another sequence's page), int64, rank 1, one
    column short."""
    table = kw.get("block_table")
    if table is None:
        return
    kind = draw(st.sampled_from(["entry", "entry", "int64", "rank1", "narrow", "shared"]))
    table = np.array(table)
    if kind == "int64":
        kw["block_table"] = table.astype(np.int64)
    elif kind == "rank1":
        kw["block_table"] = table.reshape(-1)
    elif kind == "narrow":
        kw["block_table"] = table[:, : max(table.shape[1] - 1, 0)]
    elif table.size:
        b = draw(st.integers(0, table.shape[0] - 1))
        col = draw(st.integers(0, table.shape[1] - 1))
        if kind == "shared":
            table[b, col] = table[draw(st.integers(0, table.shape[0] - 1)), 0]
        else:
            table[b, col] = draw(st.sampled_from([-1, -(2**31), kw["k_cache"].shape[0], 2**31 - 1]))
        kw["block_table"] = table


def scalar_fault(*extra: tuple) -> Callable:
    """A mask or score option out of its domain (and the target's own `extra` (name, value))."""

    def fault(draw, rng, kw):
        heads = heads_of(kw)
        name, value = draw(
            st.sampled_from(
                [
                    ("window_size", (-2, 0)),
                    ("window_size", (0, -5)),
                    ("window_size", "wide"),
                    ("softcap", -1.0),
                    ("softcap", float("nan")),
                    ("softmax_scale", float("nan")),
                    ("softmax_scale", float("inf")),
                    ("alibi_slopes", np.ones(heads + 1, np.float32)),
                    ("alibi_slopes", np.full(heads, np.nan, np.float32)),
                    ("alibi_slopes", np.ones((2, 3, heads), np.float32)),
                ]
                + list(extra)
            )
        )
        kw[name] = value

    return mutation("scalars", fault)


def scales_fault(draw, rng, kw):
    """An 8-bit cache's scale dropped, out of its domain, misshapen, float64, or given to a float
    cache."""
    name = draw(st.sampled_from(["k_scale", "v_scale"]))
    s = kw.get(name)
    kind = draw(st.sampled_from(["drop", "zero", "shape", "float64", "to_float_cache"]))
    if kind == "drop":
        kw.pop(name, None)
    elif kind == "zero":
        kw[name] = draw(st.sampled_from([0.0, -1.0, float("nan")]))
    elif kind == "shape":
        kw[name] = np.ones(7, np.float32)
    elif kind == "float64" and isinstance(s, np.ndarray):
        kw[name] = s.astype(np.float64)
    elif kind == "to_float_cache":
        kw[name] = 0.5


# ---- quantize_kv --------------------------------------------------------------------------------


def draw_quantize_kv(draw) -> Call:
    rng = rng_of(draw)
    tokens = draw(st.sampled_from([1, 2, 3, 5, 0]), label="tokens")
    heads = draw(st.integers(1, 3), label="kv_heads")
    d = draw(st.sampled_from(DIMS), label="d")
    fmt = draw(st.sampled_from(list(FORMATS)), label="format")
    src_dtype = draw(st.sampled_from(FLOATS), label="src dtype")
    granularity = draw(st.sampled_from(["tensor", "head", "token"]), label="granularity")
    # Magnitudes from float32 subnormals to near float16's / bfloat16's range ends.
    exponent = draw(st.integers(-140, 100) if src_dtype != "float16" else st.integers(-24, 15))
    src = values(rng, (tokens, heads, d), src_dtype, 2.0**exponent)
    if draw(st.booleans(), label="special values"):
        specials = [np.nan, np.inf, -np.inf, 0.0, -0.0, 3e38, 1e-45, 65504.0]
        for _ in range(draw(st.integers(1, 4))):
            if src.size:
                index = tuple(int(rng.integers(n)) for n in src.shape)
                src[index] = draw(st.sampled_from(specials), label="special")
    dst = codes(rng, (tokens, heads, d), fmt)  # garbage the call overwrites
    if granularity == "token":
        scale = rng.uniform(-1, 1, (tokens, heads)).astype(np.float32)  # garbage, written
    else:
        scale = rng.uniform(0.01, 4.0, 1 if granularity == "tensor" else heads) * 2.0**exponent
        scale = scale.astype(np.float32)
    kwargs = {"src": place(draw, src), "dst": place(draw, dst), "scale": place(draw, scale)}

    mutation = draw(st.sampled_from([None] * 8 + QUANTIZE_MUTATIONS), label="mutation")
    if mutation:
        mutation(draw, rng, kwargs)
    c = Contract()
    src, dst, scale = kwargs["src"], kwargs["dst"], kwargs["scale"]
    fmt_of = {v: k for k, v in FORMATS.items()}
    if not is_float(src):
        c.refuse(f"src is {name_of(src)}")
    if not isinstance(dst, np.ndarray) or dst.dtype not in fmt_of:
        c.refuse(f"dst is {name_of(dst)}")
    if c.refused:
        return Call(
            flashcte.quantize_kv, kwargs, c, lambda *a: None, summary={"mutation": mutation}
        )
    fmt = fmt_of[dst.dtype]
    if src.ndim != 3 or dst.shape != src.shape:
        c.refuse(f"src {src.shape} and dst {dst.shape} are not one (tokens, kv_heads, d) shape")
    tokens, heads = (src.shape + (0, 0))[:2] if src.ndim >= 2 else (0, 0)
    shapes = {"tensor": (1,), "head": (heads,), "token": (tokens, heads)}
    if heads == 1:
        shapes.pop("head")  # (1,): per tensor
    if not isinstance(scale, np.ndarray):
        c.refuse(f"scale is a {type(scale).__name__}, not an array")
    granularity = scale_contract(c, "scale", scale, shapes, written=True)
    if isinstance(scale, np.ndarray) and not scale.flags.writeable:
        c.refuse("scale is read-only")  # taken as writable whatever its granularity
    if negative_strides(scale):
        c.refuse("scale has negative strides (it is addressed in place)")
    if not dst.flags.writeable:
        c.refuse("dst is read-only")
    if negative_strides(dst):
        c.leave_open("dst has negative strides")
    if fmt == "int8" and src.ndim == 3 and np.isnan(f64(src)).any():
        c.refuse("a NaN in src for an int8 dst")
    if tokens == 0 or src.size == 0:
        c.leave_open("an empty src")

    def check(result, before, after):
        assert result[0] is after["dst"] and result[1] is after["scale"]
        src64 = f64(before["src"])
        if granularity == "token":
            check_token_scales(after["scale"], token_scales(src64, fmt), "scale")
            used = f64(after["scale"])[..., None]
        else:
            used = (
                f64(before["scale"]).reshape(-1)[None, :, None]
                if granularity == "head"
                else (f64(before["scale"]).reshape(-1)[0])
            )
        check_codes(after["dst"], quantized(src64, fmt, used), "dst")

    summary = {
        "src": (src.shape, name_of(src)) if isinstance(src, np.ndarray) else src,
        "dst": (dst.shape, name_of(dst)),
        "granularity": granularity,
        "mutation": getattr(mutation, "__name__", None),
    }
    return Call(flashcte.quantize_kv, kwargs, c, check, written=("dst", "scale"), summary=summary)


def _src_dtype(draw, rng, kw):
    kw["src"] = retype(draw, kw["src"], WRONG_FLOAT)


def _dst_dtype(draw, rng, kw):
    kw["dst"] = np.zeros(kw["dst"].shape, draw(st.sampled_from(["float16", "uint8", "int16"])))


def _scale_dtype(draw, rng, kw):
    kw["scale"] = kw["scale"].astype(draw(st.sampled_from(["float64", "float16", "int32"])))


def _dst_shape(draw, rng, kw):
    shape = list(kw["dst"].shape)
    shape[draw(st.integers(0, 2))] += draw(st.sampled_from([1, -1]))
    kw["dst"] = np.zeros([max(n, 0) for n in shape], kw["dst"].dtype)


def _src_rank(draw, rng, kw):
    kw["src"] = kw["src"][..., None] if draw(st.booleans()) else kw["src"][:, 0]


def _scale_shape(draw, rng, kw):
    t, h, _ = kw["dst"].shape
    shape = draw(st.sampled_from([(h + 1,), (t, h + 1), (t + 1, h), (1, 1), (), (t, h, 1)]))
    kw["scale"] = rng.uniform(0.1, 1, shape).astype(np.float32)


def _scale_value(draw, rng, kw):
    if kw["scale"].size:
        kw["scale"].reshape(-1)[0] = draw(st.sampled_from([0.0, -1.0, np.nan, np.inf]))


def _read_only(draw, rng, kw):
    kw[draw(st.sampled_from(["dst", "scale"]))].flags.writeable = False


def _not_an_array(draw, rng, kw):
    name = draw(st.sampled_from(["src", "dst", "scale"]))
    kw[name] = f64(kw[name]).tolist() if name != "scale" or draw(st.booleans()) else 0.5


def _nan_in_src(draw, rng, kw):
    if kw["src"].size:
        kw["src"][(0,) * kw["src"].ndim] = np.nan


QUANTIZE_MUTATIONS = [
    _src_dtype,
    _dst_dtype,
    _scale_dtype,
    _dst_shape,
    _src_rank,
    _scale_shape,
    _scale_value,
    _read_only,
    _not_an_array,
    _nan_in_src,
]


# ---- flash_attn_with_kvcache ---------------------------------------------------------------------


def table_contract(c: Contract, name: str, x: Any, length: int | None, shape2: bool = False):
    """An int32 table argument (a (batch,) vector, or with shape2 a 2-D page table): the array,
    or None after refusing it."""
    if x is None:
        return None
    a = int_table(x)
    if a is None:
        c.refuse(f"{name} is {name_of(x)}, not int32")
        return None
    if shape2 and (a.ndim != 2 or a.shape[0] != length):
        c.refuse(f"{name} has shape {a.shape}, not ({length}, max_blocks)")
        return None
    if not shape2 and a.shape != (length,):
        c.refuse(f"{name} has shape {a.shape}, not ({length},)")
        return None
    return a


def cache_contract(c: Contract, name: str, x: Any, dtype: str, written: bool):
    """A cache argument: its format ("" for a float cache) or None after refusing it."""
    if not isinstance(x, np.ndarray):
        c.refuse(f"{name} is a {type(x).__name__}")
        return None
    fmt = {v: k for k, v in FORMATS.items()}.get(x.dtype, "")
    if not fmt and name_of(x) != dtype:
        c.refuse(f"{name} is {name_of(x)}, q is {dtype}")
        return None
    if x.ndim != 4:
        c.refuse(f"{name} has rank {x.ndim}")
        return None
    if written and not x.flags.writeable:
        c.refuse(f"{name} is read-only and written")
    if written and negative_strides(x) and not fmt:
        c.refuse(f"{name} has negative strides and is written")
    if fmt and negative_strides(x):
        # Float arrays with negative strides are read through a copy (_tensors.viewable); an
        # 8-bit cache is addressed in place, and whether it may have them is not documented.
        c.leave_open(f"{name}: an 8-bit cache with negative strides")
    return fmt


def pages_read(lengths, leftpad, table, page):
    """(sequence, table column) of the pages each sequence reads: slots [leftpad, length)."""
    for b, n in enumerate(lengths):
        first = int(leftpad[b]) if leftpad is not None else 0
        for col in range(first // page, -(-int(n) // page)):
            yield b, col


def pages_seen(lengths, new, leftpad, sq, window, causal, page):
    """(sequence, table column) of the pages flash_attn_with_kvcache must find in range: those
    holding a slot some query row sees (kvcache.h: rows bottom-right aligned over slots
    [leftpad, length + new), within the window) or the append writes. A page of the other used
    slots is left open: the library may look at it (a prefill reads whole tiles) or not (no query
    row, or before a window)."""
    try:
        left, right = (int(x) for x in window)
    except (TypeError, ValueError):  # refused by window_contract
        left, right = -1, -1
    right = 0 if causal else right
    for b, n in enumerate(lengths):
        n, first = int(n) + new, int(leftpad[b]) if leftpad is not None else 0
        cols = {slot // page for slot in range(n - new, n)}
        for i in range(sq):
            diagonal = n - sq + i
            hi = n if right < 0 else min(n, diagonal + right + 1)
            lo = first if left < 0 else max(first, diagonal - left)
            cols.update(range(lo // page, -(-hi // page)) if lo < hi else ())
        for col in sorted(cols):
            yield b, col


def kvcache_contract(kw: dict) -> tuple[Contract, dict]:
    """flash_attn_with_kvcache's documented contract on `kw` (kvcache.h, _kvcache.py's docstring);
    returns it and what the reference needs (shapes, formats, lengths)."""
    c = Contract()
    info = {}
    q = kw["q"]
    if not is_float(q):
        c.refuse(f"q is {name_of(q)}")
        return c, info
    if q.ndim != 4:
        c.refuse(f"q has rank {q.ndim}")
        return c, info
    batch, sq, heads, d = q.shape
    dtype = name_of(q)
    appending = kw.get("k") is not None
    kf = cache_contract(c, "k_cache", kw["k_cache"], dtype, appending)
    vf = cache_contract(c, "v_cache", kw["v_cache"], dtype, appending)
    if kf is None or vf is None:
        return c, info
    kc, vc = kw["k_cache"], kw["v_cache"]
    info.update(dtype=dtype, kf=kf, vf=vf, batch=batch, heads=heads)
    if bool(kf) != bool(vf):
        c.leave_open("one 8-bit cache and one float cache")
    hk = kc.shape[2]
    if vc.shape[:3] != kc.shape[:3]:
        c.refuse(f"k_cache {kc.shape} and v_cache {vc.shape} differ before head_dim")
    if hk == 0 or heads % hk:
        c.refuse(f"{heads} heads are not a multiple of {hk} KV heads")
    if kc.shape[3] != d:
        c.refuse(f"k_cache head_dim {kc.shape[3]} != q's {d}")
    if min(batch, sq, heads, d, vc.shape[3], kc.shape[0], kc.shape[1]) == 0:
        c.leave_open("an empty dimension")
    paged = kw.get("block_table") is not None
    table = table_contract(c, "block_table", kw.get("block_table"), batch, shape2=True)
    rows = kc.shape[1]
    capacity = table.shape[1] * rows if table is not None else rows
    if paged and kw.get("cache_batch_idx") is not None:
        c.refuse("cache_batch_idx with a paged cache")
    idx = table_contract(c, "cache_batch_idx", kw.get("cache_batch_idx"), batch)
    bad_rows = np.zeros(batch, bool)  # out-of-range cache_batch_idx entries (judged below)
    if idx is not None and not paged:
        bad_rows = (idx < 0) | (idx >= kc.shape[0])
        if not bad_rows.any() and appending and len(set(idx.tolist())) < batch:
            c.refuse("a repeated cache_batch_idx entry while appending")
    elif not paged and kc.shape[0] != batch:
        (c.refuse if kc.shape[0] < batch else c.leave_open)(f"batch_cache {kc.shape[0]} != {batch}")
    new = 0
    if appending != (kw.get("v") is not None):
        c.refuse("k and v must be given together")
    elif appending:
        k, v = kw["k"], kw["v"]
        for name, t, last in (("k", k, d), ("v", v, vc.shape[3])):
            if not is_float(t) or name_of(t) != dtype:
                c.refuse(f"{name} is {name_of(t)}, q is {dtype}")
            elif t.ndim != 4 or t.shape[0] != batch or t.shape[2:] != (hk, last):
                c.refuse(f"{name} has shape {t.shape}")
        if k.shape[:2] != v.shape[:2]:
            c.refuse(f"k {k.shape} and v {v.shape} hold different tokens")
        new = k.shape[1] if k.ndim == 4 else 0
        if new == 0:
            c.leave_open("k and v of no token")
        if kf == "int8" and is_float(k) and np.isnan(f64(k)).any():
            c.refuse("a NaN appended to an int8 cache")
    raw = kw.get("cache_seqlens")
    if raw is None:
        lengths = np.full(batch, capacity)
        if appending:
            c.refuse("k and v without cache_seqlens")
    elif isinstance(raw, (int, np.integer)) and not isinstance(raw, bool):
        lengths = np.full(batch, int(raw))
    else:
        lengths = table_contract(c, "cache_seqlens", raw, batch)
        if lengths is None:
            return c, info
    if np.any(lengths < 0) or np.any(lengths + new > capacity):
        c.refuse(f"cache_seqlens {lengths.tolist()} + {new} outside [0, {capacity}]")
        return c, info
    leftpad = table_contract(c, "cache_leftpad", kw.get("cache_leftpad"), batch)
    if leftpad is not None and np.any((leftpad < 0) | (leftpad > lengths)):
        c.refuse(f"cache_leftpad {leftpad.tolist()} outside [0, cache_seqlens]")
        return c, info
    # A cache row, as a page, must be in range where the sequence reads or writes it.
    uses = (
        (lengths + new > (0 if leftpad is None else leftpad)) if new == 0 else np.ones(batch, bool)
    )
    if np.any(bad_rows & uses):
        c.refuse("cache_batch_idx out of range for a sequence that reads or writes its row")
    elif bad_rows.any():
        c.leave_open("cache_batch_idx out of range for a sequence that uses no slot")
    if table is not None and not c.refused:
        window = kw.get("window_size", (-1, -1))
        seen = set(pages_seen(lengths, new, leftpad, sq, window, kw.get("causal"), rows))
        used = set(pages_read(lengths + new, leftpad, table, rows))
        named = {}
        for b in range(batch):
            for col in range(table.shape[1]):
                p = int(table[b, col])
                if not 0 <= p < kc.shape[0]:
                    if (b, col) in seen:
                        c.refuse(f"block_table[{b}, {col}] = {p} is read and out of range")
                    elif (b, col) in used:
                        c.leave_open(f"block_table[{b}, {col}] = {p} is out of range, used, seen by no query")
                    else:
                        c.leave_open(f"block_table[{b}, {col}] = {p} is out of range, not read")
                named.setdefault(p, []).append((b, col))
        for b in range(batch):
            for slot in range(int(lengths[b]), int(lengths[b]) + new):
                p = int(table[b, slot // rows])
                if len(named.get(p, [])) > 1:
                    c.refuse(f"page {p} is written by sequence {b} and named {named[p]}")
    cos, sin = kw.get("rotary_cos"), kw.get("rotary_sin")
    if (cos is None) != (sin is None):
        c.refuse("rotary_cos and rotary_sin must be given together")
    elif cos is not None:
        if not appending:
            c.refuse("rotary tables without k and v")
        for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
            if not is_float(t) or name_of(t) not in (dtype, "float32"):
                c.refuse(f"{name} is {name_of(t)}")
        if cos.shape != sin.shape or cos.ndim != 2 or not 1 <= 2 * cos.shape[1] <= d:
            c.refuse(f"rotary tables of shapes {cos.shape}, {sin.shape} for head_dim {d}")
        elif new and not c.refused:
            per_token = kw.get("causal") or tuple(kw.get("window_size", (-1, -1))) != (-1, -1)
            last = int(np.max(lengths + max(new, sq if per_token else 1) - 1, initial=-1))
            if cos.shape[0] <= last:
                c.refuse(f"rotary tables of {cos.shape[0]} positions, position {last} needed")
    window_contract(c, kw, "window_size")
    softcap_contract(c, kw.get("softcap"))
    scale_value_contract(c, "softmax_scale", kw.get("softmax_scale"))
    alibi_contract(c, kw.get("alibi_slopes"), batch, heads)
    if kw.get("num_splits", 0) < 0:
        c.refuse("num_splits < 0")
    threads_contract(c, kw.get("num_threads"))
    shapes = {"tensor": (1,), "head": (hk,), "token": kc.shape[:3]}
    if hk == 1:
        shapes.pop("head")
    for name, fmt in (("k_scale", kf), ("v_scale", vf)):
        s = kw.get(name)
        if not fmt:
            if s is not None:
                c.refuse(f"{name} with a float cache")
            continue
        if s is None:
            c.refuse(f"an 8-bit cache without {name}")
            continue
        info[name] = scale_contract(c, name, s, shapes, written=appending)
    info.update(lengths=lengths, new=new, leftpad=leftpad, table=table, idx=idx, rows=rows)
    return c, info


def window_contract(c: Contract, kw: dict, name: str) -> None:
    w = kw.get(name, (-1, -1))
    try:
        left, right = (int(x) for x in w)
    except (TypeError, ValueError):
        c.refuse(f"{name} {w!r} is not a pair of ints")
        return
    if left < -1 or right < -1:
        c.refuse(f"{name} {w!r} has an entry below -1")


def softcap_contract(c: Contract, softcap) -> None:
    if softcap is not None and not (np.isfinite(softcap) and softcap >= 0):
        c.refuse(f"softcap {softcap} is not finite and >= 0")


def scale_value_contract(c: Contract, name: str, scale) -> None:
    if scale is not None and not np.isfinite(scale):
        c.refuse(f"{name} {scale} is not finite")


def alibi_contract(c: Contract, slopes, batch: int, heads: int) -> None:
    if slopes is None:
        return
    a = np.asarray(slopes)
    if a.shape not in ((heads,), (batch, heads)):
        c.refuse(f"alibi_slopes of shape {a.shape}")
    elif not np.all(np.isfinite(f64(a))):
        c.refuse("alibi_slopes holds a non-finite slope")


def threads_contract(c: Contract, threads) -> None:
    if threads is not None and threads < 0:
        c.leave_open(f"num_threads = {threads}")


def dequantized(cache: np.ndarray, scale, granularity: str) -> np.ndarray:
    """An 8-bit cache (..., kv_heads, d) in float64, with its scales."""
    s = np.asarray(scale, np.float64)
    if granularity == "token":
        s = s[..., None]
    elif granularity == "head":
        s = s.reshape(-1)[:, None]
    else:
        s = s.reshape(-1)[0]
    return f64(cache) * s


def slot_of(info: dict, b: int, j: int) -> tuple[int, int]:
    """Where slot j of sequence b lives: (cache row or page, row within it)."""
    if info["table"] is not None:
        return int(info["table"][b, j // info["rows"]]), j % info["rows"]
    return (b if info["idx"] is None else int(info["idx"][b])), j


def rotated_q(args: dict, lengths) -> np.ndarray:
    """q turned as flash_attn_with_kvcache turns it (kvcache_ref's rule): at cache_seqlens + i
    when causal or windowed, else all at cache_seqlens; float32 arithmetic, q's dtype."""
    q = args["q"]
    per_token = args.get("causal") or tuple(args.get("window_size", (-1, -1))) != (-1, -1)
    out = np.array(q)
    for b in range(q.shape[0]):
        positions = int(lengths[b]) + (np.arange(q.shape[1]) if per_token else 0)
        positions = np.broadcast_to(positions, (q.shape[1],))
        for h in range(q.shape[2]):
            turned = fa_rotary(
                q[b, :, h],
                args["rotary_cos"],
                args["rotary_sin"],
                positions,
                args.get("rotary_interleaved", True),
            )
            out[b, :, h] = turned.astype(q.dtype)
    return out


def check_kv8_append(before: dict, after: dict, info: dict, side: str) -> None:
    """The 8-bit append of k or v (side), slot by slot: codes quantize_kv's contract gives in
    float64 (with the scale the call wrote for a per-token cache) for the new row (k turned in
    float32 first when rotary tables are given), other slots untouched."""
    cache, scale = f"{side}_cache", f"{side}_scale"
    fmt, granularity = info["kf" if side == "k" else "vf"], info[scale]
    new_rows = f64(before[side])
    want_codes = before[cache].copy()
    want_scale = before[scale].copy() if isinstance(before[scale], np.ndarray) else None
    for b in range(info["batch"]):
        for t in range(info["new"]):
            r, s = slot_of(info, b, int(info["lengths"][b]) + t)
            row = new_rows[b, t]  # (kv_heads, d)
            if side == "k" and before.get("rotary_cos") is not None:
                position = np.full(row.shape[0], int(info["lengths"][b]) + t)
                interleaved = before.get("rotary_interleaved", True)
                row = f64(
                    fa_rotary(
                        row, before["rotary_cos"], before["rotary_sin"], position, interleaved
                    )
                )
            if granularity == "token":
                want = token_scales(row, fmt)
                check_token_scales(after[scale][r, s], want, f"{scale}[{r}, {s}]")
                used = f64(after[scale][r, s])[:, None]
                want_scale[r, s] = after[scale][r, s]
            elif granularity == "head":
                used = f64(before[scale]).reshape(-1)[:, None]
            else:
                used = f64(np.asarray(before[scale])).reshape(-1)[0]
            want_codes[r, s] = quantized(row, fmt, used)
    check_codes(after[cache], want_codes, cache)
    if want_scale is not None:
        assert after[scale].tobytes() == want_scale.tobytes(), f"{scale}: other entries changed"


def draw_kvcache(draw) -> Call:
    rng = rng_of(draw)
    dtype = draw(st.sampled_from(FLOATS), label="dtype")
    batch = draw(st.sampled_from([1, 1, 2, 3, 0]), label="batch")
    hk, heads, d, dv = draw_heads(draw)
    sq = draw(st.sampled_from([1, 1, 2, 3, 5, 0, 17, 20]), label="seqlen_q")
    new = draw(st.sampled_from([0, 0, 1, 2, 3]), label="seqlen_new")
    storage = draw(st.sampled_from(["dense", "batch_idx", "paged", "paged"]), label="storage")
    fmt = draw(st.sampled_from([""] * 4 + list(FORMATS)), label="cache format")
    page = draw(st.sampled_from([1, 2, 3, 5, 16]), label="page") if storage == "paged" else 0
    wanted = draw(st.integers(max(new, 1), 48) | st.just(1100), label="capacity")
    pages = -(-wanted // page) if page else 0
    capacity = pages * page if page else wanted
    lengths = rng.integers(0, capacity - new + 1, batch).astype(np.int32)
    form = draw(st.sampled_from(["array", "array", "int", "list", "none"]), label="cache_seqlens")
    kwargs: dict = {"q": values(rng, (batch, sq, heads, d), dtype)}
    if form == "int" and batch:
        lengths[:] = lengths[0]
    if form == "none" and not new:
        lengths[:] = capacity
    kwargs["cache_seqlens"] = {
        "array": lengths,
        "int": int(lengths[0]) if batch else 0,
        "list": lengths.tolist(),
        "none": None,
    }[form]

    def cache_values(shape, last):
        if fmt:
            return codes(rng, shape + (last,), fmt)
        return values(rng, shape + (last,), dtype)

    if page:
        num_blocks = batch * pages + draw(st.integers(0, 2), label="spare pages")
        table = rng.permutation(num_blocks)[: batch * pages].reshape(batch, pages)
        if batch > 1 and not new and draw(st.booleans(), label="shared pages"):
            table[1, : pages // 2 + 1] = table[0, : pages // 2 + 1]  # read-only prefix sharing
        kwargs["block_table"] = table.astype(np.int32)
        cache_shape = (num_blocks, page, hk)
    elif storage == "batch_idx":
        rows = batch + draw(st.integers(0, 2), label="spare rows")
        kwargs["cache_batch_idx"] = rng.permutation(rows)[:batch].astype(np.int32)
        cache_shape = (rows, capacity, hk)
    else:
        cache_shape = (batch, capacity, hk)
    kwargs["k_cache"] = cache_values(cache_shape, d)
    kwargs["v_cache"] = cache_values(cache_shape, dv)
    if fmt:
        for name in ("k_scale", "v_scale"):
            granularity = draw(st.sampled_from(["tensor", "head", "token"]), label=name)
            shape = {"tensor": (1,), "head": (hk,), "token": cache_shape}[granularity]
            scale = kv8_scales(rng, fmt, shape)
            python_float = granularity == "tensor" and draw(st.booleans(), label="float scale")
            kwargs[name] = float(scale[0]) if python_float else scale
    if new:
        kwargs["k"] = values(rng, (batch, new, hk, d), dtype)
        kwargs["v"] = values(rng, (batch, new, hk, dv), dtype)
        if d >= 2 and draw(st.booleans(), label="rotary"):
            half = draw(st.integers(1, d // 2), label="rotary_dim / 2")
            positions = capacity + max(sq, new) + draw(st.integers(0, 3))
            angle = rng.random((positions, half)) * 2 * np.pi
            table_dtype = draw(st.sampled_from([dtype, "float32"]), label="rotary dtype")
            kwargs["rotary_cos"] = np.cos(angle).astype(dtype_of(table_dtype))
            kwargs["rotary_sin"] = np.sin(angle).astype(dtype_of(table_dtype))
            kwargs["rotary_interleaved"] = draw(st.booleans(), label="interleaved")
    if batch and draw(st.booleans(), label="leftpad"):
        full = np.asarray(lengths if form != "none" else np.full(batch, capacity))
        kwargs["cache_leftpad"] = np.array([rng.integers(0, n + 1) for n in full], np.int32)
    options(draw, rng, kwargs, heads, batch)
    kwargs["num_splits"] = draw(st.sampled_from([0, 0, 1, 3]), label="num_splits")
    kwargs["return_softmax_lse"] = draw(st.booleans(), label="lse")
    for name in ("q", "k_cache", "v_cache", "k", "v", "k_scale", "v_scale"):
        if isinstance(kwargs.get(name), np.ndarray):
            kwargs[name] = place(draw, kwargs[name])

    mutation = draw(st.sampled_from([None] * 6 + KVCACHE_MUTATIONS), label="mutation")
    if mutation:
        mutation(draw, rng, kwargs)
    c, info = kvcache_contract(kwargs)
    appending = kwargs.get("k") is not None

    def check(result, before, after):
        out, lse = result if after.get("return_softmax_lse") else (result, None)
        args = {n: before[n] for n in inspect.signature(kvcache_ref).parameters if n in before}
        args["cache_seqlens"] = info["lengths"]
        if info["kf"]:
            # The append first, checked on its own; then attention over the verified cache.
            if appending:
                check_kv8_append(before, after, info, "k")
                check_kv8_append(before, after, info, "v")
            args.update(k=None, v=None, cache_seqlens=info["lengths"] + info["new"])
            if args.get("rotary_cos") is not None:
                # q turned where the append put it (kvcache_ref would take the grown lengths).
                args["q"] = rotated_q(args, info["lengths"])
                args.update(rotary_cos=None, rotary_sin=None)
            args["k_cache"] = dequantized(after["k_cache"], after["k_scale"], info["k_scale"])
            args["v_cache"] = dequantized(after["v_cache"], after["v_scale"], info["v_scale"])
        ref_out, ref_lse, k_after, v_after = kvcache_ref(**args)
        assert_close(out, ref_out, info["dtype"])
        if lse is not None:
            assert_stat_close(lse, ref_lse, info["dtype"], "lse")
        if appending and not info["kf"]:
            # FlashAttention's rule for the append: v exactly, k within 1e-3 after rotary.
            check_allclose(after["v_cache"], v_after, rtol=0, atol=0, what="v_cache")
            rotary = 1e-3 if before.get("rotary_cos") is not None else 0.0
            check_allclose(after["k_cache"], k_after, rtol=rotary, atol=rotary, what="k_cache")

    written = ("k_cache", "v_cache", "k_scale", "v_scale") if appending else ()
    summary = summarize(kwargs, mutation)
    return Call(flashcte.flash_attn_with_kvcache, kwargs, c, check, written, summary=summary)


def options(draw, rng, kwargs: dict, heads: int, batch: int, names=None) -> None:
    """The masks and score modifiers, under the target's names for them."""
    names = names or {}
    kwargs["causal"] = draw(st.booleans(), label="causal")
    if draw(st.booleans(), label="window"):
        w = (draw(st.integers(-1, 6), label="left"), draw(st.integers(-1, 6), label="right"))
        kwargs[names.get("window_size", "window_size")] = w
    kwargs["softcap"] = draw(st.sampled_from([0.0, 0.0, 0.0, 0.5, 3.0]), label="softcap")
    form = draw(st.sampled_from([None, None, "heads", "batch_heads"]), label="alibi")
    if form:
        shape = (heads,) if form == "heads" else (batch, heads)
        kwargs["alibi_slopes"] = (rng.random(shape) * 0.5).astype(np.float32)
    scale = draw(st.sampled_from([None, None, 0.3, -0.7, 0.0, 1.3]), label="softmax_scale")
    if scale is not None or "softmax_scale" not in names:
        kwargs[names.get("softmax_scale", "softmax_scale")] = scale
    kwargs["num_threads"] = draw(st.sampled_from([None, 1, 2, 3]), label="num_threads")


def summarize(kwargs: dict, mutation) -> dict:
    def brief(x):
        if isinstance(x, np.ndarray):
            layout = "" if x.flags.c_contiguous else f" strides={x.strides}"
            return f"{name_of(x)}{list(x.shape)}{layout}"
        return x

    summary = {n: brief(x) for n, x in kwargs.items()}
    summary["mutation"] = getattr(mutation, "__name__", None)
    return summary


# flash_attn_with_kvcache's own faults.


def _kv_lengths(draw, rng, kw):
    given = kw.get("cache_seqlens")
    lengths = np.array(0 if given is None else given, np.int64).reshape(-1)
    kind = draw(st.sampled_from(["negative", "past", "int64", "short", "python"]))
    if kind == "int64":
        kw["cache_seqlens"] = lengths.astype(np.int64)
        return
    if kind == "short":
        kw["cache_seqlens"] = lengths[:-1].astype(np.int32)
        return
    if kind == "python":
        kw["cache_seqlens"] = draw(st.sampled_from([-1, 10_000, 0]))
        return
    if lengths.size:
        lengths[draw(st.integers(0, lengths.size - 1))] = -1 if kind == "negative" else 10_000
    kw["cache_seqlens"] = lengths.astype(np.int32)


def _kv_table(draw, rng, kw):
    if kw.get("block_table") is None:
        kw["block_table"] = np.zeros((kw["q"].shape[0], 1), np.int32)  # a dense cache as pages
    else:
        table_fault(draw, rng, kw)


def _kv_batch_idx(draw, rng, kw):
    batch = kw["q"].shape[0]
    idx = rng.integers(0, kw["k_cache"].shape[0] + 1, batch)
    idx[: draw(st.integers(0, batch))] = draw(st.sampled_from([-1, 0]))
    kw["cache_batch_idx"] = idx.astype(draw(st.sampled_from(["int32", "int32", "int64"])))


def _kv_leftpad(draw, rng, kw):
    batch = kw["q"].shape[0]
    pad = np.full(batch, draw(st.sampled_from([-1, 5, 60, 2000])), np.int32)
    kw["cache_leftpad"] = pad if draw(st.booleans()) else pad.astype(np.int64)


def _kv_half_append(draw, rng, kw):
    kw.pop(draw(st.sampled_from(["k", "v"])), None)


def _kv_rotary(draw, rng, kw):
    cos, sin = kw.get("rotary_cos"), kw.get("rotary_sin")
    if cos is None:
        d = kw["q"].shape[3]
        kw["rotary_cos"] = kw["rotary_sin"] = np.ones((64, max(d // 2, 1)), np.float32)
        return
    kind = draw(st.sampled_from(["short", "only_cos", "wide", "mismatch"]))
    if kind == "short":
        n = draw(st.integers(0, 4))
        kw["rotary_cos"], kw["rotary_sin"] = cos[:n], sin[:n]
    elif kind == "only_cos":
        kw.pop("rotary_sin")
    elif kind == "wide":
        kw["rotary_cos"] = kw["rotary_sin"] = np.ones((cos.shape[0], kw["q"].shape[3]), cos.dtype)
    else:
        kw["rotary_sin"] = sin[:, :-1]


def _kv_nan_new(draw, rng, kw):
    k = kw.get("k")
    if isinstance(k, np.ndarray) and k.size:
        k[(0,) * k.ndim] = np.nan


KVCACHE_MUTATIONS = [
    dtype_fault("q", "k_cache", "v_cache", "k", "v", "rotary_cos"),
    _kv_lengths,
    _kv_table,
    _kv_batch_idx,
    _kv_leftpad,
    _kv_half_append,
    shape_fault("q", "k_cache", "v_cache", "k", "v"),
    _kv_rotary,
    scalar_fault(("num_splits", -1)),
    read_only_fault("k_cache", "v_cache", "k_scale", "v_scale"),
    scales_fault,
    _kv_nan_new,
]


# ---- flash_attn_varlen_func, packed --------------------------------------------------------------

# Query chunks of a mixed batch: decode steps (up to 16 queries run on the decode kernel), and
# prefill chunks past it (attention_cte); keys around them.
QUERY_LENGTHS = (0, 1, 1, 2, 3, 5, 17, 20)
KEY_LENGTHS = (0, 1, 2, 5, 9, 20, 33)


def offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int64)


def draw_offsets(draw, lengths, name: str) -> Any:
    """cu_seqlens over `lengths`: int32 as FlashAttention's, int64, or a list."""
    cu = offsets(lengths)
    form = draw(st.sampled_from(["int32", "int32", "int64", "list"]), label=f"{name} form")
    return cu.tolist() if form == "list" else cu.astype(form)


def offsets_contract(c: Contract, name: str, x: Any, total: int | None = None, int32=False):
    """cu_seqlens: 1-D, >= 1 entries, from 0, non-decreasing (and with `total`, ending at it);
    any integer dtype or a list (with int32, an int32 array or a list). The array or None."""
    if int32:
        a = int_table(x)
        if a is None:
            c.refuse(f"{name} is {name_of(x)}, not int32")
            return None
    else:
        a = np.asarray(x) if isinstance(x, (list, tuple, np.ndarray)) else None
        if a is None or not (np.issubdtype(a.dtype, np.integer) or a.size == 0 and a.ndim == 1):
            c.refuse(f"{name} is {name_of(x)}, not integers")
            return None
    if a.ndim != 1 or a.size < 1:
        c.refuse(f"{name} has shape {a.shape}, not (batch + 1,)")
        return None
    a = a.astype(np.int64)
    if a[0] != 0 or np.any(np.diff(a) < 0):
        c.refuse(f"{name} {a.tolist()} does not start at 0 or decreases")
        return None
    if total is not None and a[-1] != total:
        c.refuse(f"{name} ends at {a[-1]}, not at total_q = {total}")
        return None
    return a


def draw_varlen(draw) -> Call:
    rng = rng_of(draw)
    dtype = draw(st.sampled_from(FLOATS), label="dtype")
    nseq = draw(st.sampled_from([1, 1, 2, 3, 4, 0]), label="sequences")
    hk, heads, d, dv = draw_heads(draw)
    len_q = [draw(st.sampled_from(QUERY_LENGTHS), label="seqlen_q") for _ in range(nseq)]
    if draw(st.booleans(), label="cu_seqlens_k == cu_seqlens_q"):
        len_k = list(len_q)
    else:
        len_k = [draw(st.sampled_from(KEY_LENGTHS), label="seqlen_k") for _ in range(nseq)]
    # Rows past the last offset: q's output 0 (lse -inf), k's and v's never read.
    total_q = sum(len_q) + draw(st.sampled_from([0, 0, 0, 1, 3]), label="rows past cu_seqlens_q")
    total_k = sum(len_k) + draw(st.sampled_from([0, 0, 0, 2]), label="rows past cu_seqlens_k")
    kwargs: dict = {
        "q": values(rng, (total_q, heads, d), dtype),
        "k": values(rng, (total_k, hk, d), dtype),
        "v": values(rng, (total_k, hk, dv), dtype),
        "cu_seqlens_q": draw_offsets(draw, len_q, "cu_seqlens_q"),
        "cu_seqlens_k": draw_offsets(draw, len_k, "cu_seqlens_k"),
        "max_seqlen_q": max(len_q, default=0) + draw(st.sampled_from([0, 0, 1, 9])),
        "max_seqlen_k": max(len_k, default=0) + draw(st.sampled_from([0, 0, 1, 9])),
    }
    # ALiBi per head reaches one packed attention_cte call when every sequence has the same
    # key-query shift (self-attention), per sequence the mixed-batch call: both are drawn.
    options(draw, rng, kwargs, heads, nseq)
    kwargs["return_softmax_lse"] = draw(st.booleans(), label="lse")
    for name in ("q", "k", "v"):
        kwargs[name] = place(draw, kwargs[name])

    mutation = draw(st.sampled_from([None] * 6 + VARLEN_MUTATIONS), label="mutation")
    if mutation:
        mutation(draw, rng, kwargs)
    c, info = varlen_contract(kwargs)

    def check(result, before, after):
        out, lse = result if after.get("return_softmax_lse") else (result, None)
        ref_out, ref_lse = flash_attn_varlen_ref(
            before["q"],
            before["k"],
            before["v"],
            info["cu_q"],
            info["cu_k"],
            before.get("softmax_scale"),
            before.get("causal", False),
            before.get("window_size", (-1, -1)),
            before.get("softcap", 0.0),
            before.get("alibi_slopes"),
        )
        assert_close(out, ref_out, info["dtype"])
        if lse is not None:
            assert_stat_close(lse, ref_lse, info["dtype"], "lse")

    summary = summarize(kwargs, mutation)
    call = Call(flashcte.flash_attn_varlen_func, kwargs, c, check, summary=summary)
    # ALiBi per sequence goes through the mixed-batch call, whose names for k and v these are.
    call.foreign = frozenset(VARLEN_PAGED_NAMES)
    return call


def varlen_contract(kw: dict) -> tuple[Contract, dict]:
    """flash_attn_varlen_func's documented contract without block_table (_flash_attn.py)."""
    c = Contract()
    info: dict = {}
    for name in ("q", "k", "v"):
        if not is_float(kw[name]):
            c.refuse(f"{name} is {name_of(kw[name])}")
    if c.refused:
        return c, info
    q, k, v = kw["q"], kw["k"], kw["v"]
    dtype = name_of(q)
    if name_of(k) != dtype or name_of(v) != dtype:
        c.refuse(f"q, k, v are {dtype}, {name_of(k)}, {name_of(v)}")
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        c.refuse(f"ranks {q.ndim}, {k.ndim}, {v.ndim}, not 3")
        return c, info
    total_q, heads, d = q.shape
    total_k, hk, _ = k.shape
    if v.shape[:2] != k.shape[:2]:
        c.refuse(f"k {k.shape} and v {v.shape} differ before head_dim")
    if hk == 0 or heads % hk:
        c.refuse(f"{heads} heads are not a multiple of {hk} KV heads")
    if k.shape[2] != d:
        c.refuse(f"k head_dim {k.shape[2]} != q's {d}")
    if min(total_q, heads, d, total_k, v.shape[2]) == 0:
        c.leave_open("an empty dimension")
    cu_q = offsets_contract(c, "cu_seqlens_q", kw["cu_seqlens_q"])
    cu_k = offsets_contract(c, "cu_seqlens_k", kw["cu_seqlens_k"])
    if cu_q is None or cu_k is None:
        return c, info
    if cu_q.size != cu_k.size:
        c.refuse(f"{cu_q.size} query offsets, {cu_k.size} key offsets")
        return c, info
    if cu_q[-1] > total_q or cu_k[-1] > total_k:
        c.refuse(f"offsets end at {cu_q[-1]}, {cu_k[-1]} past {total_q}, {total_k}")
        return c, info
    for name, cu in (("max_seqlen_q", cu_q), ("max_seqlen_k", cu_k)):
        longest, m = int(np.diff(cu).max(initial=0)), kw[name]
        if cu.size > 1 and not (isinstance(m, (int, np.integer)) and m >= longest):
            c.refuse(f"{name} = {m!r} is not an int >= the longest sequence, {longest}")
    window_contract(c, kw, "window_size")
    softcap = kw.get("softcap")
    if softcap is not None and not (np.isfinite(softcap) and softcap >= 0):
        c.refuse(f"softcap {softcap} is not finite and >= 0")
    scale = kw.get("softmax_scale")
    if scale is not None and not np.isfinite(scale):
        c.refuse(f"softmax_scale {scale} is not finite")
    alibi_contract(c, kw.get("alibi_slopes"), cu_q.size - 1, heads)
    threads_contract(c, kw.get("num_threads"))
    info.update(dtype=dtype, cu_q=cu_q, cu_k=cu_k)
    return c, info


def _varlen_offsets(draw, rng, kw):
    """cu_seqlens_q or cu_seqlens_k not from 0, decreasing, past the rows, float, 2-D, or one
    sequence short of the other."""
    name = draw(st.sampled_from(["cu_seqlens_q", "cu_seqlens_k"]))
    kw[name] = offsets_fault(draw, kw[name], extra=1_000)


def offsets_fault(draw, x, extra: int):
    cu = np.array(x, np.int64)
    kind = draw(st.sampled_from(["start", "decrease", "past", "float", "rank2", "short", "empty"]))
    if kind == "start":
        cu = cu + 1
    elif kind == "decrease" and cu.size > 1:
        cu[-1], cu[0] = -1, 0
    elif kind == "past":
        cu[-1] += extra
    elif kind == "float":
        return cu.astype(np.float32)
    elif kind == "rank2":
        return cu[None].astype(np.int32)
    elif kind == "short":
        cu = cu[:-1]
    elif kind == "empty":
        cu = cu[:0]
    return cu.astype(np.int32)


def _varlen_max_seqlen(draw, rng, kw):
    name = draw(st.sampled_from(["max_seqlen_q", "max_seqlen_k"]))
    kw[name] = draw(st.sampled_from([0, -1, None]))


VARLEN_MUTATIONS = [
    dtype_fault("q", "k", "v"),
    shape_fault("q", "k", "v"),
    _varlen_offsets,
    _varlen_max_seqlen,
    scalar_fault(("num_threads", -1)),
]


# ---- the mixed batch: flash_attn_varlen_func over pages, and paged_attention ------------------
#
# One draw for both (they share the library's flash_attn_varlen_kvcache), in the names below
# (flash_attn_varlen_func's, the caches as the library names them); each target's own names
# replace them before the call. The caches are only read: a call must leave them as they were.

PAGED_NAMES = {
    "q": "query",
    "k_cache": "key_cache",
    "v_cache": "value_cache",
    "seqused_k": "seq_lens",
    "cu_seqlens_q": "query_start_loc",
    "softmax_scale": "scale",
    "window_size": "window",
}
VARLEN_PAGED_NAMES = {"k_cache": "k", "v_cache": "v"}


def nhd(x: Any, hnd: bool) -> Any:
    """A cache (num_blocks, heads_k, block_size, d) or a per-token scale (num_blocks, heads_k,
    block_size) in HND as the (num_blocks, block_size, heads_k, ...) view the library reads."""
    if hnd and isinstance(x, np.ndarray) and x.ndim in (3, 4):
        return x.swapaxes(1, 2)
    return x


def draw_mixed(draw, api: str) -> Call:
    """A mixed batch of decode steps and prefill chunks over a shuffled page pool, for
    flash_attn_varlen_func(block_table=...) (api "varlen") or paged_attention ("paged")."""
    paged = api == "paged"
    rng = rng_of(draw)
    dtype = draw(st.sampled_from(FLOATS), label="dtype")
    nseq = draw(st.sampled_from([1, 1, 2, 3, 4, 0]), label="sequences")
    hk, heads, d, dv = draw_heads(draw)
    page = draw(st.sampled_from([1, 2, 3, 5, 16]), label="page")
    len_q = [draw(st.sampled_from(QUERY_LENGTHS), label="seqlen_q") for _ in range(nseq)]
    used = [n + draw(st.sampled_from([0, 0, 1, 4, 9, 30]), label="cached") for n in len_q]
    if nseq and draw(st.integers(0, 9), label="fewer keys than queries") == 0:
        b = draw(st.integers(0, nseq - 1))
        used[b] = draw(st.integers(0, max(len_q[b] - 1, 0)))
    hnd = paged and draw(st.booleans(), label="HND")
    formats = [""] * (4 if paged else 16) + list(FORMATS)  # varlen takes no scales: refused
    fmt = draw(st.sampled_from(formats), label="cache format")
    pages = max(-(-max(used, default=0) // page), 1) + draw(st.integers(0, 1), label="spare")
    num_blocks = nseq * pages + draw(st.integers(0, 2), label="spare pages")
    table = rng.permutation(num_blocks)[: nseq * pages].reshape(nseq, pages).astype(np.int32)
    if nseq > 1 and draw(st.booleans(), label="shared pages"):
        table[1, : pages // 2 + 1] = table[0, : pages // 2 + 1]  # prefix sharing, read only
    if draw(st.booleans(), label="-1 past the used pages"):
        for b in range(nseq):
            table[b, -(-used[b] // page) :] = -1  # never read
    cache_shape = (num_blocks, page, hk)

    def cache(last):
        x = (
            codes(rng, cache_shape + (last,), fmt)
            if fmt
            else values(rng, cache_shape + (last,), dtype)
        )
        return np.ascontiguousarray(x.swapaxes(1, 2)) if hnd else x

    kwargs: dict = {
        "q": values(rng, (sum(len_q), heads, d), dtype),
        "k_cache": cache(d),
        "v_cache": cache(dv),
        "cu_seqlens_q": offsets(len_q).astype(np.int32),
        "block_table": table,
    }
    if draw(st.booleans(), label="lists"):
        kwargs["cu_seqlens_q"] = kwargs["cu_seqlens_q"].tolist()
    if fmt and paged:  # flash_attn_varlen_func takes no scales: its 8-bit caches are refused
        for name in ("k_scale", "v_scale"):
            granularity = draw(st.sampled_from(["tensor", "head", "token"]), label=name)
            shape = {"tensor": (1,), "head": (hk,), "token": cache_shape}[granularity]
            scale = kv8_scales(rng, fmt, shape)
            if granularity == "tensor" and draw(st.booleans(), label="float scale"):
                kwargs[name] = float(scale[0])
            else:
                kwargs[name] = nhd(scale, hnd).copy() if granularity == "token" else scale
    options(draw, rng, kwargs, heads, nseq)
    if paged:
        kwargs["seqused_k"] = np.array(used, np.int32)
        if kwargs.get("softmax_scale") is None:
            kwargs["softmax_scale"] = d**-0.5  # required
        form = draw(st.sampled_from([None, None, "values", "with -inf"]), label="sinks")
        if form:
            sinks = rng.standard_normal(heads).astype(np.float32)
            if form == "with -inf":
                sinks[draw(st.integers(0, heads - 1))] = -np.inf  # no sink for that head
            kwargs["sinks"] = sinks
        if draw(st.booleans(), label="output"):
            kwargs["output"] = np.full((sum(len_q), heads, dv), np.nan, dtype_of(dtype))
        layout = draw(st.sampled_from(["default", "named"]), label="kv_layout")
        if not hnd or layout == "named":
            kwargs["kv_layout"] = "HND" if hnd else "NHD"
    else:
        lengths = draw(st.sampled_from(["seqused_k", "cu_seqlens_k", "both"]), label="lengths")
        kwargs["cu_seqlens_k"] = None
        if lengths != "seqused_k":
            # With both, seqused_k says the lengths and cu_seqlens_k is not read.
            kwargs["cu_seqlens_k"] = draw_offsets(
                draw, used if lengths == "cu_seqlens_k" else len_q, "cu_seqlens_k"
            )
        if lengths != "cu_seqlens_k":
            kwargs["seqused_k"] = np.array(used, np.int32)
        kwargs["max_seqlen_q"] = max(len_q, default=0) + draw(st.sampled_from([0, 0, 1, 9]))
        kwargs["max_seqlen_k"] = max(used, default=0) + draw(st.sampled_from([0, 0, 1, 9]))
        kwargs["return_softmax_lse"] = draw(st.booleans(), label="lse")
    for name in ("q", "k_cache", "v_cache", "k_scale", "v_scale", "output"):
        if isinstance(kwargs.get(name), np.ndarray):
            kwargs[name] = place(draw, kwargs[name])

    mutations = MIXED_MUTATIONS + (PAGED_MUTATIONS if paged else VARLEN_PAGED_MUTATIONS)
    mutation = draw(st.sampled_from([None] * 6 + mutations), label="mutation")
    if mutation:
        mutation(draw, rng, kwargs)
    c, info = mixed_contract(kwargs, api)

    def check(result, before, after):
        out, lse = result if after.get("return_softmax_lse") else (result, None)
        if before.get("output") is not None:
            assert out is after["output"], "output given: the call returns it"
        caches = {}
        for side in ("k", "v"):
            x = nhd(before[f"{side}_cache"], info["hnd"])
            fmt = info["kf" if side == "k" else "vf"]
            if fmt:
                scale = nhd(np.asarray(before[f"{side}_scale"]), info["hnd"])
                x = dequantized(x, scale, info[f"{side}_scale"])
            caches[side] = f64(x)
        ref_out, ref_lse = varlen_kvcache_ref(
            before["q"],
            caches["k"],
            caches["v"],
            info["cu"],
            info["used"],
            info["table"],
            before.get("softmax_scale"),
            before.get("causal", paged),
            before.get("window_size", (-1, -1)),
            before.get("softcap", 0.0),
            before.get("alibi_slopes"),
            before.get("sinks"),
        )
        assert_close(out, ref_out, info["dtype"])
        if lse is not None:
            assert_stat_close(lse, ref_lse, info["dtype"], "lse")

    names = PAGED_NAMES if paged else VARLEN_PAGED_NAMES
    fn = flashcte.paged_attention if paged else flashcte.flash_attn_varlen_func
    summary = summarize({names.get(n, n): x for n, x in kwargs.items()}, mutation)
    call = Call(fn, kwargs, c, check, ("output",) if paged else (), summary=summary)
    call.foreign = frozenset(dict(names, out="output") if paged else names)
    return renamed(call, names)


def renamed(call: Call, names: dict) -> Call:
    """`call` (drawn, checked against its contract and referenced in the shared names) with the
    target's names for its arguments: the call and run() see these, `check` the shared ones."""
    back = {v: k for k, v in names.items()}
    shared_check = call.check

    def rename(kwargs: dict) -> dict:
        return {back.get(n, n): x for n, x in kwargs.items()}

    def check(result, before, after):
        shared_check(result, rename(before), rename(after))

    call.kwargs = {names.get(n, n): x for n, x in call.kwargs.items()}
    call.written = tuple(names.get(n, n) for n in call.written)
    call.check = check
    return call


def mixed_contract(kw: dict, api: str) -> tuple[Contract, dict]:
    """The mixed batch's documented contract (kvcache.h, flash_attn_varlen_kvcache; the
    docstrings of flash_attn_varlen_func and paged_attention) on `kw` in the shared names."""
    c = Contract()
    info: dict = {}
    paged = api == "paged"
    layout = kw.get("kv_layout", "HND") if paged else "NHD"
    if layout not in ("HND", "NHD"):
        c.refuse(f"kv_layout {layout!r}")
        return c, info
    hnd = layout == "HND"
    q = kw["q"]
    if not is_float(q):
        c.refuse(f"q is {name_of(q)}")
        return c, info
    if q.ndim != 3:
        c.refuse(f"q has rank {q.ndim}")
        return c, info
    total_q, heads, d = q.shape
    dtype = name_of(q)
    fmts = {}
    for name in ("k_cache", "v_cache"):
        x = kw[name]
        fmt = {v: k for k, v in FORMATS.items()}.get(getattr(x, "dtype", None), "")
        if not (fmt or is_float(x)):
            c.refuse(f"{name} is {name_of(x)}")
        elif x.ndim != 4:
            c.refuse(f"{name} has rank {x.ndim}")
        else:
            fmts[name] = fmt
            if not fmt and name_of(x) != dtype:
                c.refuse(f"{name} is {name_of(x)}, q is {dtype}")
            if fmt and negative_strides(x):
                # Float arrays are copied (_tensors.viewable); an 8-bit cache is read in place.
                c.leave_open(f"{name}: an 8-bit cache with negative strides")
    if len(fmts) < 2:
        return c, info
    kf, vf = fmts["k_cache"], fmts["v_cache"]
    kc, vc = nhd(kw["k_cache"], hnd), nhd(kw["v_cache"], hnd)
    if not paged and (kf or vf):
        c.refuse("an 8-bit cache, and flash_attn_varlen_func takes no k_scale")
    if bool(kf) != bool(vf):
        c.leave_open("one 8-bit cache and one float cache")
    hk, dv = kc.shape[2], vc.shape[3]
    if vc.shape[:3] != kc.shape[:3]:
        c.refuse(f"k_cache {kc.shape} and v_cache {vc.shape} differ before head_dim")
    if hk == 0 or heads % hk:
        c.refuse(f"{heads} heads are not a multiple of {hk} KV heads")
    if kc.shape[3] != d:
        c.refuse(f"k_cache head_dim {kc.shape[3]} != q's {d}")
    if min(total_q, heads, d, dv, kc.shape[0], kc.shape[1]) == 0:
        c.leave_open("an empty dimension")
    cu = offsets_contract(c, "cu_seqlens_q", kw["cu_seqlens_q"], total_q, int32=True)
    if cu is None:
        return c, info
    batch = cu.size - 1
    if kw.get("seqused_k") is not None or paged:
        lengths = table_contract(c, "seqused_k", kw.get("seqused_k"), batch)
        if kw.get("seqused_k") is None:
            c.refuse("seq_lens is None")
    elif kw.get("cu_seqlens_k") is None:
        c.refuse("neither seqused_k nor cu_seqlens_k")
        lengths = None
    else:
        cu_k = offsets_contract(c, "cu_seqlens_k", kw["cu_seqlens_k"])
        lengths = None if cu_k is None else np.diff(cu_k)
        if lengths is not None and lengths.shape != (batch,):
            c.refuse(f"cu_seqlens_k gives {lengths.size} sequences, cu_seqlens_q {batch}")
    if lengths is None or c.refused:
        return c, info
    page = kc.shape[1]
    table = None
    if kw.get("block_table") is None:
        c.leave_open("no block_table: dense caches, one row per sequence (undocumented)")
        if kc.shape[0] != batch:
            c.refuse(f"dense caches of {kc.shape[0]} rows for {batch} sequences")
        capacity = page
    else:
        table = table_contract(c, "block_table", kw["block_table"], batch, shape2=True)
        if table is None:
            return c, info
        if page == 0:
            c.refuse("pages of 0 slots")
        capacity = table.shape[1] * page
    if np.any(lengths < 0) or np.any(lengths > capacity):
        c.refuse(f"seqused_k {lengths.tolist()} outside [0, {capacity}]")
        return c, info
    if table is not None and page:
        for b, col in pages_read(lengths, None, table, page):
            if not 0 <= table[b, col] < kc.shape[0]:
                c.refuse(f"block_table[{b}, {col}] = {table[b, col]} is used and out of range")
    if np.any(np.diff(cu) > lengths):
        c.leave_open("a sequence with more queries than keys")
    sinks = kw.get("sinks")
    if sinks is not None:
        if not is_float(sinks):
            c.refuse(f"sinks is {name_of(sinks)}")
        elif name_of(sinks) != "float32":
            c.refuse(f"sinks is {name_of(sinks)}, not float32")
        elif sinks.shape != (heads,):
            c.refuse(f"sinks has shape {sinks.shape}, not ({heads},)")
        elif np.any(np.isnan(sinks) | (sinks == np.inf)):
            c.refuse("sinks holds NaN or +inf")
    alibi_contract(c, kw.get("alibi_slopes"), batch, heads)
    if paged and np.ndim(kw.get("alibi_slopes")) == 2:
        c.leave_open("alibi_slopes (num_seqs, heads): paged_attention documents (heads,)")
    if not paged:
        for name, longest in (("max_seqlen_q", np.diff(cu)), ("max_seqlen_k", lengths)):
            m = kw.get(name)
            if batch and not (isinstance(m, (int, np.integer)) and m >= longest.max()):
                c.refuse(f"{name} = {m!r} is not an int >= the longest sequence")
    window_contract(c, kw, "window_size")
    softcap = kw.get("softcap")
    if softcap is not None and not (np.isfinite(softcap) and softcap >= 0):
        c.refuse(f"softcap {softcap} is not finite and >= 0")
    scale = kw.get("softmax_scale")
    if scale is not None and not np.isfinite(scale):
        c.refuse(f"softmax_scale {scale} is not finite")
    threads_contract(c, kw.get("num_threads"))
    shapes = {"tensor": (1,), "head": (hk,), "token": kc.shape[:3]}
    if hk == 1:
        shapes.pop("head")
    for name, fmt in (("k_scale", kf), ("v_scale", vf)):
        s = kw.get(name)
        if not fmt:
            if s is not None:
                c.refuse(f"{name} with a float cache")
        elif s is None:
            if paged:
                c.refuse(f"an 8-bit cache without {name}")
        else:
            info[name] = scale_contract(c, name, nhd(s, hnd), shapes, False, )
    out = kw.get("output")
    if out is not None:
        if not is_float(out):
            c.refuse(f"output is {name_of(out)}")
        elif not out.flags.writeable or negative_strides(out):
            c.refuse("output is read-only or negatively strided")
        elif out.ndim != 3 or out.shape[:2] != (total_q, heads):
            c.refuse(f"output has shape {out.shape}, not {(total_q, heads, dv)}")
        elif any(
            np.shares_memory(out, x)
            for n, x in kw.items()
            if n != "output" and isinstance(x, np.ndarray)
        ):
            c.refuse("output overlaps an input")
        elif name_of(out) != dtype or out.shape[2] != dv:
            c.refuse(f"output is {name_of(out)}{list(out.shape)}, q is {dtype}")
    info.update(dtype=dtype, kf=kf, vf=vf, cu=cu, used=lengths, table=table, hnd=hnd)
    return c, info


def _mixed_offsets(draw, rng, kw):
    kw["cu_seqlens_q"] = offsets_fault(draw, kw["cu_seqlens_q"], extra=1)


def _mixed_lengths(draw, rng, kw):
    """seqused_k (or, without it, cu_seqlens_k) negative, past the pages, int64, short, an int."""
    if kw.get("seqused_k") is None:
        kw["cu_seqlens_k"] = offsets_fault(draw, kw["cu_seqlens_k"], extra=10_000)
        return
    lengths = np.array(kw["seqused_k"], np.int64)
    kind = draw(st.sampled_from(["negative", "past", "int64", "short", "python"]))
    if kind == "int64":
        kw["seqused_k"] = lengths
    elif kind == "short":
        kw["seqused_k"] = lengths[:-1].astype(np.int32)
    elif kind == "python":
        kw["seqused_k"] = draw(st.sampled_from([0, 5]))
    elif lengths.size:
        lengths[draw(st.integers(0, lengths.size - 1))] = -1 if kind == "negative" else 10_000
        kw["seqused_k"] = lengths.astype(np.int32)


def _mixed_more_queries(draw, rng, kw):
    """One sequence given fewer keys than it has queries (seqused_k)."""
    cu, used = np.asarray(kw["cu_seqlens_q"]), kw.get("seqused_k")
    if isinstance(used, np.ndarray) and used.size:
        b = draw(st.integers(0, used.size - 1))
        used[b] = max(int(cu[b + 1] - cu[b]) - draw(st.integers(1, 3)), 0)


def _paged_output(draw, rng, kw):
    """output overlapping q, of the wrong dtype or shape, read-only or negatively strided."""
    q = kw["q"]
    kind = draw(st.sampled_from(["q", "float64", "shape", "read_only", "reversed"]))
    if not isinstance(q, np.ndarray) or q.ndim != 3:
        return
    shape = q.shape[:2] + (kw["v_cache"].shape[-1],)
    if kind == "q":
        kw["output"] = q
    elif kind == "float64":
        kw["output"] = np.zeros(shape, np.float64)
    elif kind == "shape":
        kw["output"] = np.zeros(shape[:2] + (shape[2] + 1,), q.dtype)
    else:
        out = np.zeros(shape, q.dtype)
        if kind == "read_only":
            out.flags.writeable = False
        kw["output"] = out if kind == "read_only" else place(draw, out, "reversed")


def _paged_no_table(draw, rng, kw):
    kw["block_table"] = None


MIXED_MUTATIONS = [
    dtype_fault("q", "k_cache", "v_cache"),
    shape_fault("q", "k_cache", "v_cache", "block_table"),
    table_fault,
    _mixed_offsets,
    _mixed_lengths,
    _mixed_more_queries,
    # The caches and their scales are only read: read-only arrays are taken.
    read_only_fault("q", "k_cache", "v_cache", "k_scale", "v_scale"),
]
PAGED_MUTATIONS = [
    scalar_fault(
        ("sinks", np.array([np.nan], np.float32)),
        ("sinks", np.full(1, np.inf, np.float32)),
        ("sinks", np.zeros(3, np.float64)),
        ("kv_layout", "NCHW"),
        ("num_threads", -1),
    ),
    scales_fault,
    _paged_output,
    _paged_no_table,
    shape_fault("output", "sinks"),
]
VARLEN_PAGED_MUTATIONS = [scalar_fault(("num_threads", -1)), _varlen_max_seqlen]


# ---- tests ---------------------------------------------------------------------------------------


@FUZZ
@hypothesis_seed(FUZZ_SEED)
@given(st.data())
def test_quantize_kv(data):
    with np.errstate(all="ignore"):  # casts that overflow on purpose, inf - inf in references
        run(draw_quantize_kv(data.draw))


@FUZZ
@hypothesis_seed(FUZZ_SEED)
@given(st.data())
def test_flash_attn_with_kvcache(data):
    with np.errstate(all="ignore"):
        run(draw_kvcache(data.draw))


@FUZZ
@hypothesis_seed(FUZZ_SEED)
@given(st.data())
def test_flash_attn_varlen_func(data):
    with np.errstate(all="ignore"):
        run(draw_varlen(data.draw))


@FUZZ
@hypothesis_seed(FUZZ_SEED)
@given(st.data())
def test_flash_attn_varlen_func_over_pages(data):
    with np.errstate(all="ignore"):
        run(draw_mixed(data.draw, "varlen"))


@FUZZ
@hypothesis_seed(FUZZ_SEED)
@given(st.data())
def test_paged_attention(data):
    with np.errstate(all="ignore"):
        run(draw_mixed(data.draw, "paged"))
