"""A tensor-parallel rank of flashcte.AttentionLayer built from its own shard of the weights
(set_weights(shard=True), load_safetensors) instead of the full layer's: bitwise the rank built
from the full weights, and refused, naming the weight, when the shard is not the rank's."""

from __future__ import annotations

import numpy as np
import pytest

import flashcte
from layer_model import HF_NAMES, cut_shard

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

HIDDEN, D = 24, 8
PREFIX = "model.layers.3.self_attn."


def full_weights(heads: int, kv_heads: int, seed: int = 7) -> dict:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    return {
        "q_proj": w(heads * D, HIDDEN),
        "k_proj": w(kv_heads * D, HIDDEN),
        "v_proj": w(kv_heads * D, HIDDEN),
        "o_proj": w(HIDDEN, heads * D),
        "q_bias": w(heads * D),
        "k_bias": w(kv_heads * D),
        "v_bias": w(kv_heads * D),
        "o_bias": w(HIDDEN),
        "q_norm": 1 + w(D),
        "k_norm": 1 + w(D),
    }


def make(heads, kv_heads, tp, rank, strategy="auto", dtype="float32"):
    sinks = np.linspace(-1, 1, heads).astype(np.float32)
    return flashcte.AttentionLayer(
        HIDDEN, heads, kv_heads, D, qkv_bias=True, o_bias=True, qk_norm=True, sinks=sinks,
        dtype=dtype, tp_degree=tp, tp_rank=rank, gqa_strategy=strategy,
    )


def conversation(layer) -> list:
    """A 20-token prefill and two decode steps; the outputs."""
    rng = np.random.default_rng(3)
    cache, outs, start = layer.new_cache(1, 32), [], 0
    for n in (20, 1, 1):
        x = rng.standard_normal((1, n, HIDDEN)).astype(np.float32)
        outs.append(np.asarray(layer(x, np.arange(start, start + n)[None], cache)).copy())
        start += n
    return outs


# (heads, kv_heads, tp, strategy): replicated KV heads; pad query and KV heads (6/3 at tp 4);
# CONVERT asked for; MHA; one rank.
LAYOUTS = [(8, 2, 4, "auto"), (6, 3, 4, "auto"), (8, 2, 4, "convert-to-mha"), (4, 4, 2, "auto"),
           (4, 2, 1, "auto")]


@pytest.mark.parametrize("heads,kv_heads,tp,strategy", LAYOUTS)
def test_a_rank_from_its_shard_is_bitwise_the_rank_from_the_full_weights(
    heads, kv_heads, tp, strategy
):
    full = full_weights(heads, kv_heads)
    for rank in range(tp):
        whole = make(heads, kv_heads, tp, rank, strategy)
        whole.set_weights(**full)
        own = make(heads, kv_heads, tp, rank, strategy)
        own.set_weights(**cut_shard(full, own), shard=True)
        for step, (a, b) in enumerate(zip(conversation(own), conversation(whole))):
            assert np.array_equal(a, b), f"rank {rank} of {tp}, call {step}"


@pytest.mark.parametrize("heads,kv_heads,tp,strategy", LAYOUTS)
@pytest.mark.parametrize("file_dtype", ["float32", "bfloat16"])
def test_load_safetensors_reads_the_ranks_shard(tmp_path, heads, kv_heads, tp, strategy,
                                                file_dtype):
    full = full_weights(heads, kv_heads)
    tensors = {PREFIX + HF_NAMES[k]: torch.from_numpy(v).to(getattr(torch, file_dtype))
               for k, v in full.items()}
    tensors["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(3, 3)  # another layer's
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(tensors, str(path))
    as_read = {k: tensors[PREFIX + HF_NAMES[k]].to(torch.float32).numpy() for k in full}
    for rank in range(tp):
        whole = make(heads, kv_heads, tp, rank, strategy)
        whole.set_weights(**as_read)
        loaded = make(heads, kv_heads, tp, rank, strategy)
        loaded.load_safetensors(path, PREFIX)
        for step, (a, b) in enumerate(zip(conversation(loaded), conversation(whole))):
            assert np.array_equal(a, b), f"rank {rank} of {tp}, call {step}"


def test_a_shard_that_is_not_the_ranks_is_refused_naming_the_weight(tmp_path):
    full = full_weights(6, 3)
    layer = make(6, 3, 4, 3)  # CONVERT_TO_MHA: rank 3 holds two pad query and two pad KV heads
    assert layer.rank_heads == ([-1, -1], [-1, -1])
    shard = cut_shard(full, layer)
    with pytest.raises(ValueError, match=r"q_proj: shape \(48, 24\) must be .*this rank's shard"):
        layer.set_weights(**dict(full, o_bias=None), shard=True)
    with pytest.raises(ValueError, match="o_bias: a rank's shard holds none past tp_degree 1"):
        layer.set_weights(**shard, o_bias=full["o_bias"], shard=True)
    bad = dict(shard, v_bias=shard["v_bias"] + 1)
    with pytest.raises(ValueError, match="v_bias: the rows of pad KV head 0 must be 0"):
        layer.set_weights(**bad, shard=True)
    with pytest.raises(ValueError, match=r"o_proj: 'x.o_proj.weight' is not in"):
        path = tmp_path / "partial.safetensors"
        safetensors_torch.save_file(
            {f"x.{k}.weight": torch.from_numpy(full[k]) for k in ("q_proj", "k_proj", "v_proj")},
            str(path),
        )
        make(6, 3, 1, 0).load_safetensors(path, "x.")
    assert not layer.has_weights
