"""flash_attn_func / flash_attn_varlen_func against FlashAttention's conventions (float64)."""

from __future__ import annotations

import flashcte
import numpy as np
import pytest
from conftest import DTYPES, assert_close, assert_stat_close, make, np_dtype
from semantics import fa_mask, flash_attn_ref, flash_attn_varlen_ref


def observed_mask(seqlen_q, seqlen_k, **kwargs):
    """The mask flash_attn_func applies, read off its output: with all scores equal and v the
    identity, out[i, j] = 1/n_i where key j is allowed, 0 elsewhere."""
    q = np.zeros((1, seqlen_q, 1, 4), np.float32)
    k = np.zeros((1, seqlen_k, 1, 4), np.float32)
    v = np.eye(seqlen_k, dtype=np.float32)[None, :, None, :]
    out, lse = flashcte.flash_attn_func(q, k, v, return_softmax_lse=True, **kwargs)
    return (out[0, :, 0] > 0).astype(int), out[0, :, 0], lse[0, 0]


def test_readme_causal_examples():
    """FlashAttention README: causal masks are aligned to the bottom-right corner."""
    mask, _, _ = observed_mask(2, 5, causal=True)
    assert mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    mask, out, lse = observed_mask(5, 2, causal=True)
    assert mask.tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    # Fully masked rows output 0 and have lse = -inf (log of an empty sum).
    assert np.all(out[:3] == 0)
    assert np.all(lse[:3] == -np.inf) and np.all(np.isfinite(lse[3:]))


@pytest.mark.parametrize("sq,sk", [(7, 7), (3, 9), (9, 3), (1, 6), (6, 1)])
@pytest.mark.parametrize(
    "causal,window",
    [
        (False, (-1, -1)),
        (True, (-1, -1)),
        (True, (2, -1)),
        (True, (0, 5)),
        (False, (2, 1)),
        (False, (-1, 0)),
        (False, (3, -1)),
        (False, (0, 0)),
        (False, (20, 20)),
    ],
)
def test_mask_conventions(sq, sk, causal, window):
    mask, out, _ = observed_mask(sq, sk, causal=causal, window_size=window)
    expect = fa_mask(sq, sk, causal, window).astype(int)
    assert mask.tolist() == expect.tolist()
    rows = expect.sum(1)
    np.testing.assert_allclose(out.sum(1), (rows > 0).astype(np.float32), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "sq,sk,causal,window",
    [
        (64, 64, False, (-1, -1)),
        (64, 64, True, (-1, -1)),
        (40, 100, True, (-1, -1)),
        (100, 40, True, (-1, -1)),
        (50, 80, True, (15, -1)),
        (80, 50, False, (10, 4)),
        (77, 77, False, (-1, 8)),
    ],
)
def test_flash_attn_func(rng, dtype, sq, sk, causal, window):
    batch, heads, heads_k, d = 2, 4, 2, 32
    q = make(rng, (batch, sq, heads, d), dtype)
    k = make(rng, (batch, sk, heads_k, d), dtype)
    v = make(rng, (batch, sk, heads_k, d), dtype)
    out, lse = flashcte.flash_attn_func(
        q, k, v, causal=causal, window_size=window, return_softmax_lse=True
    )
    ref_out, ref_lse = flash_attn_ref(q, k, v, causal=causal, window_size=window)
    assert out.dtype == np_dtype(dtype) and out.shape == (batch, sq, heads, d)
    assert lse.dtype == np.float32 and lse.shape == (batch, heads, sq)
    assert_close(out, ref_out, dtype)
    assert_stat_close(lse, ref_lse, dtype, "lse")


@pytest.mark.parametrize("heads,heads_k", [(6, 6), (6, 3), (6, 1)])
def test_flash_attn_gqa_and_scale(rng, heads, heads_k):
    q = make(rng, (3, 30, heads, 16), "float32")
    k = make(rng, (3, 45, heads_k, 16), "float32")
    v = make(rng, (3, 45, heads_k, 24), "float32")  # dv != d
    for scale in (None, 0.5):
        out = flashcte.flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
        ref, _ = flash_attn_ref(q, k, v, softmax_scale=scale, causal=True)
        assert out.shape == (3, 30, heads, 24)
        assert_close(out, ref, "float32")


def test_flash_attn_strided_inputs(rng):
    """q/k/v as views of a packed qkv tensor (B, S, 3, H, D), as models produce them."""
    qkv = make(rng, (2, 40, 3, 4, 16), "float32")
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out = flashcte.flash_attn_func(q, k, v, causal=True)
    ref, _ = flash_attn_ref(q, k, v, causal=True)
    assert_close(out, ref, "float32")


def test_flash_attn_unsupported():
    q = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(NotImplementedError, match="softcap"):
        flashcte.flash_attn_func(q, q, q, softcap=30.0)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        flashcte.flash_attn_func(q, q, q, alibi_slopes=np.ones(2, np.float32))
    with pytest.raises(NotImplementedError, match="softcap"):
        flashcte.flash_attn_varlen_func(
            q[0], q[0], q[0], np.array([0, 4]), np.array([0, 4]), 4, 4, softcap=1.0
        )


def random_cu_seqlens(rng, lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (6, -1)), (False, (5, 3))]
)
def test_flash_attn_varlen(rng, dtype, causal, window):
    len_q = np.array([17, 1, 0, 40, 25, 9])
    len_k = np.array([17, 30, 5, 12, 25, 0])  # some shorter, some longer, one empty
    cu_q, cu_k = random_cu_seqlens(rng, len_q), random_cu_seqlens(rng, len_k)
    heads, heads_k, d = 4, 2, 16
    extra = 3  # query rows past cu_seqlens_q[-1]: output 0
    q = make(rng, (cu_q[-1] + extra, heads, d), dtype)
    k = make(rng, (cu_k[-1], heads_k, d), dtype)
    v = make(rng, (cu_k[-1], heads_k, d), dtype)
    out, lse = flashcte.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        int(len_q.max()),
        int(len_k.max()),
        causal=causal,
        window_size=window,
        return_softmax_lse=True,
    )
    ref_out, ref_lse = flash_attn_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, window_size=window)
    assert out.shape == q.shape and lse.shape == (heads, q.shape[0]) and lse.dtype == np.float32
    assert_close(out, ref_out, dtype)
    assert_stat_close(lse, ref_lse, dtype, "lse")
    assert np.all(out[-extra:].astype(np.float32) == 0)


def test_varlen_matches_batched(rng):
    """Equal-length sequences: varlen and the batched function agree bit for bit."""
    batch, s, heads, d = 3, 33, 4, 16
    q = make(rng, (batch, s, heads, d), "float32")
    k = make(rng, (batch, s, 2, d), "float32")
    v = make(rng, (batch, s, 2, d), "float32")
    cu = np.arange(batch + 1, dtype=np.int32) * s
    a = flashcte.flash_attn_func(q, k, v, causal=True, window_size=(9, 0))
    b = flashcte.flash_attn_varlen_func(
        q.reshape(-1, heads, d),
        k.reshape(-1, 2, d),
        v.reshape(-1, 2, d),
        cu,
        cu,
        s,
        s,
        causal=True,
        window_size=(9, 0),
    )
    assert_close(b.reshape(a.shape), a, "float32", rtol=1e-6)


def test_varlen_bad_offsets(rng):
    q = make(rng, (10, 2, 8), "float32")
    cu = np.array([0, 4, 10], np.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        flashcte.flash_attn_varlen_func(q, q, q, np.array([0, 6, 4]), cu, 10, 10)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        flashcte.flash_attn_varlen_func(q, q, q, cu, np.array([0, 4, 11]), 10, 11)
    with pytest.raises(ValueError, match="cu_seqlens_k: holds 2 offsets"):
        flashcte.flash_attn_varlen_func(q, q, q, cu, np.array([0, 10]), 10, 10)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        flashcte.flash_attn_varlen_func(q, q, q, cu, cu, 4, 6)
