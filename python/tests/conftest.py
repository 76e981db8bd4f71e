"""Shared helpers: dtypes (bfloat16 through ml_dtypes), casting, tolerances."""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

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


def assert_close(got, ref, dtype, rtol=None, what="out"):
    got = f64(got)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    rtol = OUT_RTOL[dtype] if rtol is None else rtol
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), finite), f"{what}: non-finite entries differ"
    assert np.array_equal(got[~finite], ref[~finite]), f"{what}: infinities differ"
    if not finite.any():
        return
    scale = float(np.abs(ref[finite]).max())
    err = float(np.abs(got[finite] - ref[finite]).max())
    tol = 1e-6 + rtol * scale
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} (max |ref| {scale:.3g}, {dtype})"


def assert_stat_close(got, ref, dtype, what):
    """Elementwise relative check for neg_max / sum_recip / lse (each row its own scale)."""
    got = f64(got)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), finite), f"{what}: non-finite entries differ"
    assert np.array_equal(got[~finite], ref[~finite]), f"{what}: infinities differ"
    err = np.abs(got[finite] - ref[finite])
    tol = 1e-6 + STAT_RTOL[dtype] * np.maximum(1.0, np.abs(ref[finite]))
    if err.size:
        worst = int(np.argmax(err - tol))
        assert np.all(err <= tol), (
            f"{what}: error {err[worst]:.3g} > {tol[worst]:.3g} at ref {ref[finite][worst]:.6g}"
        )


@pytest.fixture
def rng(request):
    # A per-test seed so that each parametrisation draws its own data, reproducibly.
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
