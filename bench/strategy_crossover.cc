// strategy_crossover: where, if anywhere, does plain materialized attention beat attention_cte on
// this CPU? The answer sets MaterializedMaxLength in src/dispatch/strategy.cc (cpu_strategy),
// whose comment tables the results of these runs (build target flashcte_strategy_crossover):
//   --reps 201 --sample-ms 0.5 --threads 1 --causal both                      (twice)
//   --reps 101 --sample-ms 0.5 --threads 1 --causal both --dims 8,32,256 --sizes 1,4,...,256
//   --reps 101 --sample-ms 0.5 --threads 1 --causal both --heads 8 --kv-heads 8 --sizes 1,...,128
//   --reps 101 --sample-ms 0.5 --threads 1 --causal both --heads 32 --kv-heads 8 --sizes 1,...,64
//   --reps 61 --sample-ms 2 --threads 1 --causal false --sizes 128,256,512,1024,2048
//   --reps 11 --sample-ms 20 --threads 2 --causal both --sizes 1,4,16,64,256
//
// The two contenders, on the same float32 inputs (uniform [0, 1), scale 1/sqrt(d)):
//   flashcte      attention_cte with q (H, S, d), k (KV, d, S), v (KV, S, d), out (H, S, d).
//   materialized  the `flashcte bench --impl materialized` peer (tools/cmd_bench.cc), repeated
//                 here call for call: OpenBLAS sgemm Q.K^T into a preallocated S x S score
//                 matrix, the same vectorized masked row softmax (tools/bench_softmax.cc), sgemm
//                 P.V. Its buffers are allocated once outside the timing, which flatters it: a
//                 library NONE path would have to find an S x S scratch per call.
//
// Method, for a shared and noisy machine: every sample times a batch of back-to-back calls
// (sized to --sample-ms on the slower contender, at least one call) and reports microseconds per
// call; samples of the two contenders alternate in ABBA order so drift hits both alike; the
// median over --reps samples is reported with the ratio and the fraction of samples in which the
// materialized path was faster. With more than one thread the process sleeps 150 ms before each
// switch of contender, because OpenBLAS's idle workers spin for ~0.1 s after a call and would
// steal the second core from the OpenMP team (the same precaution as `flashcte bench`).
// Outputs are compared once per configuration, so a mismatch in scale or masking cannot pass as
// a speedup.
//
// Usage: flashcte_strategy_crossover [--reps N] [--sample-ms X] [--sizes 1,2,...] [--dims 64,128]
//            [--threads 1,2] [--causal true|false|both] [--heads H --kv-heads KV (default 1/1)]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flashcte/flashcte.h"
#include "tools/bench_softmax.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Config {
  int64_t s = 0, d = 0;
  int threads = 1;
  bool causal = true;
  int64_t heads = 1, kv_heads = 1;
};

std::vector<float> Uniform(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

class Contenders {
 public:
  explicit Contenders(const Config& c)
      : c_(c),
        scale_(static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)))),
        q_(Uniform(c.heads * c.s * c.d, 1)),
        k_(Uniform(c.kv_heads * c.d * c.s, 2)),  // (d, S): the Neuron default, tp_k = false
        v_(Uniform(c.kv_heads * c.s * c.d, 3)),
        out_flash_(c.heads * c.s * c.d),
        out_mat_(c.heads * c.s * c.d),
        scores_(c.s * c.s) {
    options_.scale = scale_;
    options_.causal_mask = c.causal;
    options_.num_threads = c.threads;
    using flashcte::DType;
    q_view_ = flashcte::TensorView::contiguous(q_.data(), DType::kFloat32, {c.heads, c.s, c.d});
    k_view_ = flashcte::TensorView::contiguous(k_.data(), DType::kFloat32, {c.kv_heads, c.d, c.s});
    v_view_ = flashcte::TensorView::contiguous(v_.data(), DType::kFloat32, {c.kv_heads, c.s, c.d});
    outputs_.out = flashcte::MutableTensorView::contiguous(out_flash_.data(), DType::kFloat32,
                                                           {c.heads, c.s, c.d});
  }

  void Flash() {
    const flashcte::Status s =
        flashcte::attention_cte(q_view_, k_view_, v_view_, outputs_, options_);
    if (!s.ok) {
      std::fprintf(stderr, "attention_cte: %s\n", s.message.c_str());
      std::exit(1);
    }
  }

  // Head by head, as the `flashcte bench` peer does.
  void Materialized() {
    const int s = static_cast<int>(c_.s), d = static_cast<int>(c_.d);
    const int64_t group = c_.heads / c_.kv_heads, hs = c_.s * c_.d;
    for (int64_t h = 0; h < c_.heads; ++h) {
      const float* k = k_.data() + (h / group) * hs;
      const float* v = v_.data() + (h / group) * hs;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s, s, d, scale_, q_.data() + h * hs, d,
                  k, s, 0.0f, scores_.data(), s);
      flashcte::tools::MaskedSoftmaxRows(scores_.data(), s, s, s, c_.causal, c_.threads);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s, d, s, 1.0f, scores_.data(), s, v, d,
                  0.0f, out_mat_.data() + h * hs, d);
    }
  }

  double MaxAbsDifference() const {
    double m = 0;
    for (size_t i = 0; i < out_flash_.size(); ++i) {
      m = std::max(m, std::fabs(static_cast<double>(out_flash_[i]) - out_mat_[i]));
    }
    return m;
  }

 private:
  Config c_;
  float scale_;
  std::vector<float> q_, k_, v_, out_flash_, out_mat_, scores_;
  flashcte::Options options_;
  flashcte::TensorView q_view_, k_view_, v_view_;
  flashcte::Outputs outputs_;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<int64_t> ParseList(const char* text) {
  std::vector<int64_t> out;
  std::string s(text);
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = std::min(s.find(',', pos), s.size());
    out.push_back(std::atoll(s.substr(pos, comma - pos).c_str()));
    pos = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 41;
  double sample_ms = 2.0;
  std::vector<int64_t> sizes = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  std::vector<int64_t> dims = {64, 128};
  std::vector<int64_t> thread_counts = {1, 2};
  std::vector<bool> causal_modes = {true};
  int64_t heads = 1, kv_heads = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--reps") {
      reps = std::max(1, std::atoi(value));
    } else if (flag == "--sample-ms") {
      sample_ms = std::max(0.01, std::atof(value));
    } else if (flag == "--sizes") {
      sizes = ParseList(value);
    } else if (flag == "--dims") {
      dims = ParseList(value);
    } else if (flag == "--threads") {
      thread_counts = ParseList(value);
    } else if (flag == "--heads") {
      heads = std::max<int64_t>(1, std::atoll(value));
    } else if (flag == "--kv-heads") {
      kv_heads = std::max<int64_t>(1, std::atoll(value));
    } else if (flag == "--causal") {
      const std::string v = value;
      causal_modes = v == "both" ? std::vector<bool>{true, false} : std::vector<bool>{v == "true"};
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }

  if (heads % kv_heads != 0) {
    std::fprintf(stderr, "--kv-heads must divide --heads\n");
    return 2;
  }
  std::printf(
      "# simd %s, openblas %s, heads %lld/%lld, %d reps of ~%.1f ms per contender and config\n",
      flashcte::simd_target().c_str(), openblas_get_corename(), static_cast<long long>(heads),
      static_cast<long long>(kv_heads), reps, sample_ms);
  std::printf("%5s %4s %3s %6s %8s %12s %12s %9s %9s %10s\n", "S", "d", "thr", "causal", "calls",
              "flash_us", "mat_us", "mat/flash", "mat_wins", "max_diff");
  for (const bool causal : causal_modes) {
    for (const int64_t threads : thread_counts) {
      for (const int64_t d : dims) {
        for (const int64_t s : sizes) {
          const Config c{s, d, static_cast<int>(threads), causal, heads, kv_heads};
          openblas_set_num_threads(c.threads);
          Contenders x(c);
          // Microseconds per call of one contender over a batch of `calls` back-to-back calls.
          const auto batch = [&x](bool flash, int calls) {
            const auto start = Clock::now();
            for (int i = 0; i < calls; ++i) flash ? x.Flash() : x.Materialized();
            return std::chrono::duration<double, std::micro>(Clock::now() - start).count() / calls;
          };
          const auto pause = [&c] {
            if (c.threads > 1) std::this_thread::sleep_for(std::chrono::milliseconds(150));
          };
          // Warm up both and check they agree. Then size the batch: double the call count until
          // a batch of the slower contender takes sample_ms, keeping the fastest of three
          // probes per size so that a preemption during a probe does not shrink the batch.
          x.Flash();
          x.Materialized();
          const double diff = x.MaxAbsDifference();
          int calls = 1;
          for (; calls < (1 << 20); calls *= 2) {
            double slowest = 0;
            for (const bool flash : {true, false}) {
              double best = 1e300;
              for (int t = 0; t < 3; ++t) best = std::min(best, batch(flash, calls) * calls);
              slowest = std::max(slowest, best);
            }
            if (slowest >= sample_ms * 1e3) break;
          }

          std::vector<double> flash_us, mat_us;
          int mat_wins = 0;
          for (int r = 0; r < reps; ++r) {
            // ABBA: alternate which contender goes first.
            const bool flash_first = r % 2 == 0;
            pause();
            const double first = batch(flash_first, calls);
            pause();
            const double second = batch(!flash_first, calls);
            const double f = flash_first ? first : second;
            const double m = flash_first ? second : first;
            flash_us.push_back(f);
            mat_us.push_back(m);
            mat_wins += m < f;
          }
          const double fm = Median(flash_us), mm = Median(mat_us);
          std::printf("%5lld %4lld %3d %6s %8d %12.3f %12.3f %9.3f %5d/%-3d %10.2e\n",
                      static_cast<long long>(s), static_cast<long long>(d), c.threads,
                      causal ? "true" : "false", calls, fm, mm, mm / fm, mat_wins, reps, diff);
          std::fflush(stdout);
        }
      }
    }
  }
  return 0;
}
