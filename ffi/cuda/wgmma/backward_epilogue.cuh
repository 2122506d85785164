// The Hopper backward's epilogue: a block's dK and dV staged in shared memory and written with
// TMA stores.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// The consumer thread's coordinates the epilogue needs: its thread index and consumer
// warpgroup, the warpgroup's and the warp's first key of the block, the mma accumulator
// coordinates quad_row = lane / 4 and quad_col = 2 (lane % 4), and the warpgroup's first span
// of dK / dV columns.
struct BackwardEpilogueThread {
  int tid, consumer, wg_key0, warp_key0, quad_row, quad_col, dkv_span0;
};

// The backward's named barriers (0 is __syncthreads): kConsumers for both consumers (dS^T
// published; the epilogue's K and V free), kWarpgroup + c for consumer c alone.
struct BackwardNamedBarriers {
  static constexpr int kConsumers = 1, kWarpgroup = 2;
};

// Epilogue: once both consumers' last dQ has read K, dK = scale dS^T Q and dV (keys no query
// sees, and keys past the length, hold zeros) are staged as Elem in this warpgroup's rows and
// head-dim spans of the K and V tiles, in the swizzled layout the TMA store reads; one thread
// stores each span. sK and sV: the K and V tiles' shared addresses, free once both consumers
// have passed the first barrier below.
// kDkvCols: the warpgroup's dK / dV columns.
template <typename Elem, typename Traits, int kDkvCols, typename Block>
__device__ __forceinline__ void store_dk_dv(const AttentionParams& p, const BackwardMaps& maps,
                                            const Block& block,
                                            float (&dk_acc)[kDkvCols / 8][4],
                                            float (&dv_acc)[kDkvCols / 8][4],
                                            uint32_t sK, uint32_t sV,
                                            const BackwardEpilogueThread& th) {
  constexpr int kBlockN = Traits::kBlockN, kDTiles = kDkvCols / 8;
  // This warpgroup's spans, the last one half used at head dim 96 (the map clips the rest).
  constexpr int kSpans = (kDkvCols + Traits::kSpanElems - 1) / Traits::kSpanElems;
  constexpr int kSpanElems = Traits::kSpanElems;
  const int span0 = th.dkv_span0;
  ptx::named_barrier_sync(BackwardNamedBarriers::kConsumers, 128 * Traits::kConsumers);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = th.warp_key0 + th.quad_row + 8 * h;
    const uint32_t row_offset = (row * kRowBytes + ((row & 7) << 4)) | (th.quad_col * 2);
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) {
      const uint32_t offset =
          (span0 + d / 8) * kBlockN * kRowBytes + (row_offset ^ ((d % 8) << 4));
      ptx::st_shared_b32(sK + offset, ptx::pack2<Elem>(p.scale * dk_acc[d][2 * h],
                                                       p.scale * dk_acc[d][2 * h + 1]));
      ptx::st_shared_b32(sV + offset, ptx::pack2<Elem>(dv_acc[d][2 * h], dv_acc[d][2 * h + 1]));
    }
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(BackwardNamedBarriers::kWarpgroup + th.consumer, 128);
  if (th.tid % 128 == 0 && block.key0 + th.wg_key0 < p.seqlen_k) {
    for (int span = span0; span < span0 + kSpans; ++span) {
      const uint32_t offset = span * kBlockN * kRowBytes + th.wg_key0 * kRowBytes;
      ptx::tma_store_4d(&maps.dk, sK + offset, span * kSpanElems, block.kv_head,
                        block.key0 + th.wg_key0, block.b);
      ptx::tma_store_4d(&maps.dv, sV + offset, span * kSpanElems, block.kv_head,
                        block.key0 + th.wg_key0, block.b);
    }
    ptx::bulk_commit_group();
    ptx::bulk_wait_group_read_all();  // shared memory must outlive the stores' reads
  }
}

}  // namespace jax_flashattn::wgmma
