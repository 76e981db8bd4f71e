"""An attention layer's weights on their way to the native layer: the full layer's, or the shard
one tensor-parallel rank holds (its heads of ``flashcte.AttentionLayer.rank_heads``), checked
against their shapes; and a rank's shard read from a safetensors checkpoint of the full layer,
head block by head block, so that a rank never holds the whole layer's projections."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._errors import ArgumentError
from ._tensors import float32_array, torch_module

ArrayLike = Any

LINEAR = "(out_features, in_features)"
# (weight, the config flag that asks for it or None, its kind: the rows of the query ("q",
# "q_bias") or KV heads ("kv", "kv_bias"), the columns of the query heads ("o"), or whole
# ("hidden", "head_dim"))
WEIGHTS = (
    ("q_proj", None, "q"),
    ("k_proj", None, "kv"),
    ("v_proj", None, "kv"),
    ("o_proj", None, "o"),
    ("q_bias", "qkv_bias", "q_bias"),
    ("k_bias", "qkv_bias", "kv_bias"),
    ("v_bias", "qkv_bias", "kv_bias"),
    ("o_bias", "o_bias", "hidden"),
    ("q_norm", "qk_norm", "head_dim"),
    ("k_norm", "qk_norm", "head_dim"),
)
WEIGHT_NAMES = tuple(name for name, _, _ in WEIGHTS)
# Their names in a Hugging Face checkpoint, after the layer's prefix ("model.layers.0.self_attn.").
CHECKPOINT_NAMES = {
    "q_proj": "q_proj.weight",
    "k_proj": "k_proj.weight",
    "v_proj": "v_proj.weight",
    "o_proj": "o_proj.weight",
    "q_bias": "q_proj.bias",
    "k_bias": "k_proj.bias",
    "v_bias": "v_proj.bias",
    "o_bias": "o_proj.bias",
    "q_norm": "q_norm.weight",
    "k_norm": "k_norm.weight",
}


def float32(name: str, x: Any) -> np.ndarray:
    """Any real array (numpy, torch, DLPack, sequence) as a C-contiguous float32 numpy array."""
    a = float32_array(name, x)
    torch = torch_module()
    if torch is not None and isinstance(a, torch.Tensor):
        return a.contiguous().numpy()
    return np.ascontiguousarray(a)


def _shape(kind: str, heads: int, kv_heads: int, d: int, hidden: int) -> tuple:
    return {
        "q": (heads * d, hidden),
        "kv": (kv_heads * d, hidden),
        "q_bias": (heads * d,),
        "kv_bias": (kv_heads * d,),
        "o": (hidden, heads * d),
        "hidden": (hidden,),
        "head_dim": (d,),
    }[kind]


def checked(config: Any, d: int, weights: dict, shard: bool) -> dict:
    """The weights as float32 arrays of the shapes ``config`` (the full layer's, or with ``shard``
    the rank's) gives them, the optional ones present exactly when its flags ask for them."""
    hidden = config.hidden_size
    whose = " (this rank's shard: its rank_heads)" if shard else ""
    out = {}
    for name, flag, kind in WEIGHTS:
        value = weights.get(name)
        wanted = flag is None or getattr(config, flag)
        if value is None and flag is not None:
            if wanted:
                raise ArgumentError(f"{name}: required, the layer was built with {flag}=True")
            out[name] = None
            continue
        if not wanted:
            if shard and name == "o_bias":
                raise ArgumentError(
                    "o_bias: a rank's shard holds none past tp_degree 1 (it is added once, "
                    "after the ranks' outputs are summed)"
                )
            raise ArgumentError(f"{name}: given, but the layer was built with {flag}=False")
        shape = _shape(kind, config.num_heads, config.num_kv_heads, d, hidden)
        a = float32(name, value)
        if a.shape != shape:
            layout = LINEAR if len(shape) == 2 else "(out_features,)"
            if kind == "head_dim":
                layout = "(head_dim,)"
            hint = ""
            if len(shape) == 2 and a.shape == shape[::-1]:
                hint = "; this is the transpose: pass the nn.Linear weight itself"
            raise ArgumentError(f"{name}: shape {a.shape} must be {layout} = {shape}{hint}{whose}")
        out[name] = a
    return out


def rank_sinks(sinks: np.ndarray | None, query_heads: list) -> np.ndarray | None:
    """The full layer's sinks as a rank's: one per local query head, 0 for a pad head."""
    if sinks is None:
        return None
    return np.array([sinks[h] if h >= 0 else 0.0 for h in query_heads], dtype=np.float32)


def read_shard(path: Any, prefix: str, config: Any, d: int, heads: tuple, o_bias: bool) -> dict:
    """A rank's weights from the safetensors file ``path`` of the full layer (Hugging Face names
    after ``prefix``): with ``heads`` = (query heads, KV heads) of ``rank_heads``, each weight's
    blocks of those heads only (rows of q/k/v_proj and their biases, columns of o_proj, zeros for a
    pad head); the norms whole, and o_bias whole when the config has one and ``o_bias`` asks."""
    from safetensors import safe_open

    query_heads, kv_heads = heads
    hidden = config.hidden_size
    torch = torch_module()
    # numpy cannot hold a bfloat16 checkpoint's tensors; torch can.
    framework = "pt" if torch is not None else "numpy"

    def fill(target: np.ndarray, block: Any) -> None:
        """Copies a slice of the file into part of a float32 array, converting on the way (no
        float32 copy of the slice: a rank's read allocates its shard and little else)."""
        if torch is not None and isinstance(block, torch.Tensor):
            torch.from_numpy(target).copy_(block)
        else:
            target[...] = block

    out: dict = {}
    with safe_open(str(path), framework=framework) as f:
        present = set(f.keys())
        for name, flag, kind in WEIGHTS:
            key = prefix + CHECKPOINT_NAMES[name]
            wanted = flag is None or getattr(config, flag)
            if name == "o_bias":
                wanted = wanted and o_bias
            if not wanted:
                continue
            if key not in present:
                raise ArgumentError(f"{name}: {key!r} is not in {path}")
            tensor = f.get_slice(key)
            shape = tuple(tensor.get_shape())
            want = _shape(kind, config.num_heads, config.num_kv_heads, d, hidden)
            if shape != want:
                raise ArgumentError(
                    f"{name}: {key!r} in {path} has shape {shape}; the full layer's is {want}"
                )
            if kind in ("hidden", "head_dim"):
                out[name] = np.empty(shape, np.float32)
                fill(out[name], tensor[:])
                continue
            of = query_heads if kind in ("q", "q_bias", "o") else kv_heads
            if kind == "o":  # columns
                a = out[name] = np.zeros((hidden, len(of) * d), np.float32)
                for i, h in enumerate(of):
                    if h >= 0:
                        fill(a[:, i * d : (i + 1) * d], tensor[:, h * d : (h + 1) * d])
            else:  # rows
                a = out[name] = np.zeros((len(of) * d, *shape[1:]), np.float32)
                for i, h in enumerate(of):
                    if h >= 0:
                        fill(a[i * d : (i + 1) * d], tensor[h * d : (h + 1) * d])
    return out
