// FlashAttention forward for Hopper (sm_90a): TMA loads, wgmma, warp specialisation.
//
// Persistent: one block per SM walks the (kBlockM-row query block, head, batch) tiles of
// TileScheduler, claiming each next tile from a global counter when it is ready for one, so
// that blocks that drew short (causal) tiles take more of them. Warpgroup 0 is the producer:
// one thread claims the tiles and issues every TMA load, per tile Q and then K_j, V_j into a
// ring of kStages buffers, each guarded by a full barrier (the load landed) and an empty
// barrier (every consumer warp is done with it); Q has its own ring of kQStages. Once it has
// issued the current tile's loads, the producer claims the next tile, hands it, decoded, to the
// consumers through a shared-memory slot guarded by a full and an empty mbarrier, and issues
// its Q and first K/V tiles (with two Q buffers it claims the next tile, and issues its Q,
// before the current tile's loads that wait for buffers). The consumers do not meet between
// tiles: the one that finishes first starts the next tile while the others finish theirs.
// Warpgroups 1.. are consumers of 64 query rows each; per K/V tile j they compute
//   S_j = Q K_j^T              wgmma, both operands in shared memory
//   mask                       only on tiles that straddle a length or window boundary
//   P_j = exp2(S_j - max)      online softmax, the scale folded into one FFMA; once a warp's
//                              row maxima have settled, against those maxima (no max
//                              reduction, no rescale) unless a score outran them too far
//   O += P_j V_j               wgmma, P from registers
// with the products of two tiles in flight together: S_{j+1} = Q K_{j+1}^T is issued before
// O += P_j V_j, and the softmax of S_{j+1} runs while P_j V_j is still computing; only the
// rescaling of O waits for it. The consumer warpgroups (two, or three at head dim 64) take
// turns issuing their products (ping-pong on named barriers, round robin), so one's softmax
// runs under the others' tensor-core work. O is normalised once and kept in registers until
// the consumer has issued its next tile's first S = Q K^T (which it reads from the slot under
// its last O += P V); then, under that product, staged in shared memory and written with a TMA
// store (which clips rows past T) that runs on; at head dim 256, right after the tile, in a
// K/V stage that the ring lends for it after the tile's key tiles. A warpgroup whose 64 rows
// all lie past the query length computes nothing: it takes its turns and releases its buffers
// so that the others finish the tile without it. In the same way, a warpgroup skips the
// block's last key tile where none of its rows sees a key of it (the lower warpgroups of a
// causal query block, where the block's lower rows see a tile further), and multiplies only
// the first half of a last tile whose second half none of its rows sees by V.
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/fragments.cuh"
#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/mask.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/softmax.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/cuda/wgmma/forward_epilogue.cuh"
#include "ffi/cuda/wgmma/forward_mma.cuh"
#include "ffi/cuda/wgmma/forward_pipeline.cuh"
#include "ffi/cuda/wgmma/forward_tiles.cuh"
#include "ffi/cuda/wgmma/tile_scheduler.cuh"
#include "ffi/cuda/wgmma/traits.h"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

template <typename Elem, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    forward_kernel(const __grid_constant__ AttentionParams p,
                   const __grid_constant__ ForwardMapsFor<Traits::kSegments> maps) {
#ifdef JAX_FLASHATTN_SM90_BODY
  static_assert(register_budgets_fit<Traits>(), "setmaxnreg would wait forever");
  static_assert(sizeof(ForwardBarriers<Traits>) <= Traits::kBarrierBytes, "barriers fit");
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages, kHeadDim = Traits::kHeadDim;
  constexpr int kSpans = Traits::kSpans, kSpanElems = Traits::kSpanElems;
  constexpr int kPSteps = kBlockN / 16;   // k16 steps of O += P V
  constexpr int kNTiles = kBlockN / 8;    // 8-key column tiles of S
  constexpr int kDTiles = kHeadDim / 8;   // 8-wide column tiles of O
  static_assert(kBlockN % 32 == 0, "half a key tile is whole k16 steps of O += P V");
  // A warpgroup's tail (the block's key tiles past its own, below) holds at most as many tiles
  // as the (at most kBlockM - 64) block rows below its own shift the last visible key: one
  // here. It releases their buffers only after it has read the next tile from the slot, which
  // the producer fills once it has issued all of this tile's loads; a tail of kStages tiles
  // would hold buffers those loads wait for
  // (docs/decisions/idle-warpgroups-and-warpgroup-tails.md).
  static_assert((kBlockM - 64 + kBlockN - 1) / kBlockN < kStages, "a tail never blocks the loads");

  extern __shared__ unsigned char smem_raw[];
  const auto smem = ForwardSmem<Traits>::make(smem_raw);
  constexpr int kQStages = Traits::kQStages;
  // Formed here from the layout's offset: through a member function of ForwardSmem, ptxas
  // allocated and scheduled the consumer loop differently (the SASS changed).
  auto& bars = *reinterpret_cast<ForwardBarriers<Traits>*>(smem.start +
                                                           ForwardSmem<Traits>::kBarrierOffset);
  const auto bar = [](uint64_t& barrier) { return ptx::smem_address(&barrier); };
  // The tile slot by 32-bit shared address: a generic pointer to it would hold a 64-bit
  // register for the whole kernel, two more than the consumers have at head dim 256
  // (docs/decisions/hopper-kernels-without-spills.md).
  const uint32_t tile_slot = ptx::smem_address(bars.tile);
  using Named = NamedBarriers<Traits::kConsumers>;

  const int tid = threadIdx.x;

  if (tid == 0) {
    for (int s = 0; s < kQStages; ++s) {
      ptx::mbarrier_init(bar(bars.q_full[s]), 1);
      ptx::mbarrier_init(bar(bars.q_empty[s]), Traits::kConsumerWarps);
    }
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(bar(bars.k_full[s]), 1);
      ptx::mbarrier_init(bar(bars.v_full[s]), 1);
      ptx::mbarrier_init(bar(bars.k_empty[s]), Traits::kConsumerWarps);
      ptx::mbarrier_init(bar(bars.v_empty[s]), Traits::kConsumerWarps);
    }
    ptx::mbarrier_init(bar(bars.tile_full), 1);
    ptx::mbarrier_init(bar(bars.tile_empty), 128 * Traits::kConsumers);
    ptx::fence_barrier_init();
  }
  __syncthreads();

  const int warpgroup = tid / 128;
  if (warpgroup == 0) {
    // Producer: one thread claims the tiles, hands them to the consumers through the tile
    // slot and issues Q (kQStages buffers) and K/V (kStages buffers) for every tile with keys.
    ptx::setmaxnreg_dec<Traits::kProducerRegisters>();
    if (tid != 0) return;
    // Made here, not once above: a value live across the split spills within the producer's
    // 24 registers (the default budget; docs/decisions/hopper-kernels-without-spills.md).
    const auto scheduler = TileScheduler<kBlockM, kBlockN, Traits::kSegments>::make(p);
    // Each load goes into the next buffer of its ring once the consumers have released it.
    // Tiles without keys take no buffer (the consumers write their zeros and -inf lse).
    const auto load_q = [&](const ForwardTile& t, RingPosition<kQStages>& q_ring) {
      const int q_stage = q_ring.stage();
      if (q_ring.refill()) ptx::mbarrier_wait(bar(bars.q_empty[q_stage]), q_ring.previous_phase());
      ++q_ring.count;
      ptx::mbarrier_arrive_expect_tx(bar(bars.q_full[q_stage]), Traits::kQBytes);
      for (int span = 0; span < kSpans; ++span)
        ptx::tma_load_4d(smem.q(q_stage) + span * kBlockM * kRowBytes, &maps.q,
                         bar(bars.q_full[q_stage]), span * kSpanElems, t.n, t.row0, t.b);
    };
    // K_j, V_j for j in [j_begin, min(j_end, num_kv_tiles)).
    const auto load_kv = [&](const ForwardTile& t, int j_begin, int j_end,
                             RingPosition<kStages>& kv_ring) {
      for (int j = j_begin; j < j_end && j < t.num_kv_tiles; ++j, ++kv_ring.count) {
        const int stage = kv_ring.stage();
        const int key0 = (t.tile_begin + j) * kBlockN;
        if (kv_ring.refill())
          ptx::mbarrier_wait(bar(bars.k_empty[stage]), kv_ring.previous_phase());
        ptx::mbarrier_arrive_expect_tx(bar(bars.k_full[stage]),
                                       Traits::kKVBytes + Traits::KeyIdBox::kBytes);
        for (int span = 0; span < kSpans; ++span)
          ptx::tma_load_4d(smem.k(stage) + span * kBlockN * kRowBytes, &maps.k,
                           bar(bars.k_full[stage]), span * kSpanElems, t.kv_head, key0, t.b);
        if constexpr (Traits::kSegments)
          ptx::tma_load_1d(smem.key_ids(stage), &maps.kv_ids, bar(bars.k_full[stage]),
                           cuda::id_box_start(t.b, int(p.seqlen_k), key0));
        if (kv_ring.refill())
          ptx::mbarrier_wait(bar(bars.v_empty[stage]), kv_ring.previous_phase());
        ptx::mbarrier_arrive_expect_tx(bar(bars.v_full[stage]), Traits::kKVBytes);
        for (int span = 0; span < kSpans; ++span)
          ptx::tma_load_4d(smem.v(stage) + span * kBlockN * kRowBytes, &maps.v,
                           bar(bars.v_full[stage]), span * kSpanElems, t.kv_head, key0, t.b);
      }
    };
    // A tile's Q (unless q_loaded) and first kStages K/V tiles. Q first, as the first product
    // needs it as soon as K_0: with one Q buffer it waits for the current tile's last S, but
    // V_0 (and, from the second K/V tile on, K) wait for buffers released under or after the
    // last O += P V (docs/decisions/next-q-a-tile-ahead.md).
    const auto load_first = [&](const ForwardTile& t, RingPosition<kQStages>& q_ring,
                                RingPosition<kStages>& kv_ring, bool q_loaded) {
      if (t.num_kv_tiles == 0) return;
      if (!q_loaded) load_q(t, q_ring);
      load_kv(t, 0, kStages, kv_ring);
    };
    // kOInKV: the ring position after a tile's key tiles is lent to the consumers for O once
    // they have released it; full barriers completed without a load say that it is theirs
    // (both, so that the stage's K and V phases stay in step;
    // docs/decisions/o-staged-in-kv-ring-at-head-dim-256.md).
    const auto lend_for_o = [&](RingPosition<kStages>& kv_ring) {
      const int stage = kv_ring.stage();
      if (kv_ring.refill()) {
        ptx::mbarrier_wait(bar(bars.k_empty[stage]), kv_ring.previous_phase());
        ptx::mbarrier_wait(bar(bars.v_empty[stage]), kv_ring.previous_phase());
      }
      ptx::mbarrier_arrive(bar(bars.k_full[stage]));
      ptx::mbarrier_arrive(bar(bars.v_full[stage]));
      ++kv_ring.count;
    };
    // Tile k goes into the slot once every consumer thread has read tile k - 1's. While
    // the consumers compute tile k the producer issues the rest of tile k's loads, claims tile
    // k + 1 (with one Q buffer, when it has issued them: the counter then hands out tiles in
    // the order blocks near the end of theirs;
    // docs/decisions/hopper-forward-persistent-tile-schedule.md), publishes it and issues its
    // first loads, which wait only for buffers that tile k releases. No consumer waits for
    // another between tiles: a warpgroup that finishes tile k first starts tile k + 1 while the
    // others finish tile k, and the ping-pong turns run on across the tile boundary.
    // With two Q buffers (kQAhead) the producer claims tile k + 1 and issues its Q before the
    // rest of tile k's loads, which wait for buffers that tile k releases: Q then lands a whole
    // tile ahead instead of under tile k's last key tiles. Its buffer held the Q two loads
    // back (tile k - 1's where tiles k - 1 and k have keys), released at that tile's last
    // S = Q K^T, which needs nothing the producer has yet to issue. The claim moves a tile
    // earlier with it, so a block may hold its next tile while it finishes a long causal one;
    // the earlier Q is worth that, most at short T (why, with measurements:
    // docs/decisions/next-q-a-tile-ahead.md).
    // (With one Q buffer, Q k + 1 would wait for tile k's last S, which needs tile k's loads.)
    constexpr bool kQAhead = kQStages == 2;
    RingPosition<kQStages> q_ring;
    RingPosition<kStages> kv_ring;
    int index = blockIdx.x;  // the current tile's index
    ForwardTile t;           // the current tile, made once when it is claimed
    ForwardTile next;        // kQAhead: tile k + 1, made when claimed, its Q issued
    bool o_owed = false;     // kOInKV: tile k - 1 had keys, so its O takes a ring position
    // Hands out tile k, the one at `index`: made (kQAhead, k > 0: made and its Q issued at
    // the claim), published once the consumers have read tile k - 1, (kOInKV) tile k - 1's O
    // position lent, and its first loads issued; past the last tile, the end is published.
    // The lending waits for tile k - 1's buffers, so it comes after the publication, which the
    // consumers read under tile k - 1's last O += P V.
    const auto hand_out = [&](int k) {
      const bool more = index < scheduler.num_tiles, claimed_ahead = kQAhead && k > 0;
      if (more) t = claimed_ahead ? next : scheduler.tile(p, index);
      if (k > 0) ptx::mbarrier_wait(bar(bars.tile_empty), uint32_t(k - 1) & 1);
      if (more)
        TileSlot::store(tile_slot, t);
      else
        TileSlot::store_end(tile_slot);
      ptx::mbarrier_arrive(bar(bars.tile_full));
      if constexpr (Traits::kOInKV) {
        if (o_owed) lend_for_o(kv_ring);
        o_owed = more && t.num_kv_tiles > 0;
      }
      if (more) load_first(t, q_ring, kv_ring, claimed_ahead);
    };
    const auto claim = [&] { index = int(gridDim.x) + atomicAdd(p.tile_counter, 1); };
    hand_out(0);
    for (int k = 0; index < scheduler.num_tiles; ++k) {
      if constexpr (kQAhead) {
        claim();
        if (index < scheduler.num_tiles) {
          next = scheduler.tile(p, index);
          if (next.num_kv_tiles > 0) load_q(next, q_ring);
        }
      }
      load_kv(t, kStages, t.num_kv_tiles, kv_ring);
      if constexpr (!kQAhead) claim();
      hand_out(k + 1);
    }
    return;
  }

  // Consumers.
  ptx::setmaxnreg_inc<Traits::kConsumerRegisters>();
  // The consumer index through a warp reduction, whose result ptxas knows to be the same in
  // every lane: the tile loop's branches are then known uniform too, and ptxas keeps the tile
  // counter, the K/V ring and each tile's indices in uniform registers. From tid alone nothing
  // tells ptxas that the warp stays converged through the loop: those take general registers
  // and spill with three consumers (docs/decisions/hopper-forward-tile-hand-over.md).
  const int consumer = __reduce_max_sync(0xffffffff, warpgroup - 1);
  const int warp = (tid / 32) % 4, lane = tid % 32;
  const int wg_row0 = consumer * 64;           // this warpgroup's rows of the block
  const int warp_row0 = wg_row0 + warp * 16;   // this warp's 16 rows (its accumulator rows)
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);

  const auto desc = ForwardDescriptors<Traits>::make(smem);

  float s_acc[1][kNTiles][4];
  float o_acc[1][kDTiles][4];
  uint32_t p_frag[kPSteps][4];
  const float scale_log2 = p.scale * cuda::kLog2e;

  const auto fence_s = [&] { ptx::fence_registers(s_acc[0]); };
  const auto fence_o = [&] { ptx::fence_registers(o_acc[0]); };
  const auto issue_qk = [&](uint32_t q_tile, int stage) {  // S = Q K^T, overwriting S
    issue_scores<Elem, Traits>(s_acc, desc, q_tile, stage);
  };
  // O += P V over the tile's first kKeys keys. The register fences go after the branch
  // between the two widths (issue_pv): with the branch between them and the first wgmma,
  // ptxas injected a warpgroup.arrive of its own.
  const auto pv_keys = [&](auto keys, int stage) {
    issue_values<decltype(keys)::value, Elem, Traits>(o_acc, p_frag, desc, stage);
  };
  // O += P V; over the first half of the tile's keys when `half` (no row of this warpgroup
  // sees the rest, and the rest of P holds unexponentiated scores: see softmax_step). Only a
  // warpgroup's last key tile is taken as seen on its first half alone, and it is multiplied
  // after the tile loop, so the loop itself has no branch between products.
  // (S = Q K^T stays whole: of the first half alone, into the first half of S, ptxas
  // serialises every wgmma of the kernel; docs/decisions/half-seen-last-key-tile.md.)
  const auto issue_pv = [&](int stage, bool half) {
    if (half) return pv_keys(std::integral_constant<int, kBlockN / 2>{}, stage);
    pv_keys(std::integral_constant<int, kBlockN>{}, stage);
  };
  // Ping-pong: consumer c issues its products only while it holds the turn (named barrier
  // Named::kTurn + c, completed by consumer c - 1's hand-over) and hands it to consumer c + 1
  // (round robin) right after issuing. Every consumer takes the same number of turns (they
  // share each tile); the last one gives consumer 0 the first turn, so consumer 0 takes one
  // extra turn at the end to leave every barrier with as many arrivals as waits.
  const auto take_turn = [&] { ptx::named_barrier_sync(Named::kTurn + consumer, 256); };
  const auto hand_over = [&] {
    ptx::named_barrier_arrive(Named::kTurn + (consumer + 1) % Traits::kConsumers, 256);
  };
  const auto sync_warpgroup = [&] { ptx::named_barrier_sync(1 + consumer, 128); };
  // One arrival per warp, once all of its lanes are past their reads of the buffer.
  const auto release = [&](uint64_t& barrier) {
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(bar(barrier));
  };
  // The S accumulators of 8-key tiles 2 kk, 2 kk + 1 are the A operand of k-step kk.
  const auto pack_p = [&] {
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) mma_sync::pack_a<Elem>(p_frag[kk], s_acc[0], kk);
  };

  const auto recompute_scores = [&](uint32_t q_tile, int stage) {
    recompute_warp_scores<Elem, Traits>(s_acc, q_tile, smem, stage, lane, warp);
  };

  const auto store_output = [&](int b, int n, int row0, const float (&row_lse)[1][2],
                                uint32_t o_tile) {
    store_tile_output<Elem, Traits>(p, maps, o_acc, b, n, row0, row_lse, o_tile,
                                    EpilogueThread{tid, warp, lane, quad_row, quad_col, warp_row0,
                                                   consumer});
  };
  // The epilogue waits (O in its own tile): a tile's normalised O stays in o_acc until the
  // next tile's first S = Q K^T is issued, and is stored while that product runs, before it
  // is zeroed for the next tile's first O += P V (or at once, where the next tile computes
  // nothing). Stored right after the tile, the epilogue and the next tile's start (slot, Q,
  // first S) run one after the other with the tensor cores idle, which weighs most on blocks
  // with few key tiles (docs/decisions/hopper-forward-epilogue.md). pending_b = -1: nothing
  // waits (always, with O in the K/V ring, which is stored at once: there smem.o() is where
  // the ring starts, and nothing stores to it).
  int pending_b = -1, pending_n = 0, pending_row0 = 0;
  float pending_lse[1][2];
  const auto store_pending = [&] {
    if (pending_b >= 0)
      store_output(pending_b, pending_n, pending_row0, pending_lse,
                   smem.o() + wg_row0 * kRowBytes);
    pending_b = -1;
  };
  // The block's next tile from the slot; false when there is none (the producer has left).
  int tiles_read = 0;
  const auto call_vis = variant::KeyWindow<int>::make(p);
  const auto read_tile = [&](ForwardTile& tile) {
    ptx::mbarrier_wait(bar(bars.tile_full), uint32_t(tiles_read) & 1);
    const bool more = TileSlot::load(tile_slot, call_vis, tile);
    ptx::mbarrier_arrive(bar(bars.tile_empty));
    ++tiles_read;
    return more;
  };

  if (consumer == Traits::kConsumers - 1) hand_over();
  RingPosition<kQStages> q_ring;
  RingPosition<kStages> kv_ring;
  ForwardTile t;
  for (bool more = read_tile(t); more;) {
    if (t.num_kv_tiles == 0) {
      store_pending();
      write_unseen_rows<Elem>(p, t, wg_row0, 64, tid % 128, 128);
      more = read_tile(t);
      continue;
    }
    const int q_stage = q_ring.stage();
    ptx::mbarrier_wait(bar(bars.q_full[q_stage]), q_ring.phase());
    ++q_ring.count;
    // Every row of this warpgroup past the query length (in the last query block of a sequence
    // that is not a whole number of blocks: at T = 512 with 192-row blocks, a third of the last
    // block; or in the block that holds a per-batch query length): it writes their zeros and
    // -inf lse (nothing past T) and goes through the tile's turns and buffers with no product
    // and no softmax, so the other warpgroups finish the tile without it. The same turns, waits
    // and releases as the computing path below, in the same order, so every barrier phase sees
    // the same arrivals. The test goes through a warp vote for ptxas's sake: as a plain compare
    // it moves the tile loop's values out of uniform registers, and three consumers spill
    // (docs/decisions/idle-warpgroups-and-warpgroup-tails.md). kSegments: also a warpgroup
    // whose rows see no key of the block through their documents' spans.
    [[maybe_unused]] bool sees_nothing = false;
    if constexpr (Traits::kSegments)
      sees_nothing = sees_no_keys_of_its_documents(p, t.vis, t, wg_row0);
    if (__all_sync(0xffffffff, t.row0 + wg_row0 >= t.vis.q_len || sees_nothing)) {
      store_pending();
      write_unseen_rows<Elem>(p, t, wg_row0, 64, tid % 128, 128);
      // Turn r issues S_r (r < n) and P_{r-1} V_{r-1} (r > 0) on the computing path of a
      // warpgroup without a tail; the counts of turns and releases are what must match.
      RingPosition<kStages> last = kv_ring;  // tile r - 1's buffers
      for (int r = 0; r <= t.num_kv_tiles; ++r) {
        const bool key_tile = r < t.num_kv_tiles, value_tile = r > 0;
        if (key_tile) ptx::mbarrier_wait(bar(bars.k_full[kv_ring.stage()]), kv_ring.phase());
        if (r == t.num_kv_tiles) release(bars.q_empty[q_stage]);
        if (value_tile) ptx::mbarrier_wait(bar(bars.v_full[last.stage()]), last.phase());
        take_turn();
        hand_over();
        if (key_tile) release(bars.k_empty[kv_ring.stage()]);
        if (value_tile) release(bars.v_empty[last.stage()]);
        last = kv_ring;
        if (key_tile) ++kv_ring.count;
      }
      if constexpr (Traits::kOInKV) {  // the ring position lent for O: nothing to stage
        ptx::mbarrier_wait(bar(bars.k_full[kv_ring.stage()]), kv_ring.phase());
        release(bars.k_empty[kv_ring.stage()]);
        release(bars.v_empty[kv_ring.stage()]);
        ++kv_ring.count;
      }
      more = read_tile(t);
      continue;
    }
    // kSegments: the id of this warp's row lane % 16 (the last query's past T), loaded before
    // the tile's first product so that the product hides its latency: the tests below take
    // the rows' ids from it by shuffles.
    [[maybe_unused]] int32_t lane_row_id = 0;
    if constexpr (Traits::kSegments)
      lane_row_id = p.q_segment_ids[int64_t(t.b) * p.seqlen_q +
                                    min(t.row0 + warp_row0 + lane % 16, int(p.seqlen_q) - 1)];
    // The key tiles this warpgroup's rows see: the block's, up to the one that holds the last
    // key its last row sees (fewer where the block's other rows see further: the lower
    // warpgroups on a causal diagonal); the last one may be seen on its first half only. The
    // tiles past them are this warpgroup's tail: it takes their turns and releases their
    // buffers, as an idle warpgroup does, and computes nothing.
    // Without causal or window bounds (kWindowed false) every row sees the same keys: no tail,
    // and the last tile is multiplied whole (keys past the length masked to zero). Why:
    // docs/decisions/idle-warpgroups-and-warpgroup-tails.md, half-seen-last-key-tile.md.
    int wg_tiles = t.num_kv_tiles;
    bool half_last = false;
    if constexpr (Traits::kWindowed) {
      int key_lo, key_hi;
      t.vis.key_range(t.row0 + wg_row0, t.row0 + wg_row0 + 64, key_lo, key_hi);
      if (key_hi > key_lo) {
        const int last = int(unsigned(key_hi - 1) / kBlockN) - t.tile_begin;
        if (last + 1 < wg_tiles) wg_tiles = last + 1;
        half_last = key_hi - (t.tile_begin + wg_tiles - 1) * kBlockN <= kBlockN / 2;
      }
    }
    cuda::OnlineSoftmax<1> softmax;
    softmax.init();
    // The tiles no boundary crosses for this warp's rows, worked out once per query block:
    // two compares per tile remain, and the tile's bounds on the masked path
    // (docs/decisions/int32-bounds-and-column-bits-masking.md).
    int interior_lo, interior_hi;
    t.vis.all_visible_tiles<kBlockN>(t.row0 + warp_row0, t.row0 + warp_row0 + 16, t.tile_begin,
                                     interior_lo, interior_hi);
    const uint32_t q_tile = smem.q(q_stage) + wg_row0 * kRowBytes;
    // kSegments: whether one document holds all of this warp's rows and all the keys of the
    // tile in K stage `stage`, so that the ids need no element test there. Asked only of
    // interior tiles (below), where every row and key is inside its length.
    [[maybe_unused]] const auto one_document = [&](int stage) {
      return cuda::one_segment<kBlockN>(
          lane_row_id, KeyIdsInSmem<Traits>::make(smem, stage, p, t.b).first, lane);
    };
    // The full update of tile j over its first kUsed 8-column tiles: where a boundary crosses
    // the tile for this warp's rows (not interior), the scores it hides set to -inf first.
    const auto mask_and_exponentiate = [&](auto used, int j, int stage, bool interior,
                                           float (&correction)[1][2]) {
      constexpr int kUsed = decltype(used)::value;
      if (!interior) {
        // The bounds rebuilt from the parameters (the lengths one load away): t.vis, kept live
        // through the tile loop for this, spills with three consumers
        // (docs/decisions/int32-bounds-and-column-bits-masking.md).
        // The opaque batch index keeps the compiler from reusing the tile's first loads.
        const auto vis = variant::KeyWindow<int>::make(p, ptx::opaque(uint32_t(t.b)));
        const cuda::TileVisibility tile_vis = cuda::TileVisibility::make(
            vis, t.row0, (t.tile_begin + j) * kBlockN, kBlockM + kBlockN);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t bits[(2 * kUsed + 31) / 32];  // this thread's visible elements of the row
          tile_vis.column_bits<kUsed>(warp_row0 + quad_row + 8 * h, quad_col, bits);
          // kSegments: the row's id and the ids of this thread's keys (from the K stage, whose
          // box covers the tile: every read is in bounds).
          [[maybe_unused]] int32_t row_id = 0;
          [[maybe_unused]] KeyIdsInSmem<Traits> key_ids{};
          if constexpr (Traits::kSegments) {
            row_id = __shfl_sync(0xffffffff, lane_row_id, quad_row + 8 * h);
            key_ids = KeyIdsInSmem<Traits>::make(smem, stage, p, t.b);
            key_ids.first += uint32_t(quad_col) * 4;
          }
#pragma unroll
          for (int c = 0; c < kUsed; ++c)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              bool visible = cuda::TileVisibility::column_visible(bits, 2 * c + e);
              if constexpr (Traits::kSegments)
                visible = (key_ids[8 * c + e] == row_id) & visible;
              if (!visible) s_acc[0][c][2 * h + e] = -INFINITY;
            }
        }
      }
      softmax.exponentiate_first<kUsed>(s_acc, scale_log2, correction);
    };
    // Tile j's probabilities from its landed scores. On an interior tile (every row of the
    // warp below the query length) after the first, once each of the warp's rows has a finite
    // maximum, the tile is exponentiated against those maxima: no max reduction, no O rescale.
    // Where a score outran them too far, the warp recomputes its 16 rows of S with mma.sync (a
    // wgmma recompute would need the whole warpgroup, and its issue spills registers) and
    // takes the full update, as every other tile does (with masking where a boundary crosses
    // it). K_j is released once nothing reads it (docs/decisions/settled-row-maxima.md).
    const auto softmax_step = [&](int j, float (&correction)[1][2]) {
      const int stage = kv_ring.stage();
      bool interior = j >= interior_lo && j < interior_hi;
      if constexpr (Traits::kSegments) interior = interior && one_document(stage);
      const bool settled = j > 0 && interior &&
                           __all_sync(0xffffffff, softmax.row_max[0][0] > -INFINITY &&
                                                      softmax.row_max[0][1] > -INFINITY);
      if (settled && softmax.exponentiate_against_settled_max(s_acc, scale_log2)) {
        correction[0][0] = correction[0][1] = 1.f;
      } else {
        // Beside this warpgroup's P_{j-1} V_{j-1} wgmma, whose registers it leaves alone (a
        // wgmma wait, taken by one warp, would break wait_group's warpgroup-wide rule).
        if (settled) recompute_scores(q_tile, stage);
        // A half-seen last tile (half_last) is masked and exponentiated on its first half
        // alone: no row of this warpgroup sees the rest, and its O += P V reads only the first
        // half of P. On a causal diagonal with 128-key tiles and 128-row blocks, that is
        // warpgroup 0's last tile in every block (docs/decisions/half-seen-last-key-tile.md).
        if (half_last && j == wg_tiles - 1)
          mask_and_exponentiate(std::integral_constant<int, kNTiles / 2>{}, j, stage, interior,
                                correction);
        else
          mask_and_exponentiate(std::integral_constant<int, kNTiles>{}, j, stage, interior,
                                correction);
      }
      // One release site after both paths: releasing K_j before the full update where no
      // recompute can follow spills (docs/decisions/hopper-kernels-without-spills.md).
      release(bars.k_empty[stage]);
    };

    ptx::mbarrier_wait(bar(bars.k_full[kv_ring.stage()]), kv_ring.phase());
    take_turn();
    issue_qk(q_tile, kv_ring.stage());
    hand_over();
    store_pending();
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[0][d][e] = 0.f;
    ptx::wgmma_wait<0>();
    fence_s();
    // The factor O must be rescaled by before the last exponentiated tile's P V is added (1
    // after tile 0: O is still zero).
    float correction[1][2];
    softmax_step(0, correction);

    // The P V product issued by the previous iteration is waited for at the top of the next
    // one, not right after the softmax: ptxas schedules a wgmma wait as early as its basic
    // block allows, and in the softmax's block it goes above the softmax, which then no longer
    // runs under the tensor-core work (docs/decisions/hopper-forward-warp-specialisation.md).
    // The wait is unconditional (at j = 1 nothing is in flight): behind a branch, ptxas cannot
    // tell that O is never read while a product writes it, and serialises every wgmma.
    const auto retire_pv = [&](bool in_flight, int stage) {
      ptx::wgmma_wait<0>();
      fence_o();
      if (in_flight) release(bars.v_empty[stage]);
    };
    for (int j = 1; j < wg_tiles; ++j) {
      const RingPosition<kStages> prev = kv_ring;
      ++kv_ring.count;
      retire_pv(j > 1, (prev.count - 1) % kStages);  // P_{j-2} V_{j-2}
      cuda::OnlineSoftmax<1>::rescale_where_moved(o_acc, correction);
      pack_p();
      ptx::mbarrier_wait(bar(bars.k_full[kv_ring.stage()]), kv_ring.phase());
      ptx::mbarrier_wait(bar(bars.v_full[prev.stage()]), prev.phase());
      take_turn();
      issue_qk(q_tile, kv_ring.stage());
      issue_pv(prev.stage(), false);
      hand_over();
      ptx::wgmma_wait<1>();  // S_j landed; P_{j-1} V_{j-1} may still be running
      fence_s();
      softmax_step(j, correction);
    }
    retire_pv(wg_tiles > 1, (kv_ring.count - 1) % kStages);
    cuda::OnlineSoftmax<1>::rescale_where_moved(o_acc, correction);
    // The tile's last S = Q K^T has landed, Q's last read: the next tile's Q may load under
    // this tile's last O += P V.
    release(bars.q_empty[q_stage]);
    pack_p();
    ptx::mbarrier_wait(bar(bars.v_full[kv_ring.stage()]), kv_ring.phase());
    if (const int first_row = first_v_row_to_zero<kBlockN, Traits::kWindowed, Traits::kSegments>(
            p, t, consumer, wg_tiles);
        first_row < kBlockN) {
      zero_v_rows(smem, kv_ring.stage(), first_row, tid % 128, 128);
      ptx::fence_proxy_async_shared();  // generic stores that wgmma (async proxy) reads
      sync_warpgroup();
    }
    take_turn();
    issue_pv(kv_ring.stage(), half_last);
    hand_over();
    // The next tile, read while this one's last O += P V runs.
    ForwardTile next;
    more = read_tile(next);
    retire_pv(true, kv_ring.stage());
    ++kv_ring.count;

    float row_lse[1][2];
    softmax.finalize(o_acc, scale_log2, row_lse);
    // The tail: see wg_tiles. Its turns come before the epilogue (with O in the K/V ring,
    // before the wait for O's position), so that the other warpgroup's last turn, which
    // follows them, does not wait for this one's epilogue
    // (docs/decisions/idle-warpgroups-and-warpgroup-tails.md).
    for (int j = wg_tiles; j < t.num_kv_tiles; ++j, ++kv_ring.count) {
      ptx::mbarrier_wait(bar(bars.k_full[kv_ring.stage()]), kv_ring.phase());
      ptx::mbarrier_wait(bar(bars.v_full[kv_ring.stage()]), kv_ring.phase());
      take_turn();
      hand_over();
      release(bars.k_empty[kv_ring.stage()]);
      release(bars.v_empty[kv_ring.stage()]);
    }
    if constexpr (Traits::kOInKV) {
      // Stored at once, and the position released as soon as the TMA store has read it: the
      // next tile's second K/V tile loads into it
      // (docs/decisions/o-staged-in-kv-ring-at-head-dim-256.md).
      const int stage = kv_ring.stage();
      ptx::mbarrier_wait(bar(bars.k_full[stage]), kv_ring.phase());
      store_output(t.b, t.n, t.row0, row_lse, consumer == 0 ? smem.k(stage) : smem.v(stage));
      if (tid % 128 == 0) ptx::bulk_wait_group_read_all();
      sync_warpgroup();
      release(bars.k_empty[stage]);
      release(bars.v_empty[stage]);
      ++kv_ring.count;
    } else {
      pending_b = t.b;
      pending_n = t.n;
      pending_row0 = t.row0;
      pending_lse[0][0] = row_lse[0][0];
      pending_lse[0][1] = row_lse[0][1];
    }
    t = next;
  }
  store_pending();
  if (consumer == 0) take_turn();
  if (tid % 128 == 0) ptx::bulk_wait_group_read_all();
#endif
}

}  // namespace jax_flashattn::wgmma
