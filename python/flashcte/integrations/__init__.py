"""Integrations of flashcte with other libraries (imported on demand, never by ``import flashcte``).

* :mod:`flashcte.integrations.transformers`: ``register()`` makes ``"attention_cte"`` a Hugging Face
  transformers attention implementation; ``enable_continuous_batching()`` runs transformers'
  continuous batching (``generate_batch``) with it on flashcte's paged attention.
* :mod:`flashcte.integrations.flash_attn`: FlashAttention's private ``_flash_attn_forward`` /
  ``_flash_attn_varlen_forward`` on flashcte, and ``install()``, which puts a ``flash_attn``
  package made of them into ``sys.modules`` (ring-attention code written for FlashAttention then
  runs on the CPU unchanged).
"""
