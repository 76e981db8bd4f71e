"""flashcte.distributed.ulysses_flash_attn_func with real processes, as test_distributed.py:
torch.multiprocessing spawns 4 ranks once for the module (gloo over loopback), which build
process groups of 2, 3 and 4 ranks and run every case on each group size it names; each rank
checks its rows of out and lse against single-process flashcte.flash_attn_func on the whole
sequence (the same seeded tensors on every rank) and reports to a JSON file the parent reads.

Tolerances: test_distributed.py's rule (float32 within ``(1e-5 + P * 4e-7) * max|ref|``, lse on
``max(|lse|, 1)``; 16-bit outputs 2e-2). Ulysses computes each head in one call on the whole
sequence, as the single-process call does, so it has no merges and no extra rounding; the rule
is the same so that the strategies are held to one standard.

Failures: heads the group cannot split, arguments that differ between ranks, bad arguments on one
rank, lengths a split does not produce and a failure while computing must raise on every rank
with the failing rank's message; a rank that never calls must make the others raise after the
timeout instead of hanging.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import _ranks  # python/tests/_ranks.py: the spawned ranks
import flashcte
from conftest import check_close
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


def _assert_close(got, ref, p: int, what: str, dtype=torch.float32) -> float:
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    floor = 1.0 if what == "lse" else 0.0
    return check_close(got, ref, rtol=rtol + p * 4e-7, floor=floor, what=f"{what} (P={p})")


def case(heads, seqlen, layout="contiguous", uneven=False, dtype=torch.float32, **kw):
    """ulysses_flash_attn_func against flashcte.flash_attn_func on the whole sequence.
    ``heads(p)`` gives (heads, heads_k) for the group size, ``seqlen`` an int or ``seqlen(p)``."""

    def run(rank, p, group):
        h, hk = heads(p)
        n = seqlen(p) if callable(seqlen) else seqlen
        g = _gen(1000 * h + 10 * hk + n)
        b, d = 2, 16
        q = _randn(g, b, n, h, d, dtype=dtype)
        k = _randn(g, b, n, hk, d, dtype=dtype)
        v = _randn(g, b, n, hk, d, dtype=dtype)
        ref, ref_lse = flashcte.flash_attn_func(
            q, k, v, return_softmax_lse=True, num_threads=1, **kw
        )
        lengths = _uneven(n, p, n) if uneven else fd.split_lengths(n, p, layout)
        rows = torch.from_numpy(fd.positions(lengths, rank, layout))
        args = (q[:, rows], k[:, rows], v[:, rows])
        opts = dict(group=group, layout=layout, timeout=WAIT, num_threads=1, **kw)
        out, lse, none = fd.ulysses_flash_attn_func(*args, return_attn_probs=True, **opts)
        # return_attn_probs=False: out alone (no lse on the way back), the same values. Every
        # collective call of a case comes before its first assertion, so a failed check cannot
        # leave the ranks out of step.
        alone = fd.ulysses_flash_attn_func(*args, **opts)
        assert none is None
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert alone.dtype == dtype and torch.equal(alone, out)
        return max(
            _assert_close(out, ref[:, rows], p, "out", dtype=dtype),
            _assert_close(lse, ref_lse[:, :, rows], p, "lse"),
        )

    return run


_raises_everywhere = _ranks.raises


def heads_not_divisible(rank, p, group):
    # 8 heads over 3 ranks: every rank refuses the same way.
    q = _randn(_gen(1), 1, 5, 8, 8)
    _raises_everywhere(
        ValueError,
        lambda: fd.ulysses_flash_attn_func(q, q, q, causal=True, group=group, timeout=WAIT),
        f"{p} of {p} ranks failed",
        "q: 8 heads are not divisible by the group size 3",
    )


def kv_heads_not_splittable(rank, p, group):
    # 12 query heads, 6 KV heads over 4 ranks: 6 % 4 and 4 % 6 are both nonzero.
    g = _gen(2)
    q, kv = _randn(g, 1, 5, 12, 8), _randn(g, 1, 5, 6, 8)
    _raises_everywhere(
        ValueError,
        lambda: fd.ulysses_flash_attn_func(q, kv, kv, group=group, timeout=WAIT),
        "k: 6 KV heads cannot be split over 4 ranks",
    )


def heads_differ_across_ranks(rank, p, group):
    g = _gen(3)
    h = 8 if rank == p - 1 else 4
    q = _randn(g, 1, 6, h, 8)
    _raises_everywhere(
        ValueError,
        lambda: fd.ulysses_flash_attn_func(q, q, q, group=group, timeout=WAIT),
        "every rank must pass the same heads",
        f"rank 0 has 4, rank {p - 1} has 8",
    )


def head_dim_differs_across_ranks(rank, p, group):
    g = _gen(4)
    q = _randn(g, 2, 6, 12, 16 if rank == 1 else 8)
    _raises_everywhere(
        ValueError,
        lambda: fd.ulysses_flash_attn_func(q, q, q, causal=True, group=group, timeout=WAIT),
        "every rank must pass the same head_dim",
        "rank 0 has 8, rank 1 has 16",
    )


def bad_kv_on_one_rank(rank, p, group):
    g = _gen(5)
    q = _randn(g, 1, 6, 12, 8)
    k = _randn(g, 1, 6 if rank != 1 else 5, 6, 8)
    _raises_everywhere(
        ValueError,
        lambda: fd.ulysses_flash_attn_func(q, k, k, group=group, timeout=WAIT),
        "rank 1: ArgumentError: k: shape (1, 5, 6, 8) must hold q's batch 1 and local_seqlen 6",
    )


def numpy_on_one_rank(rank, p, group):
    q = _randn(_gen(6), 1, 6, 4, 8)
    qq = q.numpy() if rank == 0 else q
    _raises_everywhere(
        TypeError,
        lambda: fd.ulysses_flash_attn_func(qq, q, q, group=group, timeout=WAIT),
        "rank 0: ArgumentTypeError: q: flashcte.distributed takes torch tensors",
    )


def strided_lengths_that_are_not_strided(rank, p, group):
    q = _randn(_gen(7), 1, 3 if rank == 0 else 5, 6, 8)
    _raises_everywhere(
        ValueError,
        lambda: fd.ulysses_flash_attn_func(q, q, q, layout="strided", group=group, timeout=WAIT),
        "a strided split of",
    )


def failure_while_computing(rank, p, group):
    # A bad num_threads passes every check before the kernel, which rejects it on the last rank
    # only, between the two all-to-alls: every rank raises after both.
    q = _randn(_gen(8), 1, 6, 6, 8)
    _raises_everywhere(
        ValueError,
        lambda: fd.ulysses_flash_attn_func(
            q, q, q, group=group, timeout=WAIT, num_threads=-1 if rank == p - 1 else 1
        ),
        f"1 of {p} ranks failed",
        f"rank {p - 1}: ArgumentError: num_threads: must be >= 0",
    )


def _by_p(table):
    return lambda p: table[p]


CASES = {
    # heads chosen divisible by every group size; (heads, heads_k) per group size
    "mha_noncausal_uneven": (case(lambda p: (12, 12), 45, uneven=True), (2, 3, 4)),
    "gqa_causal_uneven": (
        case(_by_p({2: (12, 6), 3: (12, 6), 4: (12, 4)}), 45, uneven=True, causal=True),
        (2, 3, 4),
    ),
    # P a multiple of heads_k: each KV head replicated to P / heads_k ranks (MQA at 2 and 3)
    "gqa_replicated_kv_causal": (
        case(_by_p({2: (6, 1), 3: (6, 1), 4: (8, 2)}), 38, uneven=True, causal=True),
        (2, 3, 4),
    ),
    "window_noncausal_uneven": (
        case(lambda p: (12, 4 if p != 3 else 6), 45, uneven=True, window_size=(5, 3)),
        (2, 3, 4),
    ),
    "causal_window_scale": (
        case(
            lambda p: (12, 12),
            40,
            causal=True,
            window_size=(6, -1),
            softmax_scale=0.3,
        ),
        (2, 3, 4),
    ),
    "strided_causal_gqa": (
        case(_by_p({2: (8, 2), 3: (6, 3), 4: (8, 4)}), 43, layout="strided", causal=True),
        (2, 3, 4),
    ),
    "zigzag_causal_window": (
        case(
            lambda p: (12, 12),
            lambda p: 10 * p,
            layout="zigzag",
            causal=True,
            window_size=(7, 0),
        ),
        (2, 3, 4),
    ),
    "bf16_causal_gqa": (
        case(
            _by_p({2: (8, 2), 3: (6, 3), 4: (8, 2)}),
            37,
            uneven=True,
            dtype=torch.bfloat16,
            causal=True,
        ),
        (2, 3, 4),
    ),
    "fp16_noncausal": (case(lambda p: (4, 2), 21, dtype=torch.float16), (2,)),
    # failures raise on every rank
    "error_heads_not_divisible": (heads_not_divisible, (3,)),
    "error_kv_heads_not_splittable": (kv_heads_not_splittable, (4,)),
    "error_heads_differ_across_ranks": (heads_differ_across_ranks, (2, 4)),
    "error_head_dim_differs_across_ranks": (head_dim_differs_across_ranks, (2, 3)),
    "error_bad_kv_on_one_rank": (bad_kv_on_one_rank, (2, 3)),
    "error_numpy_on_one_rank": (numpy_on_one_rank, (2,)),
    "error_strided_lengths": (strided_lengths_that_are_not_strided, (2, 3)),
    "error_failure_while_computing": (failure_while_computing, (2, 3)),
}


def _absent_rank(rank, group):
    """Rank 1 never calls: rank 0 raises after its 2 s timeout."""
    if rank != 0:
        return
    q = torch.ones(1, 4, 2, 8)
    _ranks.raises_in_time(
        lambda: fd.ulysses_flash_attn_func(q, q, q, group=group, timeout=2.0),
        "did not complete within 2 s",
        "a peer did not take part",
    )


# ---- the processes -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results():
    return _ranks.spawn(__name__, WORLD, SPAWN_DEADLINE)


@pytest.mark.parametrize("key", _ranks.case_keys(CASES, absent_rank=True))
def test_ulysses(results, key):
    _ranks.check(results, key)


# ---- single process ----------------------------------------------------------------------------


def test_head_split_rule():
    from flashcte.distributed._ulysses import head_split

    assert head_split(32, 8, 2) == (16, 4)  # KV heads split
    assert head_split(32, 8, 8) == (4, 1)
    assert head_split(32, 8, 16) == (2, 1)  # each KV head on 2 ranks
    assert head_split(6, 1, 3) == (2, 1)  # MQA
    with pytest.raises(ValueError, match="q: 32 heads are not divisible by the group size 64"):
        head_split(32, 8, 64)
    with pytest.raises(ValueError, match="k: 6 KV heads cannot be split over 4 ranks"):
        head_split(12, 6, 4)


def test_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.ulysses_flash_attn_func(q, q, q)
