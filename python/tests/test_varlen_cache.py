"""The mixed batch over a KV cache: flash_attn_varlen_func(block_table=..., seqused_k=...) and
the vLLM-shaped paged_attention, against FlashAttention's model of each sequence
(semantics.kvcache_ref: its queries the last of its keys, bottom-right aligned), with attention
sinks folded in exactly; bitwise equal across page sizes and layouts; numpy and torch."""

from __future__ import annotations

import flashcte
import numpy as np
import pytest
from conftest import DTYPES, assert_close, assert_stat_close, make
from semantics import varlen_kvcache_ref

# Per sequence: (queries this step, keys in its cache); 0 queries: a sequence idle this step.
MIXES = {
    "decode_and_prefill": ([1, 40, 1, 3, 17], [60, 40, 9, 3, 90]),
    "empty_sequences_and_caches": ([0, 1, 20, 0, 2], [5, 0, 20, 0, 2]),
}


def setup(rng, dtype, q_lens, used, page, heads=4, kv_heads=2, d=32):
    """A paged pool (page > 0, shuffled pages) or dense caches, and the batch's tensors."""
    batch, longest = len(q_lens), max(used)
    pages = -(-longest // page) if page else 1
    slots = pages * page if page else longest
    # Drawn over the longest sequence (the same values for every page size), padded to pages.
    pad = ((0, 0), (0, slots - longest), (0, 0), (0, 0))
    logical_k = np.pad(make(rng, (batch, longest, kv_heads, d), dtype), pad)
    logical_v = np.pad(make(rng, (batch, longest, kv_heads, d), dtype), pad)
    q = make(rng, (sum(q_lens), heads, d), dtype)
    args = dict(
        cu_seqlens_q=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        seqused_k=np.array(used, np.int32),
    )
    if page:
        order = rng.permutation(batch * pages + 2).astype(np.int32)
        table = order[: batch * pages].reshape(batch, pages)
        k_cache = make(rng, (batch * pages + 2, page, kv_heads, d), dtype)
        v_cache = make(rng, (batch * pages + 2, page, kv_heads, d), dtype)
        for b in range(batch):
            for i in range(pages):
                k_cache[table[b, i]] = logical_k[b, i * page : (i + 1) * page]
                v_cache[table[b, i]] = logical_v[b, i * page : (i + 1) * page]
        args["block_table"] = table
    else:
        k_cache, v_cache = logical_k, logical_v
    return q, k_cache, v_cache, args


def reference(q, k_cache, v_cache, args, causal=True, window=(-1, -1), softcap=0.0,
              alibi=None, sinks=None):
    """Each sequence as FlashAttention's flash_attn_with_kvcache model sees it alone, sinks
    folded in (semantics.varlen_kvcache_ref)."""
    return varlen_kvcache_ref(q, k_cache, v_cache, args["cu_seqlens_q"], args["seqused_k"],
                              args.get("block_table"), causal=causal, window_size=window,
                              softcap=softcap, alibi_slopes=alibi, sinks=sinks)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("mix", list(MIXES))
def test_varlen_func_over_pages_matches_flash_attention(rng, dtype, page, mix):
    q, k_cache, v_cache, args = setup(rng, dtype, *MIXES[mix], page)
    out, lse = flashcte.flash_attn_varlen_func(
        q, k_cache, v_cache, args["cu_seqlens_q"], None, 40, 90, causal=True,
        return_softmax_lse=True, block_table=args["block_table"], seqused_k=args["seqused_k"])
    ref_out, ref_lse = reference(q, k_cache, v_cache, args)
    assert_close(out, ref_out, dtype)
    assert_stat_close(lse, ref_lse, dtype, "lse")


def test_varlen_func_takes_the_lengths_from_cu_seqlens_k(rng):
    q, k_cache, v_cache, args = setup(rng, "float32", *MIXES["decode_and_prefill"], 16)
    cu_k = np.concatenate([[0], np.cumsum(args["seqused_k"])]).astype(np.int32)
    common = (q, k_cache, v_cache, args["cu_seqlens_q"])
    by_cu = flashcte.flash_attn_varlen_func(*common, cu_k, 40, 90, causal=True,
                                            block_table=args["block_table"])
    by_used = flashcte.flash_attn_varlen_func(*common, None, 40, 90, causal=True,
                                              block_table=args["block_table"],
                                              seqused_k=args["seqused_k"])
    assert np.asarray(by_cu).tobytes() == np.asarray(by_used).tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_vllm_shapes_with_sinks_window_softcap_alibi(rng, dtype):
    heads = 4
    q, k_cache, v_cache, args = setup(rng, dtype, [1, 30, 2, 1], [50, 70, 2, 33], 16, heads=heads)
    sinks = rng.standard_normal(heads).astype(np.float32)
    alibi = (rng.random(heads) * 0.3).astype(np.float32)
    # vLLM's (num_blocks, heads_k, block_size, d): the same pages, HND.
    k_hnd = np.ascontiguousarray(k_cache.transpose(0, 2, 1, 3))
    v_hnd = np.ascontiguousarray(v_cache.transpose(0, 2, 1, 3))
    output = np.full(q.shape, np.nan, dtype=q.dtype)
    result = flashcte.paged_attention(
        q, k_hnd, v_hnd, args["block_table"], args["seqused_k"], args["cu_seqlens_q"],
        1 / np.sqrt(q.shape[2]), causal=True, window=(20, 0), softcap=4.0, alibi_slopes=alibi,
        sinks=sinks, output=output)
    assert result is output
    ref_out, _ = reference(q, k_cache, v_cache, args, window=(20, 0), softcap=4.0, alibi=alibi,
                           sinks=sinks)
    assert_close(output, ref_out, dtype)
    nhd = flashcte.paged_attention(
        q, k_cache, v_cache, args["block_table"], args["seqused_k"], args["cu_seqlens_q"],
        1 / np.sqrt(q.shape[2]), window=(20, 0), softcap=4.0, alibi_slopes=alibi, sinks=sinks,
        kv_layout="NHD")
    assert np.asarray(nhd).tobytes() == output.tobytes()


def test_bitwise_across_page_sizes(rng):
    seed = int(rng.integers(1 << 30))
    results = []
    for page in (1, 3, 16, 256):
        q, k_cache, v_cache, args = setup(np.random.default_rng(seed), "bfloat16",
                                          [1, 40, 2], [300, 290, 5], page)
        out, lse = flashcte.flash_attn_varlen_func(
            q, k_cache, v_cache, args["cu_seqlens_q"], None, 40, 300, causal=True,
            return_softmax_lse=True, block_table=args["block_table"], seqused_k=args["seqused_k"])
        results.append((np.asarray(out).tobytes(), np.asarray(lse).tobytes()))
    assert all(r == results[0] for r in results[1:])


def test_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    q, k_cache, v_cache, args = setup(rng, "float32", *MIXES["decode_and_prefill"], 16)
    want = flashcte.paged_attention(q, k_cache, v_cache, args["block_table"], args["seqused_k"],
                                    args["cu_seqlens_q"], 0.2, kv_layout="NHD")
    got = flashcte.paged_attention(
        torch.from_numpy(q), torch.from_numpy(k_cache), torch.from_numpy(v_cache),
        torch.from_numpy(args["block_table"]), torch.from_numpy(args["seqused_k"]),
        torch.from_numpy(args["cu_seqlens_q"]), 0.2, kv_layout="NHD")
    assert isinstance(got, torch.Tensor)
    assert got.numpy().tobytes() == np.asarray(want).tobytes()


@pytest.mark.parametrize(
    "change, argument",
    [
        (dict(seq_lens=np.array([60, 40, 9, 3, 10_000], np.int32)), "seq_lens"),
        (dict(query_start_loc=np.array([0, 1, 41, 42, 45, 61], np.int32)), "query_start_loc"),
        (dict(seq_lens=np.array([60, 40, 9, 3, 90], np.int64)), "seq_lens"),
        (dict(sinks=np.array([0.0, np.nan, 0.0, 0.0], np.float32)), "sinks"),
        (dict(block_table="out_of_range"), "block_table"),
    ],
)
def test_bad_input_is_refused_by_name(rng, change, argument):
    """Each refusal names paged_attention's own argument (vLLM's names)."""
    q, k_cache, v_cache, args = setup(rng, "float32", *MIXES["decode_and_prefill"], 16)
    call = dict(block_table=args["block_table"], seq_lens=args["seqused_k"],
                query_start_loc=args["cu_seqlens_q"], sinks=None)
    for key, value in change.items():
        if isinstance(value, str):  # a page past the pool
            table = args["block_table"].copy()
            table[4, 0] = k_cache.shape[0]
            call["block_table"] = table
        else:
            call[key] = value
    with pytest.raises((ValueError, TypeError), match=f"^{argument}:"):
        flashcte.paged_attention(q, k_cache, v_cache, scale=0.2, kv_layout="NHD", **call)


def test_hnd_caches_are_named_in_the_shapes_passed(rng):
    """vLLM's HND caches run as FlashAttention's NHD views; a refusal still prints the shape the
    caller passed, not the transposed view."""
    q = make(rng, (3, 4, 64), "float32")
    k = make(rng, (10, 2, 16, 64), "float32")
    call = dict(block_table=np.arange(10, dtype=np.int32).reshape(2, 5),
                seq_lens=np.array([20, 30], np.int32),
                query_start_loc=np.array([0, 1, 3], np.int32), scale=0.1)
    bad = {
        r"value_cache: shape \(10, 3, 16, 64\) must have key_cache's": make(rng, (10, 3, 16, 64), "float32"),
        r"value_cache: shape \(10, 2, 8, 64\) must have key_cache's": make(rng, (10, 2, 8, 64), "float32"),
    }
    for message, v in bad.items():
        with pytest.raises(ValueError, match=message):
            flashcte.paged_attention(q, k, v, **call)
    with pytest.raises(ValueError, match=r"key_cache: block_size \(axis 2 of \(10, 2, 0, 64\)\) is 0"):
        empty = make(rng, (10, 2, 0, 64), "float32")
        flashcte.paged_attention(q, empty, empty, **call)
    with pytest.raises(ValueError, match=r"key_cache: shape \(10, 2, 16, 64\) has head_dim 64, expected query's 32"):
        flashcte.paged_attention(make(rng, (3, 4, 32), "float32"), k, k, **call)
    with pytest.raises(ValueError, match=r"k_scale: shape \(10, 16, 2\) must be the cache's without its last axis, \(10, 2, 16\)"):
        codes = np.zeros((10, 2, 16, 64), np.int8)
        flashcte.paged_attention(q, codes, codes, **call, k_scale=np.ones((10, 16, 2), np.float32),
                                 v_scale=np.ones((10, 2, 16), np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mla_latent_cache_with_the_value_inside_the_key(rng, dtype):
    """MLA (DeepSeek-V2/V3): one latent KV head of d 576 whose first 512 channels are the value,
    the value cache a view of the key cache (no copy). 36 heads make 36 decode rows (nine QK row
    blocks) and, for the 64-token chunk, 4.6 MiB of output state: two passes over the heads in
    attention_cte (src/kernel/attention.cc)."""
    heads, d, dv = 36, 576, 512
    q, k_cache, _, args = setup(rng, dtype, [1, 64, 3], [70, 130, 3], 16, heads=heads,
                                kv_heads=1, d=d)
    k_hnd = np.ascontiguousarray(k_cache.transpose(0, 2, 1, 3))
    sinks = rng.standard_normal(heads).astype(np.float32)
    out = flashcte.paged_attention(
        q, k_hnd, k_hnd[..., :dv], args["block_table"], args["seqused_k"], args["cu_seqlens_q"],
        1 / np.sqrt(192.0), causal=True, sinks=sinks)
    assert out.shape == (q.shape[0], heads, dv)
    ref_out, _ = varlen_kvcache_ref(q, k_cache, k_cache[..., :dv], args["cu_seqlens_q"],
                                    args["seqused_k"], args["block_table"], causal=True,
                                    softmax_scale=1 / np.sqrt(192.0), sinks=sinks)
    assert_close(out, ref_out, dtype)
