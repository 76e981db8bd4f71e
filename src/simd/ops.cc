// Vector bodies of the kernel's building blocks (ops.h), compiled once per Highway target.
//
// MM1 (qk) and MM2 (pv) are broadcast-FMA register-blocked micro-kernels: a kRows x 2-vector
// block of accumulators stays in registers while the contraction axis streams. On AVX2 that is
// 6 x 2 x 8 = 96 floats in 12 of the 16 ymm registers, plus 2 for the streamed operand and 1 for
// the broadcast: the classic 6x16 SGEMM shape. Per inner step it loads 2 vectors and broadcasts
// 6 scalars for 12 FMAs, so it is FMA-bound, not load-bound (2 loads/cycle on Zen).
//
// exp_sum is the Neuron activation_reduce: one pass that adds the bias (the negated running
// max), exponentiates with Highway's vetted Exp and sums, optionally rounding the stored
// probabilities to bfloat16.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/simd/ops.cc"
#include <cstring>
#include <limits>

#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "src/simd/ops.h"

HWY_BEFORE_NAMESPACE();
namespace flashcte::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
// Rows per register block. 6 fills AVX2's 16 registers (see the file comment); wider targets
// have 32 registers but we keep one shape so every target computes the same sums in the same
// order per lane.
constexpr int64_t kRows = 6;

// --- MM1 -------------------------------------------------------------------------------------

// Stores one row's two accumulators and folds their valid lanes (the first `valid` of the 2N)
// into that row's running max vector.
HWY_INLINE void StoreRow2(DF df, hn::Vec<DF> a0, hn::Vec<DF> a1, float* s, int64_t valid,
                          float* max_vec) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  hn::StoreU(a0, df, s);
  hn::StoreU(a1, df, s + N);
  if (max_vec == nullptr) return;
  const auto neg_inf = hn::Set(df, -std::numeric_limits<float>::infinity());
  // The first vector is always whole (callers only use 2 vectors when more than N remain).
  const auto m1 = valid >= 2 * N ? a1 : hn::IfThenElse(hn::FirstN(df, valid - N), a1, neg_inf);
  hn::Store(hn::Max(hn::Load(df, max_vec), hn::Max(a0, m1)), df, max_vec);
}

HWY_INLINE void StoreRow1(DF df, hn::Vec<DF> a0, float* s, int64_t valid, float* max_vec) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  hn::StoreU(a0, df, s);
  if (max_vec == nullptr) return;
  const auto neg_inf = hn::Set(df, -std::numeric_limits<float>::infinity());
  const auto m0 = valid >= N ? a0 : hn::IfThenElse(hn::FirstN(df, valid), a0, neg_inf);
  hn::Store(hn::Max(hn::Load(df, max_vec), m0), df, max_vec);
}

// R rows of S = Q.K^T over `cols` columns. With max_vecs (R vectors), also folds each row's
// scores into its max vector: the row max fused into MM1's epilogue while the scores are still
// in registers. Q arrives pre-scaled (the packer multiplies by scale), so the epilogue has no
// multiply and no live scale register (which made GCC spill an operand on AVX2).
template <int64_t R>
HWY_INLINE void QkBlock(const float* HWY_RESTRICT q, int64_t ldq, const float* HWY_RESTRICT k,
                        int64_t ldk, int64_t cols, int64_t d, float* HWY_RESTRICT s, int64_t lds,
                        float* max_vecs) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  float* mv[6] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  if (max_vecs) {
    for (int64_t r = 0; r < R; ++r) mv[r] = max_vecs + r * N;
  }
  int64_t c = 0;
  // Two vectors while more than one vector of columns remains; the second may run past cols
  // into the padding (see ops.h).
  for (; c + N < cols; c += 2 * N) {
    auto a00 = hn::Zero(df), a01 = hn::Zero(df), a10 = hn::Zero(df), a11 = hn::Zero(df);
    auto a20 = hn::Zero(df), a21 = hn::Zero(df), a30 = hn::Zero(df), a31 = hn::Zero(df);
    auto a40 = hn::Zero(df), a41 = hn::Zero(df), a50 = hn::Zero(df), a51 = hn::Zero(df);
    const float* kc = k + c;
    for (int64_t x = 0; x < d; ++x) {
      const auto b0 = hn::LoadU(df, kc + x * ldk);
      const auto b1 = hn::LoadU(df, kc + x * ldk + N);
      const float* qx = q + x;
      auto bc = hn::Set(df, qx[0]);
      a00 = hn::MulAdd(bc, b0, a00);
      a01 = hn::MulAdd(bc, b1, a01);
      if (R > 1) {
        bc = hn::Set(df, qx[ldq]);
        a10 = hn::MulAdd(bc, b0, a10);
        a11 = hn::MulAdd(bc, b1, a11);
      }
      if (R > 2) {
        bc = hn::Set(df, qx[2 * ldq]);
        a20 = hn::MulAdd(bc, b0, a20);
        a21 = hn::MulAdd(bc, b1, a21);
      }
      if (R > 3) {
        bc = hn::Set(df, qx[3 * ldq]);
        a30 = hn::MulAdd(bc, b0, a30);
        a31 = hn::MulAdd(bc, b1, a31);
      }
      if (R > 4) {
        bc = hn::Set(df, qx[4 * ldq]);
        a40 = hn::MulAdd(bc, b0, a40);
        a41 = hn::MulAdd(bc, b1, a41);
      }
      if (R > 5) {
        bc = hn::Set(df, qx[5 * ldq]);
        a50 = hn::MulAdd(bc, b0, a50);
        a51 = hn::MulAdd(bc, b1, a51);
      }
    }
    const int64_t valid = cols - c;
    float* sc = s + c;
    StoreRow2(df, a00, a01, sc, valid, mv[0]);
    if (R > 1) StoreRow2(df, a10, a11, sc + lds, valid, mv[1]);
    if (R > 2) StoreRow2(df, a20, a21, sc + 2 * lds, valid, mv[2]);
    if (R > 3) StoreRow2(df, a30, a31, sc + 3 * lds, valid, mv[3]);
    if (R > 4) StoreRow2(df, a40, a41, sc + 4 * lds, valid, mv[4]);
    if (R > 5) StoreRow2(df, a50, a51, sc + 5 * lds, valid, mv[5]);
  }
  // At most one vector of columns is left (c < cols <= c + N): compute it whole.
  for (; c < cols; c += N) {
    auto a0 = hn::Zero(df), a1 = hn::Zero(df), a2 = hn::Zero(df);
    auto a3 = hn::Zero(df), a4 = hn::Zero(df), a5 = hn::Zero(df);
    const float* kc = k + c;
    for (int64_t x = 0; x < d; ++x) {
      const auto b0 = hn::LoadU(df, kc + x * ldk);
      const float* qx = q + x;
      a0 = hn::MulAdd(hn::Set(df, qx[0]), b0, a0);
      if (R > 1) a1 = hn::MulAdd(hn::Set(df, qx[ldq]), b0, a1);
      if (R > 2) a2 = hn::MulAdd(hn::Set(df, qx[2 * ldq]), b0, a2);
      if (R > 3) a3 = hn::MulAdd(hn::Set(df, qx[3 * ldq]), b0, a3);
      if (R > 4) a4 = hn::MulAdd(hn::Set(df, qx[4 * ldq]), b0, a4);
      if (R > 5) a5 = hn::MulAdd(hn::Set(df, qx[5 * ldq]), b0, a5);
    }
    const int64_t valid = cols - c;
    float* sc = s + c;
    StoreRow1(df, a0, sc, valid, mv[0]);
    if (R > 1) StoreRow1(df, a1, sc + lds, valid, mv[1]);
    if (R > 2) StoreRow1(df, a2, sc + 2 * lds, valid, mv[2]);
    if (R > 3) StoreRow1(df, a3, sc + 3 * lds, valid, mv[3]);
    if (R > 4) StoreRow1(df, a4, sc + 4 * lds, valid, mv[4]);
    if (R > 5) StoreRow1(df, a5, sc + 5 * lds, valid, mv[5]);
  }
}

template <int64_t R>
HWY_INLINE void QkRows(const float* q, int64_t ldq, const float* k, int64_t ldk, int64_t cols,
                       int64_t d, float* s, int64_t lds, float* row_max) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  HWY_ALIGN float max_vecs[R * hn::MaxLanes(df)];
  if (row_max) {
    for (int64_t i = 0; i < R * N; ++i) max_vecs[i] = -std::numeric_limits<float>::infinity();
  }
  QkBlock<R>(q, ldq, k, ldk, cols, d, s, lds, row_max ? max_vecs : nullptr);
  if (row_max) {
    for (int64_t r = 0; r < R; ++r) {
      const float m = hn::GetLane(hn::MaxOfLanes(df, hn::Load(df, max_vecs + r * N)));
      row_max[r] = m > row_max[r] ? m : row_max[r];
    }
  }
}

void Qk(const float* q, int64_t ldq, int64_t rows, const float* k, int64_t ldk, int64_t cols,
        int64_t d, float* s, int64_t lds, float* row_max) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    QkRows<kRows>(q + r * ldq, ldq, k, ldk, cols, d, s + r * lds, lds,
                  row_max ? row_max + r : nullptr);
  }
  const float* qr = q + r * ldq;
  float* sr = s + r * lds;
  float* mr = row_max ? row_max + r : nullptr;
  switch (rows - r) {
    case 1:
      QkRows<1>(qr, ldq, k, ldk, cols, d, sr, lds, mr);
      break;
    case 2:
      QkRows<2>(qr, ldq, k, ldk, cols, d, sr, lds, mr);
      break;
    case 3:
      QkRows<3>(qr, ldq, k, ldk, cols, d, sr, lds, mr);
      break;
    case 4:
      QkRows<4>(qr, ldq, k, ldk, cols, d, sr, lds, mr);
      break;
    case 5:
      QkRows<5>(qr, ldq, k, ldk, cols, d, sr, lds, mr);
      break;
    default:
      break;
  }
}

// --- softmax pieces ----------------------------------------------------------------------------

float RowMax(const float* s, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  auto m = hn::Set(df, -std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + N <= n; c += N) m = hn::Max(m, hn::LoadU(df, s + c));
  float result = hn::GetLane(hn::MaxOfLanes(df, m));
  for (; c < n; ++c) result = s[c] > result ? s[c] : result;
  return result;
}

template <class D, class V>
HWY_INLINE V RoundToBf16(D d, V x) {
  // Round to nearest even on the upper 16 bits. P is finite and >= 0 here.
  const hn::RebindToUnsigned<D> du;
  const auto bits = hn::BitCast(du, x);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded = hn::Add(bits, hn::Add(hn::Set(du, 0x7FFFu), lsb));
  return hn::BitCast(d, hn::And(rounded, hn::Set(du, 0xFFFF0000u)));
}

template <class D>
HWY_INLINE hn::Vec<D> ExpStep(D d, float* p, hn::Vec<D> bias, bool round_bf16) {
  const auto x = hn::Add(hn::LoadU(d, p), bias);
  const auto e = hn::IfThenElse(hn::IsNaN(x), x, hn::Exp(d, x));
  hn::StoreU(round_bf16 ? RoundToBf16(d, e) : e, d, p);
  return e;
}

float ExpSum(float* s, int64_t n, float bias, bool round_bf16) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto vbias = hn::Set(df, bias);
  auto sum0 = hn::Zero(df), sum1 = hn::Zero(df);
  int64_t c = 0;
  for (; c + 2 * N <= n; c += 2 * N) {
    sum0 = hn::Add(sum0, ExpStep(df, s + c, vbias, round_bf16));
    sum1 = hn::Add(sum1, ExpStep(df, s + c + N, vbias, round_bf16));
  }
  for (; c + N <= n; c += N) sum0 = hn::Add(sum0, ExpStep(df, s + c, vbias, round_bf16));
  float total = hn::GetLane(hn::SumOfLanes(df, hn::Add(sum0, sum1)));
  // The tail, one lane at a time with the same Exp.
  const hn::CappedTag<float, 1> d1;
  const auto vbias1 = hn::Set(d1, bias);
  for (; c < n; ++c) total += hn::GetLane(ExpStep(d1, s + c, vbias1, round_bf16));
  return total;
}

// --- score modifiers ---------------------------------------------------------------------------

template <class D>
HWY_INLINE void SoftcapStep(D d, float* p, float cap) {
  const auto v = hn::LoadU(d, p);
  hn::StoreU(hn::Mul(hn::Set(d, cap), hn::Tanh(d, hn::Div(v, hn::Set(d, cap)))), d, p);
}

void Softcap(float* s, int64_t n, float cap) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t c = 0;
  for (; c + N <= n; c += N) SoftcapStep(df, s + c, cap);
  const hn::CappedTag<float, 1> d1;
  for (; c < n; ++c) SoftcapStep(d1, s + c, cap);
}

void Alibi(float* s, int64_t n, float slope, float d0) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto neg_slope = hn::Set(df, -slope);
  auto dist = hn::Add(hn::Iota(df, 0.0f), hn::Set(df, d0));
  const auto step = hn::Set(df, static_cast<float>(N));
  int64_t c = 0;
  for (; c + N <= n; c += N, dist = hn::Add(dist, step)) {
    hn::StoreU(hn::MulAdd(neg_slope, hn::Abs(dist), hn::LoadU(df, s + c)), df, s + c);
  }
  for (; c < n; ++c) {
    const float x = d0 + static_cast<float>(c);
    s[c] += -slope * (x < 0 ? -x : x);
  }
}

void AddRow(float* s, const float* bias, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t c = 0;
  for (; c + N <= n; c += N) {
    hn::StoreU(hn::Add(hn::LoadU(df, s + c), hn::LoadU(df, bias + c)), df, s + c);
  }
  for (; c < n; ++c) s[c] += bias[c];
}

// --- conversion ------------------------------------------------------------------------------

template <typename T>
HWY_INLINE void PromoteRow(const T* HWY_RESTRICT src, int64_t n, float* HWY_RESTRICT dst) {
  const DF df;
  const hn::Rebind<T, DF> dh;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, src + i)), df, dst + i);
  const hn::CappedTag<float, 1> d1;
  const hn::Rebind<T, decltype(d1)> dh1;
  for (; i < n; ++i) hn::StoreU(hn::PromoteTo(d1, hn::LoadU(dh1, src + i)), d1, dst + i);
}

void ToFloat(const void* src, DType dtype, int64_t n, float* dst) {
  switch (dtype) {
    case DType::kBFloat16:
      PromoteRow(static_cast<const hwy::bfloat16_t*>(src), n, dst);
      break;
    case DType::kFloat16:
      PromoteRow(static_cast<const hwy::float16_t*>(src), n, dst);
      break;
    default:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }
}

// --- MM2 -------------------------------------------------------------------------------------

template <int64_t R>
HWY_INLINE void PvBlock(const float* HWY_RESTRICT p, int64_t ldp, int64_t n,
                        const float* HWY_RESTRICT v, int64_t ldv, int64_t dv_pad,
                        const float* alpha, float* HWY_RESTRICT o, int64_t ldo) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  // dv_pad is a multiple of kPadFloats = 16, hence of 2N on every target up to 512 bits.
  for (int64_t c = 0; c < dv_pad; c += 2 * N) {
    float* oc = o + c;
    auto a00 = hn::LoadU(df, oc), a01 = hn::LoadU(df, oc + N);
    auto a10 = a00, a11 = a01, a20 = a00, a21 = a01, a30 = a00, a31 = a01;
    if (R > 1) a10 = hn::LoadU(df, oc + ldo), a11 = hn::LoadU(df, oc + ldo + N);
    if (R > 2) a20 = hn::LoadU(df, oc + 2 * ldo), a21 = hn::LoadU(df, oc + 2 * ldo + N);
    if (R > 3) a30 = hn::LoadU(df, oc + 3 * ldo), a31 = hn::LoadU(df, oc + 3 * ldo + N);
    if (alpha) {
      auto al = hn::Set(df, alpha[0]);
      a00 = hn::Mul(a00, al), a01 = hn::Mul(a01, al);
      if (R > 1) al = hn::Set(df, alpha[1]), a10 = hn::Mul(a10, al), a11 = hn::Mul(a11, al);
      if (R > 2) al = hn::Set(df, alpha[2]), a20 = hn::Mul(a20, al), a21 = hn::Mul(a21, al);
      if (R > 3) al = hn::Set(df, alpha[3]), a30 = hn::Mul(a30, al), a31 = hn::Mul(a31, al);
    }
    const float* vc = v + c;
    for (int64_t j = 0; j < n; ++j) {
      const auto b0 = hn::LoadU(df, vc + j * ldv);
      const auto b1 = hn::LoadU(df, vc + j * ldv + N);
      const float* pj = p + j;
      auto bc = hn::Set(df, pj[0]);
      a00 = hn::MulAdd(bc, b0, a00);
      a01 = hn::MulAdd(bc, b1, a01);
      if (R > 1) {
        bc = hn::Set(df, pj[ldp]);
        a10 = hn::MulAdd(bc, b0, a10);
        a11 = hn::MulAdd(bc, b1, a11);
      }
      if (R > 2) {
        bc = hn::Set(df, pj[2 * ldp]);
        a20 = hn::MulAdd(bc, b0, a20);
        a21 = hn::MulAdd(bc, b1, a21);
      }
      if (R > 3) {
        bc = hn::Set(df, pj[3 * ldp]);
        a30 = hn::MulAdd(bc, b0, a30);
        a31 = hn::MulAdd(bc, b1, a31);
      }
    }
    hn::StoreU(a00, df, oc);
    hn::StoreU(a01, df, oc + N);
    if (R > 1) hn::StoreU(a10, df, oc + ldo), hn::StoreU(a11, df, oc + ldo + N);
    if (R > 2) hn::StoreU(a20, df, oc + 2 * ldo), hn::StoreU(a21, df, oc + 2 * ldo + N);
    if (R > 3) hn::StoreU(a30, df, oc + 3 * ldo), hn::StoreU(a31, df, oc + 3 * ldo + N);
  }
}

// Rows per MM2 block: 4 x 2 vectors of accumulators; the P broadcasts come from 4 rows' cache
// lines, so more rows would add L1 streams without saving V loads that matter.
constexpr int64_t kPvRows = 4;

void Pv(const float* p, int64_t ldp, int64_t rows, int64_t n, const float* v, int64_t ldv,
        int64_t dv_pad, const float* alpha, float* o, int64_t ldo) {
  int64_t r = 0;
  for (; r + kPvRows <= rows; r += kPvRows) {
    PvBlock<kPvRows>(p + r * ldp, ldp, n, v, ldv, dv_pad, alpha ? alpha + r : nullptr, o + r * ldo,
                     ldo);
  }
  const float* pr = p + r * ldp;
  const float* ar = alpha ? alpha + r : nullptr;
  float* orow = o + r * ldo;
  switch (rows - r) {
    case 1:
      PvBlock<1>(pr, ldp, n, v, ldv, dv_pad, ar, orow, ldo);
      break;
    case 2:
      PvBlock<2>(pr, ldp, n, v, ldv, dv_pad, ar, orow, ldo);
      break;
    case 3:
      PvBlock<3>(pr, ldp, n, v, ldv, dv_pad, ar, orow, ldo);
      break;
    default:
      break;
  }
}

const Ops* GetOps() {
  static const Ops table = {
      hwy::TargetName(HWY_TARGET), &Qk, &RowMax, &ExpSum, &Softcap, &Alibi, &AddRow, &ToFloat, &Pv};
  return &table;
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashcte::simd {

HWY_EXPORT(GetOps);

const Ops& ops() { return *HWY_DYNAMIC_DISPATCH(GetOps)(); }

}  // namespace flashcte::simd
#endif  // HWY_ONCE
