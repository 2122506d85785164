// ALiBi's term on the Hopper kernels' accumulator fragments (forward_bias_and_mask.cuh,
// backward_bias_and_mask.cuh). A thread's elements of a tile have distances t + shift - s of
// the form r + k: r one integer per row of the thread (forward) or per step (backward), k a
// compile-time offset, the element's place in the fragment. With base = slope2 r, the term
// -slope2 |r + k| costs two FP32 operations per element, the scale's multiply folded in:
//   d2 = fmaf(k, slope2, base)          slope2 (r + k): an FFMA with k as its immediate
//   x  = fmaf(x, factor, -|d2|)         the abs and the sign are operand modifiers
// -|d2| is the term where slope2 >= 0, +|d2| where slope2 < 0: the sign is a template
// parameter (kNegative), chosen once per tile, so that it stays an operand modifier.
//
// r is taken from the tile's first key (and, backward, its first query), so |r| <= |r + k| +
// |k| with |k| < 256: base's rounding moves the term by at most half an ulp of slope2
// (|r + k| + 256), next to the half ulp of slope2 |r + k| that the term's own rounding costs.
// A base per absolute position (slope2 (t + shift) less slope2 s) would lose the term's low
// bits to the positions' magnitude on long sequences, on the elements nearest the diagonal,
// which weigh the most.
#pragma once

#include <cmath>

namespace jax_flashattn::wgmma {

// x times factor plus the term of the element whose distance is k more than base's.
template <bool kNegative>
__device__ __forceinline__ float with_alibi_term(float x, float factor, float slope2, float base,
                                                 int k) {
  const float d2 = k == 0 ? base : fmaf(float(k), slope2, base);
  return fmaf(x, factor, kNegative ? fabsf(d2) : -fabsf(d2));
}

// A forward accumulator fragment s (a thread's two rows h, 8 apart; adjacent keys e of its pair
// in each 8-key column tile c) times factor plus ALiBi's term: element [c][2 h + e] at distance
// r_h - (8 c + e), base[h] = slope2 r_h. The slope's sign, uniform over the tile, is chosen
// once, so that it stays an operand modifier. Hidden elements (-inf) stay hidden.
template <bool kNegative, int kNTiles>
__device__ __forceinline__ void add_alibi_to_rows(float (&s)[1][kNTiles][4], float factor,
                                                  float slope2, const float (&base)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int c = 0; c < kNTiles; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        s[0][c][2 * h + e] =
            with_alibi_term<kNegative>(s[0][c][2 * h + e], factor, slope2, base[h], -(8 * c + e));
}
template <int kNTiles>
__device__ __forceinline__ void add_alibi_to_rows(float (&s)[1][kNTiles][4], float factor,
                                                  float slope2, const float (&base)[2]) {
  if (slope2 < 0.f) return add_alibi_to_rows<true>(s, factor, slope2, base);
  add_alibi_to_rows<false>(s, factor, slope2, base);
}

}  // namespace jax_flashattn::wgmma
