"""flashcte.distributed with real processes: torch.multiprocessing spawns 4 ranks once for the
module (gloo over loopback, 127.0.0.1 and a free port), which build process groups of 2, 3 and 4
ranks and run every case on each group size it names; each rank checks its rows against the
single-process call on the whole sequence (the same seeded tensors on every rank) and reports to
a JSON file the parent reads. One spawn for the module because a process that imports torch
costs ~2 s of CPU on this 2-core machine; the cases themselves are small.

Tolerances: float32 within ``1e-5 * max|ref|`` (the suite's rule, conftest.OUT_RTOL is 2e-5 for
the kernel against float64; here both sides are the kernel) plus what the merges add: a ring
result goes through up to P merges of a few float32 roundings each (tests/merge_test.cc bounds a
merge by 6 * 2^-24 of the larger side), so ``P * 4e-7 * max|ref|`` more; lse likewise on
``max(|lse|, 1)``. 16-bit inputs: each block's output is rounded to the dtype before its merge,
one rounding (2^-8 for bfloat16) more than the single call: the Neuron suite's 2e-2.

Failures: bad arguments on one rank, arguments that differ between ranks, lengths a split cannot
balance and a failure while computing must raise on every rank with the failing rank's message;
a rank that never calls must make the others raise after the timeout instead of hanging.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import _ranks  # python/tests/_ranks.py: the spawned ranks
import flashcte
from conftest import check_close, max_abs_err
from flashcte import distributed as fd

WORLD = 4
WAIT = 30.0  # seconds: every collective's timeout in the cases
SPAWN_DEADLINE = 300.0  # seconds for the whole module's processes

# ---- the cases ---------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def _uneven(seqlen: int, n: int, seed: int) -> list[int]:
    """Deterministic uneven positive lengths summing to seqlen."""
    rng = np.random.default_rng(seed + n)
    cuts = np.sort(rng.choice(np.arange(1, seqlen), n - 1, replace=False))
    return list(np.diff(np.concatenate([[0], cuts, [seqlen]])).astype(int))


def _assert_close(got, ref, p: int, what: str, rtol: float = 1e-5, dtype=torch.float32):
    if dtype != torch.float32:
        rtol = 2e-2
    floor = 1.0 if what == "lse" else 0.0
    check_close(got, ref, rtol=rtol + p * 4e-7, floor=floor, what=f"{what} (P={p})")


def _local_rows(lengths, rank, layout):
    return torch.from_numpy(fd.positions(lengths, rank, layout))


def cp_case(seqlen, layout, uneven=False, dtype=torch.float32, **kw):
    """cp_attention_cte against flashcte.attention_cte on the whole sequence."""

    def run(rank, p, group):
        g = _gen(seqlen)
        bs, bs_kv, d = 4, 2, 24
        q = _randn(g, bs, seqlen, d, dtype=dtype)
        k = _randn(g, bs_kv, seqlen, d, dtype=dtype)  # tp_k layout
        v = _randn(g, bs_kv, seqlen, d, dtype=dtype)
        extra = dict(kw)
        prior = extra.pop("prior", None)
        if prior:
            extra["k_prior"] = _randn(g, bs_kv, prior, d, dtype=dtype)
            extra["v_prior"] = _randn(g, bs_kv, prior, d, dtype=dtype)
        if extra.pop("sink", False):
            extra["sink"] = 2.0 * _randn(g, bs, 1)
        tp_k = extra.pop("tp_k", False)
        if not tp_k and "k_prior" in extra:
            extra["k_prior"] = extra["k_prior"].transpose(1, 2).contiguous()
        kk = k if tp_k else k.transpose(1, 2).contiguous()  # (bs_kv, d, S) without tp_k
        ref = flashcte.attention_cte(q, kk, v, tp_k=tp_k, num_threads=1, **extra)
        lengths = _uneven(seqlen, p, seqlen) if uneven else fd.split_lengths(seqlen, p, layout)
        rows = _local_rows(lengths, rank, layout)
        k_local = k[:, rows] if tp_k else k[:, rows].transpose(1, 2)
        got = fd.cp_attention_cte(
            q[:, rows],
            k_local,
            v[:, rows],
            tp_k=tp_k,
            strided=layout == "strided",
            group=group,
            timeout=WAIT,
            num_threads=1,
            **extra,
        )
        _assert_close(got, ref[:, rows], p, "out", dtype=dtype)

    return run


def fa_case(fn, layout, seqlen, uneven=False, dtype=torch.float32, **kw):
    """A FlashAttention-layout distributed function against flashcte.flash_attn_func."""

    def run(rank, p, group):
        n = seqlen(p) if callable(seqlen) else seqlen
        g = _gen(n + 1000)
        b, h, hk, d = 2, 4, 2, 16
        q = _randn(g, b, n, h, d, dtype=dtype)
        k = _randn(g, b, n, hk, d, dtype=dtype)
        v = _randn(g, b, n, hk, d, dtype=dtype)
        ref, ref_lse = flashcte.flash_attn_func(
            q, k, v, return_softmax_lse=True, num_threads=1, **kw
        )
        lengths = _uneven(n, p, n) if uneven else fd.split_lengths(n, p, layout)
        rows = _local_rows(lengths, rank, layout)
        extra = {"layout": layout} if fn is fd.allgather_flash_attn_func else {}
        out, lse, none = fn(
            q[:, rows],
            k[:, rows],
            v[:, rows],
            return_attn_probs=True,
            group=group,
            timeout=WAIT,
            num_threads=1,
            **extra,
            **kw,
        )
        # return_attn_probs=False: out alone, the same values. (Every collective call of a case
        # comes before its first assertion, so a failed check cannot leave the ranks out of step.)
        again = None
        if kw.get("causal"):
            again = fn(
                q[:, rows],
                k[:, rows],
                v[:, rows],
                group=group,
                timeout=WAIT,
                num_threads=1,
                **extra,
                **kw,
            )
        assert none is None
        assert out.dtype == dtype and lse.dtype == torch.float32
        _assert_close(out, ref[:, rows], p, "out", dtype=dtype)
        _assert_close(lse, ref_lse[:, :, rows], p, "lse")
        assert again is None or torch.equal(again, out)

    return run


def _expect_everywhere(exc_type, *needles):
    """A check that its call raises exc_type naming every needle (_ranks.raises)."""
    return lambda call: _ranks.raises(exc_type, call, *needles)


def bad_heads_on_one_rank(rank, p, group):
    g = _gen(1)
    q = _randn(g, 1, 6, 4, 8)
    k = _randn(g, 1, 6, 3 if rank == 1 else 2, 8)
    _expect_everywhere(ValueError, "rank 1: ArgumentError: k: 3 heads must divide q's 4 heads")(
        lambda: fd.ring_flash_attn_func(q, k, k, causal=True, group=group, timeout=WAIT)
    )


def different_scale_across_ranks(rank, p, group):
    g = _gen(2)
    q = _randn(g, 1, 6, 2, 8)
    _expect_everywhere(ValueError, "every rank must pass the same softmax_scale", "rank 0 has 0.5")(
        lambda: fd.zigzag_ring_flash_attn_func(
            q, q, q, softmax_scale=0.5 + (rank == p - 1), group=group, timeout=WAIT
        )
    )


def zigzag_lengths_that_do_not_balance(rank, p, group):
    g = _gen(3)
    n = 6 if rank == 0 else 8
    q = _randn(g, 1, n, 2, 8)
    _expect_everywhere(ValueError, "zigzag split needs the same even local_seqlen")(
        lambda: fd.zigzag_ring_flash_attn_func(q, q, q, causal=True, group=group, timeout=WAIT)
    )


def strided_lengths_that_are_not_strided(rank, p, group):
    g = _gen(4)
    n = 3 if rank == 0 else 5
    q = _randn(g, 2, n, 8)
    _expect_everywhere(ValueError, "a strided split of")(
        lambda: fd.cp_attention_cte(
            q, q.transpose(1, 2), q, strided=True, group=group, timeout=WAIT
        )
    )


def failure_while_computing(rank, p, group):
    # A bad num_threads passes every check before the kernel, which rejects it on the last rank
    # only, in the middle of the ring: every rank raises after the ring's communication.
    g = _gen(5)
    q = _randn(g, 1, 6, 2, 8)
    _expect_everywhere(ValueError, f"rank {p - 1}: ArgumentError: num_threads: must be >= 0")(
        lambda: fd.ring_flash_attn_func(
            q, q, q, group=group, timeout=WAIT, num_threads=-1 if rank == p - 1 else 1
        )
    )
    x = q[:, :, 0]  # (1, 6, 8): attention_cte's (bs, Sq, d)
    _expect_everywhere(ValueError, f"rank {p - 1}: ArgumentError: num_threads: must be >= 0")(
        lambda: fd.cp_attention_cte(
            x,
            x.transpose(1, 2),
            x,
            group=group,
            timeout=WAIT,
            num_threads=-1 if rank == p - 1 else 1,
        )
    )


def not_a_torch_tensor_on_one_rank(rank, p, group):
    g = _gen(6)
    q = _randn(g, 2, 5, 8)
    qq = q.numpy() if rank == 0 else q
    _expect_everywhere(TypeError, "rank 0: ArgumentTypeError: q: flashcte.distributed takes torch tensors")(
        lambda: fd.cp_attention_cte(qq, q.transpose(1, 2), q, group=group, timeout=WAIT)
    )


CASES = {
    # all-gather CP in attention_cte's layout (heads folded into bs; GQA 4:2)
    "cp_contiguous_causal_uneven": (cp_case(37, "contiguous", uneven=True, scale=0.3), (2, 3, 4)),
    "cp_strided_causal": (cp_case(37, "strided", scale=0.3), (2, 3, 4)),
    "cp_contiguous_window_sink": (
        cp_case(41, "contiguous", uneven=True, sliding_window=7, sink=True, scale=0.5),
        (2, 3, 4),
    ),
    "cp_strided_prefix_window_sink": (
        cp_case(29, "strided", prior=11, prior_used_len=7, sliding_window=9, sink=True, scale=0.4),
        (2, 3, 4),
    ),
    "cp_tp_k_noncausal_prefix": (
        cp_case(33, "contiguous", uneven=True, tp_k=True, causal_mask=False, prior=5, scale=0.2),
        (2, 4),
    ),
    "cp_strided_bf16": (cp_case(40, "strided", dtype=torch.bfloat16, scale=0.25), (2, 3)),
    # ring attention, FlashAttention layout (GQA 4:2)
    "ring_noncausal_uneven": (
        fa_case(fd.ring_flash_attn_func, "contiguous", 45, uneven=True),
        (2, 3, 4),
    ),
    "ring_causal_uneven": (
        fa_case(fd.ring_flash_attn_func, "contiguous", 45, uneven=True, causal=True),
        (2, 3, 4),
    ),
    "ring_window_uneven": (
        fa_case(fd.ring_flash_attn_func, "contiguous", 45, uneven=True, window_size=(5, 3)),
        (2, 3, 4),
    ),
    "ring_causal_window": (
        fa_case(fd.ring_flash_attn_func, "contiguous", 40, causal=True, window_size=(6, -1)),
        (2, 3, 4),
    ),
    "ring_causal_bf16": (
        fa_case(fd.ring_flash_attn_func, "contiguous", 36, causal=True, dtype=torch.bfloat16),
        (2, 3),
    ),
    "zigzag_causal": (
        fa_case(fd.zigzag_ring_flash_attn_func, "zigzag", lambda p: 10 * p, causal=True),
        (2, 3, 4),
    ),
    "zigzag_causal_window": (
        fa_case(
            fd.zigzag_ring_flash_attn_func,
            "zigzag",
            lambda p: 12 * p,
            causal=True,
            window_size=(7, 0),
            softmax_scale=0.2,
        ),
        (2, 3, 4),
    ),
    "zigzag_noncausal": (
        fa_case(fd.zigzag_ring_flash_attn_func, "zigzag", lambda p: 8 * p),
        (2, 4),
    ),
    "stripe_causal": (fa_case(fd.stripe_flash_attn_func, "strided", 43, causal=True), (2, 3, 4)),
    "allgather_fa_contiguous_causal": (
        fa_case(fd.allgather_flash_attn_func, "contiguous", 39, uneven=True, causal=True),
        (2, 3, 4),
    ),
    "allgather_fa_strided_window": (
        fa_case(fd.allgather_flash_attn_func, "strided", 39, causal=True, window_size=(8, 0)),
        (2, 3, 4),
    ),
    "allgather_fa_zigzag_causal": (
        fa_case(fd.allgather_flash_attn_func, "zigzag", lambda p: 6 * p, causal=True),
        (2, 3),
    ),
    # failures raise on every rank
    "error_bad_heads_on_one_rank": (bad_heads_on_one_rank, (2, 3)),
    "error_different_scale_across_ranks": (different_scale_across_ranks, (2, 3)),
    "error_zigzag_lengths": (zigzag_lengths_that_do_not_balance, (2,)),
    "error_strided_lengths": (strided_lengths_that_are_not_strided, (2, 3)),
    "error_failure_while_computing": (failure_while_computing, (2, 3)),
    "error_not_a_torch_tensor": (not_a_torch_tensor_on_one_rank, (2,)),
}


def _absent_rank(rank, group):
    """Rank 1 never calls: rank 0 raises after its 2 s timeout."""
    if rank != 0:
        return
    q = torch.ones(1, 4, 2, 8)
    _ranks.raises_in_time(
        lambda: fd.ring_flash_attn_func(q, q, q, group=group, timeout=2.0),
        "did not complete within 2 s",
        "a peer did not take part",
    )


# ---- the processes -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results():
    return _ranks.spawn(__name__, WORLD, SPAWN_DEADLINE)


@pytest.mark.parametrize("key", _ranks.case_keys(CASES, absent_rank=True))
def test_distributed(results, key):
    _ranks.check(results, key)


# ---- single process ----------------------------------------------------------------------------


def test_merge_matches_float64_in_both_layouts():
    rng = np.random.default_rng(0)
    b, s, h, dv = 2, 9, 3, 5
    oa = rng.standard_normal((b, s, h, dv)).astype(np.float32)
    ob = rng.standard_normal((b, s, h, dv)).astype(np.float32)
    la = (5 * rng.standard_normal((b, h, s))).astype(np.float32)
    lb = (5 * rng.standard_normal((b, h, s))).astype(np.float32)
    la[0, 0, :3] = -np.inf
    lb[0, 0, 2:5] = -np.inf
    oa[0, :3, 0] = 0
    ob[0, 2:5, 0] = 0
    m = np.maximum(la, lb).astype(np.float64)
    m[~np.isfinite(m)] = 0
    with np.errstate(divide="ignore", invalid="ignore"):  # rows empty on both sides
        lse = m + np.log(np.exp(la - m) + np.exp(lb - m))
        wa = np.nan_to_num(np.exp(la - lse)).transpose(0, 2, 1)[..., None]
        wb = np.nan_to_num(np.exp(lb - lse)).transpose(0, 2, 1)[..., None]
    ref = wa * oa + wb * ob
    for kind in ("numpy", "torch"):
        conv = (lambda x: x) if kind == "numpy" else torch.from_numpy
        out, got_lse = fd.merge_attn_states(conv(oa), conv(la), conv(ob), conv(lb))
        out, got_lse = np.asarray(out), np.asarray(got_lse)
        assert np.all(np.isneginf(got_lse[0, 0, 2:3])) and np.all(out[0, 2:3, 0] == 0)
        # lse's empty rows (-inf in the reference) must be -inf in got_lse too.
        check_close(got_lse, lse, rtol=3 * 2.0**-24, what=f"{kind} lse")
        assert max_abs_err(out, ref) <= 6 * 2.0**-24 * max(np.abs(oa).max(), np.abs(ob).max())
        # attention_cte layout: the same rows
        flat = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(b * h, s, dv)
        out2, lse2 = fd.merge_attn_states(
            conv(flat(oa)), conv(la.reshape(b * h, s)), conv(flat(ob)), conv(lb.reshape(b * h, s))
        )
        assert np.array_equal(np.asarray(out2), flat(out))
        assert np.array_equal(np.asarray(lse2), got_lse.reshape(b * h, s))


def test_merge_in_place_and_split_attention():
    g = _gen(9)
    q, k, v = _randn(g, 1, 20, 2, 8), _randn(g, 1, 30, 2, 8), _randn(g, 1, 30, 2, 8)
    whole, lse = flashcte.flash_attn_func(q, k, v, return_softmax_lse=True)
    acc, acc_lse = flashcte.flash_attn_func(q, k[:, :7], v[:, :7], return_softmax_lse=True)
    acc = acc.clone()
    for lo, hi in ((7, 19), (19, 30)):
        o, l_ = flashcte.flash_attn_func(q, k[:, lo:hi], v[:, lo:hi], return_softmax_lse=True)
        res = fd.merge_attn_states(acc, acc_lse, o, l_, out=acc, lse=acc_lse)
        assert res[0] is acc and res[1] is acc_lse
    _assert_close(acc, whole, 3, "out")
    _assert_close(acc_lse, lse, 3, "lse")


def test_merge_bad_shapes_and_bfloat16():
    a = torch.zeros(1, 4, 2, 3)
    with pytest.raises(ValueError, match=r"lse_a: shape \(1, 4, 2\) must be"):
        fd.merge_attn_states(a, torch.zeros(1, 4, 2), a, torch.zeros(1, 2, 4))
    ob = torch.randn(1, 4, 2, 3).to(torch.bfloat16)
    lse = torch.zeros(1, 2, 4)
    out, _ = fd.merge_attn_states(a, lse, ob, lse)
    assert out.dtype == torch.float32  # mixed dtypes: float32
    assert torch.allclose(out, ob.float() / 2, rtol=0, atol=1e-7)
    out, _ = fd.merge_attn_states(ob, lse, ob, lse)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ob)


def test_shard_round_trip_and_block_mask():
    x = torch.arange(2 * 24).reshape(2, 24)
    for layout in ("contiguous", "strided", "zigzag"):
        parts = [fd.shard(x, r, 3, layout) for r in range(3)]
        assert torch.equal(fd.unshard(parts, layout), x)
    assert fd.split_lengths(10, 4, "strided") == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="multiple of 2"):
        fd.split_lengths(10, 4, "zigzag")
    from flashcte.distributed._ring import block_mask

    ar = lambda a, b: np.arange(a, b, dtype=np.int64)
    assert block_mask(ar(0, 4), ar(4, 8), -1, 0) is None  # causal: future block
    assert block_mask(ar(4, 8), ar(0, 4), -1, 0) == {}  # causal: past block, whole
    assert block_mask(ar(4, 8), ar(0, 4), 2, 0)["cp_offset"] == 4
    m = block_mask(ar(0, 4), ar(2, 6), 3, 3)  # keys after the queries: bounds
    assert m["bound_min"].tolist() == [0, 0, 0, 0] and m["bound_max"].tolist() == [2, 3, 4, 4]


def test_collectives_need_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.ring_flash_attn_func(q, q, q)
