// Products of the Hopper forward's consumers outside the wgmma pipeline.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/wgmma/forward_pipeline.cuh"

namespace jax_flashattn::wgmma {

// S of this warp's 16 rows again, by mma.sync from the Q and K_j tiles in shared memory (the
// accumulator layout of a warp's rows of a wgmma is that of m16n8 tiles side by side).
// ldmatrix lane l gives row l % 8 of 8 x 8 matrix l / 8 (lanes 0-15 only for .x2);
// a tile's element (row, 16-byte chunk c) sits in span c / 8 at row * kRowBytes + ((c % 8) ^
// (row % 8)) * 16, and every row group here starts at a multiple of 8 rows. The lane is
// opaque so that these addresses are formed on this rare path, not hoisted out of the tile
// loop into registers (which spills). One 8-key tile at a time (ldmatrix .x2): the four B
// registers of a pair, on top of S, O and the P of the product in flight, spill with three
// consumers (docs/decisions/settled-row-maxima.md).
template <typename Elem, typename Traits>
__device__ __forceinline__ void recompute_warp_scores(
    float (&s_acc)[1][Traits::kBlockN / 8][4], uint32_t q_tile, const ForwardSmem<Traits>& smem,
    int stage, int lane, int warp) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kKSteps = Traits::kHeadDim / 16, kNTiles = kBlockN / 8;
  const int l = int(ptx::opaque(uint32_t(lane))), matrix = l / 8;
  const auto chunk_offset = [&](int row, int chunk, int rows_per_span) {
    return uint32_t((chunk / 8) * rows_per_span * kRowBytes + row * kRowBytes +
                    (((chunk % 8) ^ (l % 8)) << 4));
  };
#pragma unroll
  for (int c = 0; c < kNTiles; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) s_acc[0][c][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t a[4];
    ptx::ldmatrix_x4(a, q_tile + chunk_offset(warp * 16 + (matrix & 1) * 8 + l % 8,
                                              2 * ks + (matrix >> 1), kBlockM));
#pragma unroll
    for (int c = 0; c < kNTiles; ++c) {
      uint32_t b[2];
      ptx::ldmatrix_x2(b, smem.k(stage) + chunk_offset(c * 8 + l % 8, 2 * ks + (matrix & 1),
                                                       kBlockN));
      ptx::mma_m16n8k16<Elem>(s_acc[0][c], a, b);
    }
  }
}

}  // namespace jax_flashattn::wgmma
