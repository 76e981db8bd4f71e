"""flashcte.distributed.TensorParallelAttention with real processes: 4 ranks spawned once for the
module (gloo over loopback), process groups of 2, 3 and 4 ranks, every case on each group size it
names. Each rank runs a whole conversation (a prefill chunk, a second chunk over the cached
prefix, decode steps, a speculation chunk) through the tensor-parallel layer and through the
single-process flashcte.AttentionLayer with the same seeded weights, and compares every output.

Tolerances: float32 within ``1e-5 * max|ref|`` (the rule of test_distributed.py and of the C++
tensor-parallel test: the sharded and the whole layer differ only in the order of float32 sums);
16-bit layers round each rank's partial output to the dtype before the sum, one rounding more
than the whole layer: the Neuron suite's 2e-2.

Failures (a group size that is not tp_degree, heads the strategy cannot shard, arguments, weights
or inputs that differ between ranks, a failure while computing, a rank that never calls) must
raise on every rank with the failing rank's message, or after the timeout, never hang.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
safetensors_torch = pytest.importorskip("safetensors.torch")

import _ranks  # python/tests/_ranks.py: the spawned ranks
import flashcte
from conftest import check_close
from layer_model import HF_NAMES, cut_shard
from flashcte import distributed as fd

WORLD = 4
WAIT = 30.0  # seconds: every collective's timeout in the cases
SPAWN_DEADLINE = 300.0

# ---- the model ---------------------------------------------------------------------------------


def make_weights(cfg: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_heads"] * d, cfg["num_kv_heads"] * d

    def linear(out_f, in_f):
        return (rng.standard_normal((out_f, in_f)) / math.sqrt(in_f)).astype(np.float32)

    def vec(n, scale=0.5):
        return (rng.standard_normal(n) * scale).astype(np.float32)

    w = {"q_proj": linear(q, h), "k_proj": linear(kv, h), "v_proj": linear(kv, h)}
    w["o_proj"] = linear(h, q)
    if cfg.get("qkv_bias"):
        w.update(q_bias=vec(q), k_bias=vec(kv), v_bias=vec(kv))
    if cfg.get("o_bias"):
        w["o_bias"] = vec(h, 2.0)  # large: an o_bias added tp times, or never, shows
    if cfg.get("qk_norm"):
        w.update(q_norm=1 + vec(d, 0.3), k_norm=1 + vec(d, 0.3))
    return w


def layer_args(cfg: dict, seed: int) -> dict:
    args = {k: v for k, v in cfg.items() if k not in ("num_heads", "num_kv_heads", "hidden_size")}
    if args.pop("sinks", False):
        args["sinks"] = np.random.default_rng(seed + 1).standard_normal(cfg["num_heads"])
    return args


def rows(*start_and_count) -> np.ndarray:
    return np.stack([np.arange(s, s + n, dtype=np.int64) for s, n in start_and_count])


# Batch 2, max_len 64: a 24-token prefill (attention_cte); a 20-token chunk continuing row 0 and
# rewriting row 1 from position 10 (prefix caching at two prior lengths); two decode steps and a
# 3-token speculation chunk (the decode kernel).
CONVERSATION = [
    rows((0, 24), (0, 24)),
    rows((24, 20), (10, 20)),
    rows((44, 1), (30, 1)),
    rows((45, 1), (31, 1)),
    rows((46, 3), (32, 3)),
]


def assert_close(got, ref, dtype: str, what: str) -> None:
    check_close(got, ref, rtol=1e-5 if dtype == "float32" else 2e-2, what=what)


def as_numpy(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.to(torch.float32).numpy()
    return np.asarray(a).astype(np.float32)


def tp_case(
    cfg: dict,
    *,
    torch_in: bool = True,
    gqa_strategy: str = "auto",
    local_heads: dict | None = None,
    block_size: int = 0,
    weights_from: str = "full",
):
    """The conversation through TensorParallelAttention on the group and through the whole
    layer, on every rank; ``local_heads[p]`` = (query heads, KV heads) a rank holds at tp p.
    With ``block_size``, the ranks' caches are block pools with the same shuffled pages on every
    rank (the whole layer keeps a dense cache). The ranks' weights: the full ones on every rank
    ("full"), each rank's own shard as tensors ("shard"), or read by each rank from a
    safetensors file of the full layer ("safetensors")."""

    def run(rank, p, group):
        seed = 11
        args = layer_args(cfg, seed)
        weights = make_weights(cfg, seed)
        h, heads, kv = cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"]
        whole = flashcte.AttentionLayer(h, heads, kv, **args)
        whole.set_weights(**weights)
        tp = fd.TensorParallelAttention(
            h, heads, kv, gqa_strategy=gqa_strategy, group=group, timeout=WAIT, **args
        )
        if local_heads is not None and p in local_heads:
            got = (tp.local_num_heads, tp.local_num_kv_heads)
            assert got == local_heads[p], f"local heads {got} != {local_heads[p]} at tp {p}"
        assert tp.tp_degree == p and tp.tp_rank == rank
        if weights_from == "full":
            tp.set_weights(**{k: torch.from_numpy(v) for k, v in weights.items()})
        elif weights_from == "shard":
            shard = cut_shard(weights, tp.layer, o_bias=True)
            tp.set_weights(**{k: torch.from_numpy(v) for k, v in shard.items()}, shard=True)
        else:
            path = Path(tempfile.gettempdir()) / f"flashcte_tp_{os.getpid()}.safetensors"
            safetensors_torch.save_file(
                {"attn." + HF_NAMES[k]: torch.from_numpy(v) for k, v in weights.items()}, path
            )
            try:
                tp.load_safetensors(path, "attn.")
            finally:
                path.unlink()
        cache, whole_cache = tp.new_cache(2, 64), whole.new_cache(2, 64)
        if block_size:
            pages = 64 // block_size
            order = np.random.default_rng(5).permutation(2 * pages + 1)
            cache = tp.new_paged_cache(2, 2 * pages + 1, block_size)
            for b in range(2):
                cache.assign(b, order[b * pages : (b + 1) * pages])
        assert cache.kv_heads == tp.local_num_kv_heads
        g = torch.Generator().manual_seed(3)
        dtype = cfg.get("dtype", "float32")
        for step, positions in enumerate(CONVERSATION):
            x = torch.randn(2, positions.shape[1], h, generator=g).to(getattr(torch, dtype))
            xin = x if torch_in else x.to(torch.float32).numpy()
            out = tp(xin, positions, cache)
            ref = whole(xin, positions, whole_cache)
            assert type(out) is type(ref), f"{type(out)} != {type(ref)}"
            assert str(out.dtype) == str(ref.dtype), f"dtype {out.dtype} != {ref.dtype}"
            assert_close(as_numpy(out), as_numpy(ref), dtype, f"call {step} at tp {p}")
        assert cache.lengths.tolist() == whole_cache.lengths.tolist()

    return run


BASE = {"hidden_size": 32, "head_dim": 8, "rope_theta": 10000.0}

# ---- failures ----------------------------------------------------------------------------------


def _expect_everywhere(exc_type, *needles):
    """A check that its call raises exc_type naming every needle (_ranks.raises)."""
    return lambda call: _ranks.raises(exc_type, call, *needles)


def group_size_is_not_tp_degree(rank, p, group):
    _expect_everywhere(ValueError, "tp_degree: 4 must be the process group's size 2")(
        lambda: fd.TensorParallelAttention(32, 4, 2, 8, tp_degree=4, group=group, timeout=WAIT)
    )


def strategy_cannot_shard(rank, p, group):
    _expect_everywhere(
        ValueError, f"{p} of {p} ranks failed", "num_kv_heads: REPLICATE_TO_TP_DEGREE"
    )(
        lambda: fd.TensorParallelAttention(
            24, 6, 3, 8, gqa_strategy="replicate-to-tp-degree", group=group, timeout=WAIT
        )
    )


def arguments_differ_across_ranks(rank, p, group):
    _expect_everywhere(
        ValueError, "every rank must pass the same num_heads", "rank 0 has 4", f"rank {p - 1} has 8"
    )(
        lambda: fd.TensorParallelAttention(
            32, 8 if rank == p - 1 else 4, 2, 8, group=group, timeout=WAIT
        )
    )


def weights_bad_on_one_rank(rank, p, group):
    cfg = dict(BASE, hidden_size=24, num_heads=4, num_kv_heads=2)
    w = make_weights(cfg, 1)
    tp = fd.TensorParallelAttention(24, 4, 2, 8, group=group, timeout=WAIT)
    if rank == 1:
        w["q_proj"] = w["q_proj"].T
    _expect_everywhere(
        ValueError, "rank 1: ArgumentError: q_proj: shape (24, 32) must be", "the transpose"
    )(lambda: tp.set_weights(**w))


def inputs_differ_across_ranks(rank, p, group):
    cfg = dict(BASE, num_heads=4, num_kv_heads=2)
    tp = fd.TensorParallelAttention(32, 4, 2, 8, group=group, timeout=WAIT)
    tp.set_weights(**make_weights(cfg, 2))
    cache = tp.new_cache(1, 32)
    n = 7 if rank == p - 1 else 6
    x = torch.zeros(1, n, 32)
    _expect_everywhere(ValueError, "every rank must pass the same x shape", f"rank {p - 1} has")(
        lambda: tp(x, rows((0, n)), cache)
    )
    x = torch.zeros(1, 6, 32)
    start = 1 if rank == p - 1 else 0  # same shape, other positions: a desynchronized caller
    _expect_everywhere(
        ValueError, "every rank must pass the same positions (each row's first): rank 0 has [0]"
    )(lambda: tp(x, rows((start, 6)), cache))
    assert cache.lengths.tolist() == [0]  # refused before any rank wrote its cache


def failure_while_computing(rank, p, group):
    # A bad num_threads passes the agreement and fails inside the last rank's layer: every rank
    # takes part in the all_reduce, sees the error flag and raises the last rank's message.
    cfg = dict(BASE, num_heads=4, num_kv_heads=2)
    tp = fd.TensorParallelAttention(32, 4, 2, 8, group=group, timeout=WAIT)
    tp.set_weights(**make_weights(cfg, 3))
    cache = tp.new_cache(1, 32)
    x = torch.ones(1, 5, 32)
    _expect_everywhere(ValueError, f"rank {p - 1}: ArgumentError: num_threads: must be >= 0")(
        lambda: tp(x, rows((0, 5)), cache, num_threads=-1 if rank == p - 1 else 1)
    )
    # The group is still usable afterwards.
    out = tp(x, rows((0, 5)), tp.new_cache(1, 32))
    assert out.shape == (1, 5, 32)


CASES = {
    # GQA 8/2 at tp 4: REPLICATE_TO_TP_DEGREE (ON's choice), K/V replicated to one head per rank
    "gqa_8_2_replicate": (
        tp_case(
            dict(BASE, num_heads=8, num_kv_heads=2, qkv_bias=True, o_bias=True, sinks=True),
            local_heads={4: (2, 1), 2: (4, 1)},
        ),
        (2, 4),
    ),
    # the same layer, CONVERT_TO_MHA asked for: two KV heads per rank at tp 4
    "gqa_8_2_convert_asked": (
        tp_case(
            dict(BASE, num_heads=8, num_kv_heads=2, o_bias=True),
            gqa_strategy="convert-to-mha",
            local_heads={4: (2, 2)},
        ),
        (4,),
    ),
    # GQA 6/3: CONVERT_TO_MHA with 2 zero pad heads at tp 4 (8 heads), REPLICATE at tp 3,
    # CONVERT without padding at tp 2; numpy in, numpy out
    "gqa_6_3_convert_pad": (
        tp_case(
            dict(
                BASE,
                hidden_size=24,
                num_heads=6,
                num_kv_heads=3,
                o_bias=True,
                qk_norm=True,
                sliding_window=9,
            ),
            torch_in=False,
            local_heads={4: (2, 2), 3: (2, 1), 2: (3, 3)},
        ),
        (2, 3, 4),
    ),
    # MHA: an even split at 2 and 4, 2 pad heads at 3
    "mha_4_4": (
        tp_case(
            dict(BASE, num_heads=4, num_kv_heads=4, qkv_bias=True, rotary_dim=4),
            local_heads={2: (2, 2), 3: (2, 2), 4: (1, 1)},
        ),
        (2, 3, 4),
    ),
    "gqa_8_2_bf16": (
        tp_case(
            dict(
                BASE,
                num_heads=8,
                num_kv_heads=2,
                o_bias=True,
                sinks=True,
                dtype="bfloat16",
                rope_scaling={"rope_type": "llama3", "original_max_position_embeddings": 16},
            ),
        ),
        (2, 4),
    ),
    # a block pool per rank, pages of 8 at shuffled places, the same tables on every rank
    "gqa_8_2_paged": (
        tp_case(
            dict(BASE, num_heads=8, num_kv_heads=2, o_bias=True, sinks=True, sliding_window=12),
            block_size=8,
        ),
        (2,),
    ),
    "gqa_6_3_bf16_numpy": (
        tp_case(
            dict(BASE, hidden_size=24, num_heads=6, num_kv_heads=3, dtype="bfloat16"),
            torch_in=False,
        ),
        (4,),
    ),
    # each rank built from its own shard, never the full weights: tensors, a safetensors file
    "gqa_8_2_shard_tensors": (
        tp_case(
            dict(BASE, num_heads=8, num_kv_heads=2, qkv_bias=True, o_bias=True, sinks=True),
            weights_from="shard",
        ),
        (2, 4),
    ),
    "gqa_6_3_pad_safetensors": (
        tp_case(
            dict(BASE, hidden_size=24, num_heads=6, num_kv_heads=3, o_bias=True, qk_norm=True),
            weights_from="safetensors",
        ),
        (2, 4),
    ),
    "error_group_size_is_not_tp_degree": (group_size_is_not_tp_degree, (2,)),
    "error_strategy_cannot_shard": (strategy_cannot_shard, (4,)),
    "error_arguments_differ": (arguments_differ_across_ranks, (2, 3)),
    "error_weights_bad_on_one_rank": (weights_bad_on_one_rank, (2,)),
    "error_inputs_differ": (inputs_differ_across_ranks, (2, 3)),
    "error_failure_while_computing": (failure_while_computing, (2, 3)),
}


def _absent_rank(rank, group):
    """Rank 1 builds the layer but never calls it: rank 0 raises after its 2 s timeout."""
    cfg = dict(BASE, num_heads=4, num_kv_heads=2)
    tp = fd.TensorParallelAttention(32, 4, 2, 8, group=group, timeout=2.0)
    tp.set_weights(**make_weights(cfg, 4))
    if rank != 0:
        return
    _ranks.raises_in_time(
        lambda: tp(torch.ones(1, 3, 32), rows((0, 3)), tp.new_cache(1, 8)),
        "did not complete within 2 s",
    )


# ---- the processes -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results():
    return _ranks.spawn(__name__, WORLD, SPAWN_DEADLINE)


@pytest.mark.parametrize("key", _ranks.case_keys(CASES, absent_rank=True))
def test_tensor_parallel(results, key):
    _ranks.check(results, key)


# ---- single process ----------------------------------------------------------------------------


def test_rank_layers_sum_to_the_whole_layer():
    """Without processes: AttentionLayer built as each rank (tp_degree, tp_rank, gqa_strategy),
    the partial outputs summed plus o_bias, against the whole layer."""
    cfg = dict(BASE, hidden_size=24, num_heads=6, num_kv_heads=3, o_bias=True)
    w = make_weights(cfg, 5)
    whole = flashcte.AttentionLayer(24, 6, 3, 8, o_bias=True)
    whole.set_weights(**w)
    x = np.random.default_rng(0).standard_normal((1, 20, 24)).astype(np.float32)
    ref = whole(x, rows((0, 20)), whole.new_cache(1, 20))
    for tp, strategy in ((4, "auto"), (4, "convert-to-mha"), (3, "replicate-to-tp-degree")):
        total = w["o_bias"].astype(np.float64)
        for r in range(tp):
            layer = flashcte.AttentionLayer(
                24, 6, 3, 8, o_bias=True, tp_degree=tp, tp_rank=r, gqa_strategy=strategy
            )
            layer.set_weights(**w)
            total = total + layer(x, rows((0, 20)), layer.new_cache(1, 20))
        assert_close(total, ref, "float32", f"tp {tp} {strategy}")


def test_rank_layer_arguments():
    layer = flashcte.AttentionLayer(24, 6, 3, 8, tp_degree=4, tp_rank=3)
    assert (layer.local_num_heads, layer.local_num_kv_heads) == (2, 2)
    assert layer.new_cache(1, 4).kv_heads == 2
    assert "tp_degree=4, tp_rank=3" in repr(layer)
    with pytest.raises(ValueError, match=r"tp_rank: must be in \[0, tp_degree = 4\), got 4"):
        flashcte.AttentionLayer(24, 6, 3, 8, tp_degree=4, tp_rank=4)
    with pytest.raises(ValueError, match="num_kv_heads: REPLICATE_TO_TP_DEGREE replicates"):
        flashcte.AttentionLayer(24, 6, 3, 8, tp_degree=4, gqa_strategy="replicate-to-tp-degree")
    with pytest.raises(ValueError, match="gqa_strategy: must be 'auto', 'replicate-to-tp"):
        flashcte.AttentionLayer(24, 6, 3, 8, tp_degree=2, gqa_strategy="mha")


def test_tensor_parallel_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.TensorParallelAttention(32, 4, 2, 8)
