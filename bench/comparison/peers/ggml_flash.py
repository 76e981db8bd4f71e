"""ggml's CPU flash attention (ggml_flash_attn_ext through ggml-python's ctypes bindings) as
llama.cpp's prefill calls it: ggml-f16 (k and v f16, llama.cpp's default KV cache) and ggml-f32
(k and v f32, the other type ggml's tiled CPU kernel takes)."""

from __future__ import annotations

from .base import PyImpl, Unsupported, check_budget


class GgmlImpl(PyImpl):
    """ggml's CPU flash attention, called the way llama.cpp's prefill calls it: q f32, k and v in
    the KV cache's type, the causal mask an additive f16 (0 or -inf) tensor, one graph of a
    single ggml_flash_attn_ext node computed on the point's threads.

    The graph, its plan and its work buffer are made once in setup(), so that run() times
    ggml's kernel (ggml_graph_compute) and not Python building ggml objects through ctypes."""

    kv_type = "F32"  # the KV cache's type: GGML_TYPE_<kv_type>, numpy float<bits>

    def setup(self):
        import ctypes
        import numpy as np
        import ggml
        p = self.p
        self.np, self.ggml, self.ctypes = np, ggml, ctypes
        if p["heads"] % p["kv_heads"]:
            raise Unsupported("query heads must be a multiple of kv heads")
        arrays = self.arrays()
        # One context holds every tensor's data and the graph; the work buffer is separate.
        size = (sum(a.nbytes for a in arrays.values()) + self.output_bytes()
                + 16 * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead() + (1 << 20))
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None,
                                                        no_alloc=False))
        if not self.ctx:
            raise MemoryError(f"ggml_init of {size / 2**20:.0f} MiB failed")
        self.build_graph(self.tensors(arrays))
        self.extra["ggml_python"] = getattr(ggml, "__version__", "?")
        self.extra["ggml"] = (ggml.ggml_version() or b"?").decode()
        # Evidence that GGML_NATIVE took: a generic x86-64 build reports no AVX-512 here.
        self.extra["ggml_avx512_bf16"] = bool(ggml.ggml_cpu_has_avx512_bf16())
        # Allocated (and zeroed, so resident) here: the memory probe's first call does not see it.
        self.extra["ggml_work_mib"] = round(self.plan.work_size / 2**20, 2)

    def output_bytes(self) -> int:
        return 4 * self.p["heads"] * self.p["s"] * self.p["d"]

    def arrays(self) -> dict:
        """q, k, v (and the causal mask) as numpy arrays of the types ggml gets.

        ggml numbers dimensions innermost first: ne (d, S, heads, 1) is numpy's (heads, S, d).
        Inputs of any point dtype go through float32, exact for bf16 and fp16; ggml-f16 then
        rounds k and v to fp16 as llama.cpp's f16 KV cache does."""
        np, p = self.np, self.p
        S = p["s"]
        kv_np = {"F16": np.float16, "F32": np.float32}[self.kv_type]
        q, k, v = self.data
        arrays = {"q": np.ascontiguousarray(q.astype(np.float32)),
                  "k": np.ascontiguousarray(k.astype(np.float32).astype(kv_np)),
                  "v": np.ascontiguousarray(v.astype(np.float32).astype(kv_np))}
        if p["causal"]:
            # ggml's mask is (n_kv, n_batch) in its order, i.e. numpy (Sq, Skv), broadcast over
            # heads; -inf above the diagonal. Older ggml asserted n_batch padded to
            # GGML_KQ_MASK_PAD (the binding still defines it; the vendored ggml dropped the
            # rule); the padding rows are never read, so pad whenever the binding has it.
            pad = int(getattr(self.ggml, "GGML_KQ_MASK_PAD", 1))
            rows = -(-S // pad) * pad
            check_budget(2 * rows * S, p, "its f16 causal mask would be {gib:.1f} GiB")
            arrays["mask"] = np.where(np.arange(S)[None, :] <= np.arange(rows)[:, None],
                                      np.float16(0), np.float16(-np.inf))
        return arrays

    def tensors(self, arrays: dict) -> dict:
        """ggml tensors in the context, holding copies of `arrays`."""
        ggml = self.ggml
        kv = getattr(ggml, f"GGML_TYPE_{self.kv_type}")
        types = {"q": ggml.GGML_TYPE_F32, "k": kv, "v": kv, "mask": ggml.GGML_TYPE_F16}
        t = {}
        for name, a in arrays.items():
            ne = list(reversed(a.shape)) + [1] * (4 - a.ndim)
            t[name] = ggml.ggml_new_tensor_4d(self.ctx, types[name], *ne)
            self.ctypes.memmove(ggml.ggml_get_data(t[name]), a.ctypes.data, a.nbytes)
        return t

    def build_graph(self, t: dict) -> None:
        ggml, ctypes = self.ggml, self.ctypes
        self.out = ggml.ggml_flash_attn_ext(self.ctx, t["q"], t["k"], t["v"], t.get("mask"),
                                            float(self.p["scale"]), 0.0, 0.0)
        # llama.cpp asks for f32 precision (the CPU kernel accumulates in f32 either way).
        ggml.ggml_flash_attn_ext_set_prec(self.out, ggml.GGML_PREC_F32)
        self.graph = ggml.ggml_new_graph(self.ctx)
        ggml.ggml_build_forward_expand(self.graph, self.out)
        self.plan = ggml.ggml_graph_plan(self.graph, self.p["threads"], None)
        self.work = (ctypes.c_uint8 * max(1, self.plan.work_size))()
        self.plan.work_data = ctypes.cast(self.work, ctypes.POINTER(ctypes.c_uint8))

    def run(self):
        status = self.ggml.ggml_graph_compute(self.graph, self.ctypes.byref(self.plan))
        if status != self.ggml.GGML_STATUS_SUCCESS:
            raise RuntimeError(f"ggml_graph_compute returned status {status}")
        return self.out

    def as_numpy(self, out):
        # ggml_flash_attn_ext's result is f32 (d, heads, S) in ggml's order: numpy (S, heads, d).
        p = self.p
        buf = (self.ctypes.c_float * (p["s"] * p["heads"] * p["d"])).from_address(
            self.ggml.ggml_get_data(out))
        a = self.np.ctypeslib.as_array(buf).reshape(p["s"], p["heads"], p["d"])
        return a.transpose(1, 0, 2).copy()  # a copy: the next run overwrites ggml's buffer

    def __del__(self):
        if getattr(self, "ctx", None):
            self.ggml.ggml_free(self.ctx)


class GgmlF16Impl(GgmlImpl):
    kv_type = "F16"
    rounds_inputs_to = "float16"  # k and v, whatever the point's dtype


class GgmlF32Impl(GgmlImpl):
    kv_type = "F32"


def q8_0(x):
    """ggml's q8_0 of float32 rows x (..., d), d a multiple of 32, as its bytes and the values
    they hold: per block of 32, d = max |x| / 127 (stored as fp16) and the codes round(x / d),
    halves away from zero (quantize_row_q8_0_ref)."""
    import numpy as np
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    scale = amax / 127.0
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    y = blocks * inv
    codes = np.trunc(y + np.copysign(0.5, y)).astype(np.int8)
    packed = np.empty(len(blocks), dtype=[("d", "<f2"), ("qs", "i1", 32)])
    packed["d"], packed["qs"] = scale[:, 0].astype(np.float16), codes
    held = codes.astype(np.float32) * packed["d"].astype(np.float32)[:, None]
    return packed, held.reshape(x.shape)


class GgmlDecodeImpl(GgmlImpl):
    """ggml_flash_attn_ext on a decode step as llama.cpp runs it: q f32 (B, heads, 1, d), the
    cache (B, kv_heads, N + 1, d) in llama.cpp's type for the point: f16 (its default) for a
    bf16 / fp16 point, f32 for fp32, q8_0 for an 8-bit one; no mask, GQA by ggml's broadcast of
    the KV heads. data = q, k, v as torch tensors of the point's dtype (decode.decode_inputs)."""

    def output_bytes(self) -> int:
        return 4 * self.data[0].numel()

    def arrays(self) -> dict:
        import numpy as np
        p = self.p
        self.kv_type = "Q8_0" if p.get("kv_dtype") else ("F32" if p["dtype"] == "float32"
                                                          else "F16")
        q, k, v = (t.float().numpy() for t in self.data)
        arrays, self.held = {"q": np.ascontiguousarray(q)}, {}
        for name, a in (("k", k), ("v", v)):
            if self.kv_type == "Q8_0":
                arrays[name], self.held[name] = q8_0(a)
            else:
                arrays[name] = np.ascontiguousarray(a.astype(np.float16 if self.kv_type == "F16"
                                                             else np.float32))
                self.held[name] = arrays[name].astype(np.float32)
        self.extra["ggml_kv_type"] = self.kv_type.lower()
        if p.get("block_size"):
            self.extra["notes"] = "a dense cache: llama.cpp's KV cache is not paged"
        return arrays

    def tensors(self, arrays: dict) -> dict:
        ggml = self.ggml
        kv = getattr(ggml, f"GGML_TYPE_{self.kv_type}")
        shapes = {"q": self.data[0].shape, "k": self.data[1].shape, "v": self.data[2].shape}
        t = {}
        for name, a in arrays.items():
            t[name] = ggml.ggml_new_tensor_4d(self.ctx, ggml.GGML_TYPE_F32 if name == "q" else kv,
                                              *reversed(shapes[name]))
            if ggml.ggml_nbytes(t[name]) != a.nbytes:
                raise RuntimeError(f"ggml's {name} holds {ggml.ggml_nbytes(t[name])} bytes, the "
                                   f"array {a.nbytes}")
            self.ctypes.memmove(ggml.ggml_get_data(t[name]), a.ctypes.data, a.nbytes)
        return t

    def as_numpy(self, out):
        # The result is f32 ne (d, heads, 1, B): numpy (B, 1, heads, d); compared as (B * heads,
        # 1, d) (decode.py's yardstick).
        B, H, _, d = self.data[0].shape
        buf = (self.ctypes.c_float * (B * H * d)).from_address(self.ggml.ggml_get_data(out))
        return self.np.ctypeslib.as_array(buf).reshape(B * H, 1, d).copy()

    def attended(self):
        """q and the values ggml's cache holds, as torch tensors (the cross-check's inputs)."""
        import torch
        return (self.data[0], *(torch.from_numpy(self.held[n]) for n in ("k", "v")))
