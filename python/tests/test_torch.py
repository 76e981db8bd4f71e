"""PyTorch interop: tensors in, tensors out, against scaled_dot_product_attention.

Skipped when torch is not importable (it is not a dependency of flashcte or of this suite).
"""

from __future__ import annotations

import flashcte
import numpy as np
import pytest
from conftest import assert_close
from semantics import attention_cte_ref, flash_attn_ref

torch = pytest.importorskip("torch", reason="PyTorch is not installed (optional interop tests)")
F = torch.nn.functional

TORCH_DTYPES = [
    pytest.param(torch.float32, "float32", id="f32"),
    pytest.param(torch.float16, "float16", id="f16"),
    pytest.param(torch.bfloat16, "bfloat16", id="bf16"),
]


def sdpa(q, k, v, causal, scale):
    """(B, H, S, D) reference through torch, in float64; GQA via enable_gqa when available."""
    q, k, v = (t.double() for t in (q, k, v))
    try:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=True
        )
    except TypeError:  # torch < 2.5: no enable_gqa
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


@pytest.mark.parametrize("dtype,name", TORCH_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,heads_k", [(4, 4), (6, 2)])
def test_flash_attn_vs_sdpa(dtype, name, causal, heads, heads_k):
    g = torch.Generator().manual_seed(heads * 10 + heads_k + causal)
    b, s, d = 2, 70, 32
    q = torch.randn(b, s, heads, d, generator=g).to(dtype)
    k = torch.randn(b, s, heads_k, d, generator=g).to(dtype)
    v = torch.randn(b, s, heads_k, d, generator=g).to(dtype)
    out = flashcte.flash_attn_func(q, k, v, causal=causal)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == q.shape
    ref = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, d**-0.5)
    assert_close(out.float().numpy(), ref.transpose(1, 2).numpy(), name)


@pytest.mark.parametrize("dtype,name", TORCH_DTYPES)
def test_attention_cte_vs_sdpa(dtype, name):
    """attention_cte's causal mask is top-left aligned (query i sees keys j <= i), as SDPA's."""
    g = torch.Generator().manual_seed(7)
    bs, bs_kv, sq, skv, d = 6, 2, 50, 80, 16
    q = torch.randn(bs, sq, d, generator=g).to(dtype)
    k = torch.randn(bs_kv, skv, d, generator=g).to(dtype)
    v = torch.randn(bs_kv, skv, d, generator=g).to(dtype)
    out = flashcte.attention_cte(q, k.transpose(1, 2), v, scale=0.3)  # k as a (bs_kv, d, Skv) view
    assert isinstance(out, torch.Tensor) and out.dtype == dtype
    ref = sdpa(q[None], k[None], v[None], True, 0.3)[0]
    assert_close(out.float().numpy(), ref.numpy(), name)


@pytest.mark.parametrize("dtype,name", TORCH_DTYPES)
def test_tensor_round_trip(dtype, name):
    """Tensors in, tensors out (outputs, statistics, lse), including strided and grad inputs."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 256, 40, generator=g).to(dtype)[:, :, 4:20].requires_grad_()  # strided
    k = torch.randn(1, 16, 300, generator=g).to(dtype)
    v = torch.randn(1, 300, 16, generator=g).to(dtype)
    sink = torch.tensor([[1.0], [2.0]], dtype=dtype)
    out, neg_max, sum_recip = flashcte.attention_cte(
        q, k, v, sink=sink, cache_softmax=True, tp_out=True
    )
    assert out.dtype == dtype and out.shape == (2, 16, 256)
    assert neg_max.dtype == torch.float32 and neg_max.shape == (2, 128, 2)
    assert sum_recip.shape == (2, 128, 2)
    qn, kn, vn = (t.detach().float().numpy() for t in (q, k, v))
    ref = attention_cte_ref(qn, kn, vn, sink=sink.float().numpy())
    assert_close(out.float().numpy().transpose(0, 2, 1), ref[0], name)
    # bfloat16 and float16 torch tensors give the same bits as the numpy path.
    if dtype is torch.float16:
        again = flashcte.attention_cte(
            q.detach().numpy(), k.numpy(), v.numpy(), sink=sink.float().numpy(), tp_out=True
        )
        assert np.array_equal(out.numpy(), again)


def test_torch_varlen_and_lse():
    g = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 10, 25, 26], dtype=torch.int32)
    q = torch.randn(26, 4, 16, generator=g)
    k = torch.randn(26, 2, 16, generator=g)
    v = torch.randn(26, 2, 16, generator=g)
    out, lse = flashcte.flash_attn_varlen_func(
        q, k, v, cu, cu, 15, 15, causal=True, return_softmax_lse=True
    )
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert out.shape == (26, 4, 16) and lse.shape == (4, 26)
    qb = q[None, 10:25].numpy()
    ref, ref_lse = flash_attn_ref(qb, k[None, 10:25].numpy(), v[None, 10:25].numpy(), causal=True)
    assert_close(out[10:25].numpy(), ref[0], "float32")
    np.testing.assert_allclose(lse[:, 10:25].numpy(), ref_lse[0], rtol=2e-5)


def test_torch_errors():
    q = torch.zeros(2, 8, 4)
    k = torch.zeros(1, 4, 8)
    v = torch.zeros(1, 8, 4)
    with pytest.raises(
        TypeError, match="^q: dtype must be float32, float16 or bfloat16, got float64"
    ):
        flashcte.attention_cte(q.double(), k, v)
    with pytest.raises(TypeError, match="^v: dtype bfloat16 differs"):
        flashcte.attention_cte(q, k, v.bfloat16())
    with pytest.raises(ValueError, match="^k: head dim"):
        flashcte.attention_cte(q, k[:, :3], v)
