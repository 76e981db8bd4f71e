"""flashcte.attention_cte against the float64 transcription of SEMANTICS.md, every mode."""

from __future__ import annotations

import threading
import time

import flashcte
import numpy as np
import pytest
from conftest import DTYPES, assert_close, assert_stat_close, make, np_dtype
from semantics import attention_cte_ref, neuron_layout


def inputs(rng, dtype, bs, bs_kv, sq, skv, d, dv=None, tp_q=True, tp_k=False, s_prior=0):
    """q, k, v (and priors) in the requested layouts, rounded to dtype."""
    dv = d if dv is None else dv
    q = make(rng, (bs, sq, d) if tp_q else (bs, d, sq), dtype)
    k = make(rng, (bs_kv, skv, d) if tp_k else (bs_kv, d, skv), dtype)
    v = make(rng, (bs_kv, skv, dv), dtype)
    priors = {}
    if s_prior:
        priors["k_prior"] = make(rng, (bs_kv, s_prior, d) if tp_k else (bs_kv, d, s_prior), dtype)
        priors["v_prior"] = make(rng, (bs_kv, s_prior, dv), dtype)
    return q, k, v, priors


def check(q, k, v, dtype, stats=False, **opts):
    """Runs flashcte.attention_cte and the transcription; compares out (and the statistics)."""
    tp_out = opts.pop("tp_out", False)
    got = flashcte.attention_cte(q, k, v, tp_out=tp_out, cache_softmax=stats, **opts)
    out, neg_max, sum_recip = got if stats else (got, None, None)
    ref = attention_cte_ref(q, k, v, **opts)
    assert out.dtype == np_dtype(dtype)
    assert_close(out.transpose(0, 2, 1) if tp_out else out, ref[0], dtype)
    if stats:
        sq = ref[1].shape[1]
        layout = neuron_layout if sq % 128 == 0 else (lambda x: x)
        assert neg_max.dtype == np.float32 and sum_recip.dtype == np.float32
        assert_stat_close(neg_max, layout(ref[1]), dtype, "neg_max")
        assert_stat_close(sum_recip, layout(ref[2]), dtype, "sum_recip")
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "causal,sq,skv",
    [
        (False, 96, 96),
        (True, 96, 96),
        (True, 70, 300),
        (True, 300, 70),
        (False, 1, 37),
        (True, 33, 1),
    ],
)
def test_causal_and_lengths(rng, dtype, causal, sq, skv):
    q, k, v, _ = inputs(rng, dtype, 3, 3, sq, skv, 32)
    check(q, k, v, dtype, causal_mask=causal, scale=32**-0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.07, 1.7])
def test_scale(rng, dtype, scale):
    q, k, v, _ = inputs(rng, dtype, 2, 1, 64, 80, 16)
    check(q, k, v, dtype, scale=scale, causal_mask=False)
    check(q, k, v, dtype, scale=scale, sliding_window=9)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "window,causal", [(1, True), (7, True), (23, True), (40, False), (500, True)]
)
def test_sliding_window(rng, dtype, window, causal):
    q, k, v, _ = inputs(rng, dtype, 2, 2, 130, 130, 24)
    check(q, k, v, dtype, sliding_window=window, causal_mask=causal, scale=0.3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("used", [None, 0, 1, 37, 64, [5, 64], [0, 20]])
def test_prefix_caching(rng, dtype, used):
    q, k, v, priors = inputs(rng, dtype, 4, 2, 48, 48, 16, s_prior=64)
    check(q, k, v, dtype, prior_used_len=used, scale=0.25, **priors)
    # Prefix with a window that reaches into the prior, and without causal masking.
    check(q, k, v, dtype, prior_used_len=used, scale=0.25, sliding_window=20, **priors)
    check(q, k, v, dtype, prior_used_len=used, causal_mask=False, **priors)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_used_len_forms(rng, dtype):
    """An int, a one-element list, a numpy array and a numpy integer mean the same thing."""
    q, k, v, priors = inputs(rng, dtype, 2, 2, 16, 16, 8, s_prior=20)
    outs = [
        flashcte.attention_cte(q, k, v, prior_used_len=u, **priors)
        for u in (11, [11], np.array([11, 11]), np.int32(11), (11, 11))
    ]
    for o in outs[1:]:
        assert np.array_equal(o.view(np.uint8), outs[0].view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset,sq,skv", [(0, 64, 64), (64, 64, 128), (100, 40, 140), (5, 60, 30)])
def test_context_parallel_contiguous(rng, dtype, offset, sq, skv):
    q, k, v, _ = inputs(rng, dtype, 2, 1, sq, skv, 16)
    check(q, k, v, dtype, cp_offset=offset, scale=0.25)
    check(q, k, v, dtype, cp_offset=offset, scale=0.25, sliding_window=17)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("degree,rank", [(2, 0), (2, 1), (4, 3), (16, 5)])
def test_context_parallel_strided(rng, dtype, degree, rank):
    skv = 160
    sq = skv // degree
    q, k, v, _ = inputs(rng, dtype, 2, 2, sq, skv, 16)
    opts = {"cp_offset": rank, "global_cp_deg": degree, "cp_strided_q_slicing": True, "scale": 0.25}
    check(q, k, v, dtype, **opts)
    check(q, k, v, dtype, sliding_window=33, **opts)


def packed_bounds(rng, sq, skv, parts):
    """Bounds of `parts` packed sequences (query and KV cut at the same random points)."""
    cuts_q = np.sort(rng.choice(np.arange(1, sq), parts - 1, replace=False))
    cuts_k = np.sort(rng.choice(np.arange(1, skv), parts - 1, replace=False))
    lo = np.zeros(sq, np.int64)
    hi = np.zeros(sq, np.int64)
    edges_q = [0, *cuts_q, sq]
    edges_k = [0, *cuts_k, skv]
    for s in range(parts):
        lo[edges_q[s] : edges_q[s + 1]] = edges_k[s]
        hi[edges_q[s] : edges_q[s + 1]] = edges_k[s + 1]
    return lo, hi


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bound_dtype", ["int32", "int64", "float32"])
def test_packing_bounds(rng, dtype, bound_dtype):
    sq = skv = 200
    q, k, v, _ = inputs(rng, dtype, 2, 1, sq, skv, 16)
    lo, hi = packed_bounds(rng, sq, skv, 4)
    lo, hi = lo.astype(bound_dtype), hi.astype(bound_dtype)
    check(q, k, v, dtype, bound_min=lo, bound_max=hi, scale=0.3)
    check(q, k, v, dtype, bound_min=lo[:, None], bound_max=hi[:, None], causal_mask=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packing_arbitrary_and_empty_rows(rng, dtype):
    """Random per-row intervals, some empty: empty rows give 0 and infinite statistics."""
    sq, skv = 77, 150
    q, k, v, _ = inputs(rng, dtype, 2, 2, sq, skv, 16)
    a = rng.integers(0, skv + 1, sq)
    b = rng.integers(0, skv + 1, sq)
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    hi[::7] = lo[::7]  # empty rows
    out = check(q, k, v, dtype, stats=True, bound_min=lo, bound_max=hi, causal_mask=False)
    assert np.all(out[:, ::7].astype(np.float32) == 0)
    # Bounds given as Python lists (converted to int64).
    check(q, k, v, dtype, bound_min=lo.tolist(), bound_max=hi.tolist(), causal_mask=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packing_with_prefix_and_cp(rng, dtype):
    """Packing combined with prefix caching and a CP offset (the kernel forbids it; we don't)."""
    q, k, v, priors = inputs(rng, dtype, 2, 1, 64, 64, 16, s_prior=32)
    lo, hi = packed_bounds(rng, 64, 96, 3)
    check(q, k, v, dtype, bound_min=lo, bound_max=hi, prior_used_len=32, cp_offset=10, **priors)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_sink(rng, dtype, causal):
    q, k, v, _ = inputs(rng, dtype, 4, 2, 100, 100, 16)
    sink = rng.uniform(-2, 3, (4, 1)).astype(np.float32)
    check(q, k, v, dtype, stats=True, sink=sink, causal_mask=causal, scale=0.25)
    # Large sinks as in the Neuron suite (most of the mass on the sink), given as (bs,) float64.
    big = rng.uniform(15, 25, 4)
    check(q, k, v, dtype, sink=big, causal_mask=causal, sliding_window=5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_with_empty_rows(rng, dtype):
    """A row with no key but a sink: all mass on the sink, so out 0 and finite statistics."""
    q, k, v, _ = inputs(rng, dtype, 2, 1, 10, 10, 8)
    lo = np.zeros(10, np.int64)
    hi = np.full(10, 10, np.int64)
    hi[3] = 0
    sink = np.array([[1.5], [-0.5]], np.float32)
    out = check(
        q, k, v, dtype, stats=True, sink=sink, bound_min=lo, bound_max=hi, causal_mask=False
    )
    assert np.all(out[:, 3].astype(np.float32) == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs,bs_kv", [(6, 6), (6, 3), (6, 2), (8, 1), (9, 3)])
def test_gqa(rng, dtype, bs, bs_kv):
    q, k, v, _ = inputs(rng, dtype, bs, bs_kv, 40, 56, 16)
    check(q, k, v, dtype, scale=0.25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp_q", [True, False])
@pytest.mark.parametrize("tp_k", [True, False])
@pytest.mark.parametrize("tp_out", [True, False])
def test_layouts(rng, dtype, tp_q, tp_k, tp_out):
    q, k, v, priors = inputs(rng, dtype, 2, 1, 50, 60, 24, dv=12, tp_q=tp_q, tp_k=tp_k, s_prior=8)
    out = check(
        q, k, v, dtype, tp_q=tp_q, tp_k=tp_k, tp_out=tp_out, scale=0.2, prior_used_len=5, **priors
    )
    assert out.shape == ((2, 12, 50) if tp_out else (2, 50, 12))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq", [256, 200])
def test_cache_softmax_stats(rng, dtype, sq):
    """neg_max / sum_recip: Neuron layout (bs, 128, Sq/128) when Sq % 128 == 0, else (bs, Sq)."""
    q, k, v, _ = inputs(rng, dtype, 3, 1, sq, 300, 16)
    _out, neg_max, sum_recip = flashcte.attention_cte(q, k, v, scale=0.3, cache_softmax=True)
    expect = (3, 128, sq // 128) if sq % 128 == 0 else (3, sq)
    assert neg_max.shape == expect and sum_recip.shape == expect
    check(q, k, v, dtype, stats=True, scale=0.3)
    check(q, k, v, dtype, stats=True, scale=0.3, sliding_window=31, causal_mask=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_kv_many_tiles(rng, dtype):
    """A KV axis long enough for several tiles and sections, with every mask at once."""
    q, k, v, priors = inputs(rng, dtype, 2, 1, 300, 1500, 40, s_prior=300)
    check(q, k, v, dtype, stats=True, scale=0.15, prior_used_len=250, **priors)
    check(q, k, v, dtype, scale=0.15, causal_mask=False)
    check(q, k, v, dtype, scale=0.15, cp_offset=1200, sliding_window=700)


@pytest.mark.parametrize(
    "d,dv", [(1, 1), (8, 8), (59, 59), (88, 88), (127, 127), (128, 64), (200, 96)]
)
def test_head_dims(rng, d, dv):
    q, k, v, _ = inputs(rng, "float32", 2, 1, 33, 45, d, dv=dv)
    check(q, k, v, "float32", scale=d**-0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs(rng, dtype):
    """Non-contiguous numpy views are read in place (and give the contiguous result)."""
    bs, sq, skv, d = 3, 40, 50, 16
    big_q = make(rng, (bs, 2 * sq, d + 5), dtype)
    q = big_q[:, ::2, 3 : 3 + d]  # strided rows, offset columns
    k_t = make(rng, (bs, skv, d), dtype)
    k = k_t.transpose(0, 2, 1)  # (bs, d, Skv) as a transposed view
    v = np.asfortranarray(make(rng, (bs, skv, d), dtype))  # column-major
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous)
    out = check(q, k, v, dtype, scale=0.25)
    ref = flashcte.attention_cte(
        np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), scale=0.25
    )
    assert np.array_equal(out.view(np.uint8), ref.view(np.uint8))
    # The same keys given with tp_k through the untransposed array.
    out_tp = flashcte.attention_cte(q, k_t, v, scale=0.25, tp_k=True)
    assert np.array_equal(out_tp.view(np.uint8), ref.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_and_broadcast_strides(rng, dtype):
    """Reversed views (copied: negative strides) and broadcast views (stride 0, read in place)."""
    q, k, v, _ = inputs(rng, dtype, 2, 1, 30, 30, 8)
    check(q[:, ::-1], k[:, :, ::-1], v[::-1, ::-1], dtype, causal_mask=False)
    k1 = np.broadcast_to(k[:, :, :1], k.shape)  # every key the same (stride 0), read-only
    check(q, k1, v, dtype)


def test_threads_bitwise_identical(rng):
    q, k, v, _ = inputs(rng, "float32", 4, 2, 257, 700, 32)
    base = flashcte.attention_cte(q, k, v, scale=0.2, num_threads=1)
    for n in (2, 3):
        o = flashcte.attention_cte(q, k, v, scale=0.2, num_threads=n)
        assert np.array_equal(o, base)


def test_empty_shapes(rng):
    q, k, v, _ = inputs(rng, "float32", 2, 1, 0, 10, 8)
    assert flashcte.attention_cte(q, k, v).shape == (2, 0, 8)
    q, k, v, _ = inputs(rng, "float32", 0, 0, 5, 10, 8)
    assert flashcte.attention_cte(q, k, v).shape == (0, 5, 8)


def test_gil_released(rng):
    """Python threads run while the kernel computes."""
    q, k, v, _ = inputs(rng, "float32", 8, 8, 1024, 1024, 64)
    t0 = time.perf_counter()
    flashcte.attention_cte(q, k, v, causal_mask=False, num_threads=1)
    if time.perf_counter() - t0 < 0.05:
        pytest.skip("kernel too fast on this machine to observe the GIL")
    worker = threading.Thread(
        target=flashcte.attention_cte,
        args=(q, k, v),
        kwargs={"causal_mask": False, "num_threads": 1},
    )
    count = 0
    worker.start()
    while worker.is_alive():
        count += 1
    worker.join()
    assert count > 10000, f"main thread made only {count} steps while the kernel ran"


class DLPackOnly:
    """A minimal DLPack producer that is neither numpy nor torch."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_generic_dlpack_producer(rng):
    q, k, v, _ = inputs(rng, "float32", 2, 1, 20, 20, 8)
    out = flashcte.attention_cte(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v))
    assert isinstance(out, np.ndarray)
    assert np.array_equal(out, flashcte.attention_cte(q, k, v))


def test_simd_target():
    assert isinstance(flashcte.simd_target(), str) and flashcte.simd_target()


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
