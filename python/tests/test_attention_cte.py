"""flashcte.attention_cte against the float64 transcription of SEMANTICS.md, every mode (the
extensions beyond the Neuron kernel: test_attention_cte_extensions.py; the helpers:
attention_cte_cases.py)."""

from __future__ import annotations

import threading
import time

import flashcte
import numpy as np
import pytest
from attention_cte_cases import check, inputs, packed_bounds
from conftest import DTYPES, make


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
