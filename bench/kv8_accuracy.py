#!/usr/bin/env python3
"""bench/kv8_accuracy.py: what an 8-bit KV cache costs in accuracy, the format's own error (the
kernel adds none beyond it: tests/kv8_prefill_test.cc, tests/layer/attention_layer_test.cc).

    build/python-venv/bin/python bench/kv8_accuracy.py [--part decode|layer|model|all]

Three tables, each against the same computation on a bfloat16 (or float32) cache:
* decode: one decode step of a Llama-3-8B-shaped attention (32/8 heads, d = 128) over --cached
  tokens through flashcte.flash_attn_with_kvcache, the 8-bit cache quantized from the bf16 one
  (flashcte.quantize_kv, per tensor and per token). Keys have a few outlier channels
  (x --outlier), as real models' keys do, values do not;
* layer: a random Llama-3-8B-shaped flashcte.AttentionLayer (hidden 4096, 32/8 heads, d 128,
  rope_theta 500000 with Llama-3 scaling, bf16 activations): a --prompt-token prefill, then
  --steps decode steps, with kv_cache_dtype int8 / float8_e4m3 / float8_e5m2 against the bf16
  cache: the relative RMS and largest error of the layer's output;
* model: a tiny random transformers LlamaForCausalLM whose attention runs on flashcte
  AttentionLayers (flashcte_logits): the logits of a prefill and decode steps with each cache
  against the float32 cache's (which equal transformers' own to 1e-4), and how often the
  argmax token agrees. python/tests/test_kv8_model.py runs the same model.

Random weights have no outlier channels, and random models no structure: the figures rank the
formats and bound their cost, they do not predict a trained model's perplexity.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

import flashcte


FORMATS = ("int8", "float8_e4m3", "float8_e5m2")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("decode", "layer", "model", "all"), default="all")
    p.add_argument("--cached", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--outlier", type=float, default=8.0)
    p.add_argument("--prompt", type=int, default=1024, help="layer: prefill tokens")
    p.add_argument("--steps", type=int, default=16, help="layer and model: decode steps")
    return p.parse_args()


def errors(got, want) -> tuple[float, float]:
    """Relative RMS error and largest absolute error of `got` against `want`."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = got - want
    return float(np.sqrt((err**2).mean() / (want**2).mean())), float(np.abs(err).max())


def run_layer(layer, prompt, steps, x):
    """The layer's output over a prefill of `prompt` tokens of x (1, prompt + steps, hidden),
    then `steps` decode steps, one token each: (prefill output, decode outputs)."""
    cache = layer.new_cache(1, prompt + steps)
    pos = np.arange(prompt + steps, dtype=np.int64)[None]
    pre = np.asarray(layer(x[:, :prompt], pos[:, :prompt], cache)).astype(np.float64)
    dec = [
        np.asarray(layer(x[:, t : t + 1], pos[:, t : t + 1], cache)).astype(np.float64)
        for t in range(prompt, prompt + steps)
    ]
    return pre, np.concatenate(dec, axis=1)


def layer_table(a) -> None:
    rng = np.random.default_rng(1)
    hidden, heads, kv_heads, d = 4096, 32, 8, 128
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

    def linear(out_f, in_f):  # unit gain, as a trained layer's projections roughly are
        return (rng.standard_normal((out_f, in_f), np.float32) / np.sqrt(in_f)).astype(np.float32)

    weights = (linear(heads * d, hidden), linear(kv_heads * d, hidden),
               linear(kv_heads * d, hidden), linear(hidden, heads * d))
    x = rng.standard_normal((1, a.prompt + a.steps, hidden), np.float32).astype(ml_dtypes.bfloat16)
    outputs = {}
    for fmt in (None, *FORMATS):
        layer = flashcte.AttentionLayer(hidden, heads, kv_heads, d, rope_theta=500000.0,
                                        rope_scaling=scaling, dtype="bfloat16",
                                        kv_cache_dtype=fmt)
        layer.set_weights(*weights)
        outputs[fmt] = run_layer(layer, a.prompt, a.steps, x)
    print(f"\nLlama-3-8B-shaped AttentionLayer (random weights, bf16 activations): prefill "
          f"{a.prompt} tokens, then {a.steps} decode steps; output against the bf16 cache's")
    print(f"{'kv_cache_dtype':14} {'prefill rel_rms':>16} {'max_abs':>9} {'decode rel_rms':>15} "
          f"{'max_abs':>9}")
    for fmt in FORMATS:
        (pr, pm), (dr, dm) = (errors(outputs[fmt][i], outputs[None][i]) for i in (0, 1))
        print(f"{fmt:14} {pr:16.2e} {pm:9.2e} {dr:15.2e} {dm:9.2e}")


def tiny_llama(seed: int = 0):
    """A tiny random-weight transformers LlamaForCausalLM (float32, eager attention)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


def flashcte_logits(model, ids, prompt: int, dtype="float32", kv_cache_dtype=None):
    """The logits (1, len(ids), vocab) of a transformers Llama whose attention modules run as
    flashcte.AttentionLayers, each with its own cache: ids[:prompt] as one prefill, then one
    decode step per remaining token. Everything else is the model's own modules."""
    import torch

    cfg = model.config
    theta = getattr(cfg, "rope_parameters", None) or {}
    theta = theta.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = []
    for block in model.model.layers:
        att = block.self_attn
        layer = flashcte.AttentionLayer(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
            rope_theta=theta, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        )
        layer.set_weights(att.q_proj.weight, att.k_proj.weight, att.v_proj.weight,
                          att.o_proj.weight)
        layers.append((block, layer, layer.new_cache(1, ids.shape[1])))
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    chunks = [(0, prompt)] + [(t, t + 1) for t in range(prompt, ids.shape[1])]
    logits = []
    with torch.no_grad():
        for start, end in chunks:
            h = model.model.embed_tokens(ids[:, start:end])
            pos = torch.arange(start, end)[None]
            for block, layer, cache in layers:
                attn = layer(block.input_layernorm(h).to(torch_dtype), pos, cache)
                h = h + attn.to(h.dtype)
                h = h + block.mlp(block.post_attention_layernorm(h))
            logits.append(model.lm_head(model.model.norm(h)))
    return torch.cat(logits, dim=1)


def model_table(a) -> None:
    import torch

    model = tiny_llama()
    ids = torch.randint(2, 97, (1, 32 + a.steps), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = model(ids).logits.double().numpy()
    base = flashcte_logits(model, ids, 32).double().numpy()
    print(f"\ntiny random LlamaForCausalLM (hidden 64, 2 layers, 4/2 heads, d 16) on flashcte "
          f"layers: a 32-token prefill, {a.steps} decode steps; logits against the float32 "
          f"cache's (which are transformers' own within {errors(base, hf)[0]:.1e} rel_rms)")
    print(f"{'cache':14} {'rel_rms':>9} {'max_abs':>9} {'argmax agrees':>14}")
    for dtype, fmt in (("bfloat16", None), *(("float32", f) for f in FORMATS)):
        got = flashcte_logits(model, ids, 32, dtype, fmt).double().numpy()
        rel, top = errors(got, base)
        agree = (got.argmax(-1) == base.argmax(-1)).mean()
        print(f"{fmt or 'bfloat16':14} {rel:9.2e} {top:9.2e} {agree:14.1%}")


def decode_table(a) -> None:
    rng = np.random.default_rng(0)
    heads, kv_heads, d = 32, 8, 128
    bf16 = np.dtype(ml_dtypes.bfloat16)
    k = rng.standard_normal((a.batch, a.cached, kv_heads, d), np.float32)
    k[..., rng.choice(d, 4, replace=False)] *= a.outlier
    v = rng.standard_normal((a.batch, a.cached, kv_heads, d), np.float32)
    q = rng.standard_normal((a.batch, 1, heads, d), np.float32) * 2
    k, v, q = k.astype(bf16), v.astype(bf16), q.astype(bf16)
    lens = np.full(a.batch, a.cached, np.int32)
    want = np.asarray(flashcte.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)).astype(
        np.float64
    )
    print(f"decode over {a.cached} cached tokens, batch {a.batch}, 32/8 heads, d 128, bf16 q, "
          f"key outlier channels x{a.outlier}: output against the bf16 cache's")
    print(f"{'format':14} {'scale':9} {'rel_rms':>9} {'max_abs':>9}")
    for fmt in ("int8", "float8_e4m3fn", "float8_e5m2"):
        for granularity in ("tensor", "token"):
            caches, scales = [], []
            for x in (k, v):
                codes = np.zeros(x.shape, np.dtype(fmt))
                if granularity == "tensor":
                    top = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[fmt]
                    scale = np.array([np.abs(x.astype(np.float32)).max() / top], np.float32)
                    for b in range(a.batch):
                        flashcte.quantize_kv(x[b], codes[b], scale)
                else:
                    scale = np.zeros(x.shape[:3], np.float32)
                    for b in range(a.batch):
                        flashcte.quantize_kv(x[b], codes[b], scale[b])
                caches.append(codes)
                scales.append(scale)
            got = np.asarray(
                flashcte.flash_attn_with_kvcache(
                    q, caches[0], caches[1], cache_seqlens=lens, k_scale=scales[0],
                    v_scale=scales[1],
                )
            ).astype(np.float64)
            err = got - want
            rel = np.sqrt((err**2).mean() / (want**2).mean())
            print(f"{fmt:14} {granularity:9} {rel:9.2e} {np.abs(err).max():9.2e}")


def main():
    a = parse_args()
    for part, table in (("decode", decode_table), ("layer", layer_table), ("model", model_table)):
        if a.part in (part, "all"):
            table(a)


if __name__ == "__main__":
    main()
