// The attention layer (flashcte/layer.h): AttentionLayer and its KvCache.
#include "flashcte/layer.h"

#include <nanobind/stl/pair.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "python/src/arrays.h"
#include "python/src/bindings.h"

namespace flashcte::python {
namespace {

// ---- The attention layer (flashcte/layer.h). Python (flashcte/_layer.py) checks shapes and
// converts the weights to float32 C-contiguous arrays; here they are copied into LayerWeights and
// AttentionLayer::create checks them against the config. A layer is held by a shared_ptr so that
// set_weights (a new layer) while another thread's forward runs cannot free the running one.

struct PyLayer {
  std::shared_ptr<const flashcte::AttentionLayer> layer;
};

// A KvCache is mutated by forward while the GIL is released: `busy` (read and written only with
// the GIL held) refuses a second forward, or a reset, on the same cache meanwhile.
struct PyKvCache {
  flashcte::KvCache cache;
  bool busy = false;
};

flashcte::DType activation_dtype(const std::string& name) {
  for (flashcte::DType t :
       {flashcte::DType::kFloat32, flashcte::DType::kBFloat16, flashcte::DType::kFloat16}) {
    if (name == flashcte::dtype_name(t)) return t;
  }
  throw nb::type_error(("dtype: must be float32, bfloat16 or float16, got " + name).c_str());
}

// One weight as the float32 values LayerWeights holds; None is an empty (absent) weight.
std::vector<float> weight_values(const char* name, nb::handle h) {
  if (h.is_none()) return {};
  nb::ndarray<const float, nb::c_contig, nb::device::cpu> a;
  if (!nb::try_cast(h, a, /*convert=*/false)) {
    throw nb::type_error(
        (std::string(name) + ": expected a C-contiguous float32 CPU array").c_str());
  }
  const float* data = a.data();
  return std::vector<float>(data, data + a.size());
}

// Config errors only: AttentionLayer::create checks the config before the weights, so with no
// weights a complaint about q_proj means the config itself passed.
void layer_check_config(const flashcte::LayerConfig& config) {
  std::unique_ptr<flashcte::AttentionLayer> layer;
  const flashcte::Status s =
      flashcte::AttentionLayer::create(config, flashcte::LayerWeights{}, &layer);
  if (!s.ok && s.message.rfind("q_proj:", 0) != 0) raise_status(s);
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> layer_rank_heads(
    const flashcte::LayerConfig& config) {
  flashcte::RankHeads heads;
  const flashcte::Status s = flashcte::rank_heads(config, &heads);
  if (!s.ok) raise_status(s);
  return {std::move(heads.query_heads), std::move(heads.kv_heads)};
}

flashcte::LayerConfig layer_rank_config(const flashcte::LayerConfig& config) {
  flashcte::LayerConfig rank;
  const flashcte::Status s = flashcte::rank_config(config, &rank);
  if (!s.ok) raise_status(s);
  return rank;
}

// LayerConfig::GqaStrategy by ON's enum values ("auto": ON's own choice).
const char* const kGqaStrategies[] = {"auto", "replicate-to-tp-degree", "convert-to-mha"};

flashcte::LayerConfig::GqaStrategy gqa_strategy(const std::string& name) {
  for (int i = 0; i < 3; ++i) {
    if (name == kGqaStrategies[i]) return static_cast<flashcte::LayerConfig::GqaStrategy>(i);
  }
  const std::string message =
      "gqa_strategy: must be 'auto', 'replicate-to-tp-degree' or 'convert-to-mha', got '" + name +
      "'";
  throw nb::value_error(message.c_str());
}

void layer_init(PyLayer* self, const flashcte::LayerConfig& config, nb::handle q_proj,
                nb::handle k_proj, nb::handle v_proj, nb::handle o_proj, nb::handle q_bias,
                nb::handle k_bias, nb::handle v_bias, nb::handle o_bias, nb::handle q_norm,
                nb::handle k_norm, nb::handle sinks, bool shard) {
  flashcte::LayerWeights w;
  w.q_proj = weight_values("q_proj", q_proj);
  w.k_proj = weight_values("k_proj", k_proj);
  w.v_proj = weight_values("v_proj", v_proj);
  w.o_proj = weight_values("o_proj", o_proj);
  w.q_bias = weight_values("q_bias", q_bias);
  w.k_bias = weight_values("k_bias", k_bias);
  w.v_bias = weight_values("v_bias", v_bias);
  w.o_bias = weight_values("o_bias", o_bias);
  w.q_norm = weight_values("q_norm", q_norm);
  w.k_norm = weight_values("k_norm", k_norm);
  w.sinks = weight_values("sinks", sinks);
  std::unique_ptr<flashcte::AttentionLayer> layer;
  flashcte::Status status;
  {
    nb::gil_scoped_release release;  // rounding and relayout of the weights: large for real models
    status = shard ? flashcte::AttentionLayer::create_from_shard(config, w, &layer)
                   : flashcte::AttentionLayer::create(config, w, &layer);
  }
  if (!status.ok) raise_status(status);
  new (self) PyLayer{std::shared_ptr<const flashcte::AttentionLayer>(std::move(layer))};
}

void layer_forward(const PyLayer& self, nb::handle x, nb::handle positions, PyKvCache& cache,
                   nb::handle out, int num_threads, bool bf16_bits) {
  Imports im;
  im.bf16_bits = bf16_bits;
  const flashcte::TensorView xv = im.in("x", x);
  const flashcte::TensorView pv = im.in("positions", positions);
  const flashcte::MutableTensorView ov = im.out("out", out);
  if (cache.busy) {
    throw std::runtime_error("cache: another forward call is using this cache right now");
  }
  const std::shared_ptr<const flashcte::AttentionLayer> layer = self.layer;
  flashcte::Status status;
  {
    // Cleared when the scope ends, with the GIL held again (`busy` outlives `release`).
    struct Busy {
      bool& flag;
      ~Busy() { flag = false; }
    };
    cache.busy = true;
    const Busy busy{cache.busy};
    nb::gil_scoped_release release;
    status = layer->forward(xv, pv, &cache.cache, ov, num_threads);
  }
  if (!status.ok) raise_status(status);
}

// A KV cache's dtype: an activation dtype, or an 8-bit format (LayerConfig::kv_cache_dtype).
flashcte::DType cache_dtype(const std::string& name) {
  for (flashcte::DType t :
       {flashcte::DType::kInt8, flashcte::DType::kFloat8E4M3, flashcte::DType::kFloat8E5M2}) {
    if (name == flashcte::dtype_name(t)) return t;
  }
  return activation_dtype(name);
}

void cache_init(PyKvCache* self, int64_t batch, int64_t kv_heads, int64_t max_len, int64_t head_dim,
                const std::string& dtype) {
  flashcte::KvCache cache;
  const flashcte::Status status =
      flashcte::KvCache::create(batch, kv_heads, max_len, head_dim, cache_dtype(dtype), &cache);
  if (!status.ok) raise_status(status);
  new (self) PyKvCache{std::move(cache), false};
}

void paged_cache_init(PyKvCache* self, int64_t batch, int64_t num_blocks, int64_t block_size,
                      int64_t kv_heads, int64_t head_dim, const std::string& dtype) {
  flashcte::KvCache cache;
  const flashcte::Status status = flashcte::KvCache::create_paged(
      batch, num_blocks, block_size, kv_heads, head_dim, cache_dtype(dtype), &cache);
  if (!status.ok) raise_status(status);
  new (self) PyKvCache{std::move(cache), false};
}

void cache_assign(PyKvCache& self, int64_t b, const std::vector<int32_t>& pages, int64_t length) {
  if (self.busy) {
    throw std::runtime_error("cache: another forward call is using this cache right now");
  }
  const flashcte::Status status = self.cache.assign(b, pages, length);
  if (!status.ok) raise_status(status);
}

void cache_reset(PyKvCache& self, int64_t b) {
  if (b < 0 || b >= self.cache.batch()) {
    throw nb::value_error(("b: must be in [0, batch = " + std::to_string(self.cache.batch()) +
                           "), got " + std::to_string(b))
                              .c_str());
  }
  if (self.busy) {
    throw std::runtime_error("cache: another forward call is using this cache right now");
  }
  self.cache.reset(b);
}

// A read-only numpy view of the cache's K or V storage, (batch, kv_heads, max_len, head_dim),
// keeping the cache alive; bfloat16 comes as its uint16 bits and fp8 as uint8 codes (Python
// views them as ml_dtypes'). `scales`: an 8-bit cache's scales, the shape without head_dim.
nb::ndarray<nb::numpy, nb::ro> cache_storage(nb::handle self_handle, bool values, bool scales) {
  PyKvCache& self = nb::cast<PyKvCache&>(self_handle);
  const flashcte::KvCache& c = self.cache;
  // Dense (batch, kv_heads, max_len, head_dim); paged (num_blocks, kv_heads, block_size,
  // head_dim).
  const size_t shape[4] = {static_cast<size_t>(c.paged() ? c.num_blocks() : c.batch()),
                           static_cast<size_t>(c.kv_heads()),
                           static_cast<size_t>(c.paged() ? c.block_size() : c.max_len()),
                           static_cast<size_t>(c.head_dim())};
  if (scales) {
    if (c.k_scale_data() == nullptr) {
      throw nb::value_error(("cache: a " + std::string(flashcte::dtype_name(c.dtype())) +
                             " cache has no scales (an 8-bit one has)")
                                .c_str());
    }
    return nb::ndarray<nb::numpy, nb::ro>(values ? c.v_scale_data() : c.k_scale_data(), 3, shape,
                                          self_handle, nullptr, nb::dtype<float>());
  }
  nb::dlpack::dtype dtype = nb::dtype<float>();
  switch (c.dtype()) {
    case flashcte::DType::kBFloat16:
      dtype = nb::dtype<uint16_t>();
      break;
    case flashcte::DType::kFloat16:
      dtype = {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
      break;
    case flashcte::DType::kInt8:
      dtype = nb::dtype<int8_t>();
      break;
    case flashcte::DType::kFloat8E4M3:
    case flashcte::DType::kFloat8E5M2:
      dtype = nb::dtype<uint8_t>();
      break;
    case flashcte::DType::kFloat32:
    case flashcte::DType::kInt32:
    case flashcte::DType::kInt64:
      break;
  }
  return nb::ndarray<nb::numpy, nb::ro>(values ? c.v_data() : c.k_data(), 4, shape, self_handle,
                                        nullptr, dtype);
}

}  // namespace

void bind_layer(nb::module_& m) {
  nb::class_<flashcte::Llama3RopeScaling>(m, "Llama3RopeScaling")
      .def(nb::init<>())
      .def_rw("factor", &flashcte::Llama3RopeScaling::factor)
      .def_rw("low_freq_factor", &flashcte::Llama3RopeScaling::low_freq_factor)
      .def_rw("high_freq_factor", &flashcte::Llama3RopeScaling::high_freq_factor)
      .def_rw("original_max_position_embeddings",
              &flashcte::Llama3RopeScaling::original_max_position_embeddings);

  using flashcte::LayerConfig;
  nb::class_<LayerConfig>(m, "LayerConfig",
                          "flashcte::LayerConfig (flashcte/layer.h), field by field.")
      .def(nb::init<>())
      .def_rw("hidden_size", &LayerConfig::hidden_size)
      .def_rw("num_heads", &LayerConfig::num_heads)
      .def_rw("num_kv_heads", &LayerConfig::num_kv_heads)
      .def_rw("head_dim", &LayerConfig::head_dim)
      .def_rw("rope", &LayerConfig::rope)
      .def_rw("rope_theta", &LayerConfig::rope_theta)
      .def_rw("rotary_dim", &LayerConfig::rotary_dim)
      .def_rw("rope_scaling", &LayerConfig::rope_scaling)
      .def_rw("sliding_window", &LayerConfig::sliding_window)
      .def_rw("qk_scale", &LayerConfig::qk_scale)
      .def_rw("qkv_bias", &LayerConfig::qkv_bias)
      .def_rw("o_bias", &LayerConfig::o_bias)
      .def_rw("qk_norm", &LayerConfig::qk_norm)
      .def_rw("qk_norm_eps", &LayerConfig::qk_norm_eps)
      .def_rw("sinks", &LayerConfig::sinks)
      .def_prop_rw(
          "dtype", [](const LayerConfig& c) { return std::string(flashcte::dtype_name(c.dtype)); },
          [](LayerConfig& c, const std::string& name) { c.dtype = activation_dtype(name); })
      .def_prop_rw(
          "kv_cache_dtype",
          [](const LayerConfig& c) -> std::optional<std::string> {
            if (!c.kv_cache_dtype) return std::nullopt;
            return std::string(flashcte::dtype_name(*c.kv_cache_dtype));
          },
          [](LayerConfig& c, const std::optional<std::string>& name) {
            c.kv_cache_dtype.reset();
            if (name) c.kv_cache_dtype = cache_dtype(*name);
          },
          nb::arg("name").none())
      .def_rw("tp_degree", &LayerConfig::tp_degree)
      .def_rw("tp_rank", &LayerConfig::tp_rank)
      .def_prop_rw(
          "gqa_strategy",
          [](const LayerConfig& c) {
            return std::string(kGqaStrategies[static_cast<int>(c.gqa_strategy)]);
          },
          [](LayerConfig& c, const std::string& name) { c.gqa_strategy = gqa_strategy(name); });

  m.def("layer_check_config", &layer_check_config, nb::arg("config"),
        "Raises ValueError/TypeError with the library's message when the config is invalid.");
  m.def("layer_rank_heads", &layer_rank_heads, nb::arg("config"),
        "flashcte::rank_heads: the full layer's query and KV heads a rank holds (-1: a pad).");
  m.def("layer_rank_config", &layer_rank_config, nb::arg("config"),
        "flashcte::rank_config: the config a tensor-parallel rank runs (its heads, no o_bias).");

  nb::class_<PyLayer>(m, "Layer", "flashcte::AttentionLayer with its weights.")
      .def("__init__", &layer_init, nb::arg("config"), nb::arg("q_proj"), nb::arg("k_proj"),
           nb::arg("v_proj"), nb::arg("o_proj"), nb::arg("q_bias").none(), nb::arg("k_bias").none(),
           nb::arg("v_bias").none(), nb::arg("o_bias").none(), nb::arg("q_norm").none(),
           nb::arg("k_norm").none(), nb::arg("sinks").none(), nb::arg("shard") = false,
           "AttentionLayer::create (shard: create_from_shard, the rank's own) from float32 "
           "C-contiguous weights (None: absent).")
      .def_prop_ro("head_dim", [](const PyLayer& l) { return l.layer->head_dim(); })
      .def("forward", &layer_forward, nb::kw_only(), nb::arg("x"), nb::arg("positions"),
           nb::arg("cache"), nb::arg("out"), nb::arg("num_threads"), nb::arg("bf16_bits"),
           "AttentionLayer::forward into a caller-allocated out, the GIL released.");

  nb::class_<PyKvCache>(m, "KvCache", "flashcte::KvCache.")
      .def("__init__", &cache_init, nb::arg("batch"), nb::arg("kv_heads"), nb::arg("max_len"),
           nb::arg("head_dim"), nb::arg("dtype"))
      .def("__init__", &paged_cache_init, nb::kw_only(), nb::arg("batch"), nb::arg("num_blocks"),
           nb::arg("block_size"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("dtype"),
           "KvCache::create_paged: a block pool.")
      .def_prop_ro("batch", [](const PyKvCache& c) { return c.cache.batch(); })
      .def_prop_ro("kv_heads", [](const PyKvCache& c) { return c.cache.kv_heads(); })
      .def_prop_ro("max_len", [](const PyKvCache& c) { return c.cache.max_len(); })
      .def_prop_ro("head_dim", [](const PyKvCache& c) { return c.cache.head_dim(); })
      .def_prop_ro(
          "dtype",
          [](const PyKvCache& c) { return std::string(flashcte::dtype_name(c.cache.dtype())); })
      .def_prop_ro("lengths", [](const PyKvCache& c) { return c.cache.lengths(); })
      .def_prop_ro("paged", [](const PyKvCache& c) { return c.cache.paged(); })
      .def_prop_ro("num_blocks", [](const PyKvCache& c) { return c.cache.num_blocks(); })
      .def_prop_ro("block_size", [](const PyKvCache& c) { return c.cache.block_size(); })
      .def(
          "pages",
          [](const PyKvCache& c, int64_t b) {
            if (b < 0 || b >= c.cache.batch()) throw nb::value_error("b: out of range");
            return c.cache.pages(b);
          },
          nb::arg("b"))
      .def("assign", &cache_assign, nb::arg("b"), nb::arg("pages"), nb::arg("length"),
           "KvCache::assign: sequence b's pages and its filled slots.")
      .def("reset", &cache_reset, nb::arg("b"), "Forgets every token of sequence b.")
      .def(
          "keys", [](nb::handle self) { return cache_storage(self, false, false); },
          "K storage: a read-only view (batch, kv_heads, max_len, head_dim).")
      .def(
          "values", [](nb::handle self) { return cache_storage(self, true, false); },
          "V storage: a read-only view (batch, kv_heads, max_len, head_dim).")
      .def(
          "key_scales", [](nb::handle self) { return cache_storage(self, false, true); },
          "An 8-bit cache's K scales: a read-only view (batch, kv_heads, max_len).")
      .def(
          "value_scales", [](nb::handle self) { return cache_storage(self, true, true); },
          "An 8-bit cache's V scales: a read-only view (batch, kv_heads, max_len).");

  m.def("layer_gemm_backend", &flashcte::layer_gemm_backend,
        "The GEMM library the layer's projections run on and its kernels.");
  m.def("set_layer_gemm_fallback", &flashcte::set_layer_gemm_fallback, nb::arg("path"),
        nb::arg("symbol_prefix"),
        "The OpenBLAS the projections load when libopenblas.so.0 does not (a shared library's "
        "path and its symbols' prefix); only before the first load counts.");
}

}  // namespace flashcte::python
