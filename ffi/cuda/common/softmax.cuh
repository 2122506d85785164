// Online softmax over mma.sync accumulator fragments.
//
// A thread holds, for each 16-row slab of its warp, two rows (lane / 4 and lane / 4 + 8) and
// two adjacent columns per 8-column tile; the four lanes of a quad share those rows, so row
// reductions are two xor-shuffles. Scores arrive in units where logit * log2(e) = s * scale,
// so each probability is exp2(s * scale - max * scale): one FFMA and one MUFU.EX2.
#pragma once

#include <cmath>

#include "ffi/cuda/common/ptx.cuh"

namespace jax_flashattn::cuda {

// exp(x) = exp2(x * kLog2e): how natural-log quantities (logits, lse) enter exp2's domain.
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;  // and back: log2(x) * kLn2 = ln(x)

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// kRows = 2 per 16-row slab. row_sum holds this thread's partial sums; the quad reduction is
// deferred to finalize() (the rescaling factors are per row, so partials rescale correctly).
// kLog2PScale: the probabilities come out times 2^kLog2PScale (each row's largest 2^8 for FP8
// attention, whose P of e4m3 then stays in e4m3's normal range, from 2^-6, down to 2^-14 of
// the row's largest weight, where in [0, 1] everything below 2^-9 of it would flush to 0);
// the sums and lse account for it.
template <int kSlabs, int kLog2PScale = 0>
struct OnlineSoftmax {
  float row_max[kSlabs][2];
  float row_sum[kSlabs][2];

  __device__ void init() {
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[m][h] = -INFINITY;
        row_sum[m][h] = 0.f;
      }
  }

  // The exp2 offset of a row whose maximum is `max`: -inf - -inf would be NaN, so a row that
  // has seen nothing gets offset 0 (its scores are -inf, its probabilities 0).
  __device__ static float offset_for(float max, float scale) {
    if constexpr (kLog2PScale != 0)
      return max == -INFINITY ? 0.f : __fsub_rn(__fmul_rn(max, scale), float(kLog2PScale));
    return max == -INFINITY ? 0.f : __fmul_rn(max, scale);
  }

  // Row h of slab m of S's first kUsed 8-column tiles, in place: P = exp2(exponent(s, h, n, c,
  // -offset)) for the score s of 8-column tile n, column c of the pair. Returns this thread's
  // share of the row's sum.
  template <int kUsed, int kNTiles, typename Exponent>
  __device__ static float exp2_row_with(float (&S)[kSlabs][kNTiles][4], int m, int h,
                                        float offset, const Exponent& exponent) {
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < kUsed; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float& s = S[m][n][2 * h + c];
        s = ptx::exp2_approx(exponent(s, h, n, c, -offset));
        sum += s;
      }
    return sum;
  }
  // P = exp2(S * scale - offset): one FFMA and one MUFU.EX2 each.
  template <int kUsed, int kNTiles>
  __device__ static float exp2_row(float (&S)[kSlabs][kNTiles][4], int m, int h, float scale,
                                   float offset) {
    return exp2_row_with<kUsed>(S, m, h, offset, [scale](float s, int, int, int, float minus) {
      return fmaf(s, scale, minus);
    });
  }

  // Turns scores S[kSlabs][kNTiles][4] into unnormalised probabilities in place, relative to
  // the updated row maxima, and returns in `correction` the factor exp2(old max - new max) that
  // the output accumulated so far must be rescaled by. Masked scores are -inf; a row with no
  // finite score yet keeps max -inf and all-zero probabilities.
  template <int kNTiles>
  __device__ void exponentiate(float (&S)[kSlabs][kNTiles][4], float scale,
                               float (&correction)[kSlabs][2]) {
    exponentiate_first<kNTiles>(S, scale, correction);
  }

  // exponentiate over S's first kUsed 8-column tiles, for a tile whose later columns no row
  // sees: they are left as they are, and the caller multiplies none of them by V.
  template <int kUsed, int kNTiles>
  __device__ void exponentiate_first(float (&S)[kSlabs][kNTiles][4], float scale,
                                     float (&correction)[kSlabs][2]) {
    static_assert(kUsed >= 1 && kUsed <= kNTiles, "a part of the tile");
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int n = 0; n < kUsed; ++n)
          tile_max = fmaxf(tile_max, fmaxf(S[m][n][2 * h], S[m][n][2 * h + 1]));
        const float new_max = fmaxf(row_max[m][h], quad_max(tile_max));
        const float offset = offset_for(new_max, scale);
        // exp2 of the old offset less the new one (the row's probabilities so far were taken
        // against the old): exactly 1 where the maximum stayed; a row that has seen nothing
        // keeps factor 1. Not one FFMA of the old maximum, whose unrounded product leaves the
        // old offset's rounding residual r: a factor 2^r on everything before at every update
        // (a tile, or a decode kernel's 16-key step), compounding over a split, and rarely
        // exactly 1, so O was rescaled at nearly every update.
        correction[m][h] =
            row_max[m][h] == -INFINITY
                ? 1.f
                : ptx::exp2_approx(__fsub_rn(offset_for(row_max[m][h], scale), offset));
        row_max[m][h] = new_max;
        row_sum[m][h] = row_sum[m][h] * correction[m][h] + exp2_row<kUsed>(S, m, h, scale, offset);
      }
  }

  // Largest partial row sum (a thread's share of a row in one tile, which bounds each of its
  // P) that exponentiate_against_settled_max accepts: 2^12 leaves fp16's range (65504) to
  // spare for P and keeps row sums far from float32 overflow.
  static constexpr float kSettledHeadroom = 4096.f;

  // exponentiate without this tile's maxima: P = exp2(S * scale - m * scale) against the row
  // maxima m of earlier tiles, so no max reduction, no shuffles and no output rescale. A score
  // above m only gives P > 1, which the final normalisation undoes exactly, so this stays
  // exact while no P exceeds kSettledHeadroom. Returns false, warp-uniform, where some row's
  // partial sum (which bounds each of its P) exceeds that or is NaN; S is then spent and the
  // caller recomputes it for exponentiate(). The caller guarantees that every row which may see
  // a key has a finite maximum; a row that sees nothing keeps m = -inf, offset 0 and P = 0.
  // (Why, with measurements: docs/decisions/settled-row-maxima.md.)
  template <int kNTiles>
  __device__ bool exponentiate_against_settled_max(float (&S)[kSlabs][kNTiles][4], float scale) {
    return exponentiate_against_settled_max(
        S, scale, [scale](float s, int, int, int, float minus) { return fmaf(s, scale, minus); });
  }
  // The same with P = exp2(exponent(s, h, n, c, -m * scale)) (exp2_row_with): for scores that
  // become the logits scale puts in the maxima's units only as they are exponentiated.
  template <int kNTiles, typename Exponent>
  __device__ bool exponentiate_against_settled_max(float (&S)[kSlabs][kNTiles][4], float scale,
                                                   const Exponent& exponent) {
    float sum[kSlabs][2];
    bool within = true;
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sum[m][h] =
            exp2_row_with<kNTiles>(S, m, h, offset_for(row_max[m][h], scale), exponent);
        within = within && sum[m][h] <= kSettledHeadroom;
      }
    if (!__all_sync(0xffffffff, within)) return false;
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) row_sum[m][h] += sum[m][h];
    return true;
  }

  // O[kSlabs][kDTiles][4] *= correction, row by row.
  template <int kDTiles>
  __device__ static void rescale(float (&O)[kSlabs][kDTiles][4],
                                 const float (&correction)[kSlabs][2]) {
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
          O[m][d][2 * h] *= correction[m][h];
          O[m][d][2 * h + 1] *= correction[m][h];
        }
  }

  // rescale, skipped by the whole warp where none of its rows moved (every correction exactly
  // 1, exp2 of 0): once the first tiles have set the row maxima they rarely move, and the
  // skip saves kSlabs * kDTiles * 4 multiplies per thread
  // (docs/decisions/online-softmax-arithmetic.md). Call it from converged warps.
  template <int kDTiles>
  __device__ static void rescale_where_moved(float (&O)[kSlabs][kDTiles][4],
                                             const float (&correction)[kSlabs][2]) {
    bool still = true;
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
      still = still && correction[m][0] == 1.f && correction[m][1] == 1.f;
    if (!__all_sync(0xffffffff, still)) rescale(O, correction);
  }

  // Both steps at once, for kernels whose O is not in flight in a tensor-core product.
  template <int kNTiles, int kDTiles>
  __device__ void update(float (&S)[kSlabs][kNTiles][4], float (&O)[kSlabs][kDTiles][4],
                         float scale) {
    float correction[kSlabs][2];
    exponentiate(S, scale, correction);
    rescale_where_moved(O, correction);
  }

  // Normalises O and returns the natural-log lse of each row (-inf and O = 0 for rows that
  // saw no key). The sum is 0 exactly for those rows; otherwise it is at least 2^kLog2PScale (the row's
  // maximum contributes 1), or NaN where a NaN or +inf logit reached the row (the maxima drop
  // NaN, but its exp2 does not), which O and lse then carry, as in jax.nn. The division and
  // log2 are rcp.approx and lg2.approx, one MUFU op each
  // (docs/decisions/online-softmax-arithmetic.md).
  template <int kDTiles>
  __device__ void finalize(float (&O)[kSlabs][kDTiles][4], float scale, float (&lse)[kSlabs][2]) {
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sum = quad_sum(row_sum[m][h]);
        const bool seen = sum != 0.f;
        const float inv = seen ? ptx::rcp_approx(sum) : 0.f;
        // The offset the row's probabilities were taken against, not an FFMA's unrounded
        // max * scale: the lse of exactly those probabilities.
        lse[m][h] = seen ? __fadd_rn(offset_for(row_max[m][h], scale), ptx::log2_approx(sum)) * kLn2
                         : -INFINITY;
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
          O[m][d][2 * h] *= inv;
          O[m][d][2 * h + 1] *= inv;
        }
      }
  }
};

}  // namespace jax_flashattn::cuda
