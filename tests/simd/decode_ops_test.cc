// Testers of the decode micro-kernels (decode_qk, decode_pv of src/simd/ops.h) on every SIMD
// target this CPU runs, for K / V rows of float32, bfloat16 and float16 read in place: head dims,
// value dims and key counts at every vector edge of the target (1, N-1, N, N+1, ...), row counts
// on both sides of the register tiles, tight and loose row strides, canary NaNs around every
// buffer and in the cache rows' padding (a value read past the contract turns a result into NaN),
// and a float64 reference.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "src/core/half.h"
#include "src/core/kv8.h"
#include "src/simd/native_ops.h"
#include "src/simd/ops.h"
#include "tests/cpu_requirements.h"
#include "tests/simd/tester.h"

namespace flashcte::test {
namespace {

constexpr DType kDtypes[] = {DType::kFloat32, DType::kBFloat16,   DType::kFloat16,
                             DType::kInt8,    DType::kFloat8E4M3, DType::kFloat8E5M2};
// The caches the native kernels read: bfloat16 values.
constexpr DType kNativeDtypes[] = {DType::kBFloat16, DType::kInt8, DType::kFloat8E4M3,
                                   DType::kFloat8E5M2};

// `rows` cache rows of `cols` values of `dtype`, `ld` elements apart, as a KV cache holds them,
// handed to the kernels by their stride (a dense cache), or, `reversed`, stored row j in the place
// of row rows - 1 - j and handed over as a table of row addresses, as pages of a paged cache may
// lie in any order. Every element outside the rows'
// [0, cols) (row padding and a guard zone after the last row) is a NaN canary, and the buffer ends
// right after the guard.
class CacheRows {
 public:
  static constexpr int64_t kGuard = 64;

  CacheRows(DType dtype, int64_t rows, int64_t cols, int64_t ld, bool reversed = false)
      : dtype_(dtype), rows_(rows), ld_(ld), elem_(dtype_size(dtype)), reversed_(reversed) {
    const int64_t elements = rows > 0 ? (rows - 1) * ld + cols + kGuard : kGuard;
    bytes_.resize(static_cast<size_t>(elements * elem_));
    for (int64_t i = 0; i < elements; ++i) store_bits(i, canary_bits());
    for (int64_t j = 0; j < rows; ++j)
      table_.push_back(&bytes_[static_cast<size_t>(place(j) * elem_)]);
  }
  // Every row to the kernels, all of them read (none left only to prefetch).
  simd::DecodeRows rows() const {
    if (reversed_) return simd::DecodeRows::of_table(table_.data(), rows_);
    return simd::DecodeRows::strided(bytes_.data(), ld_ * elem_, rows_);
  }
  // Stores x rounded to the dtype and returns the value stored.
  double set(int64_t r, int64_t c, float x) {
    const int64_t i = place(r) + c;
    switch (dtype_) {
      case DType::kBFloat16:
        store_bits(i, half::float_to_bf16(x));
        return half::bf16_to_float(half::float_to_bf16(x));
      case DType::kFloat16:
        store_bits(i, half::float_to_f16(x));
        return half::f16_to_float(half::float_to_f16(x));
      case DType::kFloat32:
        std::memcpy(&bytes_[static_cast<size_t>(i * 4)], &x, 4);
        return x;
      case DType::kInt8:
      case DType::kFloat8E4M3:
      case DType::kFloat8E5M2: {
        // Any finite code, uniformly (x in [-1, 1] picks it): subnormals and the largest too.
        auto code = static_cast<uint8_t>(std::min(255.0f, (x + 1.0f) * 128.0f));
        if (!std::isfinite(kv8::decode(dtype_, code))) code = 0;
        bytes_[static_cast<size_t>(i)] = code;
        return kv8::decode(dtype_, code);
      }
      case DType::kInt32:
      case DType::kInt64:
        break;
    }
    ADD_FAILURE() << "not a cache dtype of these tests: " << dtype_name(dtype_);
    return 0;
  }
  std::vector<unsigned char> snapshot() const { return bytes_; }
  // The rows' bytes from the first row's start to the last row's end (not reversed).
  std::vector<unsigned char> span(int64_t cols) const {
    const int64_t elements = rows_ > 0 ? (rows_ - 1) * ld_ + cols : 0;
    return {bytes_.begin(), bytes_.begin() + elements * elem_};
  }

 private:
  uint32_t canary_bits() const {
    if (elem_ == 1) return 0x7F;  // fp8 NaN, int8 127
    return dtype_ == DType::kFloat32 ? kCanaryBits : dtype_ == DType::kBFloat16 ? 0x7FC1u : 0x7E01u;
  }
  int64_t place(int64_t j) const { return (reversed_ ? rows_ - 1 - j : j) * ld_; }
  void store_bits(int64_t i, uint32_t bits) {
    if (elem_ == 4) {
      std::memcpy(&bytes_[static_cast<size_t>(i * 4)], &bits, 4);
    } else if (elem_ == 1) {
      bytes_[static_cast<size_t>(i)] = static_cast<uint8_t>(bits);
    } else {
      const auto h = static_cast<uint16_t>(bits);
      std::memcpy(&bytes_[static_cast<size_t>(i * 2)], &h, 2);
    }
  }
  DType dtype_;
  int64_t rows_, ld_, elem_;
  bool reversed_;
  std::vector<unsigned char> bytes_;
  std::vector<const void*> table_;
};

// One decode_qk call: rows x n scores over head dim d, K rows of `dtype`.
struct QkCase {
  DType dtype = DType::kFloat32;
  int64_t rows = 1, n = 1, d = 1, ld_extra = 0;
  bool native = false;    // decode_qk_bf16 (bfloat16 and 8-bit only)
  bool reversed = false;  // K rows stored last to first (CacheRows)
  float scale = 0.75f;

  void run(const simd::Ops& ops, std::mt19937& rng) const {
    std::ostringstream os;
    os << "decode_qk on " << ops.target << ", " << dtype_name(dtype) << ": rows " << rows << ", n "
       << n << ", d " << d << ", ld +" << ld_extra << (native ? ", native" : "")
       << (reversed ? ", reversed" : "");
    SCOPED_TRACE(os.str());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    // Q is read over [0, round_up(d, N)) (native: its bfloat16 copy over [0, round_up(d, 32)))
    // and must be zero (finite) past d; canaries beyond.
    const int64_t q_read = round_up(d, native ? 32 : ops.lanes);
    GuardedBuffer q(rows, q_read + ld_extra, ld_extra % 3), s(rows, n + ld_extra, ld_extra % 2);
    CacheRows k(dtype, n, d, d + ld_extra, reversed);
    std::vector<double> qx(static_cast<size_t>(rows * d)), kx(static_cast<size_t>(n * d));
    // The native kernel's Q2: bfloat16 rows, the same (bfloat16-exact) values.
    const int64_t ldq2 = q_read + ld_extra;
    std::vector<uint16_t> q2(static_cast<size_t>(rows * ldq2), 0x7FC1);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t x = 0; x < q_read; ++x) {
        const float value = native ? half::bf16_to_float(half::float_to_bf16(u(rng))) : u(rng);
        q.at(r, x) = x < d ? value : 0.0f;
        q2[r * ldq2 + x] = half::float_to_bf16(q.at(r, x));
      }
      for (int64_t x = 0; x < d; ++x) qx[r * d + x] = q.at(r, x);
    }
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t x = 0; x < d; ++x) kx[j * d + x] = k.set(j, x, u(rng));
    }
    q.seal();
    const std::vector<unsigned char> k_before = k.snapshot();
    if (native) {
      simd::native_ops_for(ops)->decode_qk(q2.data(), ldq2, rows, k.rows(), dtype, n, d, scale,
                                           s.data(), s.ld());
    } else {
      ops.decode_qk(q.data(), q.ld(), rows, k.rows(), dtype, n, d, scale, s.data(), s.ld());
    }
    Reference ref(rows, n);
    for (int64_t r = 0; r < rows; ++r) {
      // The native int8 kernel quantizes Q's row to int16, steps of largest |q| / 16383 or finer
      // (decode_native-inl.h, qk_int_max): half a step of error per element, times |k|.
      double step = 0;
      if (native && dtype == DType::kInt8) {
        for (int64_t x = 0; x < d; ++x) step = std::max(step, std::fabs(qx[r * d + x]) / 16383);
      }
      for (int64_t j = 0; j < n; ++j) {
        double want = 0, abs_sum = 0, abs_k = 0;
        for (int64_t x = 0; x < d; ++x) {
          want += qx[r * d + x] * kx[j * d + x];
          abs_sum += std::fabs(qx[r * d + x] * kx[j * d + x]);
          abs_k += std::fabs(kx[j * d + x]);
        }
        ref.want[r * n + j] = scale * want;
        ref.tol[r * n + j] = scale * (dot_tolerance(d, abs_sum) + step / 2 * abs_k) +
                             std::ldexp(std::fabs(want), -23);
      }
    }
    expect_near(s, ref, "S");
    EXPECT_EQ(s.untouched_outside(rows, n), "") << "S written outside rows x n";
    EXPECT_EQ(q.unchanged(), "") << "Q changed";
    EXPECT_TRUE(k.snapshot() == k_before) << "K changed";
  }
};

// One decode_pv call: O = alpha O + P.V for rows x dv over n keys, V rows of `dtype`.
struct PvCase {
  DType dtype = DType::kFloat32;
  int64_t rows = 1, n = 1, dv = 1, ld_extra = 0;
  bool with_alpha = true;
  bool native = false;    // decode_pv_bf16 (bfloat16 or 8-bit V, P holding bfloat16 values)
  bool reversed = false;  // V rows stored last to first (CacheRows)
  bool fading = false;    // P 2^-10 times smaller with every 64 keys

  void run(const simd::Ops& ops, std::mt19937& rng) const {
    std::ostringstream os;
    os << "decode_pv on " << ops.target << ", " << dtype_name(dtype) << ": rows " << rows << ", n "
       << n << ", dv " << dv << ", ld +" << ld_extra << (with_alpha ? ", alpha" : "")
       << (native ? ", native" : "") << (reversed ? ", reversed" : "");
    SCOPED_TRACE(os.str());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f), u01(0.0f, 1.0f);
    // O is read and written over [0, round_up(dv, N)): finite there, canaries beyond.
    const int64_t o_touched = round_up(dv, native ? 16 : ops.lanes);
    GuardedBuffer p(rows, n + ld_extra, ld_extra % 3), o(rows, o_touched + ld_extra, 1);
    GuardedBuffer alpha(1, rows);
    CacheRows v(dtype, n, dv, dv + ld_extra, reversed);
    std::vector<double> vx(static_cast<size_t>(n * dv));
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t c = 0; c < dv; ++c) vx[j * dv + c] = v.set(j, c, u(rng));
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < n; ++j) {
        const float value =
            fading ? std::ldexp(u01(rng), -10 * static_cast<int>(j / 64)) : u01(rng);
        p.at(r, j) = native ? half::bf16_to_float(half::float_to_bf16(value)) : value;
      }
      for (int64_t c = 0; c < o_touched; ++c) o.at(r, c) = u(rng);
      alpha.at(0, r) = u01(rng);
    }
    p.seal();
    alpha.seal();
    Reference ref(rows, dv);
    for (int64_t r = 0; r < rows; ++r) {
      // The native int8 kernel quantizes P's row to int16 per 64 keys, steps of their largest
      // P / 32767 (decode_native_pv-inl.h, pack_p_int16): half a step of error per P, times |v|.
      std::vector<double> step(static_cast<size_t>(n), 0.0);
      if (native && dtype == DType::kInt8) {
        for (int64_t j0 = 0; j0 < n; j0 += 64) {
          double largest = 0;
          for (int64_t j = j0; j < std::min(n, j0 + 64); ++j)
            largest = std::max(largest, double{p.at(r, j)});
          for (int64_t j = j0; j < std::min(n, j0 + 64); ++j) step[j] = largest / 32767;
        }
      }
      for (int64_t c = 0; c < dv; ++c) {
        const double a = with_alpha ? alpha.at(0, r) : 1.0;
        double want = a * o.at(r, c), abs_sum = std::fabs(want), quantized = 0;
        for (int64_t j = 0; j < n; ++j) {
          want += p.at(r, j) * vx[j * dv + c];
          abs_sum += std::fabs(p.at(r, j) * vx[j * dv + c]);
          quantized += step[j] / 2 * std::fabs(vx[j * dv + c]);
        }
        ref.want[r * dv + c] = want;
        ref.tol[r * dv + c] = dot_tolerance(n + 1, abs_sum) + quantized;
      }
    }
    if (native) {
      simd::native_ops_for(ops)->decode_pv(p.data(), p.ld(), rows, n, v.rows(), dtype, dv,
                                           with_alpha ? alpha.data() : nullptr, o.data(), o.ld());
    } else {
      ops.decode_pv(p.data(), p.ld(), rows, n, v.rows(), dtype, dv,
                    with_alpha ? alpha.data() : nullptr, o.data(), o.ld());
    }
    expect_near(o, ref, "O");
    EXPECT_EQ(o.untouched_outside(rows, o_touched), "") << "O written past round_up(dv, N)";
    EXPECT_EQ(p.unchanged(), "") << "P changed";
    EXPECT_EQ(alpha.unchanged(), "") << "alpha changed";
  }
};

// Head dims at every vector edge of the target, and the ones models use.
std::vector<int64_t> dims(int64_t lanes) {
  std::vector<int64_t> out = edge_lengths(lanes);
  for (int64_t x : {64, 80, 128, 257}) out.push_back(x);
  return out;
}

TEST(SimdDecodeQk, EveryHeadDimKeyEdgeAndDtype) {
  std::mt19937 rng(11);
  for_each_target([&](const simd::Ops& ops) {
    for (DType dtype : kDtypes) {
      for (int64_t d : dims(ops.lanes)) {
        for (int64_t n : edge_lengths(ops.lanes)) QkCase{dtype, 4, n, d, 0}.run(ops, rng);
      }
    }
  });
}

TEST(SimdDecodeQk, EveryRowCountAndStride) {
  std::mt19937 rng(12);
  for_each_target([&](const simd::Ops& ops) {
    for (DType dtype : kDtypes) {
      for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 32}) {
        for (int64_t ld_extra : {0, 1, 7}) {
          for (bool reversed : {false, true}) {
            QkCase{dtype, rows, 2 * ops.lanes + 3, ops.lanes + 5, ld_extra, false, reversed}.run(
                ops, rng);
          }
        }
      }
    }
  });
}

TEST(SimdDecodePv, EveryValueDimKeyEdgeAndDtype) {
  std::mt19937 rng(13);
  for_each_target([&](const simd::Ops& ops) {
    for (DType dtype : kDtypes) {
      for (int64_t dv : dims(ops.lanes)) {
        for (int64_t n : edge_lengths(ops.lanes)) PvCase{dtype, 4, n, dv, 0, true}.run(ops, rng);
      }
      PvCase{dtype, 4, 0, 2 * ops.lanes + 1, 0, true}.run(ops, rng);  // no key: O = alpha O
    }
  });
}

// Every panel shape decode_pv-inl.h compiles: k whole vectors for k up to two panels, alone and
// with a column tail, at one row per KV head (where the tail joins the last panel) and at 2 and 4
// rows (where it is a panel of its own).
TEST(SimdDecodePv, EveryPanelWidthWithAndWithoutATail) {
  std::mt19937 rng(16);
  for_each_target([&](const simd::Ops& ops) {
    for (DType dtype : kDtypes) {
      for (int64_t rows : {1, 2, 4}) {
        for (int64_t k = 0; k <= 16; ++k) {
          for (int64_t tail : {int64_t{0}, ops.lanes / 2 + 1}) {
            if (k * ops.lanes + tail == 0) continue;
            PvCase{dtype, rows, 2 * ops.lanes + 1, k * ops.lanes + tail, 0, rows != 2}.run(ops,
                                                                                           rng);
          }
        }
      }
    }
  });
}

TEST(SimdDecodePv, EveryRowCountStrideAndAlphaMode) {
  std::mt19937 rng(14);
  for_each_target([&](const simd::Ops& ops) {
    for (DType dtype : kDtypes) {
      for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 32}) {
        for (int64_t ld_extra : {0, 1, 7}) {
          for (bool with_alpha : {false, true}) {
            PvCase{dtype,    rows,       ops.lanes + 3, 9 * ops.lanes + 3,
                   ld_extra, with_alpha, false,         with_alpha}
                // reversed with alpha, in place without
                .run(ops, rng);
          }
        }
      }
    }
  });
}

// A copy of cache rows whose last byte is the last before a page the process may not read, as
// the last row of a cache may end its mapping: a kernel that loads past a row's end faults.
class RowsBeforeAnUnreadablePage {
 public:
  RowsBeforeAnUnreadablePage(const std::vector<unsigned char>& bytes, int64_t row_bytes,
                             int64_t rows)
      : row_bytes_(row_bytes), rows_(rows) {
    const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t readable = (bytes.size() + page - 1) / page * page;
    size_ = readable + page;
    void* map = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
      ADD_FAILURE() << "mmap of " << size_ << " bytes failed";
      return;
    }
    map_ = static_cast<unsigned char*>(map);
    if (mprotect(map_ + readable, page, PROT_NONE) != 0) ADD_FAILURE() << "mprotect failed";
    start_ = map_ + readable - bytes.size();
    std::memcpy(start_, bytes.data(), bytes.size());
  }
  RowsBeforeAnUnreadablePage(const RowsBeforeAnUnreadablePage&) = delete;
  RowsBeforeAnUnreadablePage& operator=(const RowsBeforeAnUnreadablePage&) = delete;
  ~RowsBeforeAnUnreadablePage() {
    if (map_ != nullptr) munmap(map_, size_);
  }
  bool ok() const { return map_ != nullptr; }
  simd::DecodeRows rows() const { return simd::DecodeRows::strided(start_, row_bytes_, rows_); }

 private:
  unsigned char* map_ = nullptr;
  unsigned char* start_ = nullptr;
  size_t size_ = 0;
  int64_t row_bytes_, rows_;
};

// Every decode kernel (portable, and native where this CPU runs it) on K / V rows whose last one
// ends at an unreadable page, at every head dim edge (column tails of every size): no fault, and
// bit for bit the results of the same call on the rows in an ordinary buffer, which the testers
// above hold to the float64 reference.
TEST(SimdDecode, NoLoadPastTheLastRow) {
  std::mt19937 rng(18);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), u01(0.0f, 1.0f);
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kNative);
  for_each_target([&](const simd::Ops& ops) {
    for (DType dtype : kDtypes) {
      const simd::NativeOps* native = simd::native_ops_for(ops);
      const bool has_native =
          native != nullptr && std::find(std::begin(kNativeDtypes), std::end(kNativeDtypes),
                                         dtype) != std::end(kNativeDtypes);
      for (int64_t d : dims(ops.lanes)) {
        SCOPED_TRACE(std::string(ops.target) + ", " + dtype_name(dtype) + ", d " +
                     std::to_string(d));
        constexpr int64_t n = 3;
        CacheRows kv(dtype, n, d, d);
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t x = 0; x < d; ++x) kv.set(j, x, u(rng));
        }
        const RowsBeforeAnUnreadablePage edge(kv.span(d), d * dtype_size(dtype), n);
        ASSERT_TRUE(edge.ok());
        const int64_t ldq = round_up(d, 32), ldo = round_up(d, std::max<int64_t>(16, ops.lanes));
        for (int64_t rows : {1, 2, 4}) {
          std::vector<float> q(static_cast<size_t>(rows * ldq), 0.0f), p(rows * n), alpha(rows);
          std::vector<uint16_t> q2(q.size(), 0);
          std::vector<float> o(static_cast<size_t>(rows * ldo), 0.0f);
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t x = 0; x < d; ++x) {
              q2[r * ldq + x] = half::float_to_bf16(u(rng));
              q[r * ldq + x] = half::bf16_to_float(q2[r * ldq + x]);
              o[r * ldo + x] = u(rng);
            }
            for (int64_t j = 0; j < n; ++j) {
              p[r * n + j] = half::bf16_to_float(half::float_to_bf16(u01(rng)));
            }
            alpha[r] = u01(rng);
          }
          // S and O from the rows in `cache`, portable or native kernels.
          const auto run = [&](const simd::DecodeRows& cache, bool use_native) {
            std::vector<float> s(rows * n), out = o;
            if (use_native) {
              native->decode_qk(q2.data(), ldq, rows, cache, dtype, n, d, 0.5f, s.data(), n);
              native->decode_pv(p.data(), n, rows, n, cache, dtype, d, alpha.data(), out.data(),
                                ldo);
            } else {
              ops.decode_qk(q.data(), ldq, rows, cache, dtype, n, d, 0.5f, s.data(), n);
              ops.decode_pv(p.data(), n, rows, n, cache, dtype, d, alpha.data(), out.data(), ldo);
            }
            s.insert(s.end(), out.begin(), out.end());
            return s;
          };
          for (bool use_native : {false, true}) {
            if (use_native && !has_native) continue;
            const std::vector<float> want = run(kv.rows(), use_native),
                                     got = run(edge.rows(), use_native);
            EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
                << "rows " << rows << (use_native ? ", native" : "");
          }
        }
      }
    }
  });
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kAuto);
}

// The native bfloat16 kernels (decode_native-inl.h) where this CPU runs them: the AVX-512 targets
// of a CPU with AVX512_BF16, whatever the policy says (the tests force it on), on bfloat16 and
// 8-bit caches (every finite code, CacheRows::set). Sizes at the edges of their 32-element pairs
// and 16-lane vectors.
TEST(SimdDecodeBf16Native, QkAndPvAtEveryEdge) {
  std::mt19937 rng(15);
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kNative);
  std::vector<std::string> ran;
  for_each_target([&](const simd::Ops& ops) {
    if (simd::native_ops_for(ops) == nullptr) return;
    ran.emplace_back(ops.target);
    for (DType dtype : kNativeDtypes) {
      for (int64_t d : {1, 15, 16, 17, 31, 32, 33, 63, 64, 80, 128, 257}) {
        for (int64_t n : {1, 3, 4, 5, 15, 16, 17, 33}) {
          QkCase{dtype, 4, n, d, 0, true}.run(ops, rng);
          PvCase{dtype, 4, n, d, 0, true, true}.run(ops, rng);
        }
      }
      // Past one block of P (64 keys, each block its own int16 step for an int8 V), with P's
      // size falling block by block; head dims past 512 (QK's int16 step doubles).
      for (int64_t n : {64, 65, 130, 200}) {
        PvCase{dtype, 4, n, 128, 0, true, true, false, true}.run(ops, rng);
        PvCase{dtype, 3, n, 40, 1, false, true, true, true}.run(ops, rng);
      }
      for (int64_t d : {512, 513, 1024}) QkCase{dtype, 4, 9, d, 0, true}.run(ops, rng);
      for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16}) {
        for (int64_t ld_extra : {0, 1, 7}) {
          for (bool reversed : {false, true}) {
            QkCase{dtype, rows, 37, 80, ld_extra, true, reversed}.run(ops, rng);
            PvCase{dtype, rows, 21, 144, ld_extra, rows % 2 == 0, true, reversed}.run(ops, rng);
          }
        }
      }
    }
  });
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kAuto);
  if (ran.empty()) {
    FLASHCTE_SKIP_UNLESS_REQUIRED(FastPath::kNativeKernels, "the native kernels ran on no target");
  }
}

// The native int8 kernels' int16 steps at their limits (decode_native-inl.h): QK at d = 1024 with
// every product at its largest (32767 * -128 would overflow the int32 sums; the step doubles),
// a zero query row and rows holding NaN or an infinity; PV with a zero P row, a row too small
// to quantize (dropped: O = alpha O), and a row holding NaN (its O all NaN).
TEST(SimdDecodeInt8Native, StepsAtTheirLimits) {
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kNative);
  std::vector<std::string> ran;
  for_each_target([&](const simd::Ops& ops) {
    if (simd::native_ops_for(ops) == nullptr) return;
    ran.emplace_back(ops.target);
    constexpr int64_t d = 1024, n = 5, rows = 4;
    CacheRows k(DType::kInt8, n, d, d);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t x = 0; x < d; ++x) ASSERT_EQ(k.set(j, x, 0.0f), -128.0);  // code 0x80
    }
    std::vector<uint16_t> q(rows * d, half::float_to_bf16(1.0f));
    std::fill(q.begin() + d, q.begin() + 2 * d, 0);                               // zero row
    q[2 * d + 7] = half::float_to_bf16(std::numeric_limits<float>::quiet_NaN());  // NaN
    q[3 * d + 9] = half::float_to_bf16(-std::numeric_limits<float>::infinity());  // infinity
    std::vector<float> s(rows * n, 1.0f);
    simd::native_ops_for(ops)->decode_qk(q.data(), d, rows, k.rows(), DType::kInt8, n, d, 0.5f,
                                         s.data(), n);
    for (int64_t j = 0; j < n; ++j) {
      EXPECT_EQ(s[j], 0.5f * -128.0f * d) << j;
      EXPECT_EQ(s[n + j], 0.0f) << j;
      EXPECT_TRUE(std::isnan(s[2 * n + j])) << j;
      EXPECT_TRUE(std::isnan(s[3 * n + j])) << j;
    }

    constexpr int64_t keys = 70, dv = 32;
    CacheRows v(DType::kInt8, keys, dv, dv);
    std::vector<double> vx(keys * dv);
    std::mt19937 rng(17);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int64_t j = 0; j < keys; ++j) {
      for (int64_t c = 0; c < dv; ++c) vx[j * dv + c] = v.set(j, c, u(rng));
    }
    std::vector<float> p(rows * keys), o(rows * dv, 3.0f), alpha = {0.5f, 0.25f, 2.0f, 1.0f};
    for (int64_t j = 0; j < keys; ++j) {
      p[j] = 0.0f;
      p[keys + j] = 1e-36f;  // below 2^-113
      p[2 * keys + j] = j == 66 ? std::numeric_limits<float>::quiet_NaN() : 0.5f;
      p[3 * keys + j] = 0.25f;
    }
    simd::native_ops_for(ops)->decode_pv(p.data(), keys, rows, keys, v.rows(), DType::kInt8, dv,
                                         alpha.data(), o.data(), dv);
    for (int64_t c = 0; c < dv; ++c) {
      EXPECT_EQ(o[c], 1.5f) << c;
      EXPECT_EQ(o[dv + c], 0.75f) << c;
      EXPECT_TRUE(std::isnan(o[2 * dv + c])) << c;
      double want = 3.0;
      for (int64_t j = 0; j < keys; ++j) want += 0.25 * vx[j * dv + c];
      EXPECT_NEAR(o[3 * dv + c], want, 1e-4) << c;  // 0.25 is a whole step count: exact sums
    }
  });
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kAuto);
  if (ran.empty()) {
    FLASHCTE_SKIP_UNLESS_REQUIRED(FastPath::kNativeKernels, "the native kernels ran on no target");
  }
}

}  // namespace
}  // namespace flashcte::test
