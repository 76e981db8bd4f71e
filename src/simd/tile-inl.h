// Register tiles as named vectors, on every Highway target including the scalable ones.
//
// A matmul's register tile is R x C accumulator vectors indexed by compile-time constants. On
// x86 and NEON it could be an array `Vec acc[R][C]`, which the compiler keeps in registers once
// the loops over it are unrolled; SVE's (and RVV's) vectors are sizeless types, which cannot be
// array elements or class members (Highway's dot-inl.h says as much; its kernels and gemma.cpp's
// name their accumulators). So a tile here is made of local variables: WithVectors declares one
// per nested call and hands them on as a parameter pack of references, which ForEach, ForEachRow,
// ForEachColumn and Nth index (pack expansions over index sequences, unrolled by construction).
// Every call, lambdas included, is forced inline, so the vectors live in registers as the array
// elements did (x86 A/B: docs/benchmarks/README.md, "aarch64").

// Per-target include guard (Highway's idiom: toggled for every target foreach_target compiles).
#if defined(FLASHCTE_SRC_SIMD_TILE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHCTE_SRC_SIMD_TILE_INL_H_
#undef FLASHCTE_SRC_SIMD_TILE_INL_H_
#else
#define FLASHCTE_SRC_SIMD_TILE_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "hwy/highway.h"

// A lambda over tile vectors: compiled for the current target and always inlined (a call left
// out of line would take the vectors' addresses and keep them in memory). HWY_ATTR expands where
// this is used, so it names the target being compiled.
#ifndef FLASHCTE_TILE_LAMBDA
#define FLASHCTE_TILE_LAMBDA HWY_ATTR __attribute__((always_inline))
#endif

HWY_BEFORE_NAMESPACE();
namespace flashcte::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// v_I of the pack v_0, v_1, ...
template <int64_t I, class V0, class... V>
HWY_INLINE V0& Nth(V0& v0, V&... v) {
  if constexpr (I == 0) {
    return v0;
  } else {
    return Nth<I - 1>(v...);
  }
}

// body(v_0, ..., v_{kCount - 1}): kCount zeroed vectors of d, as lvalues.
template <int64_t kCount, class D, class Body, class... V>
HWY_INLINE void WithVectors(D d, const Body& body, V&... v) {
  if constexpr (static_cast<int64_t>(sizeof...(V)) == kCount) {
    body(v...);
  } else {
    hn::Vec<D> next = hn::Zero(d);
    WithVectors<kCount>(d, body, v..., next);
  }
}

// The helpers below pass indices to their callbacks as plain int64_t values: once inlined they
// are constants, and a callback is instantiated once, not once per index (with an index per type,
// the decode kernels' hundreds of tile shapes doubled the SIMD layer's compile time).

// f(i, v_i) for i = 0, 1, ... in order.
template <class F, class... V>
HWY_INLINE void ForEach(const F& f, V&... v) {
  int64_t i = 0;
  (f(i++, v), ...);
}

namespace tile_detail {
// f(r, v_{first + rC + J}...) for the row's columns J.
template <int64_t First, int64_t C, int64_t R, class F, size_t... J, class... V>
HWY_INLINE void Row(std::index_sequence<J...> /* columns */, const F& f, V&... v) {
  f(R, Nth<First + R * C + static_cast<int64_t>(J)>(v...)...);
}
template <int64_t First, int64_t C, class F, size_t... R, class... V>
HWY_INLINE void ForEachRow(std::index_sequence<R...> /* rows */, const F& f, V&... v) {
  (Row<First, C, static_cast<int64_t>(R)>(std::make_index_sequence<static_cast<size_t>(C)>(), f,
                                          v...),
   ...);
}
template <int64_t C, int64_t Col, class F, size_t... R, class... V>
HWY_INLINE void Column(std::index_sequence<R...> /* rows */, const F& f, V&... v) {
  f(Col, Nth<static_cast<int64_t>(R) * C + Col>(v...)...);
}
template <int64_t C, class F, size_t... Col, class... V>
HWY_INLINE void ForEachColumn(std::index_sequence<Col...> /* columns */, const F& f, V&... v) {
  (Column<C, static_cast<int64_t>(Col)>(std::make_index_sequence<sizeof...(V) / C>(), f, v...),
   ...);
}

// acc[r][c] += ar * b_c for one row r, where the pack is b_0..b_{C-1} and then the accumulators.
template <int64_t C, int64_t R, class A, size_t... J, class... V>
HWY_INLINE void MulAddRow(std::index_sequence<J...> /* columns */, const A& ar, V&... v) {
  ((Nth<C + R * C + static_cast<int64_t>(J)>(v...) = hn::MulAdd(
        ar, Nth<static_cast<int64_t>(J)>(v...), Nth<C + R * C + static_cast<int64_t>(J)>(v...))),
   ...);
}

// OuterProductTile's body over the pack b_0..b_{C-1}, acc[0][0], ..., acc[R-1][C-1].
template <int64_t R, int64_t C, class D, class Init, class LoadB, class Finish, size_t... I,
          size_t... Rows, size_t... J, class... V>
HWY_INLINE void OuterProduct(D d, const float* HWY_RESTRICT a, int64_t lda, int64_t steps,
                             const Init& init, const LoadB& load_b, const Finish& finish,
                             std::index_sequence<I...> /* accumulators */,
                             std::index_sequence<Rows...> /* rows */,
                             std::index_sequence<J...> /* columns */, V&... v) {
  ((Nth<C + static_cast<int64_t>(I)>(v...) =
        init(static_cast<int64_t>(I) / C, static_cast<int64_t>(I) % C)),
   ...);
  for (int64_t s = 0; s < steps; ++s) {
    load_b(s, Nth<static_cast<int64_t>(J)>(v...)...);
    (MulAddRow<C, static_cast<int64_t>(Rows)>(
         std::index_sequence<J...>(), hn::Set(d, a[static_cast<int64_t>(Rows) * lda + s]), v...),
     ...);
  }
  ForEachRow<C, C>(std::index_sequence<Rows...>(), finish, v...);
}
template <class F, size_t... I, class... V>
HWY_INLINE void ForEachPair(std::index_sequence<I...> /* pairs */, const F& f, V&... v) {
  (f(static_cast<int64_t>(I), Nth<2 * static_cast<int64_t>(I)>(v...),
     Nth<2 * static_cast<int64_t>(I) + 1>(v...)),
   ...);
}
}  // namespace tile_detail

// The pack as rows of C vectors, row-major: f(r, v_{rC}, ..., v_{rC + C - 1}) for each row r in
// order.
template <int64_t C, class F, class... V>
HWY_INLINE void ForEachRow(const F& f, V&... v) {
  constexpr int64_t kCount = static_cast<int64_t>(sizeof...(V));
  static_assert(kCount % C == 0, "whole rows");
  tile_detail::ForEachRow<0, C>(std::make_index_sequence<static_cast<size_t>(kCount / C)>(), f,
                                v...);
}

// The pack as rows of C vectors, column by column: f(c, v_c, v_{C + c}, v_{2C + c}, ...) for each
// column c in order.
template <int64_t C, class F, class... V>
HWY_INLINE void ForEachColumn(const F& f, V&... v) {
  static_assert(static_cast<int64_t>(sizeof...(V)) % C == 0, "whole rows");
  tile_detail::ForEachColumn<C>(std::make_index_sequence<static_cast<size_t>(C)>(), f, v...);
}

// The register tile of the outer-product matmuls (MM1, MM2 and decode's PV), R x C accumulators
// acc[r][c]:
//   acc[r][c] = init(r, c);
//   for each step s in [0, steps): load_b(s, b_0, ..., b_{C-1}) fills C vectors, then
//     acc[r][c] += a[r * lda + s] * b_c  (one broadcast of `a` per row);
//   finish(r, acc[r][0], ..., acc[r][C-1]) for each row r.
template <int64_t R, int64_t C, class D, class Init, class LoadB, class Finish>
HWY_INLINE void OuterProductTile(D d, const float* HWY_RESTRICT a, int64_t lda, int64_t steps,
                                 const Init& init, const LoadB& load_b, const Finish& finish) {
  WithVectors<C + R * C>(d, [&](auto&... v) FLASHCTE_TILE_LAMBDA {
    tile_detail::OuterProduct<R, C>(d, a, lda, steps, init, load_b, finish,
                                    std::make_index_sequence<static_cast<size_t>(R * C)>(),
                                    std::make_index_sequence<static_cast<size_t>(R)>(),
                                    std::make_index_sequence<static_cast<size_t>(C)>(), v...);
  });
}

// f(i, v_{2i}, v_{2i + 1}) for each pair of the pack in order.
template <class F, class... V>
HWY_INLINE void ForEachPair(const F& f, V&... v) {
  static_assert(sizeof...(V) % 2 == 0, "whole pairs");
  tile_detail::ForEachPair(std::make_index_sequence<sizeof...(V) / 2>(), f, v...);
}

// O[r][panel] = alpha[r] O[r][panel] + sum_j P[r][j] V_j[panel] for R rows and a panel of C
// vectors of columns (no rescale with a null alpha), where load_v(j, v_0, ..., v_{C-1}) loads the
// panel of V's row j: the register tile of MM2 and of decode's PV (decode_pv-inl.h). With kPairs
// (C even), vectors 2m and 2m + 1 hold the even- and odd-indexed columns of the panel's 2N columns
// from 2mN (LoadBf16Pairs' order): O's rows are split so on load and interleaved back on store.
template <int64_t R, int64_t C, bool kPairs = false, class D, class LoadV>
HWY_INLINE void RescaledPvTile(D d, const float* HWY_RESTRICT p, int64_t ldp, int64_t n,
                               const LoadV& load_v, const float* alpha, float* HWY_RESTRICT o,
                               int64_t ldo) {
  static_assert(!kPairs || C % 2 == 0, "pairs of vectors");
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto init = [&](int64_t r, int64_t c) FLASHCTE_TILE_LAMBDA {
    hn::Vec<D> prior;
    if constexpr (kPairs) {
      hn::Vec<D> even, odd;
      hn::LoadInterleaved2(d, o + r * ldo + (c & ~int64_t{1}) * N, even, odd);
      prior = (c & 1) != 0 ? odd : even;
    } else {
      prior = hn::LoadU(d, o + r * ldo + c * N);
    }
    return alpha ? hn::Mul(prior, hn::Set(d, alpha[r])) : prior;
  };
  const auto store = [&](auto r, auto&... row) FLASHCTE_TILE_LAMBDA {
    if constexpr (kPairs) {
      ForEachPair(
          [&](auto m, auto& even, auto& odd) FLASHCTE_TILE_LAMBDA {
            hn::StoreInterleaved2(even, odd, d, o + r * ldo + 2 * m * N);
          },
          row...);
    } else {
      ForEach([&](auto c, auto& x) FLASHCTE_TILE_LAMBDA { hn::StoreU(x, d, o + r * ldo + c * N); },
              row...);
    }
  };
  OuterProductTile<R, C>(d, p, ldp, n, init, load_v, store);
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#endif  // FLASHCTE_SRC_SIMD_TILE_INL_H_
