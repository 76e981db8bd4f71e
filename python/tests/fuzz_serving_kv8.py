"""The fuzzer's 8-bit caches (test_fuzz_serving.py): quantize_kv's contract in float64 (codes and
per-token scales, checked bit for bit), and the quantize_kv target's draw and mutations."""

from __future__ import annotations

from typing import Any

import flashcte
import numpy as np
from conftest import check_allclose
from fuzz_serving_draw import codes, is_float, negative_strides, place, retype, rng_of, values
from fuzz_serving_model import DIMS, FLOATS, FORMATS, TOP, WRONG_FLOAT, Call, Contract, name_of
from hypothesis import strategies as st
from semantics import f64

# ---- 8-bit caches: quantize_kv's contract in float64 -------------------------------------------


def quantized(x: np.ndarray, fmt: str, scale) -> np.ndarray:
    """x / scale (float64) rounded to nearest even and saturated to the format's largest value
    of its sign (infinities too, except in float8_e5m2, which has them); NaN stays NaN."""
    with np.errstate(all="ignore"):
        y = f64(x) / np.asarray(scale, np.float64)
    top = TOP[fmt]
    if fmt == "float8_e5m2":
        y = np.where(np.isfinite(y), np.clip(y, -top, top), y)
    else:
        y = np.clip(y, -top, top)
    if fmt == "int8":
        return np.rint(y).astype(np.int8)
    return y.astype(FORMATS[fmt])  # ml_dtypes rounds float64 to nearest even


def token_scales(x: np.ndarray, fmt: str) -> np.ndarray:
    """Per-token scales of rows x (..., d): the largest finite |x| over the format's largest
    value, 1 for a row without one."""
    x = f64(x)
    largest = np.where(np.isfinite(x), np.abs(x), 0.0).max(axis=-1, initial=0.0)
    return np.where(largest > 0, (largest / TOP[fmt]).astype(np.float32), np.float32(1.0))


def check_token_scales(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Written scales: want within an ulp; where want underflows float32 (a row of tiny
    subnormals), any positive subnormal (the codes are then checked against it)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    under = want == 0
    assert np.all((got[under] > 0) & (got[under] < 2.0**-126)), f"{what}: {got[under]}"
    check_allclose(got[~under], want[~under], rtol=2e-7, atol=2.0**-149, what=what)


def check_codes(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """8-bit codes bit for bit (signed zeros included), any NaN code where NaN is wanted."""
    got_nan, want_nan = np.isnan(f64(got)), np.isnan(f64(want))
    assert np.array_equal(got_nan, want_nan), (
        f"{what}: NaN codes at {np.argwhere(got_nan != want_nan)[:3].tolist()}"
    )
    bad = (got.view(np.uint8) != want.view(np.uint8)) & ~want_nan
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} codes differ, first at {np.argwhere(bad)[0].tolist()}: "
        f"{f64(got)[bad][0]} != {f64(want)[bad][0]}"
    )


def scale_contract(c: Contract, name: str, s: Any, shapes: dict, written: bool) -> str | None:
    """An 8-bit cache's scale argument: its granularity ("tensor", "head", "token") or None."""
    rule = c.refuse
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        if not (np.isfinite(s) and s > 0):
            rule(f"{name} = {s} is not finite and > 0")
        return "tensor"
    if not isinstance(s, np.ndarray):
        c.refuse(f"{name} is a {type(s).__name__}")
        return None
    if s.dtype != np.float32:
        (rule if is_float(s) else c.refuse)(f"{name} is {s.dtype.name}, not float32")
        return None
    kind = {shape: k for k, shape in shapes.items()}.get(s.shape)
    if kind is None:
        rule(f"{name} has shape {s.shape}, not one of {sorted(shapes.values())}")
        return None
    if kind != "token" and not (np.all(np.isfinite(s)) and np.all(s > 0)):
        rule(f"{name} holds an entry that is not finite and > 0")
    if written and (not s.flags.writeable or negative_strides(s)):
        c.refuse(f"{name} is read-only or negatively strided, and the append takes it as writable")
    return kind


# ---- quantize_kv --------------------------------------------------------------------------------


def draw_quantize_kv(draw) -> Call:
    rng = rng_of(draw)
    tokens = draw(st.sampled_from([1, 2, 3, 5, 0]), label="tokens")
    heads = draw(st.integers(1, 3), label="kv_heads")
    d = draw(st.sampled_from(DIMS), label="d")
    fmt = draw(st.sampled_from(list(FORMATS)), label="format")
    src_dtype = draw(st.sampled_from(FLOATS), label="src dtype")
    granularity = draw(st.sampled_from(["tensor", "head", "token"]), label="granularity")
    # Magnitudes from float32 subnormals to near float16's / bfloat16's range ends.
    exponent = draw(st.integers(-140, 100) if src_dtype != "float16" else st.integers(-24, 15))
    src = values(rng, (tokens, heads, d), src_dtype, 2.0**exponent)
    if draw(st.booleans(), label="special values"):
        specials = [np.nan, np.inf, -np.inf, 0.0, -0.0, 3e38, 1e-45, 65504.0]
        for _ in range(draw(st.integers(1, 4))):
            if src.size:
                index = tuple(int(rng.integers(n)) for n in src.shape)
                src[index] = draw(st.sampled_from(specials), label="special")
    dst = codes(rng, (tokens, heads, d), fmt)  # garbage the call overwrites
    if granularity == "token":
        scale = rng.uniform(-1, 1, (tokens, heads)).astype(np.float32)  # garbage, written
    else:
        scale = rng.uniform(0.01, 4.0, 1 if granularity == "tensor" else heads) * 2.0**exponent
        scale = scale.astype(np.float32)
    kwargs = {"src": place(draw, src), "dst": place(draw, dst), "scale": place(draw, scale)}

    mutation = draw(st.sampled_from([None] * 8 + QUANTIZE_MUTATIONS), label="mutation")
    if mutation:
        mutation(draw, rng, kwargs)
    c = Contract()
    src, dst, scale = kwargs["src"], kwargs["dst"], kwargs["scale"]
    fmt_of = {v: k for k, v in FORMATS.items()}
    if not is_float(src):
        c.refuse(f"src is {name_of(src)}")
    if not isinstance(dst, np.ndarray) or dst.dtype not in fmt_of:
        c.refuse(f"dst is {name_of(dst)}")
    if c.refused:
        return Call(
            flashcte.quantize_kv, kwargs, c, lambda *a: None, summary={"mutation": mutation}
        )
    fmt = fmt_of[dst.dtype]
    if src.ndim != 3 or dst.shape != src.shape:
        c.refuse(f"src {src.shape} and dst {dst.shape} are not one (tokens, kv_heads, d) shape")
    tokens, heads = (src.shape + (0, 0))[:2] if src.ndim >= 2 else (0, 0)
    shapes = {"tensor": (1,), "head": (heads,), "token": (tokens, heads)}
    if heads == 1:
        shapes.pop("head")  # (1,): per tensor
    if not isinstance(scale, np.ndarray):
        c.refuse(f"scale is a {type(scale).__name__}, not an array")
    granularity = scale_contract(c, "scale", scale, shapes, written=True)
    if isinstance(scale, np.ndarray) and not scale.flags.writeable:
        c.refuse("scale is read-only")  # taken as writable whatever its granularity
    if negative_strides(scale):
        c.refuse("scale has negative strides (it is addressed in place)")
    if not dst.flags.writeable:
        c.refuse("dst is read-only")
    if negative_strides(dst):
        c.leave_open("dst has negative strides")
    if fmt == "int8" and src.ndim == 3 and np.isnan(f64(src)).any():
        c.refuse("a NaN in src for an int8 dst")
    if tokens == 0 or src.size == 0:
        c.leave_open("an empty src")

    def check(result, before, after):
        assert result[0] is after["dst"] and result[1] is after["scale"]
        src64 = f64(before["src"])
        if granularity == "token":
            check_token_scales(after["scale"], token_scales(src64, fmt), "scale")
            used = f64(after["scale"])[..., None]
        else:
            used = (
                f64(before["scale"]).reshape(-1)[None, :, None]
                if granularity == "head"
                else (f64(before["scale"]).reshape(-1)[0])
            )
        check_codes(after["dst"], quantized(src64, fmt, used), "dst")

    summary = {
        "src": (src.shape, name_of(src)) if isinstance(src, np.ndarray) else src,
        "dst": (dst.shape, name_of(dst)),
        "granularity": granularity,
        "mutation": getattr(mutation, "__name__", None),
    }
    return Call(flashcte.quantize_kv, kwargs, c, check, written=("dst", "scale"), summary=summary)


def _src_dtype(draw, rng, kw):
    kw["src"] = retype(draw, kw["src"], WRONG_FLOAT)


def _dst_dtype(draw, rng, kw):
    kw["dst"] = np.zeros(kw["dst"].shape, draw(st.sampled_from(["float16", "uint8", "int16"])))


def _scale_dtype(draw, rng, kw):
    kw["scale"] = kw["scale"].astype(draw(st.sampled_from(["float64", "float16", "int32"])))


def _dst_shape(draw, rng, kw):
    shape = list(kw["dst"].shape)
    shape[draw(st.integers(0, 2))] += draw(st.sampled_from([1, -1]))
    kw["dst"] = np.zeros([max(n, 0) for n in shape], kw["dst"].dtype)


def _src_rank(draw, rng, kw):
    kw["src"] = kw["src"][..., None] if draw(st.booleans()) else kw["src"][:, 0]


def _scale_shape(draw, rng, kw):
    t, h, _ = kw["dst"].shape
    shape = draw(st.sampled_from([(h + 1,), (t, h + 1), (t + 1, h), (1, 1), (), (t, h, 1)]))
    kw["scale"] = rng.uniform(0.1, 1, shape).astype(np.float32)


def _scale_value(draw, rng, kw):
    if kw["scale"].size:
        kw["scale"].reshape(-1)[0] = draw(st.sampled_from([0.0, -1.0, np.nan, np.inf]))


def _read_only(draw, rng, kw):
    kw[draw(st.sampled_from(["dst", "scale"]))].flags.writeable = False


def _not_an_array(draw, rng, kw):
    name = draw(st.sampled_from(["src", "dst", "scale"]))
    kw[name] = f64(kw[name]).tolist() if name != "scale" or draw(st.booleans()) else 0.5


def _nan_in_src(draw, rng, kw):
    if kw["src"].size:
        kw["src"][(0,) * kw["src"].ndim] = np.nan


QUANTIZE_MUTATIONS = [
    _src_dtype,
    _dst_dtype,
    _scale_dtype,
    _dst_shape,
    _src_rank,
    _scale_shape,
    _scale_value,
    _read_only,
    _not_an_array,
    _nan_in_src,
]
