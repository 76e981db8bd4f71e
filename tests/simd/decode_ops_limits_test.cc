// The decode micro-kernels (decode_qk, decode_pv of src/simd/ops.h) at their limits, on every SIMD
// target this CPU runs: K / V rows whose last one ends at an unreadable page (no load past a
// row's end), the native bfloat16 kernels at the edges of their pairs and vectors on bfloat16
// and 8-bit caches, and the native int8 kernels' int16 steps at their limits. The testers over
// every edge, dtype, row count and stride: decode_ops_test.cc.
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
#include "tests/simd/decode_cases.h"
#include "tests/simd/tester.h"

namespace flashcte::test {
namespace {

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
