"""All-gather context parallelism, the Neuron way: each rank holds a slice of the queries and
the K/V of the same tokens; the K/V slices are all-gathered into the whole sequence and each rank
runs attention_cte on its own queries with its ``cp_offset`` (and, strided, ``global_cp_deg``
with ``cp_strided_q_slicing``), exactly as NxD Inference drives the kernel on a CP group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._attention import attention_cte
from .._errors import ArgumentError, ArgumentTypeError
from .._tensors import dtype_name, transpose
from . import _comm
from ._shard import positions, split_lengths

ArrayLike = Any


def _torch_tensor(name: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(
            f"{name}: flashcte.distributed takes torch tensors (torch.distributed moves them), "
            f"got {type(x).__name__}"
        )
    if x.device.type != "cpu":
        raise ArgumentError(f"{name}: must be a CPU tensor, got device {x.device}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ArgumentTypeError(
            f"{name}: dtype must be float32, float16 or bfloat16, got {x.dtype}"
        )
    return x.detach()


def _shape(x: Any) -> list | None:
    return None if x is None else [int(s) for s in getattr(x, "shape", ())]


def cp_attention_cte(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    scale: float = 1.0,
    causal_mask: bool = True,
    k_prior: ArrayLike | None = None,
    v_prior: ArrayLike | None = None,
    prior_used_len: None | int | Sequence[int] = None,
    sink: ArrayLike | None = None,
    sliding_window: int = 0,
    tp_q: bool = True,
    tp_k: bool = False,
    tp_out: bool = False,
    cache_softmax: bool = False,
    *,
    strided: bool = False,
    group: Any = None,
    timeout: Any = None,
    num_threads: int | None = None,
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    key_bias: ArrayLike | None = None,
    window_left: int = -1,
    window_right: int = -1,
) -> ArrayLike | tuple[ArrayLike, ArrayLike, ArrayLike]:
    """attention_cte over a context-parallel group: this rank's queries against the whole
    sequence's keys.

    Each rank of ``group`` (default: the world) passes the Q, K and V of its own tokens in
    attention_cte's layouts: ``q (bs, Sq_r, d)`` (``(bs, d, Sq_r)`` without ``tp_q``),
    ``k (bs_kv, d, Sq_r)`` (``(bs_kv, Sq_r, d)`` with ``tp_k``), ``v (bs_kv, Sq_r, dv)``.
    Which tokens a rank holds:

    * contiguous (default): rank r holds one run, the runs in rank order; any lengths (each
      rank's is exchanged): ``cp_offset`` = the tokens of the ranks before it.
    * ``strided=True``: rank r holds tokens ``r, r + P, r + 2P, ...`` (``ceil((S - r) / P)`` of
      them, :func:`flashcte.distributed.shard` with ``layout="strided"``): ``cp_offset = r``,
      ``global_cp_deg = P``, ``cp_strided_q_slicing`` (the kernel's strided CP: causal work
      balanced without reordering the sequence).

    K and V are all-gathered (each rank sends its ``Sq_r * bs_kv * (d + dv)`` elements to every
    other rank) and put back in sequence order; then one attention_cte call computes this rank's
    rows. Every other argument means what it means for :func:`flashcte.attention_cte` on the whole
    sequence and must be the same on every rank: causal masking, sliding window, sinks
    (``(bs, 1)``, replicated), prefix caching (``k_prior``/``v_prior``/``prior_used_len``, the
    cached prefix replicated on every rank, before position 0), softcap, ALiBi, key_bias (over the
    whole concatenated KV axis), FlashAttention windows.

    Returns this rank's rows of what ``flashcte.attention_cte`` returns for the whole sequence
    (``out (bs, Sq_r, dv)``, or ``(out, neg_max, sum_recip)`` with ``cache_softmax``), a torch
    tensor.

    Errors raise on every rank alike: bad arguments on any rank, arguments that differ between
    ranks, lengths the strided split does not produce, and a failure while computing (the
    exception type of the failing rank, its message prefixed with its rank). ``timeout`` (seconds
    or a timedelta; None: the process group's) bounds every wait, so a rank that never arrives
    raises RuntimeError instead of hanging.
    """
    g = _comm.resolve_group(group, timeout)
    what = "cp_attention_cte"
    local: dict = {}

    def describe() -> dict:
        qt, kt, vt = _torch_tensor("q", q), _torch_tensor("k", k), _torch_tensor("v", v)
        for name, t in (("q", qt), ("k", kt), ("v", vt)):
            if t.ndim != 3:
                raise ArgumentError(f"{name}: must have rank 3, got shape {tuple(t.shape)}")
        if not (qt.dtype == kt.dtype == vt.dtype):
            raise ArgumentTypeError(
                f"k, v: dtypes {dtype_name(kt.dtype)}, {dtype_name(vt.dtype)} must be q's "
                f"{dtype_name(qt.dtype)}"
            )
        k_seq = kt if tp_k else kt.transpose(1, 2)  # (bs_kv, Sq_r, d)
        bs, d = qt.shape[0], qt.shape[2] if tp_q else qt.shape[1]
        seqlen = qt.shape[1] if tp_q else qt.shape[2]
        if k_seq.shape[1] != seqlen or vt.shape[1] != seqlen:
            raise ArgumentError(
                f"k, v: hold {k_seq.shape[1]} and {vt.shape[1]} tokens, q {seqlen}: each rank "
                "passes the K/V of its own query tokens"
            )
        if vt.shape[0] != k_seq.shape[0]:
            raise ArgumentError(f"v: batch {vt.shape[0]} differs from k's {k_seq.shape[0]}")
        local.update(q=qt, k=k_seq, v=vt)
        common = {
            "bs": int(bs),
            "d": int(d),
            "bs_kv": int(k_seq.shape[0]),
            "dk": int(k_seq.shape[2]),
            "dv": int(vt.shape[2]),
            "dtype": dtype_name(qt.dtype),
            "scale": float(scale),
            "causal_mask": bool(causal_mask),
            "sliding_window": int(sliding_window),
            "tp_q": bool(tp_q),
            "tp_k": bool(tp_k),
            "tp_out": bool(tp_out),
            "cache_softmax": bool(cache_softmax),
            "strided": bool(strided),
            "k_prior": _shape(k_prior),
            "v_prior": _shape(v_prior),
            "prior_used_len": None
            if prior_used_len is None
            else [int(x) for x in torch.as_tensor(prior_used_len).reshape(-1).tolist()],
            "sink": _shape(sink),
            "softcap": float(softcap or 0.0),
            "alibi_slopes": _shape(alibi_slopes),
            "key_bias": _shape(key_bias),
            "window_left": int(window_left),
            "window_right": int(window_right),
        }
        return {"common": common, "length": int(seqlen)}

    metas = _comm.agree(g, describe, what)
    _comm.fail_unless_same(metas, "common", what)
    lengths = [m["length"] for m in metas]
    total = sum(lengths)
    if strided and lengths != split_lengths(total, g.size, "strided"):
        raise ArgumentError(
            f"flashcte.distributed.{what}: the ranks hold {lengths} tokens; a strided split of "
            f"{total} tokens over {g.size} ranks holds {split_lengths(total, g.size, 'strided')} "
            "(rank r: tokens r, r + P, ...)"
        )
    layout = "strided" if strided else "contiguous"
    fulls, error = _comm.allgather_seq(
        g,
        [local.get("k"), local.get("v")],
        lengths,
        lambda r: positions(lengths, r, layout),
        f"{what}: K/V",
    )
    result = None
    if error is None:
        try:
            k_full, v_full = fulls
            offset = g.rank if strided else sum(lengths[: g.rank])
            result = attention_cte(
                local["q"],
                k_full,
                v_full,
                scale=scale,
                causal_mask=causal_mask,
                k_prior=k_prior if k_prior is None or tp_k else transpose(k_prior, 1, 2),
                v_prior=v_prior,
                prior_used_len=prior_used_len,
                sink=sink,
                sliding_window=sliding_window,
                tp_q=tp_q,
                tp_k=True,
                tp_out=tp_out,
                cache_softmax=cache_softmax,
                cp_offset=offset,
                global_cp_deg=g.size if strided else None,
                cp_strided_q_slicing=strided,
                num_threads=num_threads,
                softcap=softcap,
                alibi_slopes=alibi_slopes,
                key_bias=key_bias,
                window_left=window_left,
                window_right=window_right,
            )
        except Exception as e:  # noqa: BLE001 - reported to every rank by settle()
            error = e
    _comm.settle(g, error, what)
    return result
