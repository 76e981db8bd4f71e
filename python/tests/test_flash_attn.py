"""flash_attn_func / flash_attn_varlen_func against FlashAttention's conventions (float64)."""

from __future__ import annotations

import flashcte
import numpy as np
import pytest
from conftest import DTYPES, assert_close, assert_stat_close, make, np_dtype
from flashcte._flash_attn import _packed_alibi_positions
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


def fa_slopes(rng, *shape):
    return rng.uniform(0.01, 0.5, shape).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "sq,sk,causal,window",
    [
        (48, 48, False, (-1, -1)),
        (48, 48, True, (-1, -1)),
        (30, 70, True, (-1, -1)),
        (70, 30, True, (-1, -1)),
        (30, 70, False, (-1, -1)),
        (70, 30, False, (-1, -1)),
        (50, 80, True, (12, -1)),
        (80, 50, False, (10, 4)),
    ],
)
@pytest.mark.parametrize("modifier", ["softcap", "alibi", "alibi_batch", "both"])
def test_flash_attn_modifiers(rng, dtype, sq, sk, causal, window, modifier):
    """softcap and ALiBi ((heads,) and (batch, heads) slopes), alone and together, with GQA."""
    batch, heads, heads_k, d = 2, 6, 2, 32
    q = make(rng, (batch, sq, heads, d), dtype)
    k = make(rng, (batch, sk, heads_k, d), dtype)
    v = make(rng, (batch, sk, heads_k, d), dtype)
    extra = {}
    if modifier in ("softcap", "both"):
        extra["softcap"] = 3.0  # scores are ~N(0, 1) at 1/sqrt(d): a cap of 3 bends the tail
    if modifier in ("alibi", "both"):
        extra["alibi_slopes"] = fa_slopes(rng, heads)
    if modifier == "alibi_batch":
        extra["alibi_slopes"] = fa_slopes(rng, batch, heads)
    scale = 1.0 if modifier == "softcap" else None
    out, lse = flashcte.flash_attn_func(
        q,
        k,
        v,
        softmax_scale=scale,
        causal=causal,
        window_size=window,
        return_softmax_lse=True,
        **extra,
    )
    ref_out, ref_lse = flash_attn_ref(
        q, k, v, softmax_scale=scale, causal=causal, window_size=window, **extra
    )
    assert out.dtype == np_dtype(dtype) and out.shape == (batch, sq, heads, d)
    assert_close(out, ref_out, dtype)
    assert_stat_close(lse, ref_lse, dtype, "lse")


def test_flash_attn_alibi_convention():
    """FlashAttention's documented ALiBi bias: -slope * |i + seqlen_k - seqlen_q - j|, read off
    the output: with q = 0 the probabilities are softmax(bias) over the allowed keys."""
    sq, sk, slope = 3, 6, 0.7
    q = np.zeros((1, sq, 1, 4), np.float32)
    k = np.zeros((1, sk, 1, 4), np.float32)
    v = np.eye(sk, dtype=np.float32)[None, :, None, :]
    for causal in (False, True):
        out, lse = flashcte.flash_attn_func(
            q,
            k,
            v,
            causal=causal,
            alibi_slopes=np.array([slope], np.float32),
            return_softmax_lse=True,
        )
        i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
        bias = -slope * np.abs(i + sk - sq - j)
        if causal:
            bias = np.where(j <= i + sk - sq, bias, -np.inf)
        p = np.exp(bias - bias.max(1, keepdims=True))
        np.testing.assert_allclose(out[0, :, 0], p / p.sum(1, keepdims=True), rtol=1e-6)
        expect_lse = np.log(np.exp(bias).sum(1))
        np.testing.assert_allclose(lse[0, 0], expect_lse, rtol=1e-6)


def test_flash_attn_softcap_convention():
    """softcap applies to the scaled score: S = softcap * tanh(softmax_scale * q.k / softcap)."""
    q = np.ones((1, 1, 1, 4), np.float32)
    k = np.array([0.0, 1.0, 2.0, 4.0], np.float32)[None, :, None, None] * np.ones(4, np.float32)
    v = np.eye(4, dtype=np.float32)[None, :, None, :]
    out, lse = flashcte.flash_attn_func(
        q, k, v, softmax_scale=0.5, softcap=2.0, return_softmax_lse=True
    )
    s = 2.0 * np.tanh(0.5 * np.array([0.0, 4.0, 8.0, 16.0]) / 2.0)
    p = np.exp(s - s.max())
    np.testing.assert_allclose(out[0, 0, 0], p / p.sum(), rtol=1e-6)
    np.testing.assert_allclose(lse[0, 0, 0], np.log(np.exp(s).sum()), rtol=1e-6)


def test_flash_attn_modifier_forms(rng):
    """Slopes in another float dtype, as a list, broadcast over the batch; softcap None or 0
    means off; strided q/k/v views."""
    qkv = make(rng, (2, 20, 3, 4, 16), "float32")
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    slopes = fa_slopes(rng, 4)
    a = flashcte.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    for form in (slopes.astype(np.float64), slopes.tolist(), np.stack([slopes, slopes])):
        b = flashcte.flash_attn_func(q, k, v, causal=True, alibi_slopes=form)
        assert np.array_equal(a, b)
    base = flashcte.flash_attn_func(q, k, v, causal=True)
    for off in (0.0, None):
        assert np.array_equal(flashcte.flash_attn_func(q, k, v, causal=True, softcap=off), base)
    ref, _ = flash_attn_ref(q, k, v, causal=True, alibi_slopes=slopes)
    assert_close(a, ref, "float32")


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


# (len_q, len_k, extra query rows, extra key rows, slopes per sequence, positions fit one call)
# One packed call runs when the positions fit and the slopes are the same for every sequence.
VARLEN_ALIBI_CASES = [
    # Self-attention (cu_q == cu_k): one call, no offset.
    pytest.param([17, 1, 0, 30, 25], [17, 1, 0, 30, 25], 3, 0, False, True, id="self"),
    # The same with one slope row per sequence: one call per sequence.
    pytest.param([17, 1, 0, 30, 25], [17, 1, 0, 30, 25], 3, 0, True, True, id="self-per-seq"),
    # Each sequence ends 4 keys after its queries: one call, cp_offset 4.
    pytest.param([5, 8, 6], [9, 8, 6], 2, 0, False, True, id="shift+4"),
    # Each ends 4 keys before: one call, bottom_right plus a cp_offset.
    pytest.param([9, 8, 6], [5, 8, 6], 3, 0, False, True, id="shift-4"),
    # As above with trailing keys past cu_seqlens_k[-1]: the offset is out of reach.
    pytest.param([9, 8, 6], [5, 8, 6], 0, 7, False, False, id="shift-4-trailing-keys"),
    # Different lengths, an empty query and an empty key sequence: one call per sequence.
    pytest.param([17, 1, 0, 40, 25, 9], [17, 30, 5, 12, 25, 0], 3, 0, False, False, id="mixed"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("len_q,len_k,extra_q,extra_k,per_seq,fits", VARLEN_ALIBI_CASES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2))])
@pytest.mark.parametrize("cap", [0.0, 2.5])
def test_flash_attn_varlen_alibi(
    rng, dtype, len_q, len_k, extra_q, extra_k, per_seq, fits, causal, window, cap
):
    """ALiBi distances within each sequence (bottom-right aligned per sequence), with softcap,
    GQA, masks; whichever of the one-call and per-sequence paths the offsets allow."""
    len_q, len_k = np.array(len_q), np.array(len_k)
    cu_q, cu_k = random_cu_seqlens(rng, len_q), random_cu_seqlens(rng, len_k)
    heads, heads_k, d = 4, 2, 16
    q = make(rng, (cu_q[-1] + extra_q, heads, d), dtype)
    k = make(rng, (cu_k[-1] + extra_k, heads_k, d), dtype)
    v = make(rng, (cu_k[-1] + extra_k, heads_k, d), dtype)
    slopes = fa_slopes(rng, len_q.size, heads) if per_seq else fa_slopes(rng, heads)
    assert (_packed_alibi_positions(cu_q, cu_k, q.shape[0], k.shape[0]) is not None) == fits
    kwargs = {"causal": causal, "window_size": window, "softcap": cap, "alibi_slopes": slopes}
    out, lse = flashcte.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        int(len_q.max()),
        int(len_k.max()),
        return_softmax_lse=True,
        **kwargs,
    )
    ref_out, ref_lse = flash_attn_varlen_ref(q, k, v, cu_q, cu_k, **kwargs)
    assert out.shape == q.shape and lse.shape == (heads, q.shape[0])
    assert_close(out, ref_out, dtype)
    assert_stat_close(lse, ref_lse, dtype, "lse")
    if extra_q:
        assert np.all(out[-extra_q:].astype(np.float32) == 0)
        assert np.all(lse[:, -extra_q:] == -np.inf)


def test_packed_alibi_positions():
    def fit(cu_q, cu_k, total_q, total_k):
        return _packed_alibi_positions(np.array(cu_q), np.array(cu_k), total_q, total_k)

    assert fit([0, 4, 9], [0, 4, 9], 9, 9) == (0, False)
    assert fit([0, 4, 9], [0, 6, 11], 12, 11) == (2, False)
    # c = -3 with total_k - total_q = -5: bottom_right (offset -5) plus cp_offset 2.
    assert fit([0, 7, 12], [0, 4, 9], 14, 9) == (2, True)
    assert fit([0, 7, 12], [0, 4, 9], 12, 10) is None  # -3 < -2: out of reach
    assert fit([0, 4, 9], [0, 5, 9], 9, 9) is None  # shifts 1 then 0
    # Sequences without queries or without keys do not constrain the offset.
    assert fit([0, 4, 4, 9], [0, 4, 8, 9], 9, 9) == (0, False)
    assert fit([0, 4, 6, 9], [0, 4, 4, 9], 9, 9) == (0, False)


def test_varlen_softcap_single_call(rng):
    """softcap alone keeps varlen's one packed call and matches the batched function."""
    batch, s, heads, d = 3, 21, 4, 16
    q = make(rng, (batch, s, heads, d), "float32")
    k = make(rng, (batch, s, 2, d), "float32")
    v = make(rng, (batch, s, 2, d), "float32")
    cu = np.arange(batch + 1, dtype=np.int32) * s
    for slopes in (None, fa_slopes(rng, heads)):
        a = flashcte.flash_attn_func(q, k, v, causal=True, softcap=2.0, alibi_slopes=slopes)
        b = flashcte.flash_attn_varlen_func(
            q.reshape(-1, heads, d),
            k.reshape(-1, 2, d),
            v.reshape(-1, 2, d),
            cu,
            cu,
            s,
            s,
            causal=True,
            softcap=2.0,
            alibi_slopes=slopes,
        )
        assert_close(b.reshape(a.shape), a, "float32", rtol=1e-6)


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


def test_varlen_checks_slopes_without_sequences_and_max_seqlen_over_pages(rng):
    """Found by test_fuzz_serving.py: a NaN ALiBi slope passed when the batch held no sequence
    (checked after broadcasting to an empty (0, heads)); an empty query_start_loc with (heads,)
    slopes raised numpy's broadcast error; with block_table, max_seqlen_* went unchecked."""
    none = np.zeros((0, 2, 8), np.float32)
    nan_slope = np.array([0.5, np.nan], np.float32)
    with pytest.raises(ValueError, match="alibi_slopes: entry head = 1 is not finite"):
        flashcte.flash_attn_varlen_func(
            none, none, none, np.array([0], np.int32), np.array([0], np.int32), 0, 0,
            alibi_slopes=nan_slope,
        )
    pages = np.zeros((1, 2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="alibi_slopes: entry head = 1 is not finite"):
        flashcte.paged_attention(
            none, pages, pages, np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
            np.array([0], np.int32), 0.3, alibi_slopes=nan_slope,
        )
    with pytest.raises(ValueError, match="cu_seqlens_q|query_start_loc"):
        flashcte.paged_attention(
            none, pages, pages, np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
            np.zeros(0, np.int32), 0.3, alibi_slopes=np.ones(2, np.float32),
        )
    q = make(rng, (5, 1, 8), "float32")
    kv = make(rng, (2, 4, 1, 8), "float32")
    args = (q, kv, kv, np.array([0, 5], np.int32))
    table, used = np.array([[0, 1]], np.int32), np.array([6], np.int32)
    for max_q, max_k, name in ((4, 6, "max_seqlen_q"), (5, 5, "max_seqlen_k")):
        with pytest.raises(ValueError, match=f"{name}: {max_q if name[-1] == 'q' else max_k} is"):
            flashcte.flash_attn_varlen_func(
                *args, None, max_q, max_k, block_table=table, seqused_k=used
            )
    with pytest.raises(TypeError, match="max_seqlen_k: expected an int"):
        flashcte.flash_attn_varlen_func(*args, None, 5, None, block_table=table, seqused_k=used)
    flashcte.flash_attn_varlen_func(*args, None, 5, 6, block_table=table, seqused_k=used)


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
    # Named by FlashAttention's argument names (found by test_fuzz_serving.py: None raised int()'s
    # own TypeError, a NaN scale attention_cte's "scale: must be finite").
    with pytest.raises(TypeError, match="max_seqlen_q: expected an int, got NoneType"):
        flashcte.flash_attn_varlen_func(q, q, q, cu, cu, None, 6)
    with pytest.raises(TypeError, match="max_seqlen_k: expected an int, got float"):
        flashcte.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6.0)
    for scale in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softmax_scale: must be finite"):
            flashcte.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, softmax_scale=scale)
        with pytest.raises(ValueError, match="softmax_scale: must be finite"):
            flashcte.flash_attn_func(q[None], q[None], q[None], softmax_scale=scale)
    np.testing.assert_array_equal(
        flashcte.flash_attn_varlen_func(q, q, q, cu, cu, np.int32(6), np.int64(6)),
        flashcte.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6),
    )
