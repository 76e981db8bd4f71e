"""attention_cte's test helpers (test_attention_cte.py, test_attention_cte_extensions.py): inputs
in every layout, one call checked against the float64 transcription of SEMANTICS.md, and packing
bounds of packed sequences."""

from __future__ import annotations

import flashcte
import numpy as np
from conftest import assert_close, assert_stat_close, make, np_dtype
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
