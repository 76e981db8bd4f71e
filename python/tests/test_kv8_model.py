"""An 8-bit KV cache in a whole (tiny) model: a random transformers LlamaForCausalLM whose
attention modules run as flashcte.AttentionLayers with kv_cache_dtype, a prefill then decode
steps (bench/kv8_accuracy.py's model, imported from there so that the table in
docs/benchmarks/README.md and this test run the same code).

The float32 cache must give transformers' own logits (1e-4). The 8-bit caches carry their
formats' rounding through two layers; the bounds are 3x what a correct quantization gave when
this test was written (rel RMS of the logits: int8 0.015, e4m3 0.082, e5m2 0.146 on an AMD EPYC
Zen 4; every build and SIMD target quantizes identically, quantize_kv being scalar), while a wrong
scale, axis or format moves the logits by O(1).
"""

from __future__ import annotations

import importlib.util
import math
import pathlib

import numpy as np
import pytest
from conftest import as_f64, nonfinite_mismatch

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "kv8_accuracy.py"
_spec = importlib.util.spec_from_file_location("kv8_accuracy", _BENCH)
kv8_accuracy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kv8_accuracy)

BOUNDS = {"int8": 0.05, "float8_e4m3": 0.25, "float8_e5m2": 0.45}


def rel_rms(got, want) -> float:
    """The relative RMS error over want's finite entries; inf when the non-finite entries differ
    (conftest.nonfinite_mismatch: a NaN or Inf logit want does not have)."""
    got, want = as_f64(got), as_f64(want)
    if nonfinite_mismatch(got, want) is not None:
        return math.inf
    finite = np.isfinite(want)
    return kv8_accuracy.errors(got[finite], want[finite])[0]


@pytest.fixture(scope="module")
def model_and_ids():
    model = kv8_accuracy.tiny_llama()
    ids = torch.randint(2, 97, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = model(ids).logits
    return model, ids, hf


def test_float32_cache_gives_transformers_logits(model_and_ids):
    model, ids, hf = model_and_ids
    assert rel_rms(kv8_accuracy.flashcte_logits(model, ids, 32), hf) < 1e-4


@pytest.mark.parametrize("fmt", list(BOUNDS))
def test_8bit_cache_logits(model_and_ids, fmt):
    model, ids, hf = model_and_ids
    got = kv8_accuracy.flashcte_logits(model, ids, 32, kv_cache_dtype=fmt)
    err = rel_rms(got, hf)
    assert err < BOUNDS[fmt], f"{fmt}: logits rel RMS {err:.3g} >= {BOUNDS[fmt]}"
    assert np.isfinite(got.numpy()).all()
