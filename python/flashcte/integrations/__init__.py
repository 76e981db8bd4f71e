"""Integrations of flashcte with other libraries (imported on demand, never by ``import flashcte``).

* :mod:`flashcte.integrations.transformers`: ``register()`` makes ``"attention_cte"`` a Hugging Face
  transformers attention implementation.
"""
