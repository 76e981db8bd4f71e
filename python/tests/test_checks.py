"""The suite's accuracy checks see every non-finite failure (issue 41): each helper the tests
compare results through must reject a NaN or an Inf where the float64 reference is finite, and a
finite value (or NaN, or the other infinity) where the reference is infinite (an empty row's
lse = -inf), and must accept an exact match, equal infinities and NaN on both sides included.

Each helper is called on a result planted with one such value; the plants are also shown to slip
past the patterns the helpers replaced (a check over the reference's finite entries only, a
tolerance scaled by an infinite max|ref|), so a plant that no longer exercises a blind spot is
noticed too."""

from __future__ import annotations

import functools
import importlib
import math

import numpy as np
import pytest
from conftest import (
    assert_close,
    assert_stat_close,
    check_allclose,
    check_close,
    max_abs_err,
    nonfinite_mismatch,
)

# Exactly representable in every dtype the helpers see (float16 and bfloat16 included), so an
# exact match is exact after any cast.
REF = (np.arange(24, dtype=np.float64) / 8 - 1.5).reshape(2, 3, 4)
EMPTY_ROW = (0, 1)  # REF_LSE's row with no key: -inf throughout, as the kernels write it
REF_LSE = REF.copy()
REF_LSE[EMPTY_ROW] = -np.inf

# (name, reference, index, planted value): each makes the result wrong.
PLANTS = [
    ("nan_where_finite", REF_LSE, (1, 2, 3), np.nan),
    ("inf_where_finite", REF_LSE, (1, 0, 1), np.inf),
    ("neg_inf_where_finite", REF_LSE, (0, 2, 0), -np.inf),
    ("finite_where_neg_inf", REF_LSE, EMPTY_ROW + (2,), 0.0),
    ("nan_where_neg_inf", REF_LSE, EMPTY_ROW + (2,), np.nan),
    ("inf_where_neg_inf", REF_LSE, EMPTY_ROW + (2,), np.inf),
    # Every entry finite in the reference: a scale of max|ref| stays finite.
    ("nan_in_finite_ref", REF, (1, 1, 1), np.nan),
    ("inf_in_finite_ref", REF, (0, 0, 0), np.inf),
]


def planted(ref, index, value):
    got = ref.copy()
    got[index] = value
    return got


def both_nan():
    """A reference with a NaN, and the result with the same NaN: equal."""
    ref = REF_LSE.copy()
    ref[1, 1, 1] = np.nan
    return ref


def _torch():
    return pytest.importorskip("torch")


def _module(name):
    """A test module's helpers (modules that need torch skip here as they would alone)."""
    return importlib.import_module(name)


# Every helper, as check(got, ref) on float64 numpy arrays; torch helpers get float32 tensors, as
# the tests give them (-inf, NaN and the planted values survive the cast).
def _t(x):
    return _torch().from_numpy(np.ascontiguousarray(x, np.float32))


HELPERS = {
    "conftest.max_abs_err": lambda got, ref: _assert(max_abs_err(got, ref) <= 1e-5),
    "conftest.check_close": lambda got, ref: check_close(got, ref, rtol=1e-5),
    "conftest.check_allclose": lambda got, ref: check_allclose(
        got, ref, rtol=1e-5, atol=1e-6, what="x"
    ),
    "conftest.assert_close": lambda got, ref: assert_close(got.astype(np.float32), ref, "float32"),
    "conftest.assert_close[bf16]": lambda got, ref: assert_close(
        got.astype(_bf16()), ref, "bfloat16"
    ),
    "conftest.assert_stat_close": lambda got, ref: assert_stat_close(
        got.astype(np.float32), ref, "float32", "lse"
    ),
    "test_torch_op.close": lambda got, ref: _module("test_torch_op").close(_t(got), _t(ref)),
    "test_distributed._assert_close": lambda got, ref: _module("test_distributed")._assert_close(
        _t(got), _t(ref), 2, "out"
    ),
    "test_distributed._assert_close[lse]": lambda got, ref: _module(
        "test_distributed"
    )._assert_close(_t(got), _t(ref), 2, "lse"),
    "test_distributed_ulysses._assert_close": lambda got, ref: _module(
        "test_distributed_ulysses"
    )._assert_close(_t(got), _t(ref), 2, "lse"),
    "test_distributed_tp.assert_close": lambda got, ref: _module(
        "test_distributed_tp"
    ).assert_close(got, ref, "float32", "out"),
    "test_flash_attn_interface.assert_close": lambda got, ref: _module(
        "test_flash_attn_interface"
    ).assert_close(_t(got), _t(ref), "out"),
    "test_flash_attn_interface.assert_close[lse]": lambda got, ref: _module(
        "test_flash_attn_interface"
    ).assert_close(_t(got), _t(ref), "lse", lse=True),
    "test_flash_attn_interface._check": lambda got, ref: _module(
        "test_flash_attn_interface"
    )._check(_t(got), _t(ref), 2, "lse", lse=True),
    "test_layer.assert_layer_close": lambda got, ref: _module("test_layer").assert_layer_close(
        got.astype(np.float32), ref, "float32", "y"
    ),
    "test_kv8_model.rel_rms": lambda got, ref: _assert(
        _module("test_kv8_model").rel_rms(_t(got), _t(ref)) < 1e-4
    ),
}


def _assert(condition):
    assert condition


def _bf16():
    from semantics import BF16

    if BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    return BF16


@pytest.mark.parametrize("helper", list(HELPERS))
@pytest.mark.parametrize("plant", PLANTS, ids=[p[0] for p in PLANTS])
def test_helper_rejects_the_plant(helper, plant):
    _, ref, index, value = plant
    with pytest.raises(AssertionError):
        HELPERS[helper](planted(ref, index, value), ref)


@pytest.mark.parametrize("helper", list(HELPERS))
@pytest.mark.parametrize("ref", [REF, REF_LSE, both_nan()], ids=["finite", "neg_inf", "nan"])
def test_helper_accepts_an_exact_match(helper, ref):
    HELPERS[helper](ref.copy(), ref)


def test_max_abs_err_values():
    assert max_abs_err(REF_LSE, REF_LSE) == 0.0
    assert max_abs_err(planted(REF, (0, 0, 0), REF[0, 0, 0] + 0.25), REF) == 0.25
    assert max_abs_err(planted(REF_LSE, EMPTY_ROW + (0,), 5.0), REF_LSE) == math.inf
    # torch tensors and numpy arrays alike
    assert max_abs_err(_t(REF_LSE), REF_LSE) == 0.0
    assert max_abs_err(_t(planted(REF_LSE, (1, 1, 1), np.nan)), REF_LSE) == math.inf


def test_mismatch_message_names_the_entry():
    message = nonfinite_mismatch(planted(REF_LSE, EMPTY_ROW + (2,), 0.5), REF_LSE)
    assert message == "entry (0, 1, 2) is 0.5 where the reference has -inf (1 such)", message
    with pytest.raises(AssertionError, match=r"out \(float32\): non-finite entries differ"):
        assert_close(planted(REF, (1, 2, 3), np.nan), REF, "float32")


@pytest.mark.parametrize("plant", PLANTS, ids=[p[0] for p in PLANTS])
def test_the_plants_slip_past_the_replaced_patterns(plant):
    """Each plant passes at least one of the comparisons issue 41 lists as blind: so it tests a
    blind spot, not a failure any comparison would see."""
    _, ref, index, value = plant
    got = planted(ref, index, value)
    finite = np.isfinite(ref)
    with np.errstate(invalid="ignore"):
        errors = np.abs(got[finite] - ref[finite])
        passed = [
            # Over the reference's finite entries, the non-finite ones compared by position only
            # (the finiteness pattern) or not at all (test_torch_op's lse, the merge test).
            np.array_equal(np.isfinite(got), finite) or bool(np.all(errors == 0)),
            # A fold that keeps its accumulator over a NaN, as std::max(m, |a - b|) and
            # Python's max(m, err) do.
            functools.reduce(max, errors.tolist(), 0.0) <= 1e-5,
            # The error over the finite entries of both sides (np.where(isfinite(...))).
            float(np.nanmax(np.where(np.isfinite(got), np.abs(got - ref), 0.0))) <= 1e-5,
        ]
    assert any(passed), f"{plant[0]} is caught by every replaced pattern: it proves nothing"


def test_attention_cte_check_rejects_a_nan_row(monkeypatch, rng):
    """test_attention_cte.check (the kernel against the transcription) fails when the kernel
    leaves an output row NaN, or writes a finite statistic for a row that sees no key."""
    import flashcte

    module = _module("test_attention_cte")
    q, k, v, _ = module.inputs(rng, "float32", 1, 1, 8, 8, 16)
    lo, hi = np.zeros(8, np.int64), np.full(8, 8, np.int64)
    hi[5] = 0  # row 5 sees no key: out 0, neg_max and sum_recip +inf
    opts = {"bound_min": lo, "bound_max": hi, "causal_mask": False}
    module.check(q, k, v, "float32", stats=True, **opts)  # the real kernel passes
    real = flashcte.attention_cte

    def nan_row(*args, **kwargs):
        out = real(*args, **kwargs)
        out[0][0, 3] = np.nan
        return out

    monkeypatch.setattr(flashcte, "attention_cte", nan_row)
    with pytest.raises(AssertionError, match="non-finite entries differ"):
        module.check(q, k, v, "float32", stats=True, **opts)

    def finite_empty_row(*args, **kwargs):
        out = real(*args, **kwargs)
        out[1][0, 5] = 0.0
        return out

    monkeypatch.setattr(flashcte, "attention_cte", finite_empty_row)
    with pytest.raises(AssertionError, match="neg_max: non-finite entries differ"):
        module.check(q, k, v, "float32", stats=True, **opts)
