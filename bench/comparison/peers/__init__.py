"""The implementations the worker times in its own Python process, one file per framework:
flashcte itself (the reference of every cross-check), PyTorch, ONNX Runtime, OpenVINO, ggml.
sgemm and materialized are timed by the flashcte CLI (cli.py)."""

from __future__ import annotations

from .base import PyImpl, Skipped, Unsupported, np_dtype
from .flashcte_py import FlashImpl, FlashTorchImpl
from .ggml_flash import GgmlDecodeImpl, GgmlF16Impl, GgmlF32Impl
from .onnxruntime_ops import OrtImpl
from .openvino_sdpa import OpenVinoImpl
from .torch_sdpa import TorchDecodeImpl, TorchImpl, TorchPagedDecodeImpl

PY_IMPLS = {"flashcte": FlashImpl, "flashcte-torch": FlashTorchImpl, "torch": TorchImpl,
            "ort-mha": OrtImpl, "ort-gqa": OrtImpl, "ort-attention": OrtImpl,
            "openvino": OpenVinoImpl, "ggml-f16": GgmlF16Impl, "ggml-f32": GgmlF32Impl}

__all__ = ["PY_IMPLS", "GgmlDecodeImpl", "PyImpl", "Skipped", "TorchDecodeImpl",
           "TorchPagedDecodeImpl", "Unsupported", "np_dtype"]
