"""Tiny random-weight decoders of the architectures whose attention differs (Llama; Mistral with
a sliding window; Qwen2; Gemma 2 with soft-capping, a query scalar and a sliding window; gpt-oss
with sinks and a sliding window; DeepSeek-V3's MLA), each with the transformers attention it is
compared against: sdpa, or eager where the model has no sdpa. Shared by test_transformers.py and
test_continuous_batching.py; skipped where the installed transformers lacks a model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

VOCAB = 97


def config(name, **overrides):
    """A tiny random-weight config of `name` (`overrides` replace its fields) and the reference
    attention; skips the test when the installed transformers lacks the model."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        initializer_range=0.2,
    )
    if name in ("mistral", "gemma2", "gpt_oss"):
        fields["sliding_window"] = 6
    if name == "gemma2":
        fields["head_dim"] = 16
        fields["query_pre_attn_scalar"] = 8  # scaling 8**-0.5, not head_dim**-0.5
        fields["attn_logit_softcapping"] = 1.5  # binds: the scores reach a few units
        fields["final_logit_softcapping"] = None
    if name == "gpt_oss":
        fields["head_dim"] = 16
        # every expert for every token: the router stays continuous, so bf16 rounding cannot
        # flip a token to other experts (a jump that is no attention error)
        fields["num_local_experts"] = 2
        fields["num_experts_per_tok"] = 2
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    if name == "deepseek_v3":  # MLA: a latent of 16 shared by 4 heads; rope and nope parts
        fields.update(
            num_key_value_heads=4,
            max_position_embeddings=512,
            moe_intermediate_size=32,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=2,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=2,  # both layers dense: no router to flip
        )
    fields.update(overrides)
    classes = dict(
        llama=("LlamaConfig", "sdpa"),
        mistral=("MistralConfig", "sdpa"),
        qwen2=("Qwen2Config", "sdpa"),
        gemma2=("Gemma2Config", "eager"),
        gpt_oss=("GptOssConfig", "eager"),
        deepseek_v3=("DeepseekV3Config", "sdpa"),
    )
    cls, ref = classes[name]
    try:
        return getattr(transformers, cls)(**fields), ref
    except (AttributeError, TypeError, ValueError) as e:  # an older transformers
        pytest.skip(f"transformers {transformers.__version__} has no usable {name} config: {e}")


MODELS = ["llama", "mistral", "qwen2", "gemma2", "gpt_oss"]


def model(name, dtype=torch.float32, **overrides):
    """The tiny model `name` in `dtype`, eval mode, and its reference attention."""
    cfg, ref = config(name, **overrides)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=ref)
    with torch.no_grad():
        for mod in m.modules():
            if hasattr(mod, "sinks"):  # gpt-oss: sinks that matter (initialised near 0)
                mod.sinks.normal_(0.0, 1.0)
    return m.to(dtype).eval(), ref
