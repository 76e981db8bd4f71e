"""flashcte.AttentionLayer on bad input: the configuration, the weights, x, the positions and the
cache (another layer's, or used out of turn) are refused with an error that names the argument.
The layer and its model: test_layer.py, layer_model.py."""

from __future__ import annotations

import flashcte
import numpy as np
import pytest
from layer_model import make_layer, make_weights, raises, rows


# --- bad input ------------------------------------------------------------------------------


@pytest.fixture
def small(rng):
    cfg = {"hidden_size": 16, "num_heads": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32"}
    layer = make_layer(cfg, make_weights(cfg, rng))
    return layer, layer.new_cache(1, 8)


def test_forward_before_set_weights():
    layer = flashcte.AttentionLayer(16, 2, 1, 8)
    cache = layer.new_cache(1, 8)
    raises(
        RuntimeError,
        "AttentionLayer: no weights yet",
        layer,
        np.zeros((1, 1, 16), np.float32),
        [[0]],
        cache,
    )


def test_bad_positions(small):
    layer, cache = small
    x = np.zeros((1, 5, 16), np.float32)
    raises(
        ValueError,
        "positions: row 0 token 0 is 1; a row must start in [0, cached length = 0]",
        layer,
        x[:, :2],
        [[1, 2]],
        cache,
    )
    raises(
        ValueError,
        "positions: row 0 token 1 is 2; positions within a row must go up by 1",
        layer,
        x[:, :2],
        [[0, 2]],
        cache,
    )
    layer(x[:, :4], rows((0, 4)), cache)
    raises(
        ValueError,
        "positions: row 0 token 0 is 5; a row must start in [0, cached length = 4]",
        layer,
        x[:, :1],
        [[5]],
        cache,
    )  # skipping slot 4
    raises(
        ValueError,
        "positions: row 0 token 4 is 8, past the cache's max_len = 8",
        layer,
        x,
        rows((4, 5)),
        cache,
    )
    assert cache.lengths.tolist() == [4]  # failed calls add no tokens
    raises(
        ValueError,
        "positions: must be an int64 tensor of shape (batch, T) = (1, 5)",
        layer,
        x,
        rows((4, 4)),
        cache,
    )
    raises(
        ValueError,
        "positions: must be an int64 tensor of shape (batch, T) = (1, 5)",
        layer,
        x,
        np.arange(4, 9),
        cache,
    )
    raises(
        TypeError,
        "positions: dtype must be int64, got float64",
        layer,
        x,
        rows((4, 5)).astype(np.float64),
        cache,
    )
    layer(x[:, :2], rows((2, 2)), cache)  # an earlier start rewrites slots 2, 3
    assert cache.lengths.tolist() == [4]


def test_bad_x(small):
    layer, cache = small
    raises(
        ValueError,
        "x: must have rank 3 (batch, T, hidden_size), got rank 2",
        layer,
        np.zeros((4, 16), np.float32),
        rows((0, 4)),
        cache,
    )
    raises(
        ValueError,
        "x: last dimension 15 must be hidden_size = 16",
        layer,
        np.zeros((1, 4, 15), np.float32),
        rows((0, 4)),
        cache,
    )
    raises(
        TypeError,
        "x: dtype must be float32, float16 or bfloat16, got int64",
        layer,
        np.zeros((1, 4, 16), np.int64),
        rows((0, 4)),
        cache,
    )
    raises(
        TypeError,
        "x: expected a numpy array or a DLPack tensor",
        layer,
        [[[0.0] * 16]],
        rows((0, 1)),
        cache,
    )


def test_cache_of_another_layer(small, rng):
    layer, _ = small
    x = np.zeros((1, 1, 16), np.float32)
    other = flashcte.AttentionLayer(16, 2, 2, 8)  # 2 KV heads
    raises(
        ValueError,
        "cache: holds (batch 1, kv_heads 2, head_dim 8, float32) but this call "
        "needs (batch 1, kv_heads 1",
        layer,
        x,
        [[0]],
        other.new_cache(1, 8),
    )
    raises(
        ValueError,
        "cache: holds (batch 1, kv_heads 1, head_dim 4",
        layer,
        x,
        [[0]],
        flashcte.AttentionLayer(8, 2, 1, 4).new_cache(1, 8),
    )
    raises(
        ValueError,
        "cache: holds (batch 1, kv_heads 1, head_dim 8, bfloat16)",
        layer,
        x,
        [[0]],
        flashcte.AttentionLayer(16, 2, 1, 8, dtype="bfloat16").new_cache(1, 8),
    )
    raises(ValueError, "cache: holds (batch 2,", layer, x, [[0]], layer.new_cache(2, 8))
    raises(TypeError, "cache: expected a flashcte.KvCache", layer, x, [[0]], object())


def test_bad_config():
    L = flashcte.AttentionLayer
    raises(ValueError, "num_kv_heads: must divide num_heads", L, 16, 4, 3, 4)
    raises(ValueError, "hidden_size: must be >= 1", L, 0, 4, 2, 4)
    raises(ValueError, "rotary_dim: must be even", L, 16, 2, 1, 8, rotary_dim=5)
    raises(ValueError, "rotary_dim: must be even", L, 16, 2, 1, 8, rotary_dim=10)
    raises(ValueError, "rope_theta: must be finite and > 0", L, 16, 2, 1, 8, rope_theta=0)
    raises(ValueError, "sliding_window: must be >= 0", L, 16, 2, 1, 8, sliding_window=-1)
    raises(ValueError, "qk_scale: must not be 0", L, 16, 2, 1, 8, qk_scale=0)
    raises(
        TypeError,
        "dtype: must be float32, bfloat16 or float16, got 'int8'",
        L,
        16,
        2,
        1,
        8,
        dtype="int8",
    )
    raises(TypeError, "hidden_size: must be an int", L, 16.5, 2, 1, 8)
    raises(
        ValueError,
        "rope_scaling: rope_type 'yarn' is not supported",
        L,
        16,
        2,
        1,
        8,
        rope_scaling={"rope_type": "yarn", "factor": 4.0},
    )
    raises(
        ValueError,
        "rope_scaling: rope_type 'linear' is not supported",
        L,
        16,
        2,
        1,
        8,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    raises(
        ValueError,
        "rope_scaling: unknown keys ['beta_fast']",
        L,
        16,
        2,
        1,
        8,
        rope_scaling={"rope_type": "llama3", "beta_fast": 32},
    )
    # transformers 5's rope_parameters carry rope_theta: it must agree.
    raises(
        ValueError,
        "rope_scaling: holds rope_theta 500000, but the layer's rope_theta is 10000",
        L,
        16,
        2,
        1,
        8,
        rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0},
    )
    assert L(16, 2, 1, 8, rope_theta=5e5, rope_scaling={"rope_type": "default", "rope_theta": 5e5})
    raises(
        ValueError,
        "rope_scaling: low_freq_factor and high_freq_factor must differ",
        L,
        16,
        2,
        1,
        8,
        rope_scaling={"rope_type": "llama3", "low_freq_factor": 2.0, "high_freq_factor": 2.0},
    )
    raises(TypeError, "rope_scaling: expected None or a dict", L, 16, 2, 1, 8, rope_scaling=8.0)
    raises(
        ValueError,
        "rope_scaling, rotary_dim: given, but rope=False",
        L,
        16,
        2,
        1,
        8,
        rope=False,
        rotary_dim=4,
    )
    raises(
        ValueError,
        "sinks: shape (3,) must be (num_heads,) = (2,)",
        L,
        16,
        2,
        1,
        8,
        sinks=np.zeros(3),
    )


def test_bad_weights(rng):
    cfg = {
        "hidden_size": 16,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 4,
        "dtype": "float32",
        "qkv_bias": True,
    }
    w = make_weights(cfg, rng)
    layer = make_layer(cfg)
    raises(
        ValueError,
        "k_proj: shape (16, 4) must be (out_features, in_features) = (4, 16); this "
        "is the transpose",
        layer.set_weights,
        **dict(w, k_proj=w["k_proj"].T),
    )
    raises(
        ValueError,
        "q_proj: shape (8, 15) must be",
        layer.set_weights,
        **dict(w, q_proj=w["q_proj"][:, :15]),
    )
    raises(
        ValueError,
        "q_bias: required, the layer was built with qkv_bias=True",
        layer.set_weights,
        **dict(w, q_bias=None),
    )
    raises(
        ValueError,
        "o_bias: given, but the layer was built with o_bias=False",
        layer.set_weights,
        **dict(w, o_bias=np.zeros(16)),
    )
    raises(
        ValueError,
        "v_bias: shape (5,) must be (out_features,) = (4,)",
        layer.set_weights,
        **dict(w, v_bias=np.zeros(5)),
    )
    bad = w["q_proj"].copy()
    bad[1, 2] = np.nan
    raises(ValueError, "q_proj: element 18 is not finite", layer.set_weights, **dict(w, q_proj=bad))
    raises(
        TypeError,
        "o_proj: dtype must be a float type, got bool",
        layer.set_weights,
        **dict(w, o_proj=w["o_proj"] > 0),
    )
    assert not layer.has_weights  # a failed set_weights keeps the layer as it was
    layer.set_weights(**w)
    assert layer.has_weights


def test_bad_cache_use(small):
    layer, cache = small
    raises(ValueError, "b: must be in [0, batch = 1), got 1", cache.reset, 1)
    raises(ValueError, "max_len: must be >= 1, got 0", layer.new_cache, 1, 0)
    raises(ValueError, "batch: must be >= 1, got 0", layer.new_cache, 0, 8)
    with pytest.raises(ValueError):
        cache.keys[0, 0, 0, 0] = 1.0  # read-only view
