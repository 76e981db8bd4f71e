"""``s_aux``: attention sinks through FlashAttention's calls (flash_attn_func and
flash_attn_varlen_func, packed or paged), as FlashAttention 3's vLLM build takes them and
transformers passes them for gpt-oss. Each against the float64 reference with the sinks folded
in (semantics.fold_sinks); any real dtype; bad sinks refused as ``s_aux``."""

from __future__ import annotations

import flashcte
import numpy as np
import pytest
from conftest import DTYPES, assert_close, assert_stat_close, make
from semantics import flash_attn_ref, flash_attn_varlen_ref, varlen_kvcache_ref

HEADS, HEADS_K, D = 4, 2, 16


def sinks(rng):
    """One sink per head, the last head none (-inf)."""
    s = rng.standard_normal(HEADS).astype(np.float32) * 2
    s[-1] = -np.inf
    return s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, 0))])
@pytest.mark.parametrize("seqlen_q", [1, 30])
def test_flash_attn_func(rng, dtype, causal, window, seqlen_q):
    q = make(rng, (2, seqlen_q, HEADS, D), dtype)
    k, v = make(rng, (2, 40, HEADS_K, D), dtype), make(rng, (2, 40, HEADS_K, D), dtype)
    s = sinks(rng)
    out, lse = flashcte.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                        return_softmax_lse=True, s_aux=s)
    ref_out, ref_lse = flash_attn_ref(q, k, v, causal=causal, window_size=window, sinks=s)
    assert_close(out, ref_out, dtype)
    assert_stat_close(lse, ref_lse, dtype, "lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alibi", [False, True], ids=["one_call", "per_sequence_alibi"])
def test_flash_attn_varlen_func_packed(rng, dtype, alibi):
    """Both ways the packed call runs: one attention_cte call with packing bounds, and the mixed
    batch (ALiBi slopes per sequence); rows past the last sequence are 0 with lse -inf."""
    len_q, len_k = np.array([17, 1, 0, 40, 9]), np.array([17, 30, 5, 12, 0])
    cu_q = np.concatenate([[0], np.cumsum(len_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(len_k)]).astype(np.int32)
    q = make(rng, (cu_q[-1] + 3, HEADS, D), dtype)
    k, v = make(rng, (cu_k[-1], HEADS_K, D), dtype), make(rng, (cu_k[-1], HEADS_K, D), dtype)
    slopes = rng.uniform(0, 0.5, (len_q.size, HEADS)).astype(np.float32) if alibi else None
    s = sinks(rng)
    out, lse = flashcte.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 40, 30, causal=True, alibi_slopes=slopes, return_softmax_lse=True,
        s_aux=s,
    )
    ref_out, ref_lse = flash_attn_varlen_ref(q, k, v, cu_q, cu_k, causal=True, alibi_slopes=slopes,
                                             sinks=s)
    assert_close(out, ref_out, dtype)
    assert_stat_close(lse, ref_lse, dtype, "lse")
    assert np.all(out[-3:].astype(np.float32) == 0) and np.all(np.isneginf(lse[:, -3:]))


def test_flash_attn_varlen_func_paged(rng):
    page, q_lens, used = 8, [1, 20, 3], [30, 20, 9]
    table = rng.permutation(12).astype(np.int32).reshape(3, 4)
    k_cache, v_cache = make(rng, (12, page, HEADS_K, D), "float32"), make(rng, (12, page, HEADS_K, D), "float32")
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = make(rng, (cu_q[-1], HEADS, D), "float32")
    s = sinks(rng)
    out, lse = flashcte.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_q, None, 20, 30, causal=True, return_softmax_lse=True,
        block_table=table, seqused_k=np.array(used, np.int32), s_aux=s,
    )
    ref_out, ref_lse = varlen_kvcache_ref(q, k_cache, v_cache, cu_q, used, table, causal=True, sinks=s)
    assert_close(out, ref_out, "float32")
    assert_stat_close(lse, ref_lse, "float32", "lse")


def test_sinks_of_the_models_dtype():
    """gpt-oss keeps its sinks as bfloat16 parameters: taken as their float32 values."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, k, v = (torch.from_numpy(make(rng, (1, 12, HEADS, D), "float32")) for _ in range(3))
    s = torch.from_numpy(sinks(rng)).to(torch.bfloat16)
    got = flashcte.flash_attn_func(q, k, v, causal=True, s_aux=s)
    want = flashcte.flash_attn_func(q, k, v, causal=True, s_aux=s.float().numpy())
    assert torch.equal(got, torch.from_numpy(np.asarray(want)))


def test_bad_sinks_are_refused_as_s_aux(rng):
    q = make(rng, (1, 12, HEADS, D), "float32")
    k, v = make(rng, (1, 12, HEADS_K, D), "float32"), make(rng, (1, 12, HEADS_K, D), "float32")
    cu = np.array([0, 12], np.int32)
    nan = np.array([0.0, np.nan, 0.0, 0.0], np.float32)
    calls = {
        "func": lambda s: flashcte.flash_attn_func(q, k, v, s_aux=s),
        "varlen": lambda s: flashcte.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 12, 12, s_aux=s),
        "varlen_alibi": lambda s: flashcte.flash_attn_varlen_func(
            q[0], k[0], v[0], cu, np.array([0, 10], np.int32), 12, 12, s_aux=s,
            alibi_slopes=np.ones((1, HEADS), np.float32)),
        "paged": lambda s: flashcte.flash_attn_varlen_func(
            q[0], k[:, :, None][0], v[:, :, None][0], cu, None, 12, 12, s_aux=s,
            block_table=np.arange(12, dtype=np.int32)[None], seqused_k=np.array([12], np.int32)),
    }
    for name, call in calls.items():
        for bad in (nan, np.zeros(HEADS + 1, np.float32)):
            with pytest.raises(ValueError, match="^s_aux:"):
                call(bad)
                pytest.fail(f"{name} accepted {bad}")
