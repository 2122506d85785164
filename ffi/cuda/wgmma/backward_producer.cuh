// The Hopper backward's producer: one thread of warpgroup 0 issues every TMA load of a block. K
// and V once; then per step (query head of the GQA group, query tile that can see the block's
// keys: BackwardBlock) the Q and dO tiles with the tile's lse and D (and, with segment ids, its
// query ids) into a ring of kStages buffers, each guarded by a full barrier (the loads landed)
// and an empty barrier (every consumer warp is done with them). With a staged bias or mask
// (BackwardWithStagedTerm) warp 2 copies each step's tile of it into the same stage by
// cp.async (copy_terms), its lanes' completions more arrivals on the full barrier.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/id_box.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/cuda/wgmma/backward_pipeline.cuh"
#include "ffi/cuda/wgmma/backward_term_tile.cuh"
#include "ffi/cuda/wgmma/staged_term.h"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

template <typename Traits>
struct BackwardProducer {
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  static constexpr int kStages = Traits::kStages, kSpans = Traits::kSpans;
  static constexpr int kSpanElems = Traits::kSpanElems;
  using Barriers = BackwardBarriers<Traits>;
  using Layout = BackwardSmemLayout<Traits>;

  const AttentionParams& p;
  const BackwardMapsFor<Traits::kSegments>& maps;
  const BackwardSmem<Traits>& smem;
  const BackwardBlock<Traits>& block;

  // The barriers are formed from the layout's offset where they are used: held as a member, or
  // returned by a function, their addresses share one base and ptxas schedules the step loop
  // differently (compare_sass).

  // K and V of the block, once.
  __device__ __forceinline__ void load_kv() {
    auto& bars = *reinterpret_cast<Barriers*>(smem.start + Layout::kBarrierOffset);
    ptx::mbarrier_arrive_expect_tx(ptx::barrier_address(bars.kv_full), 2 * Traits::kKVBytes);
    for (int span = 0; span < kSpans; ++span) {
      ptx::tma_load_4d(smem.k() + span * kBlockN * kRowBytes, &maps.k,
                       ptx::barrier_address(bars.kv_full), span * kSpanElems, block.kv_head,
                       block.key0, block.b);
      ptx::tma_load_4d(smem.v() + span * kBlockN * kRowBytes, &maps.v,
                       ptx::barrier_address(bars.kv_full), span * kSpanElems, block.kv_head,
                       block.key0, block.b);
    }
  }

  // Q, dO, lse and D (and the query ids) of query tile `tile` of head n into the stage of step
  // `step`, once the consumers have released it (from the ring's second round on).
  __device__ __forceinline__ void load_step(int step, int n, int tile) {
    const int stage = step % kStages;
    auto& bars = *reinterpret_cast<Barriers*>(smem.start + Layout::kBarrierOffset);
    if (step >= kStages)
      ptx::mbarrier_wait(ptx::barrier_address(bars.q_empty[stage]), step_phase<kStages>(step) ^ 1);
    const uint32_t full = ptx::barrier_address(bars.q_full[stage]);
    ptx::mbarrier_arrive_expect_tx(full, 2 * Traits::kQBytes +
                                             2 * Traits::kStatsBox * sizeof(float) +
                                             Traits::QIdBox::kBytes);
    for (int span = 0; span < kSpans; ++span) {
      ptx::tma_load_4d(smem.q(stage) + span * kBlockM * kRowBytes, &maps.q, full,
                       span * kSpanElems, n, tile * kBlockM, block.b);
      ptx::tma_load_4d(smem.d_out(stage) + span * kBlockM * kRowBytes, &maps.d_out, full,
                       span * kSpanElems, n, tile * kBlockM, block.b);
    }
    const int box0 = block.stats_row(p, n, tile * kBlockM) & -kFlatAlignElems;
    ptx::tma_load_1d(smem.stats(stage), &maps.lse, full, box0);
    ptx::tma_load_1d(smem.stats(stage) + Traits::kStatsStride * sizeof(float), &maps.delta,
                     full, box0);
    if constexpr (Traits::kSegments)
      ptx::tma_load_1d(smem.q_ids(stage), &maps.q_ids, full,
                       cuda::id_box_start(block.b, int(p.seqlen_q), tile * kBlockM));
  }

  // kStagedTerm: each step's tile of the staged bias or mask into its stage, by this warp's
  // cp.async (BackwardTermTile), once the consumers have released the stage; each lane's
  // arrival on the stage's full barrier comes when its copies have landed (the barrier
  // counts them: kQFullArrivals).
  template <int kBytes>
  __device__ __forceinline__ void copy_terms(const void* base, const BroadcastStrides& st,
                                             int lane) {
    using Tile = BackwardTermTile<Traits, kBytes>;
    auto& bars = *reinterpret_cast<Barriers*>(smem.start + Layout::kBarrierOffset);
    for (int step = 0; step < block.steps; ++step) {
      const int stage = step % kStages;
      if (step >= kStages)
        ptx::mbarrier_wait(ptx::barrier_address(bars.q_empty[stage]),
                           step_phase<kStages>(step) ^ 1);
      // The step's head and tile worked out afresh (BackwardBlock's order), not carried.
      const int n = block.head0 + step / block.tiles;
      const int q0 = (block.tile_begin + step % block.tiles) * kBlockM;
      Tile::copy(p, base, st, block.b, n, q0, block.key0, smem.term(stage), lane);
      ptx::cp_async_mbarrier_arrive_noinc(ptx::barrier_address(bars.q_full[stage]));
    }
    // The warp leaves no copy in flight behind it.
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
  }
  __device__ __forceinline__ void copy_terms(int lane) {
    if (staged_term(p) == StagedTerm::kMask) return copy_terms<1>(p.mask, p.mask_strides, lane);
    copy_terms<2>(p.bias, p.bias_strides, lane);
  }

  // The steps heads outermost, in the consumers' order (BackwardBlock). (tile declared before
  // n: the other order swaps the two selects of the head change, and the schedule with them.)
  __device__ __forceinline__ void run() {
    if (block.steps > 0) load_kv();
    int tile = block.tile_begin, n = block.head0;
    for (int step = 0; step < block.steps; ++step) {
      load_step(step, n, tile);
      if (++tile == block.tile_begin + block.tiles) tile = block.tile_begin, ++n;
    }
  }
};

}  // namespace jax_flashattn::wgmma
