"""flashcte.integrations.flash_attn: FlashAttention 2.6+'s private ``_flash_attn_forward`` /
``_flash_attn_varlen_forward`` on flashcte, and the ``flash_attn`` modules ``install()`` puts in
sys.modules.

The forwards are checked against a float64 softmax (out within the suite's fp32 rule, 2e-5 of
the largest |out|; lse within 1e-5 of max(|lse|, 1)). With ring-flash-attention installed
(``pip install --no-deps ring-flash-attn``; python/run_tests.sh does), its own
``ring_flash_attn_func`` and ``zigzag_ring_flash_attn_func`` run unchanged on 2 and 3 spawned gloo
ranks over the shim and must equal the single-process flashcte call within test_distributed.py's
rule. ring-flash-attn 0.1.8's package ``__init__`` imports its Hugging Face adapter, which needs a
transformers with ``is_flash_attn_greater_or_equal_2_10`` (gone in transformers 5,
zhuzilin/ring-flash-attention#88): when that import fails, the ranks load the ring modules
themselves without the package ``__init__``; the modules' code is unchanged either way.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import _ranks  # python/tests/_ranks.py: the spawned ranks
import flashcte
import flashcte.integrations.flash_attn as fa
from conftest import check_close

# ---- the forwards, single process ---------------------------------------------------------------


def reference(q, k, v, scale, causal, window=(-1, -1), softcap=0.0):
    """float64 attention in FlashAttention's layout; causal and windows bottom-right aligned."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[1], k.shape[1]
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, -torch.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def assert_close(got, ref, what, lse=False, rtol=None):
    rtol = (1e-5 if lse else 2e-5) if rtol is None else rtol
    check_close(got, ref, rtol=rtol, floor=1.0 if lse else 0.0, what=what)


@pytest.mark.parametrize(
    "causal, left, right, softcap",
    [(False, -1, -1, 0.0), (True, -1, -1, 0.0), (True, 5, -1, 0.0), (False, 4, 3, 2.5)],
)
def test_forward_matches_float64(causal, left, right, softcap):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 19, 4, 16, generator=g)
    k, v = torch.randn(2, 23, 2, 16, generator=g), torch.randn(2, 23, 2, 16, generator=g)
    out, lse, s_dmask, rng_state = fa._flash_attn_forward(
        q, k, v, 0.0, 0.3, causal, left, right, softcap, None, False
    )
    assert s_dmask is None and rng_state is None
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ref, ref_lse = reference(q, k, v, 0.3, causal, (left, right), softcap)
    assert_close(out, ref, "out")
    assert_close(lse, ref_lse, "lse", lse=True)  # (batch, heads, seqlen_q)


def test_forward_bfloat16_and_default_scale():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 12, 2, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    out, lse, _, _ = fa._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
    ref, ref_lse = reference(q, k, v, 32**-0.5, True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close(out, ref, "out", rtol=2e-2)
    assert_close(lse, ref_lse, "lse", lse=True)


def test_varlen_forward_matches_float64_per_sequence():
    g = torch.Generator().manual_seed(3)
    cu_q = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 16, 27], dtype=torch.int32)
    q = torch.randn(17, 4, 8, generator=g)
    k, v = torch.randn(27, 2, 8, generator=g), torch.randn(27, 2, 8, generator=g)
    out, lse, _, _ = fa._flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, 9, 11, 0.0, 0.5, True, window_size_left=6
    )
    assert lse.shape == (4, 17)  # (heads, total_q), FlashAttention 2.6+
    for s in range(3):
        qs = q[cu_q[s] : cu_q[s + 1]][None]
        ks, vs = k[cu_k[s] : cu_k[s + 1]][None], v[cu_k[s] : cu_k[s + 1]][None]
        ref, ref_lse = reference(qs, ks, vs, 0.5, True, (6, -1))
        assert_close(out[cu_q[s] : cu_q[s + 1]], ref[0], f"out of sequence {s}")
        assert_close(lse[:, cu_q[s] : cu_q[s + 1]], ref_lse[0], f"lse of {s}", lse=True)


def test_signatures_are_flash_attn_2_6s():
    # What callers introspect (ring-flash-attention's get_default_args uses getfullargspec).
    assert inspect.getfullargspec(fa._flash_attn_forward).args == [
        "q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left",
        "window_size_right", "softcap", "alibi_slopes", "return_softmax",
    ]  # fmt: skip
    args = inspect.getfullargspec(fa._flash_attn_varlen_forward).args
    assert args[:10] == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
        "dropout_p", "softmax_scale", "causal",
    ]  # fmt: skip
    assert "window_size" not in args and "window_size_left" in args


def test_forward_only_errors():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match="dropout_p: flashcte computes"):
        fa._flash_attn_forward(q, q, q, 0.1, None, False)
    with pytest.raises(NotImplementedError, match="return_softmax: flashcte does not"):
        fa._flash_attn_forward(q, q, q, 0.0, None, False, return_softmax=True)
    with pytest.raises(NotImplementedError, match="forward only"):
        fa._flash_attn_backward(q, q, q, q, q, q, q, q, q, 0.0, 1.0, False)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="leftpad_k: left-padded"):
        fa._flash_attn_varlen_forward(
            q[0], q[0], q[0], cu, cu, 4, 4, 0.0, None, False, leftpad_k=cu
        )
    with pytest.raises(ValueError, match="v: has 2 heads"):  # the library's checks still apply
        fa._flash_attn_forward(q, torch.zeros(1, 4, 3, 8), q, 0.0, None, False)


def test_varlen_forward_over_pages():
    """block_table and seqused_k reach the mixed batch: each sequence as flash_attn_with_kvcache
    computes it alone."""
    gen = torch.Generator().manual_seed(0)
    pool_k, pool_v = (torch.randn(6, 4, 2, 8, generator=gen) for _ in range(2))
    table = torch.tensor([[3, 0], [5, 1]], dtype=torch.int32)
    used = torch.tensor([6, 3], dtype=torch.int32)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    q = torch.randn(4, 4, 8, generator=gen)
    out, lse, _, _ = fa._flash_attn_varlen_forward(
        q, pool_k, pool_v, cu, None, 3, 6, 0.0, None, True, block_table=table, seqused_k=used
    )
    for s, rows in ((0, slice(0, 1)), (1, slice(1, 4))):
        want, want_lse = fa.flash_attn_with_kvcache(
            q[None, rows], pool_k, pool_v, cache_seqlens=used[s : s + 1],
            block_table=table[s : s + 1], causal=True, return_softmax_lse=True,
        )
        assert torch.equal(out[rows], want[0]) and torch.equal(lse[:, rows], want_lse[0])


def test_install_and_restore():
    saved = {n: sys.modules.get(n) for n in ("flash_attn", "flash_attn.flash_attn_interface")}
    try:
        for n in saved:
            sys.modules.pop(n, None)
        with fa.install():
            import flash_attn
            from flash_attn.flash_attn_interface import _flash_attn_forward

            assert _flash_attn_forward is fa._flash_attn_forward
            assert flash_attn.flash_attn_func is flashcte.flash_attn_func
            assert flash_attn.__version__ == "2.6.3+flashcte"
            assert importlib.import_module("flash_attn.flash_attn_interface").__flashcte__
        assert "flash_attn" not in sys.modules
        sys.modules["flash_attn"] = types.ModuleType("flash_attn")  # "the real one"
        with pytest.raises(RuntimeError, match="replace: flash_attn is already imported"):
            fa.install()
        with fa.install(replace=True):
            assert sys.modules["flash_attn"].__flashcte__
        assert not hasattr(sys.modules["flash_attn"], "__flashcte__")
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


# ---- ring-flash-attention, unchanged, on 2 and 3 gloo ranks -------------------------------------

HAVE_RING = importlib.util.find_spec("ring_flash_attn") is not None
WORLD = 3


_RING: list = []


def _ring_modules():
    """ring-flash-attention's ring and zigzag functions, imported over the shim (once)."""
    if not _RING:
        _RING.extend(_import_ring())
    return _RING


def _import_ring():
    fa.install(replace=True)
    try:
        import ring_flash_attn as rfa

        return rfa.ring_flash_attn_func, rfa.zigzag_ring_flash_attn_func
    except ImportError:  # its Hugging Face adapter on transformers 5 (see the module docstring)
        for name in [m for m in sys.modules if m.split(".")[0] == "ring_flash_attn"]:
            del sys.modules[name]
        spec = importlib.util.find_spec("ring_flash_attn")
        package = types.ModuleType("ring_flash_attn")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["ring_flash_attn"] = package
        ring = importlib.import_module("ring_flash_attn.ring_flash_attn")
        zigzag = importlib.import_module("ring_flash_attn.zigzag_ring_flash_attn")
        return ring.ring_flash_attn_func, zigzag.zigzag_ring_flash_attn_func


def _ring_cases(rank, p, group):
    from flashcte import distributed as fd

    ring, zigzag = _ring_modules()
    g = torch.Generator().manual_seed(7)
    s = 12 * p
    q = torch.randn(2, s, 4, 16, generator=g)
    k, v = torch.randn(2, s, 2, 16, generator=g), torch.randn(2, s, 2, 16, generator=g)
    for causal in (False, True):
        ref, ref_lse = flashcte.flash_attn_func(
            q, k, v, softmax_scale=0.3, causal=causal, return_softmax_lse=True
        )
        rows = slice(rank * s // p, (rank + 1) * s // p)
        with torch.no_grad():
            out, lse, _ = ring(
                *(t[:, rows].contiguous() for t in (q, k, v)),
                softmax_scale=0.3,
                causal=causal,
                return_attn_probs=True,
                group=group,
            )
        _check(out, ref[:, rows], p, f"ring causal={causal} out")
        _check(lse, ref_lse[:, :, rows], p, f"ring causal={causal} lse", lse=True)
    with torch.no_grad():
        out, lse, _ = zigzag(
            *(fd.shard(t, rank, p, "zigzag") for t in (q, k, v)),
            softmax_scale=0.3,
            causal=True,
            return_attn_probs=True,
            group=group,
        )
    _check(out, fd.shard(ref, rank, p, "zigzag"), p, "zigzag out")
    _check(lse, fd.shard(ref_lse, rank, p, "zigzag", dim=2), p, "zigzag lse", lse=True)


def _check(got, ref, p, what, lse=False):
    """test_distributed.py's rule: 1e-5 plus P merges' 4e-7 of the largest |ref|."""
    check_close(got, ref, rtol=1e-5 + p * 4e-7, floor=1.0 if lse else 0.0, what=what)


CASES = {"ring": (_ring_cases, (2, 3))}


@pytest.fixture(scope="module")
def ring_results():
    if not HAVE_RING:
        pytest.skip("ring-flash-attn is not installed (pip install --no-deps ring-flash-attn)")
    return _ranks.spawn(__name__, WORLD, 240.0)


@pytest.mark.parametrize("key", _ranks.case_keys(CASES, absent_rank=False))
def test_ring_flash_attention_runs_unchanged_on_flashcte(ring_results, key):
    _ranks.check(ring_results, key)


def test_shim_values_are_numpy_friendly():
    # numpy in, numpy out, like flashcte.flash_attn_func
    q = np.random.default_rng(0).standard_normal((1, 6, 2, 8)).astype(np.float32)
    out, lse, _, _ = fa._flash_attn_forward(q, q, q, 0.0, None, True)
    assert isinstance(out, np.ndarray) and lse.shape == (1, 2, 6)
    ref, ref_lse = reference(*(torch.from_numpy(q) for _ in range(3)), 8**-0.5, True)
    assert_close(torch.from_numpy(out), ref, "out")
    assert_close(torch.from_numpy(lse), ref_lse, "lse", lse=True)
