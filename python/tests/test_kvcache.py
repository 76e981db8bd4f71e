"""flash_attn_with_kvcache against FlashAttention's test_flash_attn_kvcache (float64 model in
semantics.kvcache_ref): dense and paged caches, appends with rotary, left padding, batch_idx,
windows, softcap, ALiBi; numpy and torch; the caches untouched by a call that raises."""

from __future__ import annotations

import flashcte
import numpy as np
import pytest
from conftest import DTYPES, assert_close, assert_stat_close, make, np_dtype
from semantics import f64, kvcache_ref

LAYOUTS = ["dense", "batch_idx", "page1", "page3", "page16"]

FEATURES = {
    "decode": dict(seqlen_q=1, new=1, causal=True),
    "rotary_gptj": dict(seqlen_q=3, new=3, rotary_dim=16, interleaved=True, causal=True),
    "rotary_neox_noncausal": dict(seqlen_q=2, new=2, rotary_dim=8, interleaved=False),
    "leftpad_window": dict(seqlen_q=4, new=2, leftpad=True, window=(5, 1)),
    "alibi_softcap": dict(seqlen_q=2, new=0, alibi=True, softcap=3.0, causal=True),
    "chunk_no_append": dict(seqlen_q=5, new=0, causal=True),
}


def setup(rng, dtype, layout, seqlen_q=1, new=1, causal=False, rotary_dim=0, interleaved=True,
          leftpad=False, window=(-1, -1), alibi=False, softcap=0.0, batch=3, heads=4,
          kv_heads=2, d=32, capacity=48):
    """The arguments of one call: a logical cache per sequence placed as `layout` says."""
    page = int(layout[4:]) if layout.startswith("page") else 0
    pages = -(-capacity // page) if page else 0
    slots = pages * page if page else capacity
    # Drawn over the capacity (the same values whatever the layout), padded to whole pages.
    pad = ((0, 0), (0, slots - capacity), (0, 0), (0, 0))
    logical_k = np.pad(make(rng, (batch, capacity, kv_heads, d), dtype), pad)
    logical_v = np.pad(make(rng, (batch, capacity, kv_heads, d), dtype), pad)
    args = dict(
        q=make(rng, (batch, seqlen_q, heads, d), dtype),
        cache_seqlens=rng.integers(0 if new else 1, capacity - new + 1, batch).astype(np.int32),
        causal=causal,
        window_size=window,
        softcap=softcap,
    )
    if new:
        args["k"] = make(rng, (batch, new, kv_heads, d), dtype)
        args["v"] = make(rng, (batch, new, kv_heads, d), dtype)
    if rotary_dim:
        angle = rng.random((capacity, rotary_dim // 2)) * 2 * np.pi
        args["rotary_cos"] = np.cos(angle).astype(args["q"].dtype)
        args["rotary_sin"] = np.sin(angle).astype(args["q"].dtype)
        args["rotary_interleaved"] = interleaved
    if leftpad:
        args["cache_leftpad"] = np.array(
            [rng.integers(0, s + 1) for s in args["cache_seqlens"]], np.int32
        )
    if alibi:
        args["alibi_slopes"] = (rng.random(heads) * 0.5).astype(np.float32)
    if page:
        num_blocks = batch * pages + 2
        order = rng.permutation(num_blocks).astype(np.int32)
        table = order[: batch * pages].reshape(batch, pages)
        k_cache = make(rng, (num_blocks, page, kv_heads, d), dtype)
        v_cache = make(rng, (num_blocks, page, kv_heads, d), dtype)
        for b in range(batch):
            for i in range(pages):
                k_cache[table[b, i]] = logical_k[b, i * page : (i + 1) * page]
                v_cache[table[b, i]] = logical_v[b, i * page : (i + 1) * page]
        args["block_table"] = table
    elif layout == "batch_idx":
        idx = rng.permutation(2 * batch)[:batch].astype(np.int32)
        k_cache = make(rng, (2 * batch, slots, kv_heads, d), dtype)
        v_cache = make(rng, (2 * batch, slots, kv_heads, d), dtype)
        k_cache[idx], v_cache[idx] = logical_k, logical_v
        args["cache_batch_idx"] = idx
    else:
        k_cache, v_cache = logical_k, logical_v
    args["k_cache"], args["v_cache"] = k_cache, v_cache
    return args


def run(args):
    args = dict(args)
    return flashcte.flash_attn_with_kvcache(
        args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), return_softmax_lse=True, **args
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_matches_flash_attention(rng, dtype, layout, feature):
    args = setup(rng, dtype, layout, **FEATURES[feature])
    ref_args = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    out, lse = run(args)
    ref_out, ref_lse, k_after, v_after = kvcache_ref(**ref_args)
    assert_close(out, ref_out, dtype)
    assert_stat_close(lse, ref_lse, dtype, "lse")
    # FlashAttention's rule for the append: v exactly, k within 1e-3 after rotary.
    assert np.array_equal(f64(args["v_cache"]), f64(v_after))
    np.testing.assert_allclose(f64(args["k_cache"]), f64(k_after), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_is_bitwise_dense(rng, dtype):
    seed = int(rng.integers(1 << 30))
    results = []
    for layout in ("dense", "page1", "page3", "page16"):
        args = setup(np.random.default_rng(seed), dtype, layout, seqlen_q=2, new=2, causal=True,
                     rotary_dim=8, alibi=True, capacity=64)
        out, lse = run(args)
        results.append((np.asarray(out).tobytes(), np.asarray(lse).tobytes()))
    assert all(r == results[0] for r in results[1:])


def test_empty_rows_and_cache_seqlens_zero(rng):
    """cache_seqlens 0 and no new token: nothing to attend, out 0 and lse -inf."""
    args = setup(rng, "float32", "page3", seqlen_q=2, new=0)
    args["cache_seqlens"] = np.array([0, 5, 0], np.int32)
    out, lse = run(args)
    assert np.all(out[[0, 2]] == 0) and np.all(lse[[0, 2]] == -np.inf)
    assert np.all(np.isfinite(lse[1]))


def test_int_cache_seqlens_and_defaults(rng):
    args = setup(rng, "float32", "dense", seqlen_q=1, new=1, causal=True)
    args["cache_seqlens"] = 7
    ref_args = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    ref_args["cache_seqlens"] = np.full(3, 7)
    out, lse = run(args)
    ref_out, ref_lse, _, _ = kvcache_ref(**ref_args)
    assert_close(out, ref_out, "float32")
    out_only = flashcte.flash_attn_with_kvcache(
        args["q"], args["k_cache"], args["v_cache"], cache_seqlens=8, causal=True
    )
    assert out_only.shape == (3, 1, 4, 32)


def test_torch_tensors_and_op(rng):
    torch = pytest.importorskip("torch")
    import flashcte.torch as ft

    for dtype in ("float32", "bfloat16"):
        args = setup(rng, "float32", "page16", seqlen_q=1, new=1, causal=True, rotary_dim=8)
        tdt = getattr(torch, dtype)
        targs = {
            k: (torch.from_numpy(v).to(tdt) if isinstance(v, np.ndarray) and v.dtype == np.float32
                else torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
            for k, v in args.items()
        }
        ref_args = {
            k: (v.float().numpy().astype(np_dtype(dtype)) if isinstance(v, torch.Tensor)
                and v.is_floating_point() else v.numpy() if isinstance(v, torch.Tensor) else v)
            for k, v in targs.items()
        }
        ref_out, _, k_after, v_after = kvcache_ref(**ref_args)
        k_cache, v_cache = targs["k_cache"], targs["v_cache"]
        out, lse = ft.flash_attn_with_kvcache(
            targs["q"], k_cache, v_cache, k=targs["k"], v=targs["v"],
            rotary_cos=targs["rotary_cos"], rotary_sin=targs["rotary_sin"],
            cache_seqlens=targs["cache_seqlens"], block_table=targs["block_table"], causal=True,
            return_softmax_lse=True,
        )
        assert isinstance(out, torch.Tensor) and out.dtype == tdt
        assert_close(out.float().numpy(), ref_out, dtype)
        assert torch.equal(v_cache.float(), torch.from_numpy(f64(v_after)).float())
        np.testing.assert_allclose(k_cache.float().numpy(), f64(k_after), rtol=1e-3, atol=1e-3)
    # The op is registered with its mutation, so torch.compile traces through it.
    assert "flash_attn_with_kvcache" in dir(torch.ops.flashcte)


BAD = [
    ("block_table", lambda a: a["block_table"].__setitem__((0, 0), 99), ValueError),
    ("block_table", lambda a: a.__setitem__("block_table", a["block_table"].astype(np.int64)),
     TypeError),
    ("cache_seqlens", lambda a: a.__setitem__("cache_seqlens", np.array([48, 0, 0], np.int32)),
     ValueError),
    ("cache_seqlens", lambda a: a.__setitem__("cache_seqlens", a["cache_seqlens"].astype(np.int64)),
     TypeError),
    ("block_table", lambda a: a["block_table"].__setitem__((1, slice(None)), a["block_table"][0]),
     ValueError),
    ("v", lambda a: a.pop("v"), ValueError),
    ("k", lambda a: a.__setitem__("k", a["k"][:, :, :1]), ValueError),
    ("rotary_cos", lambda a: a.update(rotary_cos=a["rotary_cos"][:3], rotary_sin=a["rotary_sin"][:3]),
     ValueError),
    ("window_size", lambda a: a.__setitem__("window_size", (-2, 0)), ValueError),
    ("alibi_slopes", lambda a: a.__setitem__("alibi_slopes", np.ones(3, np.float32)), ValueError),
]


@pytest.mark.parametrize("argument,breaks,exc", BAD, ids=[f"{b[0]}{i}" for i, b in enumerate(BAD)])
def test_bad_input_leaves_the_caches(rng, argument, breaks, exc):
    args = setup(rng, "float32", "page16", seqlen_q=1, new=1, causal=True, rotary_dim=8)
    breaks(args)
    k_before, v_before = args["k_cache"].copy(), args["v_cache"].copy()
    with pytest.raises(exc) as info:
        run(args)
    assert str(info.value).startswith(argument + ":"), str(info.value)
    assert np.array_equal(args["k_cache"], k_before) and np.array_equal(args["v_cache"], v_before)


def test_readme_serving_example_runs_as_written():
    """The README's serving loop, executed from the README itself."""
    import os
    import re

    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    section = readme[readme.index("## Serving: paged KV caches") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md (serving)", "exec"), scope)
    assert scope["lens"].tolist() == [35, 35]
    assert scope["out"].shape == (22, 8, 64) and np.all(np.isfinite(scope["out"]))
    # Request B read A's prompt pages: its cache is A's prompt plus its own 3 tokens.
    assert np.array_equal(scope["pool_k"][0], scope["prompt_k"][0, :16])


def test_the_flash_attn_drop_in_serves_it(rng):
    """Engine code written against FlashAttention imports the call from flash_attn."""
    import importlib

    import flashcte.integrations.flash_attn as fa

    with fa.install(replace=True):
        interface = importlib.import_module("flash_attn.flash_attn_interface")
        assert interface.flash_attn_with_kvcache is flashcte.flash_attn_with_kvcache
        assert importlib.import_module("flash_attn").flash_attn_with_kvcache is (
            flashcte.flash_attn_with_kvcache
        )
