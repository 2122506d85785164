// The Hopper forward's producer: one thread of warpgroup 0 claims the block's tiles, hands each,
// decoded, to the consumers through the tile slot, and issues every TMA load: per tile Q into a
// ring of kQStages buffers and K_j, V_j into a ring of kStages buffers (WithAlibi: the key tiles
// in AlibiTileOrder's order). A load goes into the next buffer of its ring once every consumer
// warp has released it (the empty barrier); its full barrier counts the bytes in. Tiles without
// keys take no buffer (the consumers write their zeros and -inf lse).
//
// Tile k goes into the slot once every consumer thread has read tile k - 1's. While the
// consumers compute tile k the producer issues the rest of tile k's loads, claims tile k + 1
// (with one Q buffer, when it has issued them: the counter then hands out tiles in the order
// blocks near the end of theirs; docs/decisions/hopper-forward-persistent-tile-schedule.md),
// publishes it and issues its first loads, which wait only for buffers that tile k releases. No
// consumer waits for another between tiles: a warpgroup that finishes tile k first starts tile
// k + 1 while the others finish tile k, and the ping-pong turns run on across the tile boundary.
// With two Q buffers (kQAhead) the producer claims tile k + 1 and issues its Q before the rest of
// tile k's loads, which wait for buffers that tile k releases: Q then lands a whole tile ahead
// instead of under tile k's last key tiles. Its buffer held the Q two loads back (tile k - 1's
// where tiles k - 1 and k have keys), released at that tile's last S = Q K^T, which needs nothing
// the producer has yet to issue. The claim moves a tile earlier with it, so a block may hold its
// next tile while it finishes a long causal one; the earlier Q is worth that, most at short T
// (why, with measurements: docs/decisions/next-q-a-tile-ahead.md). (With one Q buffer, Q k + 1
// would wait for tile k's last S, which needs tile k's loads.)
#pragma once

#include <cstdint>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/id_box.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/cuda/wgmma/alibi_tile_order.cuh"
#include "ffi/cuda/wgmma/forward_pipeline.cuh"
#include "ffi/cuda/wgmma/tile_scheduler.cuh"
#include "ffi/cuda/wgmma/traits.h"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

template <typename Traits>
struct ForwardProducer {
  static constexpr int kBlockN = Traits::kBlockN, kStages = Traits::kStages;
  static constexpr int kQStages = Traits::kQStages, kSpans = Traits::kSpans;
  static constexpr int kSpanElems = Traits::kSpanElems;
  static constexpr bool kQAhead = kQStages == 2;

  const AttentionParams& p;
  const ForwardMapsFor<Traits::kSegments>& maps;
  const ForwardSmem<Traits> smem;
  ForwardBarriers<Traits>& bars;
  // The tile slot by 32-bit shared address (as the consumers hold it:
  // ForwardConsumer::tile_slot).
  const uint32_t tile_slot;
  // Calls with segment ids take their tiles in the call's tile order (tile_order.cuh).
  using Scheduler =
      TileScheduler<Traits::kBlockM, kBlockN, kNarrowsToSpans<Traits>, Traits::kSegments>;
  // Made by the producer thread, not once for the block: a value live across the register
  // split spills within the producer's 24 registers (the default budget;
  // docs/decisions/hopper-kernels-without-spills.md).
  const Scheduler scheduler;
  RingPosition<kQStages> q_ring;
  RingPosition<kStages> kv_ring;
  int index;          // the current tile's index
  ForwardTile t;      // the current tile, made once when it is claimed
  ForwardTile next;   // kQAhead: tile k + 1, made when claimed, its Q issued
  bool o_owed;        // kOInKV: tile k - 1 had keys, so its O takes a ring position

  __device__ __forceinline__ ForwardProducer(const AttentionParams& params,
                                             const ForwardMapsFor<Traits::kSegments>& tma_maps,
                                             const ForwardSmem<Traits>& layout,
                                             ForwardBarriers<Traits>& barriers)
      : p(params), maps(tma_maps), smem(layout), bars(barriers),
        tile_slot(ptx::smem_address(barriers.tile)),
        scheduler(Scheduler::make(params)),
        index(int(blockIdx.x)), o_owed(false) {}

  __device__ __forceinline__ void load_q(const ForwardTile& tile) {
    const int q_stage = q_ring.stage();
    if (q_ring.refill())
      ptx::mbarrier_wait(barrier_address(bars.q_empty[q_stage]), q_ring.previous_phase());
    ++q_ring.count;
    ptx::mbarrier_arrive_expect_tx(barrier_address(bars.q_full[q_stage]), Traits::kQBytes);
    for (int span = 0; span < kSpans; ++span)
      ptx::tma_load_4d(smem.q(q_stage) + span * Traits::kBlockM * kRowBytes, &maps.q,
                       barrier_address(bars.q_full[q_stage]), span * kSpanElems, tile.n, tile.row0,
                       tile.b);
  }

  // The current tile's key tiles visited j-th for j in [j_begin, min(j_end, num_kv_tiles)):
  // tile j, or (kAlibi) the one AlibiTileOrder visits j-th.
  __device__ __forceinline__ void load_kv(int j_begin, int j_end) {
    [[maybe_unused]] AlibiTileOrder<kBlockN> order{};
    if constexpr (Traits::kAlibi) order = AlibiTileOrder<kBlockN>::make(p, t);
    for (int j = j_begin; j < j_end && j < t.num_kv_tiles; ++j, ++kv_ring.count) {
      const int stage = kv_ring.stage();
      int key_tile = j;
      if constexpr (Traits::kAlibi) key_tile = order.key_tile(j);
      const int key0 = (t.tile_begin + key_tile) * kBlockN;
      if (kv_ring.refill())
        ptx::mbarrier_wait(barrier_address(bars.k_empty[stage]), kv_ring.previous_phase());
      ptx::mbarrier_arrive_expect_tx(barrier_address(bars.k_full[stage]),
                                     Traits::kKVBytes + Traits::KeyIdBox::kBytes);
      for (int span = 0; span < kSpans; ++span)
        ptx::tma_load_4d(smem.k(stage) + span * kBlockN * kRowBytes, &maps.k,
                         barrier_address(bars.k_full[stage]), span * kSpanElems, t.kv_head, key0,
                         t.b);
      if constexpr (Traits::kSegments)
        ptx::tma_load_1d(smem.key_ids(stage), &maps.kv_ids, barrier_address(bars.k_full[stage]),
                         cuda::id_box_start(t.b, int(p.seqlen_k), key0));
      if (kv_ring.refill())
        ptx::mbarrier_wait(barrier_address(bars.v_empty[stage]), kv_ring.previous_phase());
      ptx::mbarrier_arrive_expect_tx(barrier_address(bars.v_full[stage]), Traits::kKVBytes);
      if constexpr (Traits::kE4m3) {
        // V^T [batch, K, H, vt_keys]: the tile's kBlockN keys of every head-dim row, K-major
        // for O += P V, a span of kVtBoxKeys keys (as many bytes) per box.
        constexpr int kBoxKeys = Traits::kVtBoxKeys;
        for (int span = 0; span < kBlockN / kBoxKeys; ++span)
          ptx::tma_load_4d(smem.v(stage) + span * Traits::kHeadDim * kBoxKeys, &maps.v,
                           barrier_address(bars.v_full[stage]), key0 + span * kBoxKeys, 0,
                           t.kv_head, t.b);
      } else {
        for (int span = 0; span < kSpans; ++span)
          ptx::tma_load_4d(smem.v(stage) + span * kBlockN * kRowBytes, &maps.v,
                           barrier_address(bars.v_full[stage]), span * kSpanElems, t.kv_head,
                           key0, t.b);
      }
    }
  }

  // kOInKV: the ring position after a tile's key tiles is lent to the consumers for O once
  // they have released it; full barriers completed without a load say that it is theirs
  // (both, so that the stage's K and V phases stay in step;
  // docs/decisions/o-staged-in-kv-ring-at-head-dim-256.md).
  __device__ __forceinline__ void lend_for_o() {
    const int stage = kv_ring.stage();
    if (kv_ring.refill()) {
      ptx::mbarrier_wait(barrier_address(bars.k_empty[stage]), kv_ring.previous_phase());
      ptx::mbarrier_wait(barrier_address(bars.v_empty[stage]), kv_ring.previous_phase());
    }
    ptx::mbarrier_arrive(barrier_address(bars.k_full[stage]));
    ptx::mbarrier_arrive(barrier_address(bars.v_full[stage]));
    ++kv_ring.count;
  }

  // Hands out tile k, the one at `index`: made (kQAhead, k > 0: made and its Q issued at the
  // claim), published once the consumers have read tile k - 1, (kOInKV) tile k - 1's O position
  // lent, and its Q (unless issued at the claim) and first kStages K/V tiles issued; past the
  // last tile, the end is published. The lending waits for tile k - 1's buffers, so it comes
  // after the publication, which the consumers read under tile k - 1's last O += P V. Q goes
  // first, as the first product needs it as soon as K_0: with one Q buffer it waits for tile
  // k - 1's last S, but V_0 (and, from the second K/V tile on, K) wait for buffers
  // released under or after the last O += P V (docs/decisions/next-q-a-tile-ahead.md).
  __device__ __forceinline__ void hand_out(int k) {
    const bool more = index < scheduler.num_tiles, claimed_ahead = kQAhead && k > 0;
    if (more) t = claimed_ahead ? next : scheduler.tile(p, index);
    if (k > 0) ptx::mbarrier_wait(barrier_address(bars.tile_empty), uint32_t(k - 1) & 1);
    if (more)
      TileSlot::store(tile_slot, t);
    else
      TileSlot::store_end(tile_slot);
    ptx::mbarrier_arrive(barrier_address(bars.tile_full));
    if constexpr (Traits::kOInKV) {
      if (o_owed) lend_for_o();
      o_owed = more && t.num_kv_tiles > 0;
    }
    if (!more || t.num_kv_tiles == 0) return;
    if (!claimed_ahead) load_q(t);
    load_kv(0, kStages);
  }

  __device__ __forceinline__ void claim() {
    index = int(gridDim.x) + atomicAdd(p.tile_counter, 1);
  }

  __device__ __forceinline__ void run() {
    hand_out(0);
    for (int k = 0; index < scheduler.num_tiles; ++k) {
      if constexpr (kQAhead) {
        claim();
        if (index < scheduler.num_tiles) {
          next = scheduler.tile(p, index);
          if (next.num_kv_tiles > 0) load_q(next);
        }
      }
      load_kv(kStages, t.num_kv_tiles);
      if constexpr (!kQAhead) claim();
      hand_out(k + 1);
    }
  }
};

}  // namespace jax_flashattn::wgmma
