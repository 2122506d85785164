// The Hopper forward's epilogue: a tile's normalised O staged in shared memory and written
// with a TMA store, and its lse.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// The consumer thread's coordinates the epilogue needs: its thread index, warp (of four) and
// lane, the mma accumulator coordinates quad_row = lane / 4 and quad_col = 2 (lane % 4), its
// warp's first row of the block and its consumer warpgroup.
struct EpilogueThread {
  int tid, warp, lane, quad_row, quad_col, warp_row0, consumer;
};

// A tile's epilogue: O (normalised) staged as Elem (out's 2-byte type, also beside FP8
// inputs) in this warpgroup's 64 rows at o_tile
// (in the O tile, or kOInKV in its K/V buffer), in the swizzled layout the TMA store reads,
// once the previous tile's store has read them, and lse; then one thread stores each span
// and lets the store run on.
template <typename Elem, typename Traits>
__device__ __forceinline__ void store_tile_output(
    const AttentionParams& p, const ForwardMaps& maps,
    float (&o_acc)[1][Traits::kUsedDim / 8][4], int b, int n, int row0,
    const float (&row_lse)[1][2], uint32_t o_tile, const EpilogueThread& th) {
  constexpr int kBlockM = Traits::kBlockM, kDTiles = Traits::kUsedDim / 8;
  // The spans O's columns start in (a span half used at head dim 96: the map clips the rest).
  constexpr int kSpanElems = Traits::kOutSpanElems;
  constexpr int kSpans = (Traits::kUsedDim + kSpanElems - 1) / kSpanElems;
  constexpr uint32_t kOSpanBytes = (Traits::kOInKV ? 64 : kBlockM) * kRowBytes;
  float* lse = p.lse + (int64_t(b) * p.num_heads + n) * p.seqlen_q;
  if constexpr (!Traits::kOInKV) {  // (the ring's full barrier says that o_tile is free)
    if (th.tid % 128 == 0) ptx::bulk_wait_group_read_all();
    ptx::named_barrier_sync(1 + th.consumer, 128);
  }
  // By stmatrix, four 8 x 8 matrices per instruction (a quarter of the instructions of
  // st.shared.b32 stores; docs/decisions/hopper-forward-epilogue.md). Matrix
  // m = lane / 8 of instruction i is rows 8 (m % 2) .. 8 (m % 2) + 7 of this warp's 16 and
  // 8-column tile 2 i + m / 2 of O; each lane gives the address of row lane % 8 of its
  // matrix. Chunk c of row r sits in span c / 8 at ((c % 8 ^ r % 8) << 4): 2 i is even, so
  // chunk 2 i + m / 2 lies in span 2 i / 8, and with the lane's chunk-(m / 2) offset below,
  // at that offset XOR ((2 i % 8) << 4) (bits 5-6 only).
  // The lane's row and matrix are spelled in quad_row (lane / 4) and quad_col (2 (lane % 4)),
  // which the consumers hold anyway: from lane / 8 and lane % 8, three consumers spill.
  // Opaque, so that the kDTiles / 2 addresses are formed here and not hoisted out of the tile
  // loop, where they would hold registers through it (which spills with 160-key tiles).
  {
    const int row =
        th.warp * 16 + 8 * ((th.quad_row >> 1) & 1) + 4 * (th.quad_row & 1) + th.quad_col / 2;
    const uint32_t row_offset =
        ptx::opaque(uint32_t(row * kRowBytes + (((th.quad_row >> 2) ^ (row & 7)) << 4)));
#pragma unroll
    for (int i = 0; i < kDTiles / 2; ++i) {
      const int d = 2 * i;
      ptx::stmatrix_x4(o_tile + (d / 8) * kOSpanBytes + (row_offset ^ ((d % 8) << 4)),
                       ptx::pack2<Elem>(o_acc[0][d][0], o_acc[0][d][1]),
                       ptx::pack2<Elem>(o_acc[0][d][2], o_acc[0][d][3]),
                       ptx::pack2<Elem>(o_acc[0][d + 1][0], o_acc[0][d + 1][1]),
                       ptx::pack2<Elem>(o_acc[0][d + 1][2], o_acc[0][d + 1][3]));
    }
  }
  // lse after O: before it, three consumers spill (docs/decisions/hopper-forward-epilogue.md).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int block_row = th.warp_row0 + th.quad_row + 8 * h;
    if (th.lane % 4 == 0 && row0 + block_row < p.seqlen_q) lse[row0 + block_row] = row_lse[0][h];
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(1 + th.consumer, 128);
  // Warp 0 of the warpgroup stores: its first row (warp_row0) is the warpgroup's, and
  // wg_row0 kept for this spills with 160-key tiles
  // (docs/decisions/hopper-kernels-without-spills.md).
  if (th.tid % 128 == 0) {
#pragma unroll
    for (int span = 0; span < kSpans; ++span)
      ptx::tma_store_4d(&maps.out, o_tile + span * kOSpanBytes, span * kSpanElems, n,
                        row0 + th.warp_row0, b);
    ptx::bulk_commit_group();
  }
}

}  // namespace jax_flashattn::wgmma
