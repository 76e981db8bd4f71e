"""flashcte.torch: the torch.library op torch.ops.flashcte.flash_attn and the
scaled_dot_product_attention drop-in, against a float64 reference and torch's own SDPA.

Skipped when torch is not installed (python/run_tests.sh installs it).
"""

from __future__ import annotations

import math
import types

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
F = torch.nn.functional

import flashcte._attention as _attention  # noqa: E402
import flashcte._torch_checks as _torch_checks  # noqa: E402
import flashcte.torch as ft  # noqa: E402
from conftest import check_allclose, check_close  # noqa: E402

# |a - b| <= 1e-6 + rtol * max|ref| (conftest's OUT_RTOL: the kernel's own arithmetic; 16-bit
# dtypes round the probabilities and the output).
RTOL = {torch.float32: 2e-5, torch.float16: 8 * 2.0**-11, torch.bfloat16: 2e-2}
DTYPES = [
    pytest.param(torch.float32, id="f32"),
    pytest.param(torch.float16, id="f16"),
    pytest.param(torch.bfloat16, id="bf16"),
]


def close(got, ref, dtype=torch.float32, what="out"):
    check_close(got, ref, rtol=RTOL[dtype], atol=1e-6, what=f"{what} ({dtype})")


def reference(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    window_left=-1,
    window_right=-1,
    bottom_right=True,
    softcap=0.0,
    key_bias=None,
    sinks=None,
    alibi_slopes=None,
    bound_min=None,
    bound_max=None,
):
    """The op's documented math in float64: (out (B, Sq, H, dv), lse (B, H, Sq))."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))  # (B, H, S, d)
    batch, heads, sq, d = q.shape
    sk = k.shape[2]
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    s = scale * q @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    offset = sk - sq if bottom_right else 0
    i = torch.arange(sq)[:, None] + offset
    j = torch.arange(sk)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().expand(batch, heads)
        s = s - slopes[:, :, None, None] * (i - j).abs()
    if key_bias is not None:
        kb = key_bias.double()
        s = s + (kb[:, None, None, :] if kb.dim() == 2 else kb[:, :, None, :])
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window_left >= 0:
        keep &= j - i >= -window_left
    if window_right >= 0:
        keep &= j - i <= window_right
    keep = keep.expand(batch, 1, sq, sk)
    if bound_min is not None:
        lo = bound_min.expand(batch, sq)[:, None, :, None]
        hi = bound_max.expand(batch, sq)[:, None, :, None]
        keep = keep & (j >= lo) & (j < hi)
    s = s.masked_fill(~keep, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(batch, heads, sq, 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    out = (p @ v).transpose(1, 2)
    return out, lse


def rand(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


# ---- the op -----------------------------------------------------------------------------------


CASES = {
    "plain": {},
    "causal": dict(causal=True),
    "causal_top_left": dict(causal=True, bottom_right=False),
    "window": dict(causal=True, window_left=5),
    "window_both": dict(window_left=3, window_right=4, bottom_right=False),
    "softcap_scale": dict(softcap=2.0, softmax_scale=0.7),
    "sinks": dict(causal=True, sinks="sinks"),
    "key_bias_2d": dict(key_bias="kb2"),
    "key_bias_3d": dict(causal=True, key_bias="kb3"),
    "alibi": dict(causal=True, alibi_slopes="alibi"),
    "bounds": dict(bound_min="lo", bound_max="hi"),
    "everything": dict(
        causal=True,
        window_left=9,
        softcap=3.0,
        sinks="sinks",
        key_bias="kb2",
        bound_min="lo",
        bound_max="hi",
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sq,sk", [(23, 23), (9, 31), (31, 12)])
def test_op_vs_reference(dtype, case, sq, sk):
    g = torch.Generator().manual_seed(sq * 100 + sk)
    b, h, hk, d = 2, 6, 2, 16
    q, k, v = rand(g, b, sq, h, d, dtype=dtype), rand(g, b, sk, hk, d, dtype=dtype), rand(
        g, b, sk, hk, 24, dtype=dtype
    )
    pad = torch.zeros(b, sk)
    pad[1, : sk // 3] = -math.inf  # left padding on row 1
    extras = {
        "sinks": torch.randn(h, generator=g),
        "kb2": pad + 0.3 * torch.randn(b, sk, generator=g),
        "kb3": 0.5 * torch.randn(b, h, sk, generator=g),
        "alibi": torch.rand(h, generator=g),
        "lo": torch.randint(0, sk // 2 + 1, (b, sq), generator=g),
        "hi": torch.randint(sk // 2, sk + 1, (b, sq), generator=g),
    }
    kwargs = {n: extras.get(a, a) if isinstance(a, str) else a for n, a in CASES[case].items()}
    with torch.no_grad():
        out, lse = torch.ops.flashcte.flash_attn(q, k, v, **kwargs)
    want, want_lse = reference(q, k, v, **kwargs)
    assert out.dtype == dtype and out.is_contiguous() and out.shape == (b, sq, h, 24)
    assert lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    close(out, want, dtype)
    check_allclose(lse, want_lse, rtol=1e-4, atol=1e-4, what="lse")


# What each path of the op calls: FlashAttention's own arguments go through FlashAttention's
# mapping (flash_attn_with_kvcache over k and v as full caches), what it cannot express (a key
# bias here) through attention_cte's rank-4 form. Both read q, k, v in place.
_PATHS = {
    "flash_attn_with_kvcache": ({}, ("q", "k_cache", "v_cache", "out"), False),
    "attention_cte": ({"key_bias": "kb"}, ("q", "k", "v", "out"), True),
}


@pytest.mark.parametrize("binding", sorted(_PATHS))
def test_op_reads_inputs_in_place(monkeypatch, binding):
    """q, k, v reach the one native call for the whole batch as views of the caller's memory
    (transposed, sliced: no copy), and the outputs are the op's own fresh tensors."""
    extra, names, transposed = _PATHS[binding]
    g = torch.Generator().manual_seed(2)
    base_q = rand(g, 3, 8, 40, 16)  # (B, H, S, d) storage, sliced to 30 rows
    q = base_q[:, :, 5:35].transpose(1, 2)  # (B, S, H, d) view, neither contiguous
    k = rand(g, 3, 4, 30, 16).transpose(1, 2)
    v = rand(g, 3, 30, 4, 32)[:, :, :, ::2]  # every other channel: dv 16, stride 2
    kwargs = {n: torch.zeros(3, 30) if a == "kb" else a for n, a in extra.items()}
    seen = []
    real = getattr(_attention._flashcte, binding)

    def recording(**call):
        # Torch tensors reach the native layer as DLPack capsules (one use each): opened here
        # into the tensors they view, which the call then reads instead.
        for n in names:
            call[n] = torch.utils.dlpack.from_dlpack(call[n])
        seen.append([call[n] for n in names])
        return real(**call)

    monkeypatch.setattr(_attention._flashcte, binding, recording)
    with torch.no_grad():
        out, lse = ft.flash_attn(q, k, v, causal=True, **kwargs)
    assert len(seen) == 1  # one call for the whole batch
    for t, src in zip(seen[0], (q, k, v, out)):
        assert isinstance(t, torch.Tensor) and t.dim() == 4
        # attention_cte gets (batch, heads, seqlen, d) views; FlashAttention's call the layout.
        view = src.transpose(1, 2) if transposed else src
        assert t.data_ptr() == view.data_ptr() and t.stride() == view.stride()
        assert t.shape == view.shape
    want, _ = reference(q, k, v, causal=True, **kwargs)
    close(out, want)


def test_op_is_registered_and_passes_opcheck():
    op = torch.ops.flashcte.flash_attn.default
    assert "Tensor? key_bias=None" in str(op._schema)
    g = torch.Generator().manual_seed(3)
    q, k, v = rand(g, 2, 10, 4, 8), rand(g, 2, 14, 2, 8), rand(g, 2, 14, 2, 8)
    kb = torch.zeros(2, 14)
    torch.library.opcheck(op, (q, k, v), {"causal": True, "key_bias": kb, "softcap": 5.0})


def test_op_refuses_autograd_and_runs_without_it():
    g = torch.Generator().manual_seed(4)
    q = rand(g, 1, 5, 2, 8).requires_grad_()
    k, v = rand(g, 1, 5, 2, 8), rand(g, 1, 5, 2, 8)
    with pytest.raises(RuntimeError, match="backward pass is not implemented"):
        ft.flash_attn(q, k, v)
    with pytest.raises(RuntimeError, match="backward pass is not implemented"):
        ft.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    with torch.no_grad():
        a, _ = ft.flash_attn(q, k, v)
    with torch.inference_mode():
        b, _ = ft.flash_attn(q, k, v)
    assert torch.equal(a, b) and not a.requires_grad
    a, _ = ft.flash_attn(q.detach(), k, v)  # grad mode on, nothing requires grad
    assert torch.equal(a, b)


def test_op_errors():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="^k: 3 heads must divide q's 2 heads"):
        ft.flash_attn(q, torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 3, 8))
    with pytest.raises(TypeError, match="^q: dtype must be float32, float16 or bfloat16"):
        ft.flash_attn(q.double(), q, q)
    with pytest.raises(TypeError, match="^k: dtype bfloat16 differs"):
        ft.flash_attn(q, q.bfloat16(), q)
    with pytest.raises(ValueError, match="^q: must have rank 4"):
        ft.flash_attn(q[0], q, q)
    with pytest.raises(ValueError, match=r"^key_bias: shape \(4,\)"):
        ft.flash_attn(q, q, q, key_bias=torch.zeros(4))
    with pytest.raises(ValueError, match="^bound_min, bound_max: pass both"):
        ft.flash_attn(q, q, q, bound_min=torch.zeros(4, dtype=torch.int64))
    # Arguments are bound as a Python function's are (the op's one signature).
    with pytest.raises(TypeError, match="unexpected keyword argument 'window'"):
        ft.flash_attn(q, q, q, window=(1, 1))
    with pytest.raises(TypeError, match="missing a required argument: 'v'"):
        ft.flash_attn(q, q)
    # A tensor on an accelerator (none here: a stand-in with a device) is refused by name.
    fake = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"^q: flashcte runs on the CPU only.*cuda:0.*\.cpu\(\)"):
        _torch_checks.check_cpu("q", fake)


def test_op_edge_sizes():
    with torch.no_grad():
        no_keys = torch.randn(2, 0, 1, 8)
        out, lse = ft.flash_attn(torch.randn(2, 3, 2, 8), no_keys, no_keys)
        assert torch.equal(out, torch.zeros(2, 3, 2, 8)) and bool((lse == -math.inf).all())
        keys = torch.randn(2, 5, 1, 8)
        out, lse = ft.flash_attn(torch.randn(2, 0, 2, 8), keys, keys)
        assert out.shape == (2, 0, 2, 8) and lse.shape == (2, 2, 0)


def test_the_dispatcher_is_skipped_only_when_it_adds_nothing(monkeypatch):
    """flash_attn runs the op's implementation directly in plain eager calls (the dispatcher
    costs ~11 us a call), and goes through the op whenever torch has something to add: fake
    tensors (their shapes come from the op's fake), a tensor subclass, grad to refuse."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    direct = []
    impl = ft._flash_attn_impl
    monkeypatch.setattr(ft, "_flash_attn_impl", lambda *a, **kw: direct.append(1) or impl(*a, **kw))
    g = torch.Generator().manual_seed(8)
    q, k, v = rand(g, 2, 3, 4, 8), rand(g, 2, 6, 2, 8), rand(g, 2, 6, 2, 16)
    with torch.no_grad():
        want, _ = torch.ops.flashcte.flash_attn(q, k, v, causal=True)
        got, _ = ft.flash_attn(q, k, v, causal=True)
    assert direct == [1] and torch.equal(got, want)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        out, lse = ft.flash_attn(fq, fk, fv, causal=True)
    assert out.shape == (2, 3, 4, 16) and lse.shape == (2, 4, 3) and direct == [1]

    class Sub(torch.Tensor):
        pass

    with torch.no_grad():
        out, _ = ft.flash_attn(q.as_subclass(Sub), k, v, causal=True)
    assert direct == [1] and torch.equal(out.as_subclass(torch.Tensor), want)


def test_torch_compile_fullgraph_traces_the_op():
    g = torch.Generator().manual_seed(5)
    q, k, v = rand(g, 2, 4, 33, 16), rand(g, 2, 2, 40, 16), rand(g, 2, 2, 40, 16)
    pad = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    pad[0, ..., :7] = False

    def attend(q, k, v, pad):
        x = ft.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = ft.scaled_dot_product_attention(q, k, v, attn_mask=pad, enable_gqa=True)
        return x.transpose(1, 2).reshape(2, 33, -1) + y.transpose(1, 2).reshape(2, 33, -1)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = compiled(q, k, v, pad)
        want = attend(q, k, v, pad)
    close(got, want)


def test_torch_compile_inductor():
    """The default backend (Inductor, C++ codegen around the op; ~15 s to compile here)."""
    g = torch.Generator().manual_seed(6)
    q, k, v = rand(g, 1, 4, 24, 16), rand(g, 1, 4, 24, 16), rand(g, 1, 4, 24, 16)

    def block(q, k, v):
        out = ft.scaled_dot_product_attention(q * 0.5, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(1, 24, 64).sin()

    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        close(compiled(q, k, v), block(q, k, v))


# ---- scaled_dot_product_attention against torch's -----------------------------------------------


def torch_sdpa(q, k, v, **kwargs):
    q, k, v = (t.double() for t in (q, k, v))
    mask = kwargs.pop("attn_mask", None)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("l,s", [(40, 40), (17, 50), (50, 17)])
@pytest.mark.parametrize("heads,heads_k", [(4, 4), (6, 2)])
def test_sdpa_vs_torch(dtype, causal, l, s, heads, heads_k):
    g = torch.Generator().manual_seed(l + s + heads_k)
    q, k, v = (
        rand(g, 2, heads, l, 32, dtype=dtype),
        rand(g, 2, heads_k, s, 32, dtype=dtype),
        rand(g, 2, heads_k, s, 32, dtype=dtype),
    )
    gqa = heads != heads_k
    with torch.no_grad():
        got = ft.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    want = torch_sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)
    assert got.dtype == dtype and got.shape == (2, heads, l, 32)
    close(got, want, dtype)


def _masks(g, b, h, l, s):
    lengths = torch.tensor([s, s - 7])
    keys = torch.arange(s)[None, :] < lengths[:, None]  # right padding
    left = torch.arange(s)[None, :] >= torch.tensor([0, 5])[:, None]  # left padding
    i = torch.arange(l)[:, None] + (s - l)
    j = torch.arange(s)[None, :]
    causal = j <= i
    window = causal & (j > i - 6)
    bias = 0.5 * torch.randn(b, 1, 1, s, generator=g)
    return {
        "bool_per_key": keys[:, None, None, :],
        "bool_per_key_rows": keys[:, None, None, :].expand(b, 1, l, s).clone(),
        "float_per_key": bias.masked_fill(~left[:, None, None, :], -math.inf),
        "float_rows_equal": bias.expand(b, 1, l, s).clone(),
        "float_per_head": 0.5 * torch.randn(b, h, 1, s, generator=g),
        "bool_2d_per_key": keys[1:2],
        "finfo_min_padding": torch.zeros(b, 1, 1, s).masked_fill(
            ~left[:, None, None, :], torch.finfo(torch.float32).min
        ),
        "bool_causal_left_pad": causal[None, None] & left[:, None, None, :],
        "bool_window_right_pad": window[None, None] & keys[:, None, None, :],
        "float_causal_neginf": torch.zeros(l, s).masked_fill(~causal, -math.inf),
        "float_causal_finfo_min": torch.zeros(l, s).masked_fill(
            ~causal, torch.finfo(torch.float32).min
        ),
    }


MASKS = list(_masks(torch.Generator(), 2, 4, 20, 30))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", MASKS)
def test_sdpa_masks_vs_torch(dtype, mask):
    g = torch.Generator().manual_seed(11)
    b, h, l, s = 2, 4, 20, 30
    m = _masks(g, b, h, l, s)[mask]
    q, k, v = rand(g, b, h, l, 16, dtype=dtype), rand(g, b, 2, s, 16, dtype=dtype), rand(
        g, b, 2, s, 16, dtype=dtype
    )
    with torch.no_grad():
        got = ft.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    want = torch_sdpa(q, k, v, attn_mask=m, enable_gqa=True)
    close(got, want, dtype)


def test_sdpa_rank3_scale_and_layout():
    g = torch.Generator().manual_seed(12)
    q, k, v = rand(g, 3, 10, 8), rand(g, 3, 12, 8), rand(g, 3, 12, 8)
    got = ft.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.3)
    close(got, torch_sdpa(q, k, v, is_causal=True, scale=0.3))
    q4 = rand(g, 2, 4, 10, 8)
    out = ft.scaled_dot_product_attention(q4, q4, q4)
    assert out.shape == (2, 4, 10, 8)
    assert out.transpose(1, 2).is_contiguous()  # a view of a (B, L, H, E) tensor
    # key/value with batch 1 broadcast over the query batch
    kv = rand(g, 1, 4, 12, 8)
    kv2 = kv.expand(2, -1, -1, -1)
    close(ft.scaled_dot_product_attention(q4, kv, kv), torch_sdpa(q4, kv2, kv2))


def test_sdpa_fully_masked_rows_output_zero_as_torch():
    g = torch.Generator().manual_seed(13)
    q, k, v = rand(g, 2, 2, 6, 8), rand(g, 2, 2, 6, 8), rand(g, 2, 2, 6, 8)
    m = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    m[1] = False  # the second sequence sees no key at all
    got = ft.scaled_dot_product_attention(q, k, v, attn_mask=m)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    close(got, want)


def test_sdpa_refusals():
    g = torch.Generator().manual_seed(14)
    q, k = rand(g, 1, 2, 8, 4), rand(g, 1, 1, 8, 4)
    noise = rand(g, 8, 8)
    with pytest.raises(ValueError, match="varies along both the query and the key axis.*supported"):
        ft.scaled_dot_product_attention(q, q, q, attn_mask=noise)
    scattered = torch.rand(8, 8, generator=g) > 0.5
    scattered[:, 0] = True
    with pytest.raises(ValueError, match="padding mask of shape \\(B, 1, 1, S_kv\\)"):
        ft.scaled_dot_product_attention(q, q, q, attn_mask=scattered)
    with pytest.raises(ValueError, match="^dropout_p"):
        ft.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="not both"):
        ft.scaled_dot_product_attention(q, q, q, attn_mask=noise, is_causal=True)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        ft.scaled_dot_product_attention(q, k, k)
    with pytest.raises(ValueError, match="does not broadcast"):
        ft.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(3, 8))


def test_decompose_mask_is_exact():
    """Random interval-and-padding masks decompose and rebuild exactly; others are refused."""
    g = torch.Generator().manual_seed(15)
    for trial in range(20):
        b, l, s = 3, 11, 17
        lo = torch.randint(0, s, (b, l), generator=g)
        hi = torch.minimum(lo + torch.randint(0, s, (b, l), generator=g), torch.tensor(s))
        keys = torch.rand(b, s, generator=g) > 0.3
        j = torch.arange(s)
        allowed = (j >= lo[..., None]) & (j < hi[..., None]) & keys[:, None, :]
        plan = ft.decompose_mask(allowed)
        assert plan is not None
        rebuilt = torch.ones_like(allowed)
        if plan.bound_min is not None:
            rebuilt &= (j >= plan.bound_min[..., None]) & (j < plan.bound_max[..., None])
        if plan.key_bias is not None:
            rebuilt &= (plan.key_bias == 0)[:, None, :]
        assert torch.equal(rebuilt, allowed), trial
    bad = torch.zeros(1, 2, 5, dtype=torch.bool)
    bad[0, 0, [0, 2]] = True  # row 0: keys 0 and 2; row 1: key 1 -> key 1 is kept, row 0 skips it
    bad[0, 1, 1] = True
    assert ft.decompose_mask(bad) is None
