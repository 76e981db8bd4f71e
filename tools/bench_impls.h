// The implementations `flashcte bench` times for one prefill configuration (cmd_bench.cc): flashcte
// itself and, with OpenBLAS, the materialized peer and the sgemm roofline. Each sets up its own
// inputs (the same seeds for the attention impls) and reports its FLOPs and JSON fields.
#ifndef FLASHCTE_TOOLS_BENCH_IMPLS_H_
#define FLASHCTE_TOOLS_BENCH_IMPLS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "flashcte/flashcte.h"
#include "tools/json.h"
#include "tools/openblas_core.h"

namespace flashcte::tools {

// One prefill configuration: heads query heads over kv_heads, (sq, skv, d).
struct BenchConfig {
  int64_t sq, skv, d, heads, kv_heads;
  bool causal;
  DType dtype;
  int threads;
  float scale;
  TileConfig tiles;  // 0: the library's automatic choice
  OpenBlasSelection openblas;
};

class Impl {
 public:
  virtual ~Impl() = default;
  virtual const char* name() const = 0;
  // Allocates and fills this impl's buffers.
  virtual bool Setup(std::string* error) = 0;
  virtual bool Run(std::string* error) = 0;
  virtual double Flops() const = 0;
  // This impl's own fields of the JSON line.
  virtual void AddJson(Json*) const {}
  virtual bool UsesOpenBlas() const { return false; }
};

std::unique_ptr<Impl> MakeFlashImpl(const BenchConfig& c);
#if FLASHCTE_HAVE_OPENBLAS
std::unique_ptr<Impl> MakeMaterializedImpl(const BenchConfig& c);
// A square sgemm of about `attention_flops`.
std::unique_ptr<Impl> MakeSgemmImpl(const BenchConfig& c, double attention_flops);
#endif

}  // namespace flashcte::tools

#endif  // FLASHCTE_TOOLS_BENCH_IMPLS_H_
