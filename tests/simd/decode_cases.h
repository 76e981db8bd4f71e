// The decode micro-kernels' cases for their testers (decode_ops_test.cc,
// decode_ops_limits_test.cc): the cache dtypes, cache rows of any dtype with NaN canaries in their
// padding (dense or as a table of row addresses), one decode_qk and one decode_pv call checked
// against a float64 reference, and the head dims at every vector edge.
#ifndef FLASHCTE_TESTS_SIMD_DECODE_CASES_H_
#define FLASHCTE_TESTS_SIMD_DECODE_CASES_H_

#include <gtest/gtest.h>

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
#include "tests/simd/tester.h"

namespace flashcte::test {

inline constexpr DType kDtypes[] = {DType::kFloat32, DType::kBFloat16,   DType::kFloat16,
                                    DType::kInt8,    DType::kFloat8E4M3, DType::kFloat8E5M2};
// The caches the native kernels read: bfloat16 values.
inline constexpr DType kNativeDtypes[] = {DType::kBFloat16, DType::kInt8, DType::kFloat8E4M3,
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
inline std::vector<int64_t> dims(int64_t lanes) {
  std::vector<int64_t> out = edge_lengths(lanes);
  for (int64_t x : {64, 80, 128, 257}) out.push_back(x);
  return out;
}

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_SIMD_DECODE_CASES_H_
