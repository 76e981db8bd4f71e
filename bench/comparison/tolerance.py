"""The cross-checks' tolerances, derived at every point the way the project's tests derive
theirs, instead of picked.

tests/test_util.cc (compare()) holds the kernel against the float64 function of SEMANTICS.md
(reference::attention) with a bound worked out from the arithmetic of the case:
  * bf16/fp16 inputs, FlashAttention's rule: at most twice E_plain, the largest error of a plain
    same-precision implementation against float64 (reference::attention_plain: S = q.k^T
    accumulated in float32 and rounded to the dtype, the softmax in float32 rounded to the dtype,
    P.V accumulated in float32 and rounded to the dtype), plus a floor of u * max|exact| (u the
    dtype's unit roundoff, 2^-8 bf16, 2^-11 fp16: one rounding of the largest output, which any
    dtype-output kernel needs), capped by the issue's rule 1e-5 + 2e-2 * max|exact|;
  * fp32 inputs: 1e-5 * max|exact|, and where the logits are large
    tests/reliability/random_oracle_test.cc applies FlashAttention's rule with that floor,
    2 * E_plain + 1e-5 * max|exact|, which is what fp32 gets here (it contains the flat rule).
The tests compare all rows of a small case and a sample of rows of a big one (sample_rows: the
first two, the middle and the last two rows, the tile edges 127/128, 255/256, ..., the rest at
random; 40 rows past 3e7 element reads); so does this, on the point's own inputs.

bound(t) is that rule for arithmetic that rounds to dtype t, with the point's inputs rounded to t
(a no-op for the point's dtype; ggml-f16 rounds k and v to fp16 whatever the point's dtype, and
a plain fp16 implementation of those inputs is its yardstick). flashcte must lie within
bound(dtype) of the float64 result on the sampled rows (the worker's summary: ok). A peer is
compared with flashcte's output over the whole output, absolute differences: both are held to
their bound against float64, so by the triangle inequality
    max |peer - flashcte| <= bound(dtype) + max(bound(dtype), bound(t)),
t the coarser type the peer rounds its inputs to (PyImpl.rounds_inputs_to), if any.
"""

from __future__ import annotations

import math

import numpy as np

from .peers.base import np_dtype

UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
# tests/test_util.cc: past this many element reads (heads * Sq * Skv * (d + dv)) the tests check
# a sample of SAMPLED_ROWS rows instead of every row.
ALL_ROWS_MAX_COST = 3e7
SAMPLED_ROWS = 40


def sample_rows(sq: int, n: int, seed: int) -> list[int]:
    """tests/test_util.cc's sample_rows: the edges and tile boundaries, then random rows."""
    if n >= sq:
        return list(range(sq))
    rows = {i for i in (0, 1, sq // 2, sq - 2, sq - 1) if 0 <= i < sq}
    m = 128
    while m < sq and len(rows) < n // 2:
        rows.update(i for i in (m - 1, m) if i < sq)
        m *= 2
    rng = np.random.default_rng(seed * 7919 + 13)
    while len(rows) < n:
        rows.add(int(rng.integers(0, sq)))
    return sorted(rows)


def rounder(dtype: str):
    """x (float32) -> x rounded to dtype, as float32."""
    if dtype == "float32":
        return lambda a: a.astype(np.float32)
    t = np_dtype(dtype)
    return lambda a: a.astype(np.float32).astype(t).astype(np.float32)


def masked(s, causal_rows):
    """Scores s (rows, keys) with key j > query row i set to -inf; causal_rows None: as is."""
    if causal_rows is None:
        return s
    keep = np.arange(s.shape[1])[None, :] <= causal_rows[:, None]
    return np.where(keep, s, s.dtype.type(-np.inf))


def softmax_pv(s, v, causal_rows):
    """Rows of softmax(s) @ v in s's precision, causal_rows as masked()."""
    s = masked(s, causal_rows)
    s = s - s.max(-1, keepdims=True)
    e = np.exp(s)
    return (e / e.sum(-1, keepdims=True)) @ v


class Yardstick:
    """The float64 result and plain same-precision implementations on the sampled rows of one
    point's inputs; bound() is tests/test_util.cc's tolerance for them."""

    def __init__(self, p: dict, data: tuple):
        H, S, d = p["heads"], p["s"], p["d"]
        self.p, self.data = p, data
        self.group = H // p["kv_heads"]
        cost = H * S * S * 2 * d
        self.rows = np.array(sample_rows(S, S if cost <= ALL_ROWS_MAX_COST else SAMPLED_ROWS,
                                         1234))
        self.causal_rows = self.rows if p["causal"] else None
        self.measure()

    def measure(self) -> None:
        """The float64 result on the rows checked of every head (heads())."""
        f64 = lambda a: a.astype(np.float64)
        self.exact = np.stack([
            softmax_pv(f64(q) @ f64(k).T * self.p["scale"], f64(v), self.causal_rows)
            for q, k, v in self.heads()])
        self.max_abs = float(np.abs(self.exact).max()) if self.exact.size else 0.0
        self.bounds = {}

    def heads(self):
        """Per query head: its sampled rows of q, and the k and v of its KV head (a head at a
        time, so that no float64 copy of a whole input is made)."""
        q, k, v = self.data
        for h in range(q.shape[0]):
            yield q[h, self.rows], k[h // self.group], v[h // self.group]

    def plain(self, dtype: str) -> np.ndarray:
        """reference::attention_plain's arithmetic (float32, rounded to dtype after the scaled
        Q.K^T, after the softmax and after P.V) on the inputs rounded to dtype."""
        rnd = rounder(dtype)
        scale = np.float32(self.p["scale"])
        out = []
        for q, k, v in self.heads():
            s = masked(rnd((rnd(q) @ rnd(k).T) * scale), self.causal_rows)
            e = np.exp(s - s.max(-1, keepdims=True))
            w = rnd(e / e.sum(-1, keepdims=True))
            out.append(rnd(w @ rnd(v)))
        return np.stack(out)

    def bound(self, dtype: str) -> float:
        """How far from float64 arithmetic that rounds to dtype may be (the module's rule)."""
        if dtype not in self.bounds:
            e_plain = float(np.abs(self.plain(dtype).astype(np.float64) - self.exact).max())
            m = self.max_abs
            if dtype == "float32":
                self.bounds[dtype] = 2 * e_plain + 1e-5 * m
            else:
                self.bounds[dtype] = min(2 * e_plain + UNIT_ROUNDOFF[dtype] * m, 1e-5 + 2e-2 * m)
        return self.bounds[dtype]

    def error(self, out: np.ndarray) -> float:
        """Largest |out - float64| on the sampled rows; out (heads, S, d)."""
        err = float(np.abs(out[:, self.rows].astype(np.float64) - self.exact).max())
        return err if math.isfinite(err) else math.inf

    def peer_tolerance(self, rounds_inputs_to: str | None) -> float:
        """The bound on max |peer - flashcte| (the module's triangle inequality)."""
        dtype = self.p["dtype"]
        own = self.bound(dtype)
        if rounds_inputs_to:
            own = max(own, self.bound(rounds_inputs_to))
        return self.bound(dtype) + own


class DecodeYardstick(Yardstick):
    """The same rule at a decode point (decode.py): q (B, heads, 1, d), k and v (B, kv_heads,
    N + 1, d), torch tensors. Each (sequence, query head) is a head of the rule above with its one
    row checked and no mask (the new token attends every slot of its sequence); the output is
    compared as (B * heads, 1, d)."""

    def __init__(self, p: dict, data: tuple):
        self.p, self.data = p, data
        self.group = p["heads"] // p["kv_heads"]
        self.rows = np.arange(p["new"])
        self.causal_rows = None  # one new token: nothing to mask
        self.measure()

    def heads(self):
        q, k, v = self.data
        f32 = lambda t: t.float().numpy()
        for b in range(q.shape[0]):
            for g in range(k.shape[1]):
                kb, vb = f32(k[b, g]), f32(v[b, g])
                for h in range(g * self.group, (g + 1) * self.group):
                    yield f32(q[b, h]), kb, vb
