"""Tensor parallelism for the attention layer: the heads split over the ranks of a process group
with the GQA sharding of LAYER.md section 4, each rank running :class:`flashcte.AttentionLayer`
built as its rank (its query heads, its KV heads and their cache, its columns of o_proj), and
the ranks' partial O-projection outputs summed with one all_reduce, ``o_bias`` added once.

Per call each rank sends: a 4 KiB agreement record (one all_gather) and its partial output,
``batch * T * hidden_size`` float32 values, through the all_reduce (the sum is taken in float32
whatever the layer's dtype, then rounded to it). A rank's failure while computing rides in the
all_reduce (one more float32 value, its error flag), so the success path costs two collectives;
when a flag is set, the ranks exchange their errors and all raise the same exception.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._errors import ArgumentError, ArgumentTypeError
from .._layer import AttentionLayer, _float32, _positions
from .._layer_cache import KvCache
from .._layer_weights import WEIGHT_NAMES, read_shard
from .._tensors import BFLOAT16, TORCH, Tensor
from . import _comm

ArrayLike = Any

_WHAT = "TensorParallelAttention"


def _config_record(args: dict) -> dict:
    """The layer's arguments as JSON (sinks and rope_scaling by value, they are small)."""
    out = {}
    for key, value in sorted(args.items()):
        if key == "sinks" and value is not None:
            value = [float(x) for x in _float32("sinks", value).reshape(-1)]
        elif key == "rope_scaling" and isinstance(value, Mapping):
            value = {
                str(k): v if isinstance(v, (int, float, str)) else repr(v) for k, v in value.items()
            }
        elif key == "dtype":
            value = str(value).replace("torch.", "")
        out[key] = value
    return out


def _shape(x: Any) -> list | None:
    return None if x is None else [int(s) for s in getattr(x, "shape", ())]


class TensorParallelAttention:
    """:class:`flashcte.AttentionLayer` split over the ranks of a tensor-parallel group.

    Construct it on every rank of ``group`` (default: the world) with the same arguments: the
    layer's (those of :class:`flashcte.AttentionLayer`, ``hidden_size``, ``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``rope_theta``, ..., ``sinks``, ``dtype``) and:

    Args:
        gqa_strategy: ``"auto"`` (ON's choice: ``"replicate-to-tp-degree"`` when the group's
            size is a multiple of ``num_kv_heads``, else ``"convert-to-mha"``),
            ``"replicate-to-tp-degree"`` or ``"convert-to-mha"`` (LAYER.md section 4).
        tp_degree: None for the group's size; else it must equal it (a check).
        group: the torch.distributed process group (gloo on CPUs); None for the world.
        timeout: seconds or a timedelta bounding every wait; None for the process group's.

    Rank r builds the layer as rank r of ``tp_degree = group size``: it holds ``h`` query heads
    and ``kv`` KV heads (:attr:`local_num_heads`, :attr:`local_num_kv_heads`, pad heads and
    replicas included). :meth:`set_weights` takes the *full* weights on every rank and keeps the
    rank's shard; :meth:`new_cache` holds the rank's KV heads only; a call takes the whole
    ``x`` (replicated on every rank, as in Megatron-style tensor parallelism) and returns the
    whole layer's output on every rank.

    Every method is collective: call it on every rank in the same order. Errors raise on every
    rank alike, with the failing rank's message (bad arguments, arguments or shapes that differ
    between ranks, a group whose size is not ``tp_degree``, heads the strategy cannot shard, a
    failure while computing), and a rank that never arrives makes the others raise RuntimeError
    after ``timeout`` instead of hanging.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int | None = None,
        *,
        gqa_strategy: str = "auto",
        tp_degree: int | None = None,
        group: Any = None,
        timeout: Any = None,
        **layer_args: Any,
    ):
        g = _comm.resolve_group(group, timeout)
        self._g = g
        self._o_bias = None
        self._layer: AttentionLayer | None = None
        args = dict(
            layer_args,
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            gqa_strategy=gqa_strategy,
        )

        def describe() -> dict:
            if "tp_rank" in layer_args:
                raise ArgumentTypeError(
                    "tp_rank: not an argument here: each rank's is its rank in group"
                )
            if tp_degree is not None and tp_degree != g.size:
                raise ArgumentError(
                    f"tp_degree: {tp_degree} must be the process group's size {g.size} (one "
                    "rank per shard; None takes the group's size)"
                )
            record = _config_record(args)
            self._layer = AttentionLayer(
                hidden_size,
                num_heads,
                num_kv_heads,
                head_dim,
                tp_degree=g.size,
                tp_rank=g.rank,
                gqa_strategy=gqa_strategy,
                **layer_args,
            )
            return record

        metas = _comm.agree(g, describe, _WHAT)
        _comm.fail_unless_same([{"args": m} for m in metas], "args", _WHAT)

    # --- read back
    @property
    def layer(self) -> AttentionLayer:
        """This rank's :class:`flashcte.AttentionLayer` (its partial output, no o_bias)."""
        return self._layer

    @property
    def tp_degree(self) -> int:
        return self._g.size

    @property
    def tp_rank(self) -> int:
        return self._g.rank

    @property
    def local_num_heads(self) -> int:
        return self._layer.local_num_heads

    @property
    def local_num_kv_heads(self) -> int:
        return self._layer.local_num_kv_heads

    @property
    def hidden_size(self) -> int:
        return self._layer.hidden_size

    @property
    def dtype(self) -> str:
        return self._layer.dtype

    def __repr__(self) -> str:
        return f"TensorParallelAttention(rank {self._g.rank} of {self._g.size}: {self._layer!r})"

    def set_weights(
        self,
        q_proj: ArrayLike,
        k_proj: ArrayLike,
        v_proj: ArrayLike,
        o_proj: ArrayLike,
        q_bias: ArrayLike | None = None,
        k_bias: ArrayLike | None = None,
        v_bias: ArrayLike | None = None,
        o_bias: ArrayLike | None = None,
        q_norm: ArrayLike | None = None,
        k_norm: ArrayLike | None = None,
        *,
        shard: bool = False,
    ) -> None:
        """The weights in ``torch.nn.Linear`` layout, on every rank: the full, unsharded ones
        (:meth:`flashcte.AttentionLayer.set_weights`' shapes), of which each rank keeps its shard,
        or with ``shard=True`` each rank's own shard (the blocks of its
        :attr:`flashcte.AttentionLayer.rank_heads`; :meth:`load_safetensors` reads them), so that
        no rank holds the full projections. ``o_bias`` (the whole vector either way) is kept
        here and added once to the summed output."""
        args = locals()
        weights = {name: args[name] for name in WEIGHT_NAMES}
        self._set_weights(lambda: weights, shard)

    def _set_weights(self, get_weights: Any, shard: bool) -> None:
        """set_weights with the weights from ``get_weights()``, called inside the agreement so
        that a rank's failure to produce them reaches every rank."""

        def describe() -> dict:
            weights = get_weights()
            o_bias = weights.get("o_bias")
            record = {name: _shape(w) for name, w in weights.items()}
            self._layer.set_weights(**dict(weights, o_bias=None if shard else o_bias), shard=shard)
            if o_bias is None:
                self._o_bias = None
            else:
                # Rounded to the activation dtype as the layer rounds its weights (R1).
                b = torch.from_numpy(_float32("o_bias", o_bias).reshape(-1))
                self._o_bias = b.to(getattr(torch, self.dtype)).to(torch.float32)
            return record

        what = f"{_WHAT}.set_weights"
        metas = _comm.agree(self._g, describe, what)
        _comm.fail_unless_same([{"shapes": m} for m in metas], "shapes", what)

    def load_safetensors(self, path: Any, prefix: str = "") -> None:
        """Each rank reads its own shard of the full layer from the safetensors file ``path``
        (:meth:`flashcte.AttentionLayer.load_safetensors`: its heads' rows and columns only,
        names after ``prefix``) and ``o_proj.bias`` with the config's ``o_bias``. Collective; a
        rank that cannot read its shard makes every rank raise."""

        def read() -> dict:
            if not isinstance(prefix, str):
                raise ArgumentTypeError(f"prefix: must be a str, got {type(prefix).__name__}")
            layer = self._layer
            return read_shard(path, prefix, layer._config, layer.head_dim, layer.rank_heads, True)

        self._set_weights(read, shard=True)

    def new_cache(self, batch: int, max_len: int) -> KvCache:
        """This rank's cache: ``batch`` sequences of up to ``max_len`` tokens of its
        :attr:`local_num_kv_heads` KV heads. Not collective."""
        return self._layer.new_cache(batch, max_len)

    def new_paged_cache(self, batch: int, num_blocks: int, block_size: int) -> KvCache:
        """This rank's block pool: ``num_blocks`` pages of ``block_size`` slots of its
        :attr:`local_num_kv_heads` KV heads for ``batch`` sequences. Every rank keeps the same
        block tables (:meth:`KvCache.assign` with the same pages on each rank). Not collective."""
        return self._layer.new_paged_cache(batch, num_blocks, block_size)

    def __call__(
        self,
        x: ArrayLike,
        positions: ArrayLike,
        cache: KvCache,
        num_threads: int | None = None,
    ) -> ArrayLike:
        """One forward call of the whole layer, on every rank: :meth:`AttentionLayer.__call__`'s
        arguments, ``x (batch, T, hidden_size)`` and ``positions (batch, T)`` the same on every
        rank, ``cache`` this rank's (from :meth:`new_cache`). Calls with up to 16 new tokens run
        on the decode kernel, longer ones on attention_cte, as the layer chooses.

        Returns ``(batch, T, hidden_size)`` in the layer's dtype, in the kind of ``x`` (numpy
        or torch), the same on every rank: the ranks' partial outputs summed in float32, plus
        ``o_bias``, rounded to the dtype.
        """
        g = self._g
        what = f"{_WHAT}.forward"
        state: dict = {}

        def describe() -> dict:
            layer = self._layer
            if layer is None or not layer.has_weights:
                raise RuntimeError(f"{_WHAT}: no weights yet; call set_weights(...) first")
            if not isinstance(cache, KvCache):
                raise ArgumentTypeError(
                    f"cache: expected a flashcte.KvCache (tp.new_cache(batch, max_len)), got "
                    f"{type(cache).__name__}"
                )
            xt = Tensor("x", x)
            pos = _positions(positions)
            pos_np = pos.numpy() if isinstance(pos, torch.Tensor) else np.asarray(pos)
            state.update(xt=xt)
            # Each row's positions go up by 1 (the layer checks), so the starts pin them down.
            starts = pos_np[:, 0] if pos_np.ndim == 2 and pos_np.shape[1] else pos_np
            return {
                "call": {
                    "x shape": list(xt.shape),
                    "x dtype": xt.dtype_name,
                    "positions shape": list(pos_np.shape),
                    "positions (each row's first)": _small(starts),
                    "cache (batch, max_len)": [cache.batch, cache.max_len],
                    "cache lengths": _small(cache.lengths),
                }
            }

        metas = _comm.agree(g, describe, what)
        _comm.fail_unless_same(metas, "call", what)
        xt = state["xt"]
        error: BaseException | None = None
        batch, tokens = xt.shape[0], xt.shape[1]
        hidden = self.hidden_size
        n = batch * tokens * hidden
        buf = torch.zeros(n + 1, dtype=torch.float32)
        try:
            partial = self._layer(x, positions, cache, num_threads=num_threads)
            buf[:n] = _as_float32(partial).reshape(-1)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = e
            buf[n] = 1.0
        if g.size > 1:
            g.wait(
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=g.group, async_op=True),
                f"{what}: all_reduce of the partial outputs",
            )
        if buf[n].item() != 0.0:
            _comm.settle(g, error, what)
            raise RuntimeError(f"flashcte.distributed.{what}: a rank failed")  # pragma: no cover
        out = buf[:n].view(batch, tokens, hidden)
        if self._o_bias is not None:
            out += self._o_bias
        return _give_back(xt, out, self.dtype)

    forward = __call__


def _small(values: Any) -> Any:
    """Ints as a list, or the list's SHA-1 beyond 32 of them (the agreement record's 4 KiB)."""
    a = np.ascontiguousarray(np.asarray(values, dtype=np.int64).reshape(-1))
    if a.size <= 32:
        return a.tolist()
    return "sha1 " + hashlib.sha1(a.tobytes()).hexdigest()


def _as_float32(a: Any) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.to(torch.float32)
    return torch.from_numpy(np.asarray(a).astype(np.float32))  # bfloat16: ml_dtypes converts


def _give_back(like: Tensor, out: torch.Tensor, dtype: str) -> Any:
    """The float32 sum rounded to the layer's dtype, in the kind of the caller's x."""
    rounded = out.to(getattr(torch, dtype))
    if like.kind == TORCH:
        return rounded
    if dtype == "bfloat16":
        return rounded.view(torch.int16).numpy().view(BFLOAT16)
    return rounded.numpy()
