"""Bad input raises flashcte.ArgumentTypeError / ArgumentError (TypeError / ValueError, and
RuntimeError) whose message names the argument."""

from __future__ import annotations

import flashcte
import numpy as np
import pytest
from semantics import BF16


def qkv(bs=2, bs_kv=1, sq=8, skv=8, d=4, dtype=np.float32):
    q = np.zeros((bs, sq, d), dtype)
    k = np.zeros((bs_kv, d, skv), dtype)
    v = np.zeros((bs_kv, skv, d), dtype)
    return q, k, v


def raises(exc, prefix, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert str(info.value).startswith(prefix), str(info.value)
    return str(info.value)


def test_wrong_rank():
    q, k, v = qkv()
    raises(ValueError, "q: must have rank 3", flashcte.attention_cte, q[0], k, v)
    raises(ValueError, "q: must have rank 3", flashcte.attention_cte, q[None], k, v)
    raises(ValueError, "k: must have rank 3", flashcte.attention_cte, q, k[0], v)
    raises(ValueError, "v: must have rank 3", flashcte.attention_cte, q, k, v[0])
    raises(ValueError, "k: must have rank 3", flashcte.attention_cte, q, k[None], v)
    raises(ValueError, "k: rank must be at most 4", flashcte.attention_cte, q, k[None, None], v)
    x = np.zeros((1, 4, 2, 8), np.float32)
    raises(ValueError, "q: must have rank 4", flashcte.flash_attn_func, x[0], x, x)
    raises(ValueError, "v: must have rank 4", flashcte.flash_attn_func, x, x, x[0])
    cu = np.array([0, 4])
    raises(
        ValueError,
        "k: must have rank 3",
        flashcte.flash_attn_varlen_func,
        x[0],
        x,
        x[0],
        cu,
        cu,
        4,
        4,
    )


def test_dtypes():
    q, k, v = qkv()
    raises(
        TypeError,
        "k: dtype float16 differs from q's dtype float32",
        flashcte.attention_cte,
        q,
        k.astype(np.float16),
        v,
    )
    raises(TypeError, "v: dtype", flashcte.attention_cte, q, k, v.astype(np.float16))
    raises(
        TypeError,
        "q: dtype must be float32, float16 or bfloat16, got float64",
        flashcte.attention_cte,
        q.astype(np.float64),
        k,
        v,
    )
    raises(TypeError, "k: dtype must be", flashcte.attention_cte, q, k.astype(np.int32), v)
    if BF16 is not None:
        raises(TypeError, "v: dtype bfloat16 differs", flashcte.attention_cte, q, k, v.astype(BF16))
    x = np.zeros((1, 4, 2, 8), np.float32)
    raises(
        TypeError,
        "k: dtype float16 must be q's float32",
        flashcte.flash_attn_func,
        x,
        x.astype(np.float16),
        x,
    )
    raises(TypeError, "q: expected a numpy array", flashcte.attention_cte, q.tolist(), k, v)
    raises(TypeError, "sink: dtype", flashcte.attention_cte, q, k, v, sink=np.array(["a", "b"]))
    raises(
        TypeError,
        "bound_min: dtype",
        flashcte.attention_cte,
        q,
        k,
        v,
        bound_min=np.zeros(8, np.complex64),
        bound_max=np.zeros(8, np.int64),
    )


def test_shapes_and_heads():
    q, k, v = qkv(bs=3, bs_kv=2)
    raises(
        ValueError, "q: bs = 3 must be a multiple of k's bs_kv = 2", flashcte.attention_cte, q, k, v
    )
    q, k, v = qkv()
    raises(ValueError, "k: head dim", flashcte.attention_cte, q, k[:, :3], v)
    raises(ValueError, "v: shape", flashcte.attention_cte, q, k, v[:, :5])
    x = np.zeros((1, 4, 6, 8), np.float32)
    y = np.zeros((1, 4, 4, 8), np.float32)
    raises(ValueError, "k: 4 heads must divide q's 6 heads", flashcte.flash_attn_func, x, y, y)
    raises(ValueError, "v: has 6 heads", flashcte.flash_attn_func, x, y, x)
    raises(ValueError, "k: batch 2 differs", flashcte.flash_attn_func, x, np.concatenate([x, x]), x)
    raises(ValueError, "k: head_dim 4 differs", flashcte.flash_attn_func, x, x[..., :4], x)


def test_options():
    q, k, v = qkv()
    kp = np.zeros((1, 4, 6), np.float32)
    vp = np.zeros((1, 6, 4), np.float32)
    raises(
        ValueError,
        "prior_used_len: 7 must be in [0, S_prior = 6]",
        flashcte.attention_cte,
        q,
        k,
        v,
        k_prior=kp,
        v_prior=vp,
        prior_used_len=7,
    )
    raises(
        ValueError,
        "prior_used_len: given without k_prior",
        flashcte.attention_cte,
        q,
        k,
        v,
        prior_used_len=3,
    )
    raises(
        TypeError,
        "prior_used_len: must be an int",
        flashcte.attention_cte,
        q,
        k,
        v,
        k_prior=kp,
        v_prior=vp,
        prior_used_len=[1.5],
    )
    raises(ValueError, "v_prior: is required", flashcte.attention_cte, q, k, v, k_prior=kp)
    raises(ValueError, "sink: shape", flashcte.attention_cte, q, k, v, sink=np.zeros((3, 1)))
    raises(
        ValueError,
        "sliding_window: must be >= 0",
        flashcte.attention_cte,
        q,
        k,
        v,
        sliding_window=-1,
    )
    raises(ValueError, "cp_offset: must be >= 0", flashcte.attention_cte, q, k, v, cp_offset=-2)
    raises(
        ValueError,
        "global_cp_deg: is required with cp_strided_q_slicing",
        flashcte.attention_cte,
        q,
        k,
        v,
        cp_offset=1,
        cp_strided_q_slicing=True,
    )
    raises(
        ValueError, "bound_max: is required", flashcte.attention_cte, q, k, v, bound_min=np.zeros(8)
    )
    raises(
        ValueError,
        "bound_min: shape",
        flashcte.attention_cte,
        q,
        k,
        v,
        bound_min=np.zeros(7, np.int64),
        bound_max=np.zeros(7, np.int64),
    )
    raises(
        ValueError,
        "bound_max: row 0 holds 9",
        flashcte.attention_cte,
        q,
        k,
        v,
        bound_min=np.zeros(8, np.int64),
        bound_max=np.full(8, 9),
    )
    raises(
        ValueError,
        "bound_min: row 2 holds 0.5",
        flashcte.attention_cte,
        q,
        k,
        v,
        bound_min=np.array([0, 0, 0.5, 0, 0, 0, 0, 0]),
        bound_max=np.full(8, 8),
    )
    raises(
        ValueError,
        "bound_min: row 1 holds",
        flashcte.attention_cte,
        q,
        k,
        v,
        bound_min=np.array([0, 1.5, 0, 0, 0, 0, 0, 0], np.float32),
        bound_max=np.full(8, 8),
    )
    raises(ValueError, "num_threads: must be >= 0", flashcte.attention_cte, q, k, v, num_threads=-1)
    raises(
        TypeError,
        "sliding_window: must be an int",
        flashcte.attention_cte,
        q,
        k,
        v,
        sliding_window=1.5,
    )
    raises(ValueError, "scale: must be finite", flashcte.attention_cte, q, k, v, scale=float("nan"))
    x = np.zeros((1, 4, 2, 8), np.float32)
    raises(
        TypeError, "window_size: must be a pair", flashcte.flash_attn_func, x, x, x, window_size=3
    )
    raises(
        ValueError,
        "window_size: entries must be >= -1",
        flashcte.flash_attn_func,
        x,
        x,
        x,
        window_size=(-2, 0),
    )


def test_dlpack_bfloat16_not_through_numpy():
    """A non-torch DLPack producer that numpy cannot read raises TypeError naming the argument."""

    class Opaque:
        def __dlpack__(self, **kwargs):
            raise BufferError("unsupported dtype")

        def __dlpack_device__(self):
            return (1, 0)

    q, k, _v = qkv()
    raises(TypeError, "v: cannot read this DLPack tensor", flashcte.attention_cte, q, k, Opaque())


def test_extension_errors():
    """softcap, alibi_slopes, key_bias and the window bounds name themselves when refused."""
    q, k, v = qkv()
    a = flashcte.attention_cte
    raises(ValueError, "softcap: must be finite and >= 0", a, q, k, v, softcap=-1.0)
    raises(ValueError, "softcap: must be finite and >= 0", a, q, k, v, softcap=float("nan"))
    raises(TypeError, "softcap: must be a float", a, q, k, v, softcap="big")
    raises(
        ValueError,
        "alibi_slopes: shape (3,) must be (bs,) or (bs, 1)",
        a,
        q,
        k,
        v,
        alibi_slopes=np.zeros(3, np.float32),
    )
    raises(
        ValueError,
        "alibi_slopes: entry 1 is not finite",
        a,
        q,
        k,
        v,
        alibi_slopes=np.array([0.5, np.inf], np.float32),
    )
    raises(
        TypeError,
        "alibi_slopes: dtype must be a float type",
        a,
        q,
        k,
        v,
        alibi_slopes=np.array(["a", "b"]),
    )
    raises(
        ValueError,
        "key_bias: shape (2, 7) must be (bs, prior_used_len + Skv) = (2, 8)",
        a,
        q,
        k,
        v,
        key_bias=np.zeros((2, 7), np.float32),
    )
    raises(ValueError, "window_left: must be >= 0, or -1", a, q, k, v, window_left=-2)
    raises(ValueError, "window_right: must be >= 0, or -1", a, q, k, v, window_right=-5)
    raises(TypeError, "window_right: must be an int", a, q, k, v, window_right=1.5)
    raises(
        ValueError,
        "window_left: 100000000000000000000 does not fit",
        a,
        q,
        k,
        v,
        window_left=10**20,
    )
    raises(TypeError, "sliding_window: must be an int", a, q, k, v, sliding_window=float("inf"))
    x = np.zeros((2, 4, 3, 8), np.float32)
    fa = flashcte.flash_attn_func
    raises(
        ValueError,
        "alibi_slopes: shape (2,) must be (heads,) = (3,) or (batch, heads) = (2, 3)",
        fa,
        x,
        x,
        x,
        alibi_slopes=np.ones(2, np.float32),
    )
    raises(
        ValueError,
        "alibi_slopes: entry (batch, head) = (1, 2) is not finite",
        fa,
        x,
        x,
        x,
        alibi_slopes=np.array([[1, 1, 1], [1, 1, np.nan]], np.float32),
    )
    raises(
        TypeError,
        "alibi_slopes: dtype must be a float type",
        fa,
        x,
        x,
        x,
        alibi_slopes=np.ones(3, bool),
    )
    raises(ValueError, "softcap: must be finite and >= 0", fa, x, x, x, softcap=-3.0)
    raises(TypeError, "softcap: must be a float", fa, x, x, x, softcap=[1.0])
    cu = np.array([0, 2, 4])
    raises(
        ValueError,
        "alibi_slopes: shape (3, 3) must be (heads,) = (3,) or (batch, heads) = (2, 3)",
        flashcte.flash_attn_varlen_func,
        x[0],
        x[0],
        x[0],
        cu,
        cu,
        4,
        4,
        alibi_slopes=np.ones((3, 3), np.float32),
    )
    # Windows wider than any position are unbounded, not an overflow.
    same = fa(x, x, x, window_size=(10**30, 10**30))
    assert np.array_equal(same, fa(x, x, x))


# The native mixed-batch call's names, which paged_attention (vLLM's names) and
# flash_attn_varlen_func(block_table=...) (k, v) spell otherwise: no message may use them (a fuzzer
# finding of issue 41).
NATIVE_NAMES = r"\b(q|k_cache|v_cache|cu_seqlens_q|seqused_k|softmax_scale|window_size|out)\b"


def test_paged_attention_names_its_own_arguments():
    import re

    f32 = np.float32
    good = dict(
        query=np.zeros((3, 4, 8), f32),
        key_cache=np.zeros((4, 2, 4, 8), f32),
        value_cache=np.zeros((4, 2, 4, 8), f32),
        block_table=np.array([[0, 1], [2, 3]], np.int32),
        seq_lens=np.array([5, 2], np.int32),
        query_start_loc=np.array([0, 1, 3], np.int32),
        scale=0.3,
    )
    flashcte.paged_attention(**good)
    bad = {
        "seq_lens": dict(seq_lens=5),
        "query_start_loc": dict(query_start_loc=np.array([0, 2, 4], np.int32)),
        "value_cache": dict(value_cache=np.zeros((4, 3, 4, 8), f32)),
        "key_cache": dict(query=np.zeros((3, 4, 8), np.float16)),
        "scale": dict(scale=float("nan")),
        "window": dict(window=(-2, 0)),
        "output": dict(output=np.zeros((3, 4, 8), np.float16)),
        "query": dict(query=np.zeros((3, 3, 8), f32)),
    }
    for name, change in bad.items():
        with pytest.raises((TypeError, ValueError)) as info:
            flashcte.paged_attention(**dict(good, **change))
        message = str(info.value)
        assert message.startswith(f"{name}:"), message
        assert not re.search(NATIVE_NAMES, message), message
    # flash_attn_varlen_func over pages: k and v, never the native call's k_cache and v_cache.
    q, k, v = good["query"], good["key_cache"].swapaxes(1, 2), good["value_cache"].swapaxes(1, 2)
    for name, change in {"v": dict(v=v.astype(np.float16)), "k": dict(k=k[..., :4])}.items():
        args = dict(q=q, k=k, v=v, cu_seqlens_q=good["query_start_loc"], cu_seqlens_k=None,
                    max_seqlen_q=2, max_seqlen_k=5, block_table=good["block_table"],
                    seqused_k=good["seq_lens"])
        with pytest.raises((TypeError, ValueError)) as info:
            flashcte.flash_attn_varlen_func(**dict(args, **change))
        message = str(info.value)
        assert message.startswith(f"{name}:"), message
        assert not re.search(r"\b(k_cache|v_cache)\b", message), message
    int8 = np.zeros(k.shape, np.int8)
    with pytest.raises(TypeError, match="^k: dtype int8 is an 8-bit cache format"):
        flashcte.flash_attn_varlen_func(**dict(args, k=int8, v=int8))


def test_refusals_are_runtime_errors_too_as_torch_and_flashattention_raise():
    """Every refused argument is a flashcte.ArgumentError (a ValueError) or ArgumentTypeError (a
    TypeError), and a RuntimeError as well: what TORCH_CHECK raises in PyTorch and FlashAttention,
    and what their users catch. Native and Python-side refusals alike."""
    assert issubclass(flashcte.ArgumentError, ValueError)
    assert issubclass(flashcte.ArgumentError, RuntimeError)
    assert issubclass(flashcte.ArgumentTypeError, TypeError)
    assert issubclass(flashcte.ArgumentTypeError, RuntimeError)
    q, k, v = qkv()
    native = raises(RuntimeError, "q: must have rank 3", flashcte.attention_cte, q[0], k, v)
    with pytest.raises(flashcte.ArgumentError, match="^q: must have rank 3"):
        flashcte.attention_cte(q[0], k, v)
    with pytest.raises(flashcte.ArgumentTypeError, match="^k: "):
        flashcte.attention_cte(q, k.astype(np.float16), v)
    raises(RuntimeError, "k: ", flashcte.attention_cte, q, k.astype(np.float16), v)
    x = np.zeros((1, 4, 2, 8), np.float32)
    # a Python-side check (flash_attn_func's window_size)
    with pytest.raises(flashcte.ArgumentError, match="window_size"):
        flashcte.flash_attn_func(x, x, x, window_size=(-5, 0))
    assert native


@pytest.mark.parametrize("append", [False, True], ids=["cache_seqlens", "appended keys"])
def test_block_table_bounds_as_flashattention_tests_them(append):
    """FlashAttention's test_flash_attn_kvcache_paged_block_table_bounds (flash-attention#2711):
    a sequence whose cached plus appended keys outgrow its block_table row (max_blocks_per_seq x
    page_block_size) raises a RuntimeError that names block_table; flashcte's also names
    cache_seqlens, the argument that broke the rule, and leaves the caches as they were."""
    rng = np.random.default_rng(0)
    page, blocks = 16, 2
    q = rng.standard_normal((1, 1, 2, 16), dtype=np.float32)
    k_cache = rng.standard_normal((4, page, 2, 16), dtype=np.float32)
    v_cache = rng.standard_normal((4, page, 2, 16), dtype=np.float32)
    before = (k_cache.copy(), v_cache.copy())
    table = np.array([[0, 1]], np.int32)
    new = dict(k=q.copy(), v=q.copy()) if append else {}
    seqlens = np.array([page * blocks if append else page * blocks + 1], np.int32)
    with pytest.raises(RuntimeError, match="block_table") as info:
        flashcte.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, **new
        )
    assert isinstance(info.value, ValueError) and str(info.value).startswith("cache_seqlens: [0]")
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])
    # the same sequence at the row's capacity (appending: one slot short of it) is taken
    seqlens[0] -= 1
    flashcte.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, **new
    )
