"""The refusals of an argument, defined by the native module (which raises them too):
``ArgumentError`` (a value or shape breaks a rule) is a ValueError and ``ArgumentTypeError`` (a
dtype or type) a TypeError, and both are RuntimeErrors, as PyTorch's and FlashAttention's
argument checks (``TORCH_CHECK``) raise: code written for either catches flashcte's refusals the
way it catches theirs, and code that catches ValueError / TypeError keeps working. The message is
``"<argument>: <rule>"``."""

from ._flashcte import ArgumentError, ArgumentTypeError

__all__ = ["ArgumentError", "ArgumentTypeError"]
