"""The fuzzer's model of the serving API (test_fuzz_serving.py; the property in its docstring):
the dtypes, formats, head dims and layouts it draws from, :class:`Contract` (the documented
contract of one call: what it must accept, refuse, or may do either way), :data:`KNOWN_BUGS`,
:class:`Call`, and :func:`run`, which makes a call and holds it to the property.

Imported by test_fuzz_serving.py after its ``pytest.importorskip`` of hypothesis and ml_dtypes.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import ml_dtypes
import numpy as np
from hypothesis import event, note
from semantics import BF16

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
