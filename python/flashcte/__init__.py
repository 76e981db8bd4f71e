"""flashcte: the Neuron ``attention_cte`` prefill flash-attention kernel on the CPU.

Functions:
    attention_cte: the Neuron kernel's signature and layouts (batch and heads folded).
    flash_attn_func, flash_attn_varlen_func: FlashAttention's interface on top of it.
    simd_target: the SIMD instruction set the library dispatched to on this machine.

Inputs are numpy arrays (float32, float16; bfloat16 through ``ml_dtypes``) or DLPack tensors
(torch.Tensor in float32, float16, bfloat16), read without copying; outputs come back in the
kind of ``q``. Errors raise TypeError (dtypes) or ValueError with the library's
``"<argument>: <rule>"`` message.
"""

from ._attention import attention_cte
from ._flash_attn import flash_attn_func, flash_attn_varlen_func
from ._flashcte import simd_target

__version__ = "0.1.0"
__all__ = ["attention_cte", "flash_attn_func", "flash_attn_varlen_func", "simd_target"]
