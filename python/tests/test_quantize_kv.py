"""flashcte.quantize_kv against ml_dtypes' own float8 conversion and numpy's rounding (the
reference here): every 8-bit format, every scale granularity, numpy and torch, in place into
strided cache rows, with saturation and refusals that leave dst as it was."""

import numpy as np
import pytest

import flashcte

ml_dtypes = pytest.importorskip("ml_dtypes")

FORMATS = {
    "int8": (np.dtype(np.int8), 127.0),
    "float8_e4m3fn": (np.dtype(ml_dtypes.float8_e4m3fn), 448.0),
    "float8_e5m2": (np.dtype(ml_dtypes.float8_e5m2), 57344.0),
}


def expected(src, scale, fmt):
    """src / scale rounded to nearest even and saturated, in float64, as dst's dtype."""
    dt, top = FORMATS[fmt]
    q = np.clip(src.astype(np.float64) / scale, -top, top)
    if fmt == "int8":
        return np.rint(q).astype(np.int8)
    return q.astype(dt)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("granularity", ["tensor", "head", "token"])
@pytest.mark.parametrize("src_dtype", ["float32", "float16", "bfloat16"])
def test_matches_the_reference(rng, fmt, granularity, src_dtype):
    tokens, heads, d = 9, 4, 24
    src = (rng.standard_normal((tokens, heads, d)) * 3).astype(
        ml_dtypes.bfloat16 if src_dtype == "bfloat16" else src_dtype
    )
    src[0, 0, :5] = [0.0, -0.0, 3e4, -3e4, 0.5]  # saturation beside ordinary values
    dt = FORMATS[fmt][0]
    # dst: rows of a (tokens, heads + 1, d + 8) cache, so its strides are not dst's own shape's.
    cache = np.zeros((tokens, heads + 1, d + 8), dt)
    dst = cache[:, 1:, 4 : 4 + d]
    if granularity == "tensor":
        scale = np.array([0.05], np.float32)
    elif granularity == "head":
        scale = np.array([0.01, 0.02, 0.05, 0.5], np.float32)
    else:
        scale = np.zeros((tokens, heads), np.float32)
    out, sc = flashcte.quantize_kv(src, dst, scale)
    assert out is dst and sc is scale
    wide = src.astype(np.float64)
    if granularity == "token":
        absmax = np.abs(wide).max(axis=2)
        np.testing.assert_allclose(scale, absmax / FORMATS[fmt][1], rtol=2e-7)
        s = scale[:, :, None].astype(np.float64)
    elif granularity == "head":
        s = scale[None, :, None].astype(np.float64)
    else:
        s = np.float64(scale[0])
    want = expected(wide, s, fmt)
    np.testing.assert_array_equal(dst.view(np.uint8), want.view(np.uint8))
    assert not cache[:, 0].view(np.uint8).any() and not cache[:, :, :4].view(np.uint8).any()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_torch_tensors(fmt):
    torch = pytest.importorskip("torch")
    dt = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
    g = torch.Generator().manual_seed(0)
    src = torch.randn(5, 2, 16, generator=g, dtype=torch.bfloat16)
    dst = torch.empty(5, 2, 16, dtype=dt[fmt])
    scale = torch.zeros(5, 2)
    flashcte.quantize_kv(src, dst, scale)
    want = expected(src.float().numpy(), scale.numpy()[:, :, None].astype(np.float64), fmt)
    np.testing.assert_array_equal(dst.view(torch.uint8).numpy(), want.view(np.uint8))


def test_refusals_name_the_argument_and_write_nothing(rng):
    src = rng.standard_normal((3, 2, 8)).astype(np.float32)
    dst = np.full((3, 2, 8), 7, np.int8)
    with pytest.raises(ValueError, match=r"^scale: entry 1 = 0\.0+ must be finite and > 0"):
        flashcte.quantize_kv(src, dst, np.array([0.5, 0.0], np.float32))
    with pytest.raises(TypeError, match="^dst: dtype must be int8, float8_e4m3fn or float8_e5m2"):
        flashcte.quantize_kv(src, np.zeros((3, 2, 8), np.float16), np.ones(1, np.float32))
    src[2, 1, 7] = np.nan
    with pytest.raises(ValueError, match=r"^src: element \(2, 1, 7\) is NaN, which int8 cannot hold"):
        flashcte.quantize_kv(src, dst, np.ones(1, np.float32))
    assert (dst == 7).all()
