"""flashcte.distributed: context-parallel prefill over torch.distributed (gloo on CPUs).

A prompt too long for one process is split over the ranks of a process group along the sequence;
each rank computes its own queries' rows of the attention of the whole sequence. A layer too big
or too slow for one process is split over the ranks by heads (tensor parallelism).

Functions:
    merge_attn_states: two attention results over disjoint key sets into the result over their
        union (the library's KV-split merge; numpy or torch, no process group needed).
    cp_attention_cte: all-gather context parallelism the Neuron way, in attention_cte's layout:
        K/V all-gathered, then attention_cte with this rank's ``cp_offset`` / ``global_cp_deg`` /
        ``cp_strided_q_slicing`` (contiguous or strided slices).
    ring_flash_attn_func, zigzag_ring_flash_attn_func, stripe_flash_attn_func: ring attention
        with ring-flash-attention's names and arguments in FlashAttention's layout
        ``(batch, local_seqlen, heads, head_dim)``: K/V blocks rotate with isend/irecv while each
        rank computes on the block it holds (contiguous, zigzag and strided shards).
    allgather_flash_attn_func: the all-gather strategy in FlashAttention's layout.
    ulysses_flash_attn_func: Ulysses-style (DeepSpeed-Ulysses) context parallelism in
        FlashAttention's layout: an all-to-all from sequence shards to head shards of the whole
        sequence, one local call per rank on its heads, an all-to-all back (any split, uneven
        lengths; heads divisible by the group, KV heads divisible or replicated).
    TensorParallelAttention: flashcte.AttentionLayer with its heads split over the ranks (the
        GQA sharding of LAYER.md section 4), the O projection's partial outputs all-reduced.
    shard, unshard, split_lengths, positions: the three splits of a sequence over the ranks.

Every collective function must be called by every rank of the group with matching arguments.
Errors raise on every rank alike (bad arguments or a failure on any rank, arguments that differ
between ranks), and every wait is bounded by ``timeout`` (default: the process group's), so a
rank that never arrives gives an error instead of a hang. docs/distributed.md has the
communication and compute of each strategy and measurements.

merge_attn_states and the split helpers need only numpy; the collective functions need torch
(an optional extra of flashcte), imported when one of them is first used.
"""

from ._merge import merge_attn_states
from ._shard import positions, shard, split_lengths, unshard

_COLLECTIVE = {
    "TensorParallelAttention": "._tp",
    "cp_attention_cte": "._allgather",
    "allgather_flash_attn_func": "._ring",
    "ring_flash_attn_func": "._ring",
    "stripe_flash_attn_func": "._ring",
    "ulysses_flash_attn_func": "._ulysses",
    "zigzag_ring_flash_attn_func": "._ring",
}


def __getattr__(name: str):
    if name in _COLLECTIVE:
        import importlib

        value = getattr(importlib.import_module(_COLLECTIVE[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TensorParallelAttention",
    "allgather_flash_attn_func",
    "cp_attention_cte",
    "merge_attn_states",
    "positions",
    "ring_flash_attn_func",
    "shard",
    "split_lengths",
    "stripe_flash_attn_func",
    "ulysses_flash_attn_func",
    "unshard",
    "zigzag_ring_flash_attn_func",
]
