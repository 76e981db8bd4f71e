"""flashcte: the Neuron ``attention_cte`` prefill flash-attention kernel on the CPU, and
optimum-neuron's attention layer around it.

Functions:
    attention_cte: the Neuron kernel's signature and layouts (batch and heads folded).
    flash_attn_func, flash_attn_varlen_func: FlashAttention's interface on top of it.
    flash_attn_with_kvcache: FlashAttention's serving call: append to a dense or paged KV cache
        in place (rotary included) and attend it.
    paged_attention: a mixed batch (prefill chunks and decoding sequences) over a paged cache in
        vLLM's shapes, in one call; flash_attn_varlen_func(block_table=...) is the same call in
        FlashAttention's.
    plan_paged_attention: paged_attention's step planned once and run in every layer
        (PagedAttentionPlan.run), FlashInfer's plan() / run().
    quantize_kv: K or V rows into an 8-bit cache format (int8, float8_e4m3fn, float8_e5m2)
        with per-tensor, per-head or per-token scales, for engines that write their own cache.
    simd_target: the SIMD instruction set the library dispatched to on this machine.
    layer_gemm_backend: the GEMM library the layer's projections run on.

Classes:
    AttentionLayer: optimum-neuron's attention layer (projections, RoPE, KV cache write,
        prefill/decode attention, O projection) with weights in torch.nn.Linear layout.
    KvCache: one layer's KV cache, from AttentionLayer.new_cache(batch, max_len).
    PagedAttentionPlan: a planned serving step, from plan_paged_attention.
    ArgumentError, ArgumentTypeError: the refusals of an argument (below).

Inputs are numpy arrays (float32, float16; bfloat16 through ``ml_dtypes``) or DLPack tensors
(torch.Tensor in float32, float16, bfloat16), read without copying; outputs come back in the
kind of ``q``. A refused argument raises ArgumentTypeError (a dtype or type; a TypeError) or
ArgumentError (a value or shape; a ValueError) with the library's ``"<argument>: <rule>"``
message, the argument in the called function's own name (``paged_attention``'s ``seq_lens``, not
the native ``seqused_k``). Both are also RuntimeErrors, as PyTorch's and FlashAttention's
argument checks raise: code written for those catches flashcte's refusals the same way. A failed
allocation raises MemoryError, a library bug RuntimeError. The kind is the library's
``Status::kind``.
"""

from ._attention import attention_cte
from ._blas import register_scipy_openblas
from ._errors import ArgumentError, ArgumentTypeError
from ._flash_attn import flash_attn_func, flash_attn_varlen_func
from ._flashcte import simd_target, version
from ._kvcache import flash_attn_with_kvcache, quantize_kv
from ._paged import PagedAttentionPlan, paged_attention, plan_paged_attention
from ._layer import AttentionLayer, layer_gemm_backend
from ._layer_cache import KvCache

# The layer's OpenBLAS when the system has none: pip's scipy-openblas32, if installed (_blas.py).
register_scipy_openblas()

# The C++ library's version, which CMakeLists.txt's project(VERSION) sets, as the wheel's is.
__version__ = version()
del register_scipy_openblas, version
__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "AttentionLayer",
    "KvCache",
    "PagedAttentionPlan",
    "attention_cte",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "layer_gemm_backend",
    "paged_attention",
    "plan_paged_attention",
    "quantize_kv",
    "simd_target",
]
