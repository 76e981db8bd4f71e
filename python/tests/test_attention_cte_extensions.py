"""flashcte.attention_cte against the float64 transcription of SEMANTICS.md: the extensions beyond
the Neuron kernel (softcap, ALiBi, key_bias, window_left/right, bottom_right). The Neuron kernel's
modes: test_attention_cte.py."""

from __future__ import annotations

import flashcte
import numpy as np
import pytest
from attention_cte_cases import check, inputs, packed_bounds
from conftest import DTYPES, assert_close

# --- Extensions beyond the Neuron kernel: softcap, ALiBi, key_bias, window_left/right,
# bottom_right (keyword-only arguments).


def slopes_for(rng, bs, shape=None):
    """ALiBi-like slopes in [0.01, 0.5] (the geometric 2^(-8h/H) family spans 0.004..0.5)."""
    s = rng.uniform(0.01, 0.5, bs).astype(np.float32)
    return s if shape is None else s.reshape(shape)


def bias_for(rng, bs, length, masked=0.1):
    """A per-key bias with a fraction of the keys masked by -inf."""
    b = rng.normal(0, 2, (bs, length)).astype(np.float32)
    b[rng.random((bs, length)) < masked] = -np.inf
    return b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cap", [0.5, 5.0, 30.0])
def test_softcap(rng, dtype, causal, cap):
    q, k, v, _ = inputs(rng, dtype, 4, 2, 70, 90, 32)
    # scale 1 over d = 32 gives scores of magnitude ~6-20, where every cap here bends them.
    check(q, k, v, dtype, stats=True, causal_mask=causal, scale=1.0, softcap=cap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sq,skv", [(64, 64), (40, 100), (100, 40)])
def test_alibi(rng, dtype, causal, sq, skv):
    q, k, v, _ = inputs(rng, dtype, 6, 2, sq, skv, 16)
    check(
        q, k, v, dtype, stats=True, causal_mask=causal, scale=0.25, alibi_slopes=slopes_for(rng, 6)
    )
    # (bs, 1) and float64 slopes (converted), bottom-right positions.
    check(
        q,
        k,
        v,
        dtype,
        causal_mask=causal,
        scale=0.25,
        bottom_right=True,
        alibi_slopes=rng.uniform(0.01, 0.5, (6, 1)),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi_positions(rng, dtype):
    """The ALiBi distance follows SEMANTICS.md's positions: prior keys negative, CP offsets and
    strided CP rows, bottom_right on top of the CP offset."""
    q, k, v, priors = inputs(rng, dtype, 4, 2, 40, 40, 16, s_prior=30)
    slopes = slopes_for(rng, 4)
    check(q, k, v, dtype, alibi_slopes=slopes, prior_used_len=[30, 7], scale=0.3, **priors)
    check(q, k, v, dtype, alibi_slopes=slopes, prior_used_len=12, causal_mask=False, **priors)
    check(q, k, v, dtype, alibi_slopes=slopes, cp_offset=17, scale=0.3)
    check(
        q,
        k,
        v,
        dtype,
        alibi_slopes=slopes,
        cp_offset=3,
        global_cp_deg=4,
        cp_strided_q_slicing=True,
        causal_mask=False,
        scale=0.3,
    )
    q2, k2, v2, _ = inputs(rng, dtype, 4, 2, 25, 60, 16)
    check(q2, k2, v2, dtype, alibi_slopes=slopes, cp_offset=5, bottom_right=True, scale=0.3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_key_bias(rng, dtype, causal):
    q, k, v, _ = inputs(rng, dtype, 4, 2, 50, 80, 16)
    bias = bias_for(rng, 4, 80)
    check(q, k, v, dtype, stats=True, causal_mask=causal, scale=0.3, key_bias=bias)
    # A strided float32 view (read in place) and a float16 bias (converted).
    wide = bias_for(rng, 4, 160)
    check(q, k, v, dtype, causal_mask=causal, key_bias=wide[:, ::2])
    check(q, k, v, dtype, causal_mask=causal, key_bias=bias.astype(np.float16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_key_bias_with_prefix(rng, dtype):
    """key_bias spans the concatenated axis: (bs, longest prior_used_len + Skv); each query batch
    reads its KV batch's prior_used_len + Skv first entries."""
    q, k, v, priors = inputs(rng, dtype, 4, 2, 30, 30, 16, s_prior=25)
    bias = bias_for(rng, 4, 25 + 30)
    check(q, k, v, dtype, stats=True, key_bias=bias, prior_used_len=[25, 9], **priors)
    check(
        q,
        k,
        v,
        dtype,
        key_bias=bias[:, :40],
        prior_used_len=[10, 3],
        causal_mask=False,
        sliding_window=12,
        **priors,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_key_bias_masks_everything(rng, dtype):
    """A batch whose keys are all -inf has empty rows (out 0, infinite statistics), unless a
    sink takes the mass."""
    q, k, v, _ = inputs(rng, dtype, 2, 1, 20, 20, 8)
    bias = np.zeros((2, 20), np.float32)
    bias[1] = -np.inf
    out = check(q, k, v, dtype, stats=True, key_bias=bias, causal_mask=False)
    assert np.all(out[1].astype(np.float32) == 0)
    sink = np.array([0.5, 1.5], np.float32)
    out = check(q, k, v, dtype, stats=True, key_bias=bias, sink=sink)
    assert np.all(out[1].astype(np.float32) == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "left,right,causal,sw",
    [
        (5, -1, False, 0),
        (-1, 3, False, 0),
        (4, 2, False, 0),
        (0, 0, False, 0),
        (7, 9, True, 0),  # causal takes right to 0
        (20, -1, True, 6),  # sliding_window 6 (left 5) is the tighter left bound
        (3, -1, True, 30),  # window_left the tighter one
        (-1, -1, True, 0),
    ],
)
def test_window_left_right(rng, dtype, left, right, causal, sw):
    q, k, v, priors = inputs(rng, dtype, 2, 1, 60, 60, 16, s_prior=10)
    opts = {
        "window_left": left,
        "window_right": right,
        "causal_mask": causal,
        "sliding_window": sw,
        "scale": 0.3,
    }
    check(q, k, v, dtype, stats=True, **opts)
    check(q, k, v, dtype, prior_used_len=6, cp_offset=4, **priors, **opts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,skv", [(30, 70), (70, 30), (50, 50)])
@pytest.mark.parametrize("causal", [True, False])
def test_bottom_right(rng, dtype, sq, skv, causal):
    q, k, v, _ = inputs(rng, dtype, 2, 2, sq, skv, 16)
    out = check(q, k, v, dtype, stats=True, causal_mask=causal, bottom_right=True, scale=0.3)
    if causal and sq > skv:  # rows before key 0 see nothing
        assert np.all(out[:, : sq - skv].astype(np.float32) == 0)
    check(q, k, v, dtype, causal_mask=causal, bottom_right=True, window_left=9, cp_offset=2)
    q, k, v, priors = inputs(rng, dtype, 2, 2, sq, skv, 16, s_prior=8)
    check(q, k, v, dtype, causal_mask=causal, bottom_right=True, prior_used_len=5, **priors)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs,bs_kv", [(6, 6), (6, 2), (6, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_modifiers_combined(rng, dtype, bs, bs_kv, causal):
    """softcap, ALiBi and key_bias together, with GQA, a prefix, a sink, a window and
    bottom-right positions; statistics included."""
    sq, skv, s_prior = 45, 70, 16
    q, k, v, priors = inputs(rng, dtype, bs, bs_kv, sq, skv, 24, dv=20, s_prior=s_prior)
    used = [s_prior - (b % 3) * 5 for b in range(bs_kv)]
    opts = {
        "softcap": 4.0,
        "alibi_slopes": slopes_for(rng, bs),
        "key_bias": bias_for(rng, bs, s_prior + skv),
        "sink": rng.uniform(-1, 2, bs).astype(np.float32),
        "scale": 0.5,
        "causal_mask": causal,
        "window_left": 25,
        "bottom_right": True,
        "prior_used_len": used,
    }
    check(q, k, v, dtype, stats=True, **opts, **priors)
    # The same with sequence packing bounds and a transposed output.
    lo, hi = packed_bounds(rng, sq, s_prior + skv, 3)
    check(
        q,
        k,
        v,
        dtype,
        tp_out=True,
        bound_min=lo,
        bound_max=hi,
        **{**opts, "prior_used_len": s_prior},
        **priors,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_modifiers_long_kv(rng, dtype):
    """Modifiers across many KV tiles and sections."""
    q, k, v, _ = inputs(rng, dtype, 2, 1, 300, 1500, 40)
    opts = {
        "softcap": 10.0,
        "alibi_slopes": slopes_for(rng, 2) / 10,
        "key_bias": bias_for(rng, 2, 1500, masked=0.02),
        "scale": 0.4,
    }
    check(q, k, v, dtype, stats=True, bottom_right=True, **opts)
    check(q, k, v, dtype, causal_mask=False, window_left=600, window_right=100, **opts)


def test_modifiers_threads_bitwise_identical(rng):
    q, k, v, _ = inputs(rng, "float32", 4, 2, 257, 700, 32)
    opts = {
        "softcap": 8.0,
        "alibi_slopes": slopes_for(rng, 4),
        "scale": 0.2,
        "key_bias": bias_for(rng, 4, 700),
        "bottom_right": True,
        "window_left": 300,
    }
    base = flashcte.attention_cte(q, k, v, num_threads=1, **opts)
    for n in (2, 3):
        assert np.array_equal(flashcte.attention_cte(q, k, v, num_threads=n, **opts), base)


def test_modifier_defaults_change_nothing(rng):
    """The extensions' defaults give the Neuron function bit for bit; they are keyword-only."""
    q, k, v, _ = inputs(rng, "float32", 2, 1, 40, 50, 16)
    base = flashcte.attention_cte(q, k, v, scale=0.3)
    same = flashcte.attention_cte(
        q,
        k,
        v,
        scale=0.3,
        softcap=0.0,
        alibi_slopes=None,
        key_bias=None,
        window_left=-1,
        window_right=-1,
        bottom_right=False,
    )
    assert np.array_equal(base, same)
    # bottom_right with Sq == Skv and zero slopes/bias change nothing either.
    same = flashcte.attention_cte(
        np.ascontiguousarray(q[:, :40]),
        k[:, :, :40],
        v[:, :40],
        scale=0.3,
        bottom_right=True,
        alibi_slopes=np.zeros(2, np.float32),
        key_bias=np.zeros((2, 40), np.float32),
    )
    ref = flashcte.attention_cte(
        np.ascontiguousarray(q[:, :40]), k[:, :, :40], v[:, :40], scale=0.3
    )
    assert_close(same, ref, "float32", rtol=1e-6)
    positional = [
        1.0,
        True,
        None,
        None,
        None,
        None,
        0,
        True,
        False,
        False,
        False,
        None,
        None,
        False,
        None,
        None,
        None,
    ]
    flashcte.attention_cte(q, k, v, *positional)  # the whole Neuron signature positionally
    with pytest.raises(TypeError):
        flashcte.attention_cte(q, k, v, *positional, 30.0)  # softcap is keyword-only
