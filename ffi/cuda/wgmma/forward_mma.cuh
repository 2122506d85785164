// The products of the Hopper forward's consumers: S = Q K^T and O += P V by wgmma from their
// descriptors, and S again by mma.sync where the settled maxima were outrun.
#pragma once

#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/wgmma/forward_pipeline.cuh"

namespace jax_flashattn::wgmma {

// The products' operand type and k-step: q's 2-byte Elem in 16-element steps, or (kE4m3)
// float8_e4m3fn in 32-element steps, each 32 bytes of a 128-byte row.
template <typename Elem, typename Traits>
using OperandOf = std::conditional_t<Traits::kE4m3, __nv_fp8_e4m3, Elem>;
template <typename Traits>
inline constexpr int kKStep = Traits::kE4m3 ? 32 : 16;

// Descriptors. Q and K are K-major (head dim contiguous): k-step ks lies in span ks / 4, 32
// bytes per step into each 128-byte row. V is MN-major for O += P V (head dim contiguous,
// keys along the reduction): k-step kk is 16 rows down, spans kBlockN rows apart (LBO); V^T
// (kE4m3) is K-major as K is, a row of kBlockN keys per head dim (with 64-key tiles rows of
// 64 bytes in the 64-byte swizzle, 8-row groups 512 bytes apart).
// Each is the descriptor of stage 0 / k-step 0 advanced by a byte offset (constant but for
// the stage).
template <typename Traits>
struct ForwardDescriptors {
  uint64_t k0, v0;  // K and V of stage 0, k-step 0

  __device__ static ForwardDescriptors make(const ForwardSmem<Traits>& smem) {
    const uint32_t v_span_stride = Traits::kE4m3 ? 16 : Traits::kBlockN * kRowBytes;
    // v()'s k_major_step_bytes spans 128-byte rows: with 64-byte ones a tile is at most the
    // two k32 steps of a row.
    static_assert(!Traits::kE4m3 || Traits::kVtBoxKeys == 128 ||
                      Traits::kBlockN / kKStep<Traits> <= 2,
                  "a 64-byte V^T row holds two k32 steps");
    if constexpr (Traits::kE4m3 && Traits::kVtBoxKeys == 64)
      return ForwardDescriptors{ptx::smem_descriptor_sw128(smem.k(0), 16, kGroupBytes),
                                ptx::smem_descriptor_sw64(smem.v(0), 16, 8 * 64)};
    return ForwardDescriptors{
        ptx::smem_descriptor_sw128(smem.k(0), 16, kGroupBytes),
        ptx::smem_descriptor_sw128(smem.v(0), v_span_stride, kGroupBytes)};
  }
  // q_tile: this warpgroup's rows of its Q stage.
  __device__ static uint64_t q(uint32_t q_tile, int ks) {
    return ptx::smem_descriptor_advance(ptx::smem_descriptor_sw128(q_tile, 16, kGroupBytes),
                                        k_major_step_bytes(Traits::kBlockM, ks));
  }
  __device__ uint64_t k(int stage, int ks) const {
    return ptx::smem_descriptor_advance(
        k0, stage * Traits::kKVBytes + k_major_step_bytes(Traits::kBlockN, ks));
  }
  __device__ uint64_t v(int stage, int kk) const {
    const uint32_t step = Traits::kE4m3 ? k_major_step_bytes(Traits::kHeadDim, kk)
                                        : mn_major_step_bytes(kk);
    return ptx::smem_descriptor_advance(v0, stage * Traits::kKVBytes + step);
  }
};

// S = Q K^T of K/V stage `stage`, overwriting S, issued and committed as one wgmma group.
template <typename Elem, typename Traits>
__device__ __forceinline__ void issue_scores(float (&s_acc)[1][Traits::kBlockN / 8][4],
                                             const ForwardDescriptors<Traits>& desc,
                                             uint32_t q_tile, int stage) {
  // Q's address is the same for every K/V tile: without this opaque copy ptxas hoists all
  // kKSteps 64-bit Q descriptors out of the tile loop (32 registers at head dim 256, which
  // spills); rebuilt here they cost two integer ops each
  // (docs/decisions/hopper-kernels-without-spills.md).
  q_tile = ptx::opaque(q_tile);
  ptx::fence_registers(s_acc[0]);
  ptx::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < Traits::kUsedDim / kKStep<Traits>; ++ks)
    ptx::wgmma_ss<Traits::kBlockN, OperandOf<Elem, Traits>>(
        s_acc[0], ForwardDescriptors<Traits>::q(q_tile, ks), desc.k(stage, ks), ks > 0);
  ptx::wgmma_commit_group();
}

// O += P V over the first kKeys keys of V stage `stage`, one wgmma group.
template <int kKeys, typename Elem, typename Traits>
__device__ __forceinline__ void issue_values(
    float (&o_acc)[1][Traits::kUsedDim / 8][4],
    uint32_t (&p_frag)[Traits::kBlockN / kKStep<Traits>][4],
    const ForwardDescriptors<Traits>& desc, int stage) {
  ptx::fence_registers(o_acc[0]);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kKeys / kKStep<Traits>; ++kk) {
    if constexpr (Traits::kE4m3)
      ptx::wgmma_rs_k_major<Traits::kHeadDim, __nv_fp8_e4m3>(o_acc[0], p_frag[kk],
                                                             desc.v(stage, kk), true);
    else
      ptx::wgmma_rs<Traits::kUsedDim, Elem>(o_acc[0], p_frag[kk], desc.v(stage, kk));
  }
  ptx::wgmma_commit_group();
}

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
  constexpr int kKSteps = Traits::kUsedDim / 16, kNTiles = kBlockN / 8;
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
