"""plan_paged_attention / PagedAttentionPlan.run: a serving step planned once and run in every
layer (FlashInfer's plan() / run()). Each layer's run is bitwise what paged_attention gives with
that layer's arrays (paged_attention itself is checked against the reference in
test_varlen_cache.py); the plan keeps its own copy of the step's tables; a layer unlike the plan,
or with bad values, is refused by paged_attention's names."""

from __future__ import annotations

import flashcte
import numpy as np
import pytest
from conftest import DTYPES, make

try:
    import ml_dtypes

    E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
except ImportError:
    E4M3 = None

HEADS, KV_HEADS, D, PAGE = 4, 2, 32, 16
Q_LENS, SEQ_LENS = [1, 40, 0, 3, 17], [60, 40, 9, 3, 90]


def step(rng):
    """The step's structure: query_start_loc, seq_lens, a shuffled block table."""
    pages = -(-max(SEQ_LENS) // PAGE)
    table = rng.permutation(len(Q_LENS) * pages + 3)[: len(Q_LENS) * pages]
    return dict(
        block_table=table.astype(np.int32).reshape(len(Q_LENS), pages),
        seq_lens=np.array(SEQ_LENS, np.int32),
        query_start_loc=np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32),
    )


def layer(rng, dtype, num_blocks, hnd=True):
    """One layer's arrays: query, the two caches (vLLM's HND or FlashAttention's NHD), sinks and
    slopes of its own."""
    shape = (num_blocks, KV_HEADS, PAGE, D) if hnd else (num_blocks, PAGE, KV_HEADS, D)
    return dict(
        query=make(rng, (sum(Q_LENS), HEADS, D), dtype),
        key_cache=make(rng, shape, dtype),
        value_cache=make(rng, shape, dtype),
        sinks=rng.standard_normal(HEADS).astype(np.float32),
        alibi_slopes=rng.uniform(0, 0.5, HEADS).astype(np.float32),
    )


def same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_every_layer_is_bitwise_its_own_call(dtype, kv_layout):
    rng = np.random.default_rng(3)
    s = step(rng)
    num_blocks = s["block_table"].size + 3
    options = dict(scale=0.2, window=(50, 0), softcap=4.0, kv_layout=kv_layout)
    layers = [layer(rng, dtype, num_blocks, kv_layout == "HND") for _ in range(3)]
    plan = flashcte.plan_paged_attention(**layers[0], **s, **options)
    for arrays in layers:
        got = plan.run(**arrays)
        same_bits(got, flashcte.paged_attention(**arrays, **s, **options))


@pytest.mark.skipif(E4M3 is None, reason="needs ml_dtypes for float8")
@pytest.mark.parametrize("per_token", [False, True])
def test_8bit_caches_take_each_layers_scales(per_token):
    """fp8 caches with a scale per KV head, or int8 ones with a scale per token, each layer its
    own: the plan reads the scales of the layer it runs."""
    rng = np.random.default_rng(4)
    s = step(rng)
    num_blocks = s["block_table"].size + 3
    runs = []
    for _ in range(3):
        fmt = np.int8 if per_token else E4M3
        caches, scales = [], []
        for _ in range(2):
            values = make(rng, (num_blocks * PAGE, KV_HEADS, D), np.float32)
            codes = np.empty((num_blocks, PAGE, KV_HEADS, D), fmt)
            if per_token:
                scale = np.empty((num_blocks, PAGE, KV_HEADS), np.float32)
                flashcte.quantize_kv(values, codes.reshape(-1, KV_HEADS, D), scale.reshape(-1, KV_HEADS))
            else:
                scale = rng.uniform(0.01, 0.05, KV_HEADS).astype(np.float32)
                flashcte.quantize_kv(values, codes.reshape(-1, KV_HEADS, D), scale)
            caches.append(codes)
            scales.append(scale)
        runs.append(dict(query=make(rng, (sum(Q_LENS), HEADS, D), np.float32),
                         key_cache=caches[0], value_cache=caches[1],
                         k_scale=scales[0], v_scale=scales[1]))
    plan = flashcte.plan_paged_attention(**runs[0], **s, scale=0.2, kv_layout="NHD")
    for arrays in runs:
        same_bits(plan.run(**arrays), flashcte.paged_attention(**arrays, **s, scale=0.2, kv_layout="NHD"))


def test_scales_over_a_cache_are_refused():
    """As paged_attention: a cache's scales are memory of their own."""
    rng = np.random.default_rng(8)
    s = step(rng)
    num_blocks = s["block_table"].size + 3
    codes = np.zeros((num_blocks, PAGE, KV_HEADS, D), np.int8)
    values = make(rng, (num_blocks * PAGE, KV_HEADS, D), np.float32)
    scale = np.array([0.02, 0.03], np.float32)
    flashcte.quantize_kv(values, codes.reshape(-1, KV_HEADS, D), scale)
    arrays = dict(query=make(rng, (sum(Q_LENS), HEADS, D), np.float32), key_cache=codes,
                  value_cache=codes.copy(), k_scale=scale, v_scale=scale)
    plan = flashcte.plan_paged_attention(**arrays, **s, scale=0.2, kv_layout="NHD")
    inside = arrays["key_cache"].view(np.float32).reshape(-1)[:KV_HEADS]
    inside[:] = scale
    with pytest.raises(ValueError, match="^k_scale: overlaps key_cache"):
        plan.run(**{**arrays, "k_scale": inside})
    with pytest.raises(ValueError, match="^k_scale: overlaps key_cache"):
        flashcte.paged_attention(**{**arrays, "k_scale": inside}, **s, scale=0.2, kv_layout="NHD")


def test_zero_dim_scales_are_per_tensor():
    """vLLM's attention layers hold k_scale / v_scale as 0-dim tensors (torch.tensor(1.0)):
    taken as the (1,) per-tensor scale, by paged_attention and by a plan's runs."""
    rng = np.random.default_rng(9)
    s = step(rng)
    num_blocks = s["block_table"].size + 3
    codes = np.zeros((num_blocks, PAGE, KV_HEADS, D), np.int8)
    flashcte.quantize_kv(make(rng, (num_blocks * PAGE, KV_HEADS, D), np.float32),
                         codes.reshape(-1, KV_HEADS, D), np.array([0.02], np.float32))
    arrays = dict(query=make(rng, (sum(Q_LENS), HEADS, D), np.float32), key_cache=codes,
                  value_cache=codes, k_scale=np.array([0.02], np.float32),
                  v_scale=np.array([0.03], np.float32))
    expected = flashcte.paged_attention(**arrays, **s, scale=0.2, kv_layout="NHD")
    zero_dim = {**arrays, "k_scale": np.array(0.02, np.float32), "v_scale": np.array(0.03, np.float32)}
    same_bits(flashcte.paged_attention(**zero_dim, **s, scale=0.2, kv_layout="NHD"), expected)
    plan = flashcte.plan_paged_attention(**zero_dim, **s, scale=0.2, kv_layout="NHD")
    same_bits(plan.run(**zero_dim), expected)
    torch = pytest.importorskip("torch")
    as_torch = {**arrays, "k_scale": torch.tensor(0.02), "v_scale": torch.tensor(0.03)}
    same_bits(flashcte.paged_attention(**as_torch, **s, scale=0.2, kv_layout="NHD"), expected)


def test_the_plan_keeps_its_own_tables():
    """Tables changed (or freed) after planning do not reach the plan."""
    rng = np.random.default_rng(5)
    s = step(rng)
    arrays = layer(rng, np.float32, s["block_table"].size + 3)
    planned = {k: v.copy() for k, v in s.items()}
    plan = flashcte.plan_paged_attention(**arrays, **planned, scale=0.2)
    expected = flashcte.paged_attention(**arrays, **s, scale=0.2)
    planned["block_table"][:] = planned["block_table"][::-1]
    planned["seq_lens"][:] = 1
    same_bits(plan.run(**arrays), expected)


def test_torch_tensors_and_an_output_in_place():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    s = step(rng)
    arrays = layer(rng, np.float32, s["block_table"].size + 3)
    plan = flashcte.plan_paged_attention(**arrays, **s, scale=0.2)
    expected = flashcte.paged_attention(**arrays, **s, scale=0.2)
    as_torch = {k: torch.from_numpy(v) for k, v in arrays.items()}
    same_bits(plan.run(**as_torch).numpy(), expected)
    out = np.empty_like(expected)
    assert plan.run(**arrays, output=out) is out
    same_bits(out, expected)


def test_a_layer_unlike_the_plan_is_refused_by_name():
    rng = np.random.default_rng(7)
    s = step(rng)
    num_blocks = s["block_table"].size + 3
    arrays = layer(rng, np.float32, num_blocks)
    plan = flashcte.plan_paged_attention(**arrays, **s, scale=0.2)
    bad = {
        "key_cache": dict(key_cache=make(rng, (num_blocks + 1, KV_HEADS, PAGE, D), np.float32),
                          value_cache=make(rng, (num_blocks + 1, KV_HEADS, PAGE, D), np.float32)),
        "query": dict(query=np.ascontiguousarray(arrays["query"].transpose(1, 0, 2)).transpose(1, 0, 2)),
        "sinks": dict(sinks=np.array([0.0, np.nan, 0.0, 0.0], np.float32)),
        "alibi_slopes": dict(alibi_slopes=np.array([0.1, np.inf, 0.1, 0.1], np.float32)),
        "output": dict(output=arrays["query"]),
    }
    for name, change in bad.items():
        with pytest.raises(ValueError, match=f"^{name}:"):
            plan.run(**{**arrays, **change})
    with pytest.raises(TypeError, match="^query: dtype float16 differs from the plan's float32"):
        plan.run(**{**arrays, "query": arrays["query"].astype(np.float16)})
    with pytest.raises(ValueError, match="^k_scale: the plan was made without one"):
        plan.run(**arrays, k_scale=1.0)
    # Shapes as the caller passed them: the HND cache, the slopes before their broadcast.
    with pytest.raises(ValueError, match=rf"^key_cache: shape \({num_blocks + 1}, {KV_HEADS}, {PAGE}, {D}\) "
                       rf"differs from the plan's \({num_blocks}, {KV_HEADS}, {PAGE}, {D}\)"):
        plan.run(**{**arrays, **bad["key_cache"]})
    with_slopes = flashcte.plan_paged_attention(**arrays, **s, scale=0.2)
    per_sequence = np.ones((len(Q_LENS), HEADS), np.float32)
    with pytest.raises(ValueError, match=rf"^alibi_slopes: shape \({len(Q_LENS)}, {HEADS}\) differs from "
                       rf"the plan's \({HEADS},\)"):
        with_slopes.run(**{**arrays, "alibi_slopes": per_sequence})
    # The plan's own checks are paged_attention's, by its names.
    with pytest.raises(ValueError, match="^seq_lens:"):
        flashcte.plan_paged_attention(**arrays, **{**s, "seq_lens": s["seq_lens"] * 100}, scale=0.2)
