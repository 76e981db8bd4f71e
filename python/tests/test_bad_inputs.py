"""Bad-input matrix for the Python package (issue 6, reliability).

A table of invalid calls, each one defect away from a valid call. Every row must raise the
documented exception type (TypeError for dtypes and argument types, ValueError for broken rules)
with a message that starts with the argument's name ("<argument>: <rule>") and contains the rule;
no row may crash the interpreter or modify an input array. The companion C++ and CLI matrices are in tests/reliability/.
"""

from __future__ import annotations

import math

import flashcte
import numpy as np
import pytest
from semantics import BF16


def qkv(bs=2, bs_kv=1, sq=8, skv=8, d=4, dv=None, dtype=np.float32):
    dv = d if dv is None else dv
    rng = np.random.default_rng(7)
    q = rng.random((bs, sq, d)).astype(dtype)
    k = rng.random((bs_kv, d, skv)).astype(dtype)
    v = rng.random((bs_kv, skv, dv)).astype(dtype)
    return q, k, v


def priors(s_prior=6, d=4, dv=4):
    return np.zeros((1, d, s_prior), np.float32), np.zeros((1, s_prior, dv), np.float32)


def bounds(lo, hi, n=8, dtype=np.int64):
    a = np.zeros(n, dtype)
    b = np.full(n, 8, dtype)
    for i, x in lo.items():
        a[i] = x
    for i, x in hi.items():
        b[i] = x
    return {"bound_min": a, "bound_max": b}


def fa(shape=(1, 8, 2, 4), dtype=np.float32):
    x = np.random.default_rng(3).random(shape).astype(dtype)
    return x, x.copy(), x.copy()


A = flashcte.attention_cte


def rows():
    """(id, thunk returning (function, args, kwargs), exception, argument, rule)."""
    q, k, v = qkv()
    kp, vp = priors()
    x4 = fa()
    cu = np.array([0, 4, 8])
    r = [
        # --- ranks and shapes ---
        ("q_rank2", (A, (q[0], k, v), {}), ValueError, "q", "must have rank 3"),
        ("q_rank4", (A, (q[None], k, v), {}), ValueError, "q", "must have rank 3"),
        ("k_rank2", (A, (q, k[0], v), {}), ValueError, "k", "must have rank 3"),
        ("v_rank4", (A, (q, k, v[None]), {}), ValueError, "v", "must have rank 3"),
        ("bs_not_multiple", (A, qkv(bs=3, bs_kv=2), {}), ValueError, "q", "must be a multiple"),
        ("head_dim_zero", (A, qkv(d=0), {}), ValueError, "q", "must be in [1, 1024]"),
        ("head_dim_1025", (A, qkv(d=1025), {}), ValueError, "q", "must be in [1, 1024]"),
        ("value_dim_zero", (A, qkv(dv=0), {}), ValueError, "v", "must be in [1, 1024]"),
        ("value_dim_1025", (A, qkv(dv=1025), {}), ValueError, "v", "must be in [1, 1024]"),
        ("k_head_dim", (A, (q, k[:, :3], v), {}), ValueError, "k", "head dim"),
        ("v_length", (A, (q, k, v[:, :5]), {}), ValueError, "v", "must be (bs_kv, Skv, dv)"),
        ("tp_k_misread", (A, (q, k, v), {"tp_k": True}), ValueError, "k", "head dim"),
        # --- dtypes ---
        ("k_float16", (A, (q, k.astype(np.float16), v), {}), TypeError, "k", "differs"),
        ("q_float64", (A, (q.astype(np.float64), k, v), {}), TypeError, "q", "dtype must be"),
        ("q_int32", (A, (q.astype(np.int32), k, v), {}), TypeError, "q", "dtype must be"),
        ("v_complex", (A, (q, k, v.astype(np.complex64)), {}), TypeError, "v", "dtype"),
        ("q_list", (A, (q.tolist(), k, v), {}), TypeError, "q", "expected"),
        # --- scalars ---
        ("scale_nan", (A, (q, k, v), {"scale": math.nan}), ValueError, "scale", "finite"),
        ("scale_inf", (A, (q, k, v), {"scale": math.inf}), ValueError, "scale", "finite"),
        ("scale_overflows_float32", (A, (q, k, v), {"scale": 1e39}), ValueError, "scale", "finite"),
        ("scale_text", (A, (q, k, v), {"scale": "big"}), TypeError, "scale", "float"),
        (
            "window_negative",
            (A, (q, k, v), {"sliding_window": -1}),
            ValueError,
            "sliding_window",
            ">= 0",
        ),
        (
            "window_float",
            (A, (q, k, v), {"sliding_window": 2.5}),
            TypeError,
            "sliding_window",
            "int",
        ),
        (
            "num_threads_negative",
            (A, (q, k, v), {"num_threads": -1}),
            ValueError,
            "num_threads",
            ">= 0",
        ),
        # --- prefix caching ---
        (
            "prior_used_len_beyond",
            (A, (q, k, v), {"k_prior": kp, "v_prior": vp, "prior_used_len": 7}),
            ValueError,
            "prior_used_len",
            "S_prior = 6",
        ),
        (
            "prior_used_len_negative",
            (A, (q, k, v), {"k_prior": kp, "v_prior": vp, "prior_used_len": -1}),
            ValueError,
            "prior_used_len",
            "must be in",
        ),
        (
            "prior_used_len_count",
            (A, (q, k, v), {"k_prior": kp, "v_prior": vp, "prior_used_len": [1, 2, 3]}),
            ValueError,
            "prior_used_len",
            "bs_kv",
        ),
        (
            "prior_without_prior",
            (A, (q, k, v), {"prior_used_len": 2}),
            ValueError,
            "prior_used_len",
            "without k_prior",
        ),
        ("k_prior_alone", (A, (q, k, v), {"k_prior": kp}), ValueError, "v_prior", "required"),
        (
            "v_prior_head_dim",
            (A, (q, k, v), {"k_prior": kp, "v_prior": vp[:, :, :3]}),
            ValueError,
            "v_prior",
            "dv",
        ),
        # --- sink ---
        (
            "sink_shape",
            (A, (q, k, v), {"sink": np.zeros((3, 1), np.float32)}),
            ValueError,
            "sink",
            "(bs, 1)",
        ),
        ("sink_text", (A, (q, k, v), {"sink": np.array(["a", "b"])}), TypeError, "sink", "dtype"),
        # --- context parallelism ---
        (
            "cp_degree_zero",
            (A, (q, k, v), {"cp_offset": 0, "global_cp_deg": 0}),
            ValueError,
            "global_cp_deg",
            ">= 1",
        ),
        ("cp_offset_negative", (A, (q, k, v), {"cp_offset": -3}), ValueError, "cp_offset", ">= 0"),
        (
            "cp_degree_without_offset",
            (A, (q, k, v), {"global_cp_deg": 2}),
            ValueError,
            "cp_offset",
            "required",
        ),
        (
            "cp_strided_without_degree",
            (A, (q, k, v), {"cp_offset": 1, "cp_strided_q_slicing": True}),
            ValueError,
            "global_cp_deg",
            "required",
        ),
        # --- packing bounds ---
        (
            "bound_min_negative",
            (A, (q, k, v), bounds({2: -1}, {})),
            ValueError,
            "bound_min",
            "outside",
        ),
        (
            "bound_max_past_end",
            (A, (q, k, v), bounds({}, {5: 9})),
            ValueError,
            "bound_max",
            "outside",
        ),
        (
            "bounds_inverted",
            (A, (q, k, v), bounds({3: 6}, {3: 2})),
            ValueError,
            "bound_max",
            "bound_min = 6",
        ),
        (
            "bounds_length",
            (A, (q, k, v), {"bound_min": np.zeros(7, np.int64), "bound_max": np.full(7, 8)}),
            ValueError,
            "bound_min",
            "(Sq, 1) or (Sq,)",
        ),
        (
            "bound_nan",
            (A, (q, k, v), bounds({4: np.nan}, {}, dtype=np.float32)),
            ValueError,
            "bound_min",
            "integral",
        ),
        (
            "bound_max_alone",
            (A, (q, k, v), {"bound_max": np.full(8, 8)}),
            ValueError,
            "bound_min",
            "required",
        ),
        # --- FlashAttention interfaces ---
        (
            "fa_q_rank3",
            (flashcte.flash_attn_func, (x4[0][0], x4[1], x4[2]), {}),
            ValueError,
            "q",
            "rank 4",
        ),
        (
            "fa_heads_do_not_divide",
            (flashcte.flash_attn_func, (fa((1, 8, 3, 4))[0], x4[1], x4[2]), {}),
            ValueError,
            "k",
            "heads must divide",
        ),
        (
            "fa_window_below_minus_one",
            (flashcte.flash_attn_func, x4, {"window_size": (-2, 0)}),
            ValueError,
            "window_size",
            ">= -1",
        ),
        (
            "fa_softcap_negative",
            (flashcte.flash_attn_func, x4, {"softcap": -1.0}),
            ValueError,
            "softcap",
            "finite and >= 0",
        ),
        (
            "fa_alibi_wrong_heads",
            (flashcte.flash_attn_func, x4, {"alibi_slopes": np.zeros(3, np.float32)}),
            ValueError,
            "alibi_slopes",
            "must be",
        ),
        (
            "fa_alibi_nan",
            (flashcte.flash_attn_func, x4, {"alibi_slopes": np.array([np.nan, 1], np.float32)}),
            ValueError,
            "alibi_slopes",
            "not finite",
        ),
        # --- score modifiers and windows on attention_cte ---
        (
            "softcap_nan",
            (A, (q, k, v), {"softcap": math.nan}),
            ValueError,
            "softcap",
            "finite and >= 0",
        ),
        (
            "key_bias_short",
            (A, (q, k, v), {"key_bias": np.zeros((2, 7), np.float32)}),
            ValueError,
            "key_bias",
            "prior_used_len + Skv",
        ),
        (
            "window_left_below_minus_one",
            (A, (q, k, v), {"window_left": -3}),
            ValueError,
            "window_left",
            "-1 for unbounded",
        ),
        (
            "varlen_decreasing_offsets",
            (
                flashcte.flash_attn_varlen_func,
                (x4[0][0], x4[1][0], x4[2][0], np.array([0, 5, 3]), cu, 8, 8),
                {},
            ),
            ValueError,
            "cu_seqlens_q",
            "never decrease",
        ),
        (
            "varlen_past_total",
            (
                flashcte.flash_attn_varlen_func,
                (x4[0][0], x4[1][0], x4[2][0], cu, np.array([0, 4, 9]), 8, 8),
                {},
            ),
            ValueError,
            "cu_seqlens_k",
            "past",
        ),
        (
            "varlen_max_understated",
            (flashcte.flash_attn_varlen_func, (x4[0][0], x4[1][0], x4[2][0], cu, cu, 2, 8), {}),
            ValueError,
            "max_seqlen_q",
            "less than",
        ),
    ]
    if BF16 is not None:
        r.append(("v_bfloat16", (A, (q, k, v.astype(BF16)), {}), TypeError, "v", "differs"))
    return r


ROWS = rows()


def test_the_valid_starting_points_succeed():
    q, k, v = qkv()
    kp, vp = priors()
    assert A(q, k, v).shape == (2, 8, 4)
    assert A(q, k, v, k_prior=kp, v_prior=vp, prior_used_len=6).shape == (2, 8, 4)
    assert A(q, k, v, **bounds({}, {})).shape == (2, 8, 4)
    assert A(q, k, v, cp_offset=1, global_cp_deg=2, cp_strided_q_slicing=True).shape == (2, 8, 4)
    assert A(*qkv(d=1024)).shape == (2, 8, 1024)
    x4 = fa()
    assert flashcte.flash_attn_func(*x4).shape == (1, 8, 2, 4)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_refused_cleanly(row):
    _, (fn, args, kwargs), exc, argument, rule = row
    snapshot = [np.array(a, copy=True) for a in args if isinstance(a, np.ndarray)]
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert message.startswith(argument + ": "), message
    assert rule in message, message
    after = [a for a in args if isinstance(a, np.ndarray)]
    for a, b in zip(snapshot, after):
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), "an input was modified"


def test_the_matrix_has_enough_rows():
    assert len(ROWS) >= 40
