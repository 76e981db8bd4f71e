// Vector bodies of the kernel's building blocks (ops.h), compiled once per Highway target.
//
// MM1 (qk) and MM2 (pv) are broadcast-FMA register-blocked micro-kernels: a kRows x 2-vector
// block of accumulators stays in registers while the contraction axis streams. On AVX2 that is
// 6 x 2 x 8 = 96 floats in 12 of the 16 ymm registers, plus 2 for the streamed operand and 1 for
// the broadcast: the classic 6x16 SGEMM shape. Per inner step it loads 2 vectors and broadcasts
// 6 scalars for 12 FMAs, so it is FMA-bound, not load-bound (2 loads/cycle on Zen).
//
// exp_sum is the Neuron activation_reduce: one pass that adds the bias (the negated running
// max), exponentiates and sums, optionally rounding the stored probabilities to bfloat16.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/simd/ops.cc"
#include <algorithm>
#include <cmath>
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
//
// Loop order (GotoBLAS): column panel outer, row blocks inner. A panel of K (d x 2N floats:
// 8 KiB at d = 128 on AVX2) stays in L1 while every row block of the sub-block streams its Q
// rows past it; row-block-outer re-read all of K (128 KiB) from L2 per 6 rows.

// Rows of Q whose max vectors a call keeps on the stack; callers pass at most this many rows at
// a time (Qk loops over groups).
constexpr int64_t kMaxPanelRows = 48;

// One 2-vector (or, with kCols = 1, 1-vector) column panel for R rows: acc[r] = Q[r] . K[:, panel].
// `valid` columns of the panel are real; the rest is padding whose scores are stored but kept
// out of the max.
template <int64_t R, int64_t kCols>
HWY_INLINE void QkPanel(const float* HWY_RESTRICT q, int64_t ldq, const float* HWY_RESTRICT k,
                        int64_t ldk, int64_t d, float* HWY_RESTRICT s, int64_t lds, int64_t valid,
                        bool accumulate, float* max_vecs) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  hn::Vec<DF> acc[R][kCols];
#pragma GCC unroll 6
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int64_t c = 0; c < kCols; ++c) {
      acc[r][c] = accumulate ? hn::LoadU(df, s + r * lds + c * N) : hn::Zero(df);
    }
  }
  for (int64_t x = 0; x < d; ++x) {
    hn::Vec<DF> b[kCols];
#pragma GCC unroll 2
    for (int64_t c = 0; c < kCols; ++c) b[c] = hn::LoadU(df, k + x * ldk + c * N);
#pragma GCC unroll 6
    for (int64_t r = 0; r < R; ++r) {
      const auto a = hn::Set(df, q[r * ldq + x]);
#pragma GCC unroll 2
      for (int64_t c = 0; c < kCols; ++c) acc[r][c] = hn::MulAdd(a, b[c], acc[r][c]);
    }
  }
  const auto neg_inf = hn::Set(df, -std::numeric_limits<float>::infinity());
#pragma GCC unroll 6
  for (int64_t r = 0; r < R; ++r) {
    auto m = neg_inf;
#pragma GCC unroll 2
    for (int64_t c = 0; c < kCols; ++c) {
      hn::StoreU(acc[r][c], df, s + r * lds + c * N);
      const int64_t lanes = valid - c * N;  // >= 1 for c == 0
      m = hn::Max(
          m, lanes >= N ? acc[r][c]
                        : hn::IfThenElse(hn::FirstN(df, static_cast<size_t>(lanes > 0 ? lanes : 0)),
                                         acc[r][c], neg_inf));
    }
    if (max_vecs) {
      float* mv = max_vecs + r * N;
      hn::Store(hn::Max(hn::Load(df, mv), m), df, mv);
    }
  }
}

template <int64_t R>
HWY_INLINE void QkRowBlock(const float* q, int64_t ldq, const float* k, int64_t ldk, int64_t c,
                           int64_t cols, int64_t d, float* s, int64_t lds, bool accumulate,
                           float* max_vecs) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(DF()));
  // Two vectors while more than one vector of columns remains (the second may cover padding).
  if (c + N < cols) {
    QkPanel<R, 2>(q, ldq, k + c, ldk, d, s + c, lds, cols - c, accumulate, max_vecs);
  } else {
    QkPanel<R, 1>(q, ldq, k + c, ldk, d, s + c, lds, cols - c, accumulate, max_vecs);
  }
}

// The contraction over d is tiled by kDTile (the d-tiling of flash_fwd_large_d): a K panel of
// kDTile x 2N floats (8 KiB on AVX2) stays L1-resident whatever the head dim, and the scores
// accumulate in S across d tiles.
constexpr int64_t kDTile = 128;

void Qk(const float* q, int64_t ldq, int64_t rows, const float* k, int64_t ldk, int64_t cols,
        int64_t d, float* s, int64_t lds, float* row_max) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  HWY_ALIGN float max_vecs[kMaxPanelRows * hn::MaxLanes(DF())];
  for (int64_t g = 0; g < rows; g += kMaxPanelRows) {
    const int64_t group_rows = std::min(kMaxPanelRows, rows - g);
    const float* qg = q + g * ldq;
    float* sg = s + g * lds;
    float* mv = row_max ? max_vecs : nullptr;
    if (mv) {
      for (int64_t i = 0; i < group_rows * N; ++i) {
        mv[i] = -std::numeric_limits<float>::infinity();
      }
    }
    for (int64_t x0 = 0; x0 < d; x0 += kDTile) {
      const int64_t dn = std::min(kDTile, d - x0);
      const bool accumulate = x0 > 0;
      float* mx = x0 + dn == d ? mv : nullptr;  // the max only once the scores are complete
      const float* qx = qg + x0;
      const float* kx = k + x0 * ldk;
      for (int64_t c = 0; c < cols; c += 2 * N) {
        int64_t r = 0;
        for (; r + kRows <= group_rows; r += kRows) {
          QkRowBlock<kRows>(qx + r * ldq, ldq, kx, ldk, c, cols, dn, sg + r * lds, lds, accumulate,
                            mx ? mx + r * N : nullptr);
        }
        const float* qr = qx + r * ldq;
        float* sr = sg + r * lds;
        float* mr = mx ? mx + r * N : nullptr;
        switch (group_rows - r) {
          case 1:
            QkRowBlock<1>(qr, ldq, kx, ldk, c, cols, dn, sr, lds, accumulate, mr);
            break;
          case 2:
            QkRowBlock<2>(qr, ldq, kx, ldk, c, cols, dn, sr, lds, accumulate, mr);
            break;
          case 3:
            QkRowBlock<3>(qr, ldq, kx, ldk, c, cols, dn, sr, lds, accumulate, mr);
            break;
          case 4:
            QkRowBlock<4>(qr, ldq, kx, ldk, c, cols, dn, sr, lds, accumulate, mr);
            break;
          case 5:
            QkRowBlock<5>(qr, ldq, kx, ldk, c, cols, dn, sr, lds, accumulate, mr);
            break;
          default:
            break;
        }
      }
    }
    if (mv) {
      for (int64_t r = 0; r < group_rows; ++r) {
        const float m = hn::GetLane(hn::MaxOfLanes(df, hn::Load(df, mv + r * N)));
        row_max[g + r] = m > row_max[g + r] ? m : row_max[g + r];
      }
    }
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

// exp(x) for the exp-and-sum pass, where x = score - running max <= 0. Highway's Exp serves
// every input range and cost 0.75 ns per element here (Zen 3, one core: 13% of the matmul time
// per score at d = 128); this one serves x <= 88 only and costs 0.43-0.56 ns (best of 30 over
// 48 x 256 scores, hot caches, 3 runs). n = round(x / ln 2) comes from the 1.5 * 2^23 shifter,
// which also leaves n in the low mantissa bits so that 2^n is a shift; r = x - n ln 2 uses ln 2 in
// two parts (the high part has 15 significant bits, so n * kLn2Hi is exact for |n| < 2^9); exp(r)
// on |r| <= ln(2) / 2 is a polynomial of degree kDegree fitted for relative error (Lawson's
// reweighted least squares): 2.0e-9 at degree 6, below float32's half ulp; 2.8e-6 at degree 4,
// enough where P is rounded to bfloat16 (half an ulp: 2e-3 to 4e-3). Below -87 the result is 0:
// exp(-87) = 1.6e-38 is near float32's smallest normal (1.2e-38), and building 2^n in the exponent
// field needs a normal result. -inf gives 0 and NaN stays NaN.
template <int kDegree, class D>
HWY_INLINE hn::Vec<D> ExpNonPositive(D d, hn::Vec<D> x) {
  static_assert(kDegree == 4 || kDegree == 6, "fitted degrees");
  const hn::RebindToSigned<D> di;
  const auto kLowest = hn::Set(d, -87.0f);
  const auto kShifter = hn::Set(d, 12582912.0f);  // 1.5 * 2^23
  const auto xc = hn::Min(hn::Max(x, kLowest), hn::Set(d, 88.0f));
  const auto f = hn::MulAdd(xc, hn::Set(d, 1.44269504088896341f), kShifter);
  const auto n = hn::Sub(f, kShifter);
  const auto kLn2Hi = hn::Set(d, 0.693145751953125f);  // 15 significant bits
  const auto kLn2Lo = hn::Set(d, 1.42860676533018705e-6f);
  auto r = hn::NegMulAdd(n, kLn2Hi, xc);
  r = hn::NegMulAdd(n, kLn2Lo, r);
  hn::Vec<D> p;
  if constexpr (kDegree == 6) {
    p = hn::MulAdd(hn::Set(d, 0.0013843653723597527f), r, hn::Set(d, 0.00837415549904108f));
    p = hn::MulAdd(p, r, hn::Set(d, 0.04166800156235695f));
    p = hn::MulAdd(p, r, hn::Set(d, 0.16666431725025177f));
    p = hn::MulAdd(p, r, hn::Set(d, 0.4999999403953552f));
    p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  } else {
    p = hn::MulAdd(hn::Set(d, 0.041513849049806595f), r, hn::Set(d, 0.16787473857402802f));
    p = hn::MulAdd(p, r, hn::Set(d, 0.5000301599502563f));
    p = hn::MulAdd(p, r, hn::Set(d, 0.9999668598175049f));
  }
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  // 2^n: f's bits are those of 1.5 * 2^23 plus n, whose low 9 bits shifted into the exponent
  // field give n << 23 (the rest shifts out).
  const auto scaled =
      hn::BitCast(d, hn::Add(hn::BitCast(di, p), hn::ShiftLeft<23>(hn::BitCast(di, f))));
  const auto e = hn::IfThenZeroElse(hn::Lt(x, kLowest), scaled);
  return hn::IfThenElse(hn::IsNaN(x), x, e);
}

template <bool kRoundBf16, class D>
HWY_INLINE hn::Vec<D> ExpStep(D d, float* p, hn::Vec<D> bias) {
  constexpr int kDegree = kRoundBf16 ? 4 : 6;
  const auto e = ExpNonPositive<kDegree>(d, hn::Add(hn::LoadU(d, p), bias));
  hn::StoreU(kRoundBf16 ? RoundToBf16(d, e) : e, d, p);
  return e;
}

template <bool kRoundBf16>
float ExpSumImpl(float* s, int64_t n, float bias) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto vbias = hn::Set(df, bias);
  auto sum0 = hn::Zero(df), sum1 = hn::Zero(df);
  int64_t c = 0;
  for (; c + 2 * N <= n; c += 2 * N) {
    sum0 = hn::Add(sum0, ExpStep<kRoundBf16>(df, s + c, vbias));
    sum1 = hn::Add(sum1, ExpStep<kRoundBf16>(df, s + c + N, vbias));
  }
  for (; c + N <= n; c += N) sum0 = hn::Add(sum0, ExpStep<kRoundBf16>(df, s + c, vbias));
  float total = hn::GetLane(hn::SumOfLanes(df, hn::Add(sum0, sum1)));
  // The tail, one lane at a time with the same polynomial.
  const hn::CappedTag<float, 1> d1;
  const auto vbias1 = hn::Set(d1, bias);
  for (; c < n; ++c) total += hn::GetLane(ExpStep<kRoundBf16>(d1, s + c, vbias1));
  return total;
}

float ExpSum(float* s, int64_t n, float bias, bool round_bf16) {
  return round_bf16 ? ExpSumImpl<true>(s, n, bias) : ExpSumImpl<false>(s, n, bias);
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

bool AllFinite(const float* x, int64_t n) {
  // A float is NaN or Inf exactly when its exponent bits are all ones.
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto exp_mask = hn::Set(du, 0x7F800000u);
  auto bad = hn::Zero(du);
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const auto e = hn::And(hn::BitCast(du, hn::LoadU(df, x + i)), exp_mask);
    bad = hn::Or(bad, hn::VecFromMask(du, hn::Eq(e, exp_mask)));
  }
  bool ok = hn::AllTrue(du, hn::Eq(bad, hn::Zero(du)));
  for (; i < n; ++i) ok &= std::isfinite(x[i]);
  return ok;
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
//
// The same panel order as MM1: a 2N-wide panel of V (n x 2N floats: 16 KiB for a 256-key tile
// on AVX2) stays in L1 while every row block of P streams past it. The rescale by alpha is
// folded into the accumulator load of the first tile.

template <int64_t R>
HWY_INLINE void PvPanel(const float* HWY_RESTRICT p, int64_t ldp, int64_t n,
                        const float* HWY_RESTRICT v, int64_t ldv, const float* alpha,
                        float* HWY_RESTRICT o, int64_t ldo) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  hn::Vec<DF> acc[R][2];
#pragma GCC unroll 6
  for (int64_t r = 0; r < R; ++r) {
    acc[r][0] = hn::LoadU(df, o + r * ldo);
    acc[r][1] = hn::LoadU(df, o + r * ldo + N);
    if (alpha) {
      const auto al = hn::Set(df, alpha[r]);
      acc[r][0] = hn::Mul(acc[r][0], al);
      acc[r][1] = hn::Mul(acc[r][1], al);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const auto b0 = hn::LoadU(df, v + j * ldv);
    const auto b1 = hn::LoadU(df, v + j * ldv + N);
#pragma GCC unroll 6
    for (int64_t r = 0; r < R; ++r) {
      const auto a = hn::Set(df, p[r * ldp + j]);
      acc[r][0] = hn::MulAdd(a, b0, acc[r][0]);
      acc[r][1] = hn::MulAdd(a, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int64_t r = 0; r < R; ++r) {
    hn::StoreU(acc[r][0], df, o + r * ldo);
    hn::StoreU(acc[r][1], df, o + r * ldo + N);
  }
}

void Pv(const float* p, int64_t ldp, int64_t rows, int64_t n, const float* v, int64_t ldv,
        int64_t dv_pad, const float* alpha, float* o, int64_t ldo) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(DF()));
  // dv_pad is a multiple of kPadFloats = 16, hence of 2N on every target up to 512 bits.
  for (int64_t c = 0; c < dv_pad; c += 2 * N) {
    int64_t r = 0;
    for (; r + kRows <= rows; r += kRows) {
      PvPanel<kRows>(p + r * ldp, ldp, n, v + c, ldv, alpha ? alpha + r : nullptr, o + r * ldo + c,
                     ldo);
    }
    const float* pr = p + r * ldp;
    const float* ar = alpha ? alpha + r : nullptr;
    float* orow = o + r * ldo + c;
    switch (rows - r) {
      case 1:
        PvPanel<1>(pr, ldp, n, v + c, ldv, ar, orow, ldo);
        break;
      case 2:
        PvPanel<2>(pr, ldp, n, v + c, ldv, ar, orow, ldo);
        break;
      case 3:
        PvPanel<3>(pr, ldp, n, v + c, ldv, ar, orow, ldo);
        break;
      case 4:
        PvPanel<4>(pr, ldp, n, v + c, ldv, ar, orow, ldo);
        break;
      case 5:
        PvPanel<5>(pr, ldp, n, v + c, ldv, ar, orow, ldo);
        break;
      default:
        break;
    }
  }
}

const Ops* GetOps() {
  static const Ops table = {hwy::TargetName(HWY_TARGET),
                            &Qk,
                            &RowMax,
                            &ExpSum,
                            &Softcap,
                            &Alibi,
                            &AddRow,
                            &AllFinite,
                            &ToFloat,
                            &Pv};
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
