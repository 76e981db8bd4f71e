"""transformers' continuous batching (``generate_batch``) on flashcte's paged attention.

transformers keeps a continuous batch's K/V in pages: per layer, ``(num_pages, page_size,
kv_heads, d)`` views over one buffer. On the CPU its ``sdpa`` path gathers every request's whole
K/V out of those pages with ``index_select`` in every layer of every step, builds a dense
``(tokens, cached tokens)`` mask, and then attends; its block-table path (the decode "fast path")
is reserved to FlashAttention on CUDA and XPU. :func:`enable_continuous_batching` lets the
``attention_cte`` implementation run it instead:

* each layer writes its new K/V into its pages (transformers' own ``index_copy_``, or one
  indexed store on the decode fast path) and flashcte reads the pages **in place**: one
  ``flash_attn_varlen_func(block_table=...)`` call per layer for the whole step, prefill chunks
  and decodes together. The block table of a mixed step is read off transformers' read index
  (the first token of each page), once per step and layer group;
* decode-only steps take transformers' block-table path, which it opens for ``attention_cte``;
* no attention mask is built (flashcte takes the sequences' lengths);
* sliding-window layers keep transformers' ring-buffer cache and its gather (a ring is not a
  list of pages), and so do MLA models' latent caches; flashcte then attends the gathered keys
  (with the window), per sequence;
* ``s_aux`` (gpt-oss's sinks), ``softcap`` and the layer's ``scaling`` go to the kernel.

It changes five functions of transformers' continuous batching, each at the one place it is
looked up (see :func:`enable_continuous_batching`); other attention implementations see them
unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from .._flash_attn import flash_attn_varlen_func

# The transformers versions this was built and tested against (its continuous batching moves
# quickly; the patched functions are checked for their signatures below, whatever the version).
TESTED_TRANSFORMERS = ("5.25",)

_KEY = "_flashcte_pages"  # what the cache update hands the attention function, per layer


def _modules():
    """transformers' continuous-batching modules, or a RuntimeError naming the version."""
    import transformers

    try:
        from transformers.generation.continuous_batching import (
            cache,
            continuous_api,
            initialization,
            input_outputs,
        )
    except ImportError as e:
        raise RuntimeError(
            f"flashcte: transformers {transformers.__version__} has no continuous batching "
            "(transformers.generation.continuous_batching, with a paged cache that takes "
            f"kwargs; built against transformers {', '.join(TESTED_TRANSFORMERS)}): {e}"
        ) from None
    wanted = {
        (cache.PagedAttentionCache, "update"): [
            "self",
            "key_states",
            "value_states",
            "layer_idx",
            "kwargs",
        ],
        (continuous_api.ContinuousBatchingManager, "switch_to_cb_friendly_attn"): None,
        (initialization, "ensure_decode_fast_path_is_available"): None,
        (input_outputs, "attn_mask_is_needed"): None,
        (cache, "is_flash_attention_requested"): None,
    }
    full = getattr(initialization, "ATTN_TYPE_TO_ALLOCATOR", {}).get("full_attention")
    wanted[(full, "update")] = ["self", "key_states", "value_states", "layer_idx", "read_index",
                                "write_index"]
    wanted[(full, "get_cache_for_block_table")] = ["self", "layer_idx"]
    for (owner, name), params in wanted.items():
        fn = getattr(owner, name, None)
        if fn is None or (params and list(inspect.signature(fn).parameters) != params):
            raise RuntimeError(
                f"flashcte: transformers {transformers.__version__}'s continuous batching differs "
                f"from the one flashcte's continuous batching was built against "
                f"({', '.join(TESTED_TRANSFORMERS)}): {getattr(owner, '__name__', owner)}.{name} "
                f"{'is missing' if fn is None else 'has another signature'}"
            )
    return cache, continuous_api, initialization, input_outputs


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replaces owner.name by make(original), once (the original is kept on the wrapper)."""
    original = getattr(owner, name)
    if getattr(original, "__flashcte_original__", None) is not None:
        return
    wrapper = make(original)
    wrapper.__flashcte_original__ = original
    wrapper.__wrapped__ = original
    setattr(owner, name, wrapper)


def enable_continuous_batching(name: str | None = None) -> str:
    """Lets ``attention_cte`` run transformers' continuous batching on flashcte's paged attention.

        import flashcte.integrations.transformers as fct
        fct.enable_continuous_batching()        # also registers "attention_cte"
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attention_cte")
        outputs = model.generate_batch(prompts, generation_config)

    Idempotent; returns the implementation's name. Raises RuntimeError naming the version when
    transformers has no continuous batching, or one whose internals differ from the version
    this was built against (:data:`TESTED_TRANSFORMERS`). What it changes, for models whose
    ``config._attn_implementation`` is ``attention_cte`` only:

    * ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` keeps ``attention_cte`` (it
      accepts only ``sdpa``, ``paged|eager`` and flash names);
    * ``initialization.ensure_decode_fast_path_is_available`` keeps the block-table decode path
      (FlashAttention-only on CUDA/XPU there) when every layer's cache has pages;
    * ``input_outputs.attn_mask_is_needed`` says no: flashcte takes the sequence lengths;
    * ``cache.is_flash_attention_requested`` says yes, for the cache's memory plan only (no
      masks to store, K/V heads read as they are, GQA, as FlashAttention does);
    * ``PagedAttentionCache.update`` writes the new K/V into the pages and hands the attention
      function the page views and the block table instead of gathering every request's K/V.
    """
    from .transformers import NAME, register

    name = register(name or NAME)
    cache, continuous_api, initialization, input_outputs = _modules()
    # Pages are read in place for full-attention layers; sliding layers (a ring buffer) and
    # MLA's latents (another allocator of the same type name) keep transformers' gather.
    full_attention = initialization.ATTN_TYPE_TO_ALLOCATOR["full_attention"]

    def is_ours(config: Any) -> bool:
        return getattr(config, "_attn_implementation", None) == name

    def switch(original):
        def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
            if is_ours(model.config):
                return None
            return original(self, model, *args, **kwargs)

        return switch_to_cb_friendly_attn

    def fast_path(original):
        def ensure_decode_fast_path_is_available(config, cb_config, user_requested):
            if not is_ours(config):
                return original(config, cb_config, user_requested)
            allocators = initialization.ATTN_TYPE_TO_ALLOCATOR
            kinds = initialization.group_layers_by_attn_type(config)
            paged = all(allocators[kind].supports_block_table for kind in kinds)
            if not paged or getattr(config, "kv_lora_rank", None) is not None:
                # a ring buffer (sliding layers) has no block table; MLA's latents are gathered
                cb_config.max_blocks_per_request = 0
            return None

        return ensure_decode_fast_path_is_available

    def mask(original):
        def attn_mask_is_needed(config):
            return False if is_ours(config) else original(config)

        return attn_mask_is_needed

    def memory(original):
        def is_flash_attention_requested(config=None, *args, **kwargs):
            # The cache's memory plan asks whether K/V heads are read natively (GQA) and no mask
            # is stored: true of flashcte as of FlashAttention.
            if is_ours(config) and not args and not kwargs:
                return True
            return original(config, *args, **kwargs)

        return is_flash_attention_requested

    def update(original):
        def paged_update(self, key_states, value_states, layer_idx, kwargs):
            allocator = self.layer_to_allocator[layer_idx]
            if not is_ours(self.config) or type(allocator) is not full_attention:
                return original(self, key_states, value_states, layer_idx, kwargs)
            return _write_pages(allocator, key_states, value_states, layer_idx, kwargs)

        return paged_update

    _wrap(continuous_api.ContinuousBatchingManager, "switch_to_cb_friendly_attn", switch)
    _wrap(initialization, "ensure_decode_fast_path_is_available", fast_path)
    _wrap(input_outputs, "attn_mask_is_needed", mask)
    _wrap(cache, "is_flash_attention_requested", memory)
    _wrap(cache.PagedAttentionCache, "update", update)
    return name


def _write_pages(allocator, key_states, value_states, layer_idx, kwargs):
    """The cache update of a paged layer: the new K/V (1, kv_heads, tokens, d) go into this
    layer's pages, and kwargs get the pages, the block table and the sequences' lengths."""
    cu_k = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
    kwargs["cu_seq_lens_k"] = cu_k
    kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
    k_pages, v_pages = allocator.get_cache_for_block_table(layer_idx)
    page = k_pages.shape[1]
    new_k, new_v = (x.squeeze(0).transpose(0, 1) for x in (key_states, value_states))
    seq_lens = cu_k[1:] - cu_k[:-1]
    block_table = kwargs.get("block_table")
    if block_table is not None:
        # The decode fast path: one new token per sequence, at slot seq_len - 1 of its pages.
        table = block_table[allocator.index]
        slot = (seq_lens - 1).to(torch.int64)
        pages = table.gather(1, (slot // page).unsqueeze(1)).squeeze(1).to(torch.int64)
        k_pages[pages, slot % page] = new_k
        v_pages[pages, slot % page] = new_v
    else:
        read_index = kwargs["read_index"][allocator.index]
        write_index = kwargs["write_index"][allocator.index]
        # transformers' own write (index_copy_); an empty read index skips its gather.
        allocator.update(new_k, new_v, layer_idx, read_index[:0], write_index)
        if read_index.numel() == 0:
            return key_states, value_states  # nothing cached: attend the new keys as they are
        table = _table_of_step(allocator, layer_idx, read_index, cu_k, page)
    kwargs[_KEY] = (k_pages, v_pages, table, seq_lens)
    return key_states, value_states


def _table_of_step(allocator, layer_idx, read_index, cu_k, page):
    """A mixed step's block table, from transformers' read index (each sequence's cached tokens
    as indices into the layer's token view, where page p holds tokens [p * page, (p+1) * page)):
    entry j of sequence s is the page of its token j * page. The same for every layer of the
    group, so it is computed at the group's first layer and kept on the allocator."""
    if layer_idx != allocator.layer_indices[0]:
        table = getattr(allocator, "_flashcte_table", None)
        if table is not None:
            return table
    lens = (cu_k[1:] - cu_k[:-1]).to(torch.int64)
    blocks = int((lens.max() + page - 1) // page) if lens.numel() else 0
    j = torch.arange(blocks, dtype=torch.int64) * page
    first = cu_k[:-1].to(torch.int64).unsqueeze(1) + j
    used = j < lens.unsqueeze(1)
    pages = read_index[torch.where(used, first, 0)]
    table = torch.where(used, pages // page, 0).to(torch.int32)
    allocator._flashcte_table = table
    return table


def is_step(kwargs: dict) -> bool:
    """Whether an attention call is one layer of a continuous-batching step."""
    return "cu_seq_lens_q" in kwargs and "read_index" in kwargs and "write_index" in kwargs


def step_forward(module, query, key, value, scaling, kwargs) -> tuple[torch.Tensor, None]:
    """One layer of a continuous-batching step: query (1, heads, tokens, d) packed sequences
    (cu_seq_lens_q); the keys in pages (kwargs[_KEY], from the cache update) or, for a sliding
    layer or a step with nothing cached, packed in key/value (cu_seq_lens_k). Every sequence is
    causal with its queries the last of its keys."""
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = kwargs["cu_seq_lens_k"]  # this layer's, selected by the cache update
    window = kwargs.get("sliding_window")
    q = query.squeeze(0).transpose(0, 1)
    args = dict(
        softmax_scale=None if scaling is None else float(scaling),
        causal=True,
        window_size=(window - 1, 0) if window else (-1, -1),
        softcap=float(kwargs.get("softcap") or 0.0),
        s_aux=kwargs.get("s_aux"),
    )
    lens_q = cu_q[1:] - cu_q[:-1]
    max_q = int(lens_q.max()) if lens_q.numel() else 0
    pages = kwargs.get(_KEY)
    if pages is not None:
        k_pages, v_pages, table, seq_lens = pages
        out = flash_attn_varlen_func(
            q, k_pages, v_pages, cu_q, None, max_q, int(seq_lens.max()) if seq_lens.numel() else 0,
            block_table=table, seqused_k=seq_lens.to(torch.int32), **args,
        )
    else:
        lens_k = cu_k[1:] - cu_k[:-1]
        k, v = (x.squeeze(0).transpose(0, 1) for x in (key, value))
        out = flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, int(lens_k.max()) if lens_k.numel() else 0, **args
        )
    return out.unsqueeze(0), None
