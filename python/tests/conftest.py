"""Shared helpers: dtypes (bfloat16 through ml_dtypes), casting, tolerances, and the accuracy
checks every test compares through (NaN- and Inf-aware: see nonfinite_mismatch)."""

from __future__ import annotations

import math
import os
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
# The Hugging Face hub is unreachable here and in CI, and the tests load only local files; but
# transformers' GGUF loader (test_real_model.py) asks the hub for matmul kernels unless offline
# (DNS lookups that fail). huggingface_hub reads this once, when it is first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from semantics import BF16, f64

DTYPES = [
    pytest.param("float32", id="f32"),
    pytest.param("float16", id="f16"),
    pytest.param(
        "bfloat16",
        id="bf16",
        marks=pytest.mark.skipif(
            BF16 is None, reason="ml_dtypes is not installed (numpy bfloat16)"
        ),
    ),
]

# Relative tolerance of the output against the float64 transcription, as a fraction of the
# output's largest magnitude (the Neuron suite's form, |a - b| <= atol + rtol * max|ref|).
# The inputs are exactly representable in the dtype (the reference reads the rounded values), so
# the error is the kernel's own arithmetic: float32 accumulation and exp (a few ulp over a few
# thousand terms), and for 16-bit inputs the probabilities rounded to the input dtype before the
# P.V product plus the final rounding of out: 8 ulp of the dtype (2^-11 for float16, 2^-8 for
# bfloat16) covers both with margin; bfloat16 uses the Neuron suite's 2e-2.
OUT_RTOL = {"float32": 2e-5, "float16": 8 * 2.0**-11, "bfloat16": 2e-2}
# The statistics are float32 in every mode: float32 dot products of the (rounded) inputs and
# float32 sums of exps, ~1.5e-6 relative measured for all three dtypes (Sq=300, Skv=1500, AVX2);
# 16-bit inputs get 5x more room in case a future kernel rounds q*scale to the input dtype.
STAT_RTOL = {"float32": 2e-5, "float16": 1e-4, "bfloat16": 1e-4}


def np_dtype(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


def make(rng, shape, dtype, scale=1.0, uniform=False):
    """Random data, rounded to `dtype` (numpy array of that dtype)."""
    if uniform:
        x = rng.random(shape, dtype=np.float32)
    else:
        x = rng.standard_normal(shape, dtype=np.float32) * scale
    return x.astype(np_dtype(dtype))


def as_f64(x) -> np.ndarray:
    """A numpy array (bfloat16 included) or a torch tensor as a float64 numpy array (duck-typed
    on ``detach`` so that conftest does not import torch)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    return f64(x)


def nonfinite_mismatch(got, ref) -> str | None:
    """Where ``got``'s non-finite entries differ from ``ref``'s (float64 arrays of one shape), or
    None: a NaN or an infinity in ``got`` where ``ref`` is finite, a finite value where ``ref``
    is not, or another infinity (or NaN) where ``ref`` has one. Equal infinities (an empty row's
    lse = -inf on both sides) and NaN on both sides count as equal.

    Every accuracy check goes through this first because ``np.abs(got - ref).max() <= tol``
    alone can miss them: over ``ref``'s finite entries only (``got[finite]``) it never sees
    ``got`` where ``ref`` is infinite, a tolerance scaled by ``max|ref|`` becomes inf when
    ``ref`` holds an infinity (so ``err = inf <= inf`` passes), and Python's ``max`` drops a NaN
    that is not its first argument."""
    got_finite, ref_finite = np.isfinite(got), np.isfinite(ref)
    same = np.where(ref_finite, got_finite, (got == ref) | (np.isnan(got) & np.isnan(ref)))
    if same.all():
        return None
    where = tuple(int(i) for i in np.argwhere(~same)[0])
    got_value, ref_value, count = float(got[where]), float(ref[where]), int((~same).sum())
    return f"entry {where} is {got_value} where the reference has {ref_value} ({count} such)"


def max_abs_err(got, ref) -> float:
    """max |got - ref| over the reference's finite entries, inf when the non-finite entries
    differ (:func:`nonfinite_mismatch`), 0.0 when there is nothing finite to compare. So
    ``max_abs_err(got, ref) <= tol`` fails, for any finite ``tol``, on a NaN or Inf that ``ref``
    does not have and on a finite value where ``ref`` has an infinity, and passes on equal
    infinities. inf rather than NaN so that folds (``max(a, b)``) keep it."""
    got, ref = as_f64(got), as_f64(ref)
    assert got.shape == ref.shape, f"shape {got.shape} != {ref.shape}"
    if nonfinite_mismatch(got, ref) is not None:
        return math.inf
    finite = np.isfinite(ref)
    return float(np.abs(got[finite] - ref[finite]).max()) if finite.any() else 0.0


def check_close(got, ref, *, rtol, atol=0.0, floor=0.0, what="out") -> float:
    """The suite's accuracy rule, ``|got - ref| <= atol + rtol * max(max|ref|, floor)`` over the
    reference's finite entries (max|ref| over those too), the non-finite entries identical
    (:func:`nonfinite_mismatch`). numpy arrays or torch tensors; returns the max error."""
    got, ref = as_f64(got), as_f64(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    mismatch = nonfinite_mismatch(got, ref)
    assert mismatch is None, f"{what}: non-finite entries differ: {mismatch}"
    finite = np.isfinite(ref)
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(ref[finite]).max()), floor)
    err = float(np.abs(got[finite] - ref[finite]).max())
    tol = atol + rtol * scale
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} (scale {scale:.3g})"
    return err


def check_allclose(got, ref, *, rtol, atol, floor=0.0, what) -> None:
    """Elementwise ``|got - ref| <= atol + rtol * max(|ref|, floor)`` over the reference's
    finite entries (each its own scale, as ``allclose``), the non-finite entries identical
    (:func:`nonfinite_mismatch`)."""
    got, ref = as_f64(got), as_f64(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    mismatch = nonfinite_mismatch(got, ref)
    assert mismatch is None, f"{what}: non-finite entries differ: {mismatch}"
    finite = np.isfinite(ref)
    err = np.abs(got[finite] - ref[finite])
    tol = atol + rtol * np.maximum(floor, np.abs(ref[finite]))
    if err.size:
        worst = int(np.argmax(err - tol))
        assert np.all(err <= tol), (
            f"{what}: error {err[worst]:.3g} > {tol[worst]:.3g} at ref {ref[finite][worst]:.6g}"
        )


def assert_close(got, ref, dtype, rtol=None, what="out"):
    """Output rule: within 1e-6 + OUT_RTOL[dtype] (or rtol) of the largest finite |ref|."""
    rtol = OUT_RTOL[dtype] if rtol is None else rtol
    check_close(got, ref, rtol=rtol, atol=1e-6, what=f"{what} ({dtype})")


def assert_stat_close(got, ref, dtype, what):
    """Elementwise relative check for neg_max / sum_recip / lse (each row its own scale)."""
    check_allclose(got, ref, rtol=STAT_RTOL[dtype], atol=1e-6, floor=1.0, what=what)


# test_fuzz_serving.py's budget and seed (hypothesis), printed when its tests are collected so
# that a failing run, or one the library crashed, names the seed that reproduces it.
FUZZ_SEED = int(os.environ.get("FLASHCTE_FUZZ_SEED", "41"))
FUZZ_EXAMPLES = int(os.environ.get("FLASHCTE_FUZZ_EXAMPLES", "500"))


def pytest_collection_finish(session):
    """The fuzzing seed and budget, before the tests run (pytest -q, as python/run_tests.sh runs
    it, shows no header) and so before anything could crash."""
    if any("test_fuzz_serving.py" in item.nodeid for item in session.items):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"flashcte fuzzing: FLASHCTE_FUZZ_SEED={FUZZ_SEED} "
                f"FLASHCTE_FUZZ_EXAMPLES={FUZZ_EXAMPLES} (examples per target)"
            )


@pytest.fixture
def rng(request):
    # A per-test seed so that each parametrisation draws its own data, reproducibly.
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
