// The dQ writer of the Hopper backward's deterministic mode (BackwardDeterministic in
// backward_traits.h): one thread of the producer warpgroup's second warp that adds the block's
// dQ of each step into dq_accum in the tile's turn, so that every element of dq_accum receives
// its key blocks' additions in the same order on every run.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/cuda/wgmma/backward_pipeline.cuh"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// `bars`: the DqWriterBarriers' shared address. Per step (query head n, query tile), in the
// consumers' order:
//   1. wait until the tile's semaphore counts kConsumers arrivals of every key block before
//      this one (dq_turn): an acquire load, so their additions are visible and come first;
//   2. with dQ staged (`staging`: consumer c's tile at staging + c * kDqBytes), per consumer
//      wait for its warps to have staged (dq_done), issue one TMA reduction per 32-column box
//      (clipping rows past T and columns past H), and hand the tile back once the reductions
//      have read it (dq_free), then wait until they are complete (their writes performed);
//      without staging, let the consumers' red.global.add through (dq_free) and wait for each
//      warp to have added (dq_done);
//   3. count the block's kConsumers arrivals with a release add: cumulative, it publishes every
//      addition this thread has observed, the consumers' through their dq_done arrivals too.
// The TMA reductions run in the async proxy: a proxy fence orders them after the acquire and
// before the release. The consumers meanwhile compute the next step; they wait only for dq_free.
template <typename Traits, typename Maps>
__device__ __forceinline__ void write_dq_in_order(const AttentionParams& p, const Maps& maps,
                                                  const BackwardBlock<Traits>& block,
                                                  uint32_t bars, uint32_t staging) {
  constexpr int kBlockM = Traits::kBlockM, kConsumers = Traits::kConsumers;
  static_assert(kConsumers == 2, "one reduction group in flight past the first's read");
  static_assert(!Traits::kUnevenSplit, "every consumer's dQ columns as the first's");
  using Bars = DqWriterBarriers;
  // 32-bit indices: the launch checks indices_fit_32_bits, which bounds B N (T / 64 + 1).
  const int tiles_per_head = int((p.seqlen_q + kBlockM - 1) / kBlockM);
  const auto window = variant::KeyWindow<int>::make(p, block.b);
  int n = block.head0, tile = block.tile_begin;
  for (int step = 0; step < block.steps; ++step) {
    int32_t* semaphore =
        p.dq_semaphores + (block.b * int(p.num_heads) + n) * tiles_per_head + tile;
    const int32_t before = kConsumers * dq_turn<Traits>(p, window, block.key0, tile);
    while (ptx::ld_acquire_gpu(semaphore) < before) {
    }
    const uint32_t parity = uint32_t(step) & 1;
    if constexpr (Traits::kDqStaged) {
      ptx::fence_proxy_async_global();
#pragma unroll
      for (int c = 0; c < kConsumers; ++c) {
        const int dq_row0 = Traits::kDqSplitRows ? c * Traits::kDqRows : 0;
        const int dq_col0 = Traits::kDqSplitRows ? 0 : c * Traits::kDqCols;
        ptx::mbarrier_wait(Bars::done_at(bars, c), parity);
        for (int box = 0; box < Traits::kDqBoxes; ++box)
          ptx::tma_reduce_add_4d(&maps.dq_accum,
                                 staging + c * Traits::kDqBytes + box * Traits::kDqRows * kRowBytes,
                                 dq_col0 + box * Traits::kDqBoxCols, n,
                                 tile * kBlockM + dq_row0, block.b);
        ptx::bulk_commit_group();
      }
      ptx::bulk_wait_group_read<1>();
      ptx::mbarrier_arrive(Bars::free_at(bars, 0));
      ptx::bulk_wait_group_read<0>();
      ptx::mbarrier_arrive(Bars::free_at(bars, 1));
      ptx::bulk_wait_group_all();
      ptx::fence_proxy_async_global();
    } else {
#pragma unroll
      for (int c = 0; c < kConsumers; ++c) ptx::mbarrier_arrive(Bars::free_at(bars, c));
#pragma unroll
      for (int c = 0; c < kConsumers; ++c) ptx::mbarrier_wait(Bars::done_at(bars, c), parity);
    }
    ptx::red_release_gpu_add(semaphore, kConsumers);
    if (++tile == block.tile_begin + block.tiles) tile = block.tile_begin, ++n;
  }
}

}  // namespace jax_flashattn::wgmma
