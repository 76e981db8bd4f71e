"""ONNX Runtime: a one-node model built with onnx.helper, of one of three attention ops:
ort-mha (com.microsoft MultiHeadAttention), ort-gqa (com.microsoft GroupQueryAttention) and
ort-attention (the standard ONNX Attention, opset 23)."""

from __future__ import annotations

from .base import PyImpl, Unsupported, check_budget, np_dtype


def bshd_feeds(p, q, k, v) -> dict:
    """q, k, v as (1, S, heads * d), the layout of the com.microsoft ops."""
    H, Hkv, S, d = p["heads"], p["kv_heads"], p["s"], p["d"]
    return {"q": q.transpose(1, 0, 2).reshape(1, S, H * d),
            "k": k.transpose(1, 0, 2).reshape(1, S, Hkv * d),
            "v": v.transpose(1, 0, 2).reshape(1, S, Hkv * d)}


def mha_graph(helper, TensorProto, et, p, data):
    H, S, d = p["heads"], p["s"], p["d"]
    vi = helper.make_tensor_value_info
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"],
                            domain="com.microsoft", num_heads=H, scale=float(p["scale"]),
                            unidirectional=int(p["causal"]))
    inputs = [vi(n, et, [1, S, H * d]) for n in "qkv"]
    outputs = [vi("o", et, [1, S, H * d])]
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return node, inputs, outputs, opsets, bshd_feeds(p, *data), "bshd"


def gqa_graph(helper, TensorProto, et, p, data):
    import numpy as np
    H, Hkv, S, d = p["heads"], p["kv_heads"], p["s"], p["d"]
    vi = helper.make_tensor_value_info
    node = helper.make_node(
        "GroupQueryAttention", ["q", "k", "v", "", "", "seqlens_k", "total_len"],
        ["o", "present_k", "present_v"], domain="com.microsoft", num_heads=H,
        kv_num_heads=Hkv, scale=float(p["scale"]), causal=int(p["causal"]))
    inputs = [vi("q", et, [1, S, H * d]), vi("k", et, [1, S, Hkv * d]),
              vi("v", et, [1, S, Hkv * d]), vi("seqlens_k", TensorProto.INT32, [1]),
              vi("total_len", TensorProto.INT32, [])]
    outputs = [vi("o", et, [1, S, H * d]), vi("present_k", et, None),
               vi("present_v", et, None)]
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    feeds = dict(bshd_feeds(p, *data), seqlens_k=np.array([S - 1], np.int32),
                 total_len=np.array(S, np.int32))
    return node, inputs, outputs, opsets, feeds, "bshd"


def attention_graph(helper, TensorProto, et, p, data):
    """The standard ONNX Attention op (opset 23), 4-D (B, H, S, d)."""
    H, Hkv, S, d = p["heads"], p["kv_heads"], p["s"], p["d"]
    vi = helper.make_tensor_value_info
    q, k, v = data
    node = helper.make_node("Attention", ["q", "k", "v"], ["o"], scale=float(p["scale"]),
                            is_causal=int(p["causal"]), q_num_heads=H, kv_num_heads=Hkv)
    inputs = [vi("q", et, [1, H, S, d]), vi("k", et, [1, Hkv, S, d]),
              vi("v", et, [1, Hkv, S, d])]
    outputs = [vi("o", et, [1, H, S, d])]
    opsets = [helper.make_opsetid("", 23)]
    return node, inputs, outputs, opsets, {"q": q[None], "k": k[None], "v": v[None]}, "bhsd"


GRAPHS = {"ort-mha": mha_graph, "ort-gqa": gqa_graph, "ort-attention": attention_graph}


class OrtImpl(PyImpl):
    """ONNX Runtime: a one-node model built with onnx.helper."""

    def setup(self):
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper
        p = self.p
        self.np, self.ort = np, ort
        if self.name == "ort-mha" and p["heads"] != p["kv_heads"]:
            raise Unsupported("MultiHeadAttention has no GQA (kv heads = heads only)")
        # ORT's CPU kernels of these ops materialize (heads, S, S) probabilities.
        check_budget(4 * p["heads"] * p["s"] ** 2, p,
                     "its CPU kernel materializes ~{gib:.1f} GiB of probabilities")
        self.et = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
                   "bfloat16": TensorProto.BFLOAT16}[p["dtype"]]
        node, inputs, outputs, opsets, feeds, self.layout = GRAPHS[self.name](
            helper, TensorProto, self.et, p, self.data)
        model = helper.make_model(helper.make_graph([node], "attention", inputs, outputs),
                                  opset_imports=opsets)
        model.ir_version = min(model.ir_version, 10)
        self.sess = self.session(model)
        self.feeds = {n: self.ortvalue(np.ascontiguousarray(a)) for n, a in feeds.items()}
        self.extra["onnxruntime"] = ort.__version__

    def session(self, model):
        ort, p = self.ort, self.p
        so = ort.SessionOptions()
        so.intra_op_num_threads = p["threads"]
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            return ort.InferenceSession(model.SerializeToString(), so,
                                        providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "NOT_IMPLEMENTED" in msg or "Could not find an implementation" in msg:
                raise Unsupported(f"no CPU kernel for {p['dtype']}: {msg[:160]}") from e
            raise

    def ortvalue(self, a):
        import ml_dtypes
        if a.dtype == ml_dtypes.bfloat16:
            return self.ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(self.np.uint16),
                                                                        self.et)
        return self.ort.OrtValue.ortvalue_from_numpy(a)

    def run(self):
        return self.sess.run_with_ort_values(["o"], self.feeds)[0]

    def as_numpy(self, out):
        p = self.p
        a = out.numpy()
        if p["dtype"] == "bfloat16":
            a = a.view(np_dtype("bfloat16"))
        a = a.astype(self.np.float32)
        if self.layout == "bshd":
            return a.reshape(p["s"], p["heads"], p["d"]).transpose(1, 0, 2)
        return a[0]
