// The Hopper backward consumers' coordinates, and how a consumer adds a step's dQ into the float32
// accumulator that every key block adds to: staged in shared memory and added by TMA reductions
// (head dims up to 192), or by red.global.add from each thread (256); in deterministic mode
// in the tile's turn (backward_dq_writer.cuh). Used by backward_consumer.cuh.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/wgmma/backward_epilogue.cuh"  // BackwardNamedBarriers
#include "ffi/cuda/wgmma/backward_pipeline.cuh"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// A consumer thread's coordinates, fixed for the block: its thread index, consumer warpgroup,
// warp of four and lane; the warpgroup's and the warp's first key of the block (the warp's 16
// keys are its accumulator rows); the mma accumulator coordinates quad_row = lane / 4 and
// quad_col = 2 (lane % 4); the warpgroup's dQ (its first query of the tile and its first
// column) and its first span of dK / dV columns (the head dim split between consumers).
struct BackwardConsumerThread {
  int tid, consumer, warp, lane;
  int wg_key0, warp_key0;
  int quad_row, quad_col;
  int dq_row0, dq_col0, dkv_span0;
};

// A step as the consumers take it: its index, query head n and first query q0 (of the query
// tile), its ring stage and dS^T buffer, and its lse and D in the stage.
struct BackwardStep {
  int step, n, q0;
  int stage, ds_buffer;
  const float* lse;
  const float* delta;
};

// One arrival per warp: __syncwarp orders every lane's accesses (its reads of a Q/dO stage,
// its dQ stores or additions) before lane 0's arrival.
__device__ __forceinline__ void release_by_warp(const BackwardConsumerThread& th,
                                                uint32_t barrier) {
  __syncwarp();
  if (th.lane == 0) ptx::mbarrier_arrive(barrier);
}

// kDqCols: the consumer's dQ columns (Traits::kDqCols, or the last consumer's with an uneven
// head dim split).
template <typename Traits, int kDqCols>
struct BackwardDqAdd {
  static constexpr int kDqTiles = kDqCols / 8;  // 8-wide column tiles of dQ
  static constexpr int kWarpgroupBarrier = BackwardNamedBarriers::kWarpgroup;
  using Thread = BackwardConsumerThread;

  const AttentionParams& p;
  const BackwardMapsFor<Traits::kSegments>& maps;
  const BackwardSmem<Traits>& smem;
  const BackwardBlock<Traits>& block;

  // kDqStaged: dQ into this warpgroup's staging tile, then one TMA reduction per 32-column box
  // adds it into dq_accum (clipping rows past T and columns past H; rows past a query length
  // have dS = 0). This thread's rows 16 warp + quad_row + 8 h, columns 8 j + quad_col, +1 of
  // the warpgroup's: column c of row r is word c % 4 of 16-byte chunk (c % 32) / 4 of the
  // row's 128 bytes in box c / 32, the chunk index XORed with r % 8 (the 128-byte swizzle of
  // the map's boxes). Chunk 2 (j % 4) + quad_col / 4 is (j % 4) << 1 XOR quad_col / 4. Rows r
  // and r ^ 1 of a half-warp would write the same banks: threads of odd rows store tile j ^ 2
  // where the others store tile j (chunk bits XOR 2 << 5), which spreads the half-warp over
  // all 32. In deterministic mode the dQ writer issues the reduction, once the reductions of
  // the step before have read the tile (dq_free).
  __device__ __forceinline__ void add_dq_staged(const Thread& th, const BackwardStep& s,
                                                const float (&dq_acc)[kDqTiles][4]) const {
    static_assert(kDqTiles % 4 == 0, "tiles j and j ^ 2 lie in one box");
    const bool odd_row = th.quad_row & 1;
    if constexpr (Traits::kDeterministic)
      if (s.step > 0) ptx::mbarrier_wait(smem.dq_free(th.consumer), uint32_t(s.step - 1) & 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = th.warp * 16 + th.quad_row + 8 * h;
      const uint32_t row_offset =
          ((row * kRowBytes + (((row & 7) ^ (th.quad_col / 4)) << 4)) |
           ((th.quad_col % 4) * 4)) ^
          (odd_row ? 2u << 5 : 0u);
#pragma unroll
      for (int j = 0; j < kDqTiles; ++j) {
        const uint32_t offset =
            (j / 4) * Traits::kDqRows * kRowBytes + (row_offset ^ ((j % 4) << 5));
        const float x0 = odd_row ? dq_acc[j ^ 2][2 * h] : dq_acc[j][2 * h];
        const float x1 = odd_row ? dq_acc[j ^ 2][2 * h + 1] : dq_acc[j][2 * h + 1];
        ptx::st_shared_v2_f32(smem.dq(th.consumer) + offset, x0, x1);
      }
    }
    // Generic stores that the TMA reduction (async proxy) reads.
    ptx::fence_proxy_async_shared();
    if constexpr (Traits::kDeterministic) {
      release_by_warp(th, smem.dq_done(th.consumer));
    } else {
      ptx::named_barrier_sync(kWarpgroupBarrier + th.consumer, 128);
      if (th.tid % 128 == 0) {
        for (int box = 0; box < kDqCols / Traits::kDqBoxCols; ++box)
          ptx::tma_reduce_add_4d(&maps.dq_accum,
                                 smem.dq(th.consumer) + box * Traits::kDqRows * kRowBytes,
                                 th.dq_col0 + box * Traits::kDqBoxCols, s.n, s.q0 + th.dq_row0,
                                 block.b);
        ptx::bulk_commit_group();
      }
    }
  }

  // Not kDqStaged: this thread's dQ rows q0 + dq_row0 + 16 warp + quad_row + 8 h, columns
  // dq_col0 + 8 j + quad_col, +1, added with red.global.add: rows past the query length have
  // dS = 0 and columns past H do not exist, so neither is added. In deterministic mode once the
  // dQ writer has said that the tile's turn has come (dq_free); each warp then says it is done
  // (dq_done), and the writer's release at GPU scope, which follows that arrival, publishes the
  // adds with it (a release is cumulative).
  __device__ __forceinline__ void add_dq_atomic(const Thread& th, const BackwardStep& s,
                                                const float (&dq_acc)[kDqTiles][4]) const {
    if constexpr (Traits::kDeterministic)
      ptx::mbarrier_wait(smem.dq_free(th.consumer), uint32_t(s.step) & 1);
    const int t0 = s.q0 + th.dq_row0 + th.warp * 16 + th.quad_row;
    const int col0 = th.dq_col0 + th.quad_col;
    float* dq = p.dq_accum + int64_t(block.b) * p.q_batch_stride + s.n * p.q_head_stride +
                t0 * p.q_row_stride + col0;
    const int64_t rows = block_visibility(p, block.b).q_len - t0;
    const int cols = int(p.head_dim) - col0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (8 * h >= rows) continue;
#pragma unroll
      for (int j = 0; j < kDqTiles; ++j)
        if (8 * j < cols)
          ptx::red_add_v2_f32(dq + 8 * h * p.q_row_stride + 8 * j, dq_acc[j][2 * h],
                              dq_acc[j][2 * h + 1]);
    }
    if constexpr (Traits::kDeterministic) release_by_warp(th, smem.dq_done(th.consumer));
  }

  __device__ __forceinline__ void add(const Thread& th, const BackwardStep& s,
                                         const float (&dq_acc)[kDqTiles][4]) const {
    if constexpr (Traits::kDqStaged)
      add_dq_staged(th, s, dq_acc);
    else
      add_dq_atomic(th, s, dq_acc);
  }
};

}  // namespace jax_flashattn::wgmma
