// The Hopper forward's consumers: warpgroups 1.. of 64 query rows each. Per K/V tile j of a
// tile (query block) they compute
//   S_j = Q K_j^T              wgmma, both operands in shared memory
//   soft-cap                   (WithSoftCap) the landed scores become capped base-2 logits
//   bias, mask, ALiBi          (WithBiasAndMask) base-2 logits plus the bias and ALiBi's term,
//                              -inf where the boolean mask (or a length or window boundary)
//                              hides them; ALiBi alone (WithAlibi): base-2 logits with its
//                              term, the key tiles visited from the diagonal on
//                              (alibi_tile_order.cuh), so that the maxima settle
//   mask                       only on tiles that straddle a length or window boundary
//   P_j = exp2(S_j - max)      online softmax, the scale folded into one FFMA; once a warp's
//                              row maxima have settled, against those maxima (no max
//                              reduction, no rescale) unless a score outran them too far
//   O += P_j V_j               wgmma, P from registers
// with the products of two tiles in flight together: S_{j+1} = Q K_{j+1}^T is issued before
// O += P_j V_j, and the softmax of S_{j+1} runs while P_j V_j is still computing; only the
// rescaling of O waits for it. The consumer warpgroups take turns issuing their products
// (ping-pong on named barriers, round robin), so one's softmax runs under the others'
// tensor-core work. O is normalised once and kept in registers until the consumer has issued
// its next tile's first S = Q K^T; then, under that product, staged in shared memory and
// written with a TMA store that runs on (forward_epilogue.cuh); at head dims 192 and 256
// (kOInKV), right after the tile, in a K/V stage that the ring lends for it after the tile's key
// tiles.
//
// Turns. Every consumer takes num_kv_tiles + 1 turns per tile: turn r issues S_r (r <
// num_kv_tiles) and P_{r-1} V_{r-1} (r > 0) on the computing path. A warpgroup that computes
// nothing of a tile (all its rows past the query length, or seeing no key through the segment
// ids: idle_tile) and the key tiles past a computing warpgroup's last (its tail) go through
// pass_turn, which waits for what the turn's products would read, takes and hands over the turn
// and releases those buffers: every barrier phase sees the same arrivals whichever path a
// warpgroup takes (docs/decisions/idle-warpgroups-and-warpgroup-tails.md).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/fragments.cuh"
#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/mask.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/soft_cap.cuh"
#include "ffi/cuda/common/softmax.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/cuda/wgmma/alibi_terms.cuh"
#include "ffi/cuda/wgmma/alibi_tile_order.cuh"
#include "ffi/cuda/wgmma/forward_bias_and_mask.cuh"
#include "ffi/cuda/wgmma/forward_epilogue.cuh"
#include "ffi/cuda/wgmma/forward_mma.cuh"
#include "ffi/cuda/wgmma/forward_pipeline.cuh"
#include "ffi/cuda/wgmma/forward_tiles.cuh"
#include "ffi/cuda/wgmma/tile_scheduler.cuh"
#include "ffi/cuda/wgmma/traits.h"
#include "ffi/params.h"
#include "ffi/variant.h"

namespace jax_flashattn::wgmma {

// A tile as a consumer warpgroup takes it: the tile and its Q stage (every path), and what a
// computing warpgroup works out once per tile and reads through its key tiles. kLog2PScale:
// the softmax's (cuda::OnlineSoftmax).
template <int kLog2PScale>
struct ConsumerTileOf {
  ForwardTile t;
  int q_stage;
  uint32_t q_tile;     // this warpgroup's rows of Q stage q_stage
  // The key tiles this warpgroup's rows see (fewer than t.num_kv_tiles on a causal or windowed
  // diagonal below the block's last rows), the last one seen on its first half only when
  // half_last; and the tiles no boundary crosses for this warp's rows, [interior_lo,
  // interior_hi).
  int wg_tiles;
  bool half_last;
  int interior_lo, interior_hi;
  // kSegments: the id of this warp's row lane % 16 (the last query's past T).
  int32_t lane_row_id;
  // kAlibi: the first key tile visited (AlibiTileOrder), the head's slope log2(e), and the
  // distance t + shift - s of this thread's first row and its first key of the block's first
  // key tile (the dispatcher keeps it within int32: alibi_fits).
  int alibi_first;
  float alibi_slope2;
  int alibi_distance;
  // kStagedTerm: this lane's half row of the staged term at the block's first key tile
  // (BiasAndMask::staged_row).
  const char* term_row;
  // kE4m3: the softmax's factor with the entry's query and key descales (their product's
  // magnitude), whether that product is negative (the scores then change sign), and the
  // value descale O is multiplied by.
  float e4m3_scale;
  bool e4m3_negate;
  float e4m3_v_descale;
  cuda::OnlineSoftmax<1, kLog2PScale> softmax;
};

// Elem: out's 2-byte type, and q's, k's and v's but where Traits::kE4m3 (FP8 attention: the
// products then take e4m3 operands, OperandOf).
template <typename Elem, typename Traits>
struct ForwardConsumer {
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  static constexpr int kStages = Traits::kStages, kQStages = Traits::kQStages;
  // FP8 attention's P in [0, 256]: OnlineSoftmax's kLog2PScale.
  using ConsumerTile = ConsumerTileOf<Traits::kE4m3 ? 8 : 0>;
  static constexpr int kPSteps = kBlockN / kKStep<Traits>;  // k-steps of O += P V
  static constexpr int kNTiles = kBlockN / 8;            // 8-key column tiles of S
  static constexpr int kDTiles = Traits::kUsedDim / 8;   // 8-wide column tiles of O
  using Named = NamedBarriers<Traits::kConsumers>;
  static_assert(kBlockN % 32 == 0, "half a key tile is whole k16 steps of O += P V");
  // A warpgroup's tail holds at most as many tiles as the (at most kBlockM - 64) block rows
  // below its own shift the last visible key: one here. It releases their buffers only after
  // it has read the next tile from the slot, which the producer fills once it has issued all
  // of this tile's loads; a tail of kStages tiles would hold buffers those loads wait for
  // (docs/decisions/idle-warpgroups-and-warpgroup-tails.md).
  static_assert((kBlockM - 64 + kBlockN - 1) / kBlockN < kStages, "a tail never blocks the loads");

  const AttentionParams& p;
  const ForwardMapsFor<Traits::kSegments>& maps;
  const ForwardSmem<Traits> smem;
  ForwardBarriers<Traits>& bars;
  // The tile slot by 32-bit shared address: a generic pointer to it would hold a 64-bit
  // register for the whole kernel, two more than the consumers have at head dim 256
  // (docs/decisions/hopper-kernels-without-spills.md).
  const uint32_t tile_slot;
  const int tid, consumer;
  // The warp of four, through a warp reduction as the consumer index (forward_kernel): known
  // warp-uniform, its rows' per-tile values (interior tiles, the half-seen last tile) stay in
  // uniform registers; from tid alone, with the consumers a function of their own, three
  // consumers spilled.
  const int warp;
  const int lane;
  const int wg_row0;     // this warpgroup's rows of the block
  const int warp_row0;   // this warp's 16 rows (its accumulator rows)
  const int quad_row, quad_col;
  const ForwardDescriptors<Traits> desc;
  // The softmax's factor on the scores: scale log2(e), or c = cap log2(e) where they are
  // tanh(s scale / cap) (kSoftCap: cap_scores as each tile lands; the capped base-2 logit is
  // c times that, folded into the softmax's FFMA), or 1 where they are base-2 logits already
  // (kBiasAndMask: BiasAndMask::apply, but logit_scale's units beside a staged term; kAlibi:
  // add_alibi). Without the cap soft_cap is an empty type: the uncapped kernels' code does not
  // depend on it.
  const float softmax_scale;
  struct NoSoftCap {};
  using SoftCap = std::conditional_t<Traits::kSoftCap, cuda::SoftCapLogits, NoSoftCap>;
  const SoftCap soft_cap;
  // kStagedTerm: the call's staged term (staged_term), worked out once: read per tile, it took
  // some 12 instructions from constant memory at each of its two uses. An empty type elsewhere,
  // as soft_cap.
  struct NoStagedTerm {};
  using StagedTermOf = std::conditional_t<Traits::kStagedTerm, StagedTerm, NoStagedTerm>;
  const StagedTermOf staged;
  // The call's windows, for every tile read (moved to the entry's by tile_window).
  const variant::KeyWindow<int> call_vis;

  float s_acc[1][kNTiles][4];
  float o_acc[1][kDTiles][4];
  uint32_t p_frag[kPSteps][4];
  RingPosition<kQStages> q_ring;
  RingPosition<kStages> kv_ring;
  int tiles_read = 0;
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

  // consumer: this warpgroup's index among the consumers, known warp-uniform to ptxas (see
  // forward_kernel).
  __device__ __forceinline__ ForwardConsumer(const AttentionParams& params,
                                             const ForwardMapsFor<Traits::kSegments>& tma_maps,
                                             const ForwardSmem<Traits>& layout,
                                             ForwardBarriers<Traits>& barriers,
                                             int thread, int consumer_index)
      : p(params), maps(tma_maps), smem(layout), bars(barriers),
        tile_slot(ptx::smem_address(barriers.tile)), tid(thread), consumer(consumer_index),
        warp(__reduce_max_sync(0xffffffff, (thread / 32) % 4)), lane(thread % 32),
        wg_row0(consumer_index * 64), warp_row0(consumer_index * 64 + warp * 16),
        quad_row(lane / 4), quad_col(2 * (lane % 4)),
        desc(ForwardDescriptors<Traits>::make(layout)),
        softmax_scale(Traits::kSoftCap        ? variant::SoftCap::make(params).cap2
                      : Traits::kBiasAndMask ? BiasAndMask<Traits>::logit_scale(params)
                      : Traits::kAlibi       ? 1.f
                                             : params.scale * cuda::kLog2e),
        soft_cap(make_soft_cap(params)),
        staged(make_staged_term(params)),
        call_vis(variant::KeyWindow<int>::make(params)) {}

  // Ping-pong: consumer c issues its products only while it holds the turn (named barrier
  // Named::kTurn + c, completed by consumer c - 1's hand-over) and hands it to consumer c + 1
  // (round robin) right after issuing. Every consumer takes the same number of turns (they
  // share each tile); the last one gives consumer 0 the first turn, so consumer 0 takes one
  // extra turn at the end to leave every barrier with as many arrivals as waits.
  __device__ __forceinline__ void take_turn() const {
    ptx::named_barrier_sync(Named::kTurn + consumer, 256);
  }
  __device__ __forceinline__ void hand_over() const {
    ptx::named_barrier_arrive(Named::kTurn + (consumer + 1) % Traits::kConsumers, 256);
  }
  __device__ __forceinline__ void sync_warpgroup() const {
    ptx::named_barrier_sync(1 + consumer, 128);
  }
  // One arrival per warp, once all of its lanes are past their reads of the buffer.
  __device__ __forceinline__ void release(uint64_t& barrier) const {
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(barrier_address(barrier));
  }

  // A turn without products: waits for K of ring position `key` (when has_key) and V of
  // `value` (when has_value) as the products would, takes and hands over the turn, and
  // releases both.
  __device__ __forceinline__ void pass_turn(bool has_key, const RingPosition<kStages>& key,
                                            bool has_value, const RingPosition<kStages>& value) {
    if (has_key) ptx::mbarrier_wait(barrier_address(bars.k_full[key.stage()]), key.phase());
    if (has_value) ptx::mbarrier_wait(barrier_address(bars.v_full[value.stage()]), value.phase());
    take_turn();
    hand_over();
    if (has_key) release(bars.k_empty[key.stage()]);
    if (has_value) release(bars.v_empty[value.stage()]);
  }
  // kOInKV: the ring position lent for O, taken and given back without staging anything.
  __device__ __forceinline__ void pass_lent_o_position() {
    ptx::mbarrier_wait(barrier_address(bars.k_full[kv_ring.stage()]), kv_ring.phase());
    release(bars.k_empty[kv_ring.stage()]);
    release(bars.v_empty[kv_ring.stage()]);
    ++kv_ring.count;
  }

  // The block's next tile from the slot; false when there is none (the producer has left).
  __device__ __forceinline__ bool read_tile(ForwardTile& tile) {
    ptx::mbarrier_wait(barrier_address(bars.tile_full), uint32_t(tiles_read) & 1);
    const bool more = TileSlot::load(tile_slot, call_vis, tile);
    ptx::mbarrier_arrive(barrier_address(bars.tile_empty));
    ++tiles_read;
    return more;
  }

  __device__ __forceinline__ void store_output(int b, int n, int row0,
                                               const float (&row_lse)[1][2], uint32_t o_tile) {
    store_tile_output<Elem, Traits>(p, maps, o_acc, b, n, row0, row_lse, o_tile,
                                    EpilogueThread{tid, warp, lane, quad_row, quad_col, warp_row0,
                                                   consumer});
  }
  __device__ __forceinline__ void store_pending() {
    if (pending_b >= 0)
      store_output(pending_b, pending_n, pending_row0, pending_lse,
                   smem.o() + wg_row0 * kRowBytes);
    pending_b = -1;
  }
  // This warpgroup's rows of tile t, which see no key: zeros and -inf lse (nothing past T),
  // once the tile before's O is stored.
  __device__ __forceinline__ void write_unseen(const ForwardTile& t) {
    store_pending();
    write_unseen_rows<Elem>(p, t, wg_row0, 64, tid % 128, 128);
  }

  // A tile this warpgroup computes nothing of: it writes its rows' zeros and -inf lse (nothing
  // past T) and goes through the tile's turns and buffers with no product and no softmax, so
  // the other warpgroups finish the tile without it. Turn r waits for K_r and V_{r-1} as the
  // computing path's turn r does; Q is released before the last turn, as there.
  __device__ __forceinline__ void idle_tile(const ForwardTile& t, int q_stage) {
    write_unseen(t);
    RingPosition<kStages> last = kv_ring;  // tile r - 1's buffers
    for (int r = 0; r <= t.num_kv_tiles; ++r) {
      if (r == t.num_kv_tiles) release(bars.q_empty[q_stage]);
      pass_turn(r < t.num_kv_tiles, kv_ring, r > 0, last);
      last = kv_ring;
      if (r < t.num_kv_tiles) ++kv_ring.count;
    }
    if constexpr (Traits::kOInKV) pass_lent_o_position();
  }

  // The S accumulators of 8-key tiles 2 kk, 2 kk + 1 are the A operand of k-step kk. kE4m3:
  // those of tiles 4 kk .. 4 kk + 3 are the A operand of k32 step kk as they lie, register
  // 2 a + h (h: the thread's row h) holding tiles 4 kk + 2 a and 4 kk + 2 a + 1: A column
  // 16 a + 4 (lane % 4) + 2 b + c is key 16 a + 8 b + 2 (lane % 4) + c of the step, the order
  // V^T's keys are given in (fp8.py kernel_values), so P needs no exchange between lanes.
  __device__ __forceinline__ void pack_p() {
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
      if constexpr (Traits::kE4m3) {
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float(&lo)[4] = s_acc[0][4 * kk + 2 * a];
            const float(&hi)[4] = s_acc[0][4 * kk + 2 * a + 1];
            p_frag[kk][2 * a + h] =
                uint32_t(ptx::cvt_e4m3x2(lo[2 * h], lo[2 * h + 1])) |
                (uint32_t(ptx::cvt_e4m3x2(hi[2 * h], hi[2 * h + 1])) << 16);
          }
      } else {
        mma_sync::pack_a<Elem>(p_frag[kk], s_acc[0], kk);
      }
    }
  }
  // The softmax's factor on this tile's scores: softmax_scale, or (kE4m3) with the entry's
  // descales (begin_tile).
  __device__ __forceinline__ float scale_of(const ConsumerTile& w) const {
    if constexpr (Traits::kE4m3) return w.e4m3_scale;
    return softmax_scale;
  }
  __device__ __forceinline__ void issue_qk(uint32_t q_tile, int stage) {
    issue_scores<Elem, Traits>(s_acc, desc, q_tile, stage);
  }
  // O += P V; over the first half of the tile's keys when `half` (no row of this warpgroup
  // sees the rest, and the rest of P holds unexponentiated scores: see softmax_step). Only a
  // warpgroup's last key tile is taken as seen on its first half alone, and it is multiplied
  // after the tile loop, so the loop itself has no branch between products.
  // (S = Q K^T stays whole: of the first half alone, into the first half of S, ptxas
  // serialises every wgmma of the kernel; docs/decisions/half-seen-last-key-tile.md.)
  // The register fences go after the branch between the two widths (in issue_values): with
  // the branch between them and the first wgmma, ptxas injected a warpgroup.arrive of its own.
  __device__ __forceinline__ void issue_pv(int stage, bool half) {
    if (half) return issue_values<kBlockN / 2, Elem, Traits>(o_acc, p_frag, desc, stage);
    issue_values<kBlockN, Elem, Traits>(o_acc, p_frag, desc, stage);
  }
  // The P V product issued by the previous iteration is waited for at the top of the next
  // one, not right after the softmax: ptxas schedules a wgmma wait as early as its basic
  // block allows, and in the softmax's block it goes above the softmax, which then no longer
  // runs under the tensor-core work (docs/decisions/hopper-forward-warp-specialisation.md).
  // The wait is unconditional (at j = 1 nothing is in flight): behind a branch, ptxas cannot
  // tell that O is never read while a product writes it, and serialises every wgmma.
  __device__ __forceinline__ void retire_pv(bool in_flight, int stage) {
    ptx::wgmma_wait<0>();
    ptx::fence_registers(o_acc[0]);
    if (in_flight) release(bars.v_empty[stage]);
  }

  // kSegments: whether one document holds all of this warp's rows and all the keys of the tile
  // in K stage `stage`, so that the ids need no element test there. Rows past the query length
  // test the last row's id and keys past the key length the next entry's: both are hidden by
  // the bounds whatever the answer.
  __device__ __forceinline__ bool one_document(const ConsumerTile& w, int stage) const {
    return cuda::one_segment<kBlockN>(
        w.lane_row_id, KeyIdsInSmem<Traits>::make(smem, stage, p, w.t.b).first, lane);
  }

  __device__ __forceinline__ static SoftCap make_soft_cap(const AttentionParams& params) {
    if constexpr (Traits::kSoftCap) return cuda::SoftCapLogits::make(params);
    else return NoSoftCap{};
  }
  __device__ __forceinline__ static StagedTermOf make_staged_term(const AttentionParams& params) {
    if constexpr (Traits::kStagedTerm) return staged_term(params);
    else return NoStagedTerm{};
  }

  // kBiasAndMask: the terms as this thread reads or computes them (forward_bias_and_mask.cuh).
  __device__ __forceinline__ BiasAndMask<Traits> bias_and_mask() const {
    StagedTerm term = StagedTerm::kNone;
    if constexpr (Traits::kStagedTerm) term = staged;
    return BiasAndMask<Traits>{p, warp_row0 + quad_row, quad_col, lane,
                               smem.term_stage(4 * consumer + warp), term};
  }

  // kSoftCap: the scores in s_acc as tanh(s scale / cap), before any mask (softmax_scale makes
  // them the capped base-2 logits).
  __device__ __forceinline__ void cap_scores() {
    if constexpr (Traits::kSoftCap) {
#pragma unroll
      for (int c = 0; c < kNTiles; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) s_acc[0][c][e] = soft_cap.tanh_of(s_acc[0][c][e]);
    }
  }

  // The key tile (from the block's first) that the tile loop's j-th step multiplies: j, or
  // (kAlibi) the one AlibiTileOrder visits j-th.
  __device__ __forceinline__ int key_tile(const ConsumerTile& w, int j) const {
    if constexpr (Traits::kAlibi) return alibi_order(w).key_tile(j);
    return j;
  }
  // kAlibi: the block's key tile order (AlibiTileOrder).
  __device__ __forceinline__ static AlibiTileOrder<kBlockN> alibi_order(const ConsumerTile& w) {
    return {w.alibi_first, w.t.num_kv_tiles};
  }

  // kAlibi: r_h of key tile kt, the distance t + shift - s of the thread's row h and its first
  // key of the tile.
  __device__ __forceinline__ int alibi_row_distance(const ConsumerTile& w, int kt, int h) const {
    return w.alibi_distance + 8 * h - kt * kBlockN;
  }
  // kAlibi: key tile kt's scores in s_acc as base-2 logits with ALiBi's term, two FFMAs each
  // (alibi_terms.cuh).
  __device__ __forceinline__ void add_alibi(const ConsumerTile& w, int kt) {
    if constexpr (Traits::kAlibi) {
      const float base[2] = {w.alibi_slope2 * float(alibi_row_distance(w, kt, 0)),
                             w.alibi_slope2 * float(alibi_row_distance(w, kt, 1))};
      add_alibi_to_rows(s_acc, p.scale * cuda::kLog2e, w.alibi_slope2, base);
    }
  }

  // kAlibi: which side of this warp's rows' diagonal keys key tile kt lies on: -1 where every
  // distance t + shift - s of the warp's elements is >= 0 (the tile at or left of every row's
  // diagonal key), +1 where every one is <= 0, 0 where the diagonal crosses the tile.
  __device__ __forceinline__ int alibi_side(const ConsumerTile& w, int kt) const {
    // The distance of the warp's first row and the tile's first key.
    const int first = w.alibi_distance - quad_row + quad_col - kt * kBlockN;
    if (first - (kBlockN - 1) >= 0) return -1;
    return first + 15 <= 0 ? 1 : 0;
  }
  // kAlibi: the settled path's exponent on a tile on one side of the diagonal: there -slope2
  // |d| is the linear sigma slope2 d (sigma the side), so the term and the maximum's offset go
  // into one FFMA per score on top of the scale's: exp2(s scale2 + (step k + base_h - offset))
  // for the element k keys right of the thread's first, whose distance is r_h - k
  // (alibi_row_distance), with step = -sigma slope2 and base_h = sigma slope2 r_h.
  struct AlibiExponent {
    float scale2, step, base[2];
    __device__ __forceinline__ float operator()(float s, int h, int n, int c,
                                                float minus_offset) const {
      return fmaf(s, scale2, fmaf(float(8 * n + c), step, base[h] + minus_offset));
    }
  };
  __device__ __forceinline__ AlibiExponent alibi_exponent(const ConsumerTile& w, int kt,
                                                          int side) const {
    const float sign = float(side);
    AlibiExponent x{p.scale * cuda::kLog2e, -sign * w.alibi_slope2, {}};
#pragma unroll
    for (int h = 0; h < 2; ++h)
      x.base[h] = sign * w.alibi_slope2 * float(alibi_row_distance(w, kt, h));
    return x;
  }

  // The per-key-tile softmax step, defined in forward_consumer_softmax.cuh: tile j's scores to
  // probabilities (softmax_step; the full update: mask_and_exponentiate), the next term copy.
  template <int kUsed>
  __device__ __forceinline__ void mask_and_exponentiate(ConsumerTile& w, int kt, int stage,
                                                        bool interior, bool one_doc,
                                                        float (&correction)[1][2]);
  __device__ __forceinline__ void softmax_step(ConsumerTile& w, int j,
                                               float (&correction)[1][2]);
  __device__ __forceinline__ void stage_next(const ConsumerTile& w, int j) const;

  // Tile t's window: the slot's lengths with the call's sides (TileSlot::load), moved to the
  // entry's under align_window_to_lengths (an option of windowed calls, which the unwindowed
  // configuration never sees). Moved where it is used rather than as the slot is read: that is
  // under the last O += P V, where the two sides' registers spill (three consumers at head
  // dim 64). t.vis itself keeps the call's sides: read its lengths only.
  __device__ __forceinline__ variant::KeyWindow<int> tile_window(const ForwardTile& t) const {
    variant::KeyWindow<int> vis = t.vis;
    if constexpr (Traits::kWindowed)
      if (p.align_window_to_lengths) vis.align_to_lengths(p);
    return vis;
  }

  // Zeroes V stage `stage`'s rows past the entry's key length where this warpgroup is the one
  // to (first_v_row_to_zero), before the turn whose product first reads them. kAlibi: every
  // computing warpgroup reads every key tile, so the lowest computing one, consumer 0, zeroes.
  __device__ __forceinline__ void zero_v_past_length(const ConsumerTile& w, int stage) {
    // kE4m3: V^T comes zero past each entry's key length (fp8.py kernel_values).
    if constexpr (Traits::kE4m3) return;
    constexpr bool kTails = Traits::kWindowed && !Traits::kAlibi;
    if (const int first_row = first_v_row_to_zero<kBlockN, kTails, kNarrowsToSpans<Traits>>(
            p, w.t, consumer, w.wg_tiles);
        first_row < kBlockN) {
      zero_v_rows(smem, stage, first_row, tid % 128, 128);
      ptx::fence_proxy_async_shared();  // generic stores that wgmma (async proxy) reads
      sync_warpgroup();
    }
  }

  // What this warpgroup works out at the start of tile t, whose Q is in stage q_stage.
  __device__ __forceinline__ void begin_tile(ConsumerTile& w) {
    const ForwardTile& t = w.t;
    const variant::KeyWindow<int> vis = tile_window(t);
    // kSegments: loaded before the tile's first product so that the product hides its
    // latency: the masking takes the rows' ids from it by shuffles.
    w.lane_row_id = 0;
    if constexpr (Traits::kSegments)
      w.lane_row_id = p.q_segment_ids[int64_t(t.b) * p.seqlen_q +
                                      min(t.row0 + warp_row0 + lane % 16, int(p.seqlen_q) - 1)];
    // The block's key tiles up to the one that holds the last key this warpgroup's last row
    // sees (fewer where the block's other rows see further: the lower warpgroups on a causal
    // diagonal); the last one may be seen on its first half only. The tiles past them are
    // this warpgroup's tail. Without causal or window bounds (kWindowed false) every row sees
    // the same keys: no tail, and the last tile is multiplied whole (keys past the length
    // masked to zero). Why: docs/decisions/idle-warpgroups-and-warpgroup-tails.md,
    // half-seen-last-key-tile.md.
    w.wg_tiles = t.num_kv_tiles;
    w.half_last = false;
    if constexpr (Traits::kWindowed && !Traits::kAlibi) {
      int key_lo, key_hi;
      vis.key_range(t.row0 + wg_row0, t.row0 + wg_row0 + 64, key_lo, key_hi);
      if (key_hi > key_lo) {
        const int last = int(unsigned(key_hi - 1) / kBlockN) - t.tile_begin;
        if (last + 1 < w.wg_tiles) w.wg_tiles = last + 1;
        w.half_last = key_hi - (t.tile_begin + w.wg_tiles - 1) * kBlockN <= kBlockN / 2;
      }
    }
    if constexpr (Traits::kStagedTerm) {
      w.term_row = bias_and_mask().staged_row(t);
      stage_next(w, 0);
    } else if constexpr (Traits::kBiasAndMask) {
      bias_and_mask().prefetch(t, 0);
    }
    if constexpr (Traits::kAlibi) {
      const cuda::AlibiLogits alibi = cuda::AlibiLogits::make(p, t.b, t.n);
      w.alibi_first = AlibiTileOrder<kBlockN>::make(p, t).first;
      w.alibi_slope2 = alibi.slope2;
      w.alibi_distance = int(int64_t(t.row0) + warp_row0 + quad_row + alibi.shift -
                             int64_t(t.tile_begin) * kBlockN - quad_col);
    }
    if constexpr (Traits::kE4m3) {
      const int64_t entry = int64_t(t.b) * p.num_kv_heads + t.kv_head;
      const float qk_descale = p.k_descale[entry];
      w.e4m3_scale = softmax_scale * fabsf(qk_descale);
      // A zero factor would make the hidden scores' -inf a NaN: the smallest normal float
      // instead, which gives the visible ones the same weight, as a zero descale does.
      if (w.e4m3_scale == 0.f) w.e4m3_scale = FLT_MIN;
      w.e4m3_negate = qk_descale < 0.f;
      w.e4m3_v_descale = p.v_descale[entry];
    }
    w.softmax.init();
    // Worked out once per query block: two compares per tile remain, and the tile's bounds
    // on the masked path (docs/decisions/int32-bounds-and-column-bits-masking.md).
    vis.all_visible_tiles<kBlockN>(t.row0 + warp_row0, t.row0 + warp_row0 + 16, t.tile_begin,
                                   w.interior_lo, w.interior_hi);
    w.q_tile = smem.q(w.q_stage) + wg_row0 * kRowBytes;
  }

  // Tile w.t, computed; reads the block's next tile into `next` under the last O += P V and
  // returns whether there is one.
  __device__ __forceinline__ bool compute_tile(ConsumerTile& w, ForwardTile& next) {
    const ForwardTile& t = w.t;
    ptx::mbarrier_wait(barrier_address(bars.k_full[kv_ring.stage()]), kv_ring.phase());
    take_turn();
    issue_qk(w.q_tile, kv_ring.stage());
    hand_over();
    store_pending();
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[0][d][e] = 0.f;
    ptx::wgmma_wait<0>();
    ptx::fence_registers(s_acc[0]);
    // The factor O must be rescaled by before the last exponentiated tile's P V is added (1
    // after tile 0: O is still zero).
    float correction[1][2];
    softmax_step(w, 0, correction);

    for (int j = 1; j < w.wg_tiles; ++j) {
      const RingPosition<kStages> prev = kv_ring;
      ++kv_ring.count;
      retire_pv(j > 1, (prev.count - 1) % kStages);  // P_{j-2} V_{j-2}
      cuda::OnlineSoftmax<1>::rescale_where_moved(o_acc, correction);
      pack_p();
      ptx::mbarrier_wait(barrier_address(bars.k_full[kv_ring.stage()]), kv_ring.phase());
      ptx::mbarrier_wait(barrier_address(bars.v_full[prev.stage()]), prev.phase());
      // kAlibi: the block's last key tile, the one that may hold keys past a length, is
      // multiplied by V wherever the order visits it (elsewhere always last: after the loop).
      if constexpr (Traits::kAlibi)
        if (j - 1 == alibi_order(w).last_tile_visit())
          zero_v_past_length(w, prev.stage());
      take_turn();
      issue_qk(w.q_tile, kv_ring.stage());
      issue_pv(prev.stage(), false);
      hand_over();
      ptx::wgmma_wait<1>();  // S_j landed; P_{j-1} V_{j-1} may still be running
      ptx::fence_registers(s_acc[0]);
      softmax_step(w, j, correction);
    }
    retire_pv(w.wg_tiles > 1, (kv_ring.count - 1) % kStages);
    cuda::OnlineSoftmax<1>::rescale_where_moved(o_acc, correction);
    // The tile's last S = Q K^T has landed, Q's last read: the next tile's Q may load under
    // this tile's last O += P V.
    release(bars.q_empty[w.q_stage]);
    pack_p();
    ptx::mbarrier_wait(barrier_address(bars.v_full[kv_ring.stage()]), kv_ring.phase());
    if (!Traits::kAlibi || alibi_order(w).last_tile_visit() == w.wg_tiles - 1)
      zero_v_past_length(w, kv_ring.stage());
    take_turn();
    issue_pv(kv_ring.stage(), w.half_last);
    hand_over();
    // The next tile, read while this one's last O += P V runs.
    const bool more = read_tile(next);
    retire_pv(true, kv_ring.stage());
    ++kv_ring.count;

    float row_lse[1][2];
    w.softmax.finalize(o_acc, scale_of(w), row_lse);
    if constexpr (Traits::kE4m3) {
#pragma unroll
      for (int d = 0; d < kDTiles; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) o_acc[0][d][e] *= w.e4m3_v_descale;
    }
    // The tail's turns come before the epilogue (with O in the K/V ring, before the wait for
    // O's position), so that the other warpgroup's last turn, which follows them, does not
    // wait for this one's epilogue (docs/decisions/idle-warpgroups-and-warpgroup-tails.md).
    for (int j = w.wg_tiles; j < t.num_kv_tiles; ++j, ++kv_ring.count)
      pass_turn(true, kv_ring, true, kv_ring);
    if constexpr (Traits::kOInKV) {
      // Stored at once, and the position released as soon as the TMA store has read it: the
      // next tile's second K/V tile loads into it
      // (docs/decisions/o-staged-in-kv-ring-at-head-dim-256.md).
      const int stage = kv_ring.stage();
      ptx::mbarrier_wait(barrier_address(bars.k_full[stage]), kv_ring.phase());
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
    return more;
  }

  __device__ __forceinline__ void run() {
    if (consumer == Traits::kConsumers - 1) hand_over();
    ConsumerTile w;
    for (bool more = read_tile(w.t); more;) {
      const ForwardTile& t = w.t;
      if (t.num_kv_tiles == 0) {
        write_unseen(t);
        more = read_tile(w.t);
        continue;
      }
      w.q_stage = q_ring.stage();
      ptx::mbarrier_wait(barrier_address(bars.q_full[w.q_stage]), q_ring.phase());
      ++q_ring.count;
      // Every row of this warpgroup past the query length (in the last query block of a
      // sequence that is not a whole number of blocks: at T = 512 with 192-row blocks, a third
      // of the last block; or in the block that holds a per-batch query length), or
      // (kNarrowsToSpans) seeing no key of the block through the spans: idle. The test
      // goes through a warp vote for ptxas's sake: as a plain compare it moves the tile loop's
      // values out of uniform registers, and three consumers spill
      // (docs/decisions/idle-warpgroups-and-warpgroup-tails.md).
      [[maybe_unused]] bool sees_nothing = false;
      if constexpr (kNarrowsToSpans<Traits>)
        sees_nothing = sees_no_keys_through_spans(p, tile_window(t), t, wg_row0);
      if (__all_sync(0xffffffff, t.row0 + wg_row0 >= t.vis.q_len || sees_nothing)) {
        idle_tile(t, w.q_stage);
        more = read_tile(w.t);
        continue;
      }
      begin_tile(w);
      ForwardTile next;
      more = compute_tile(w, next);
      w.t = next;
    }
    store_pending();
    if (consumer == 0) take_turn();
    if (tid % 128 == 0) ptx::bulk_wait_group_read_all();
  }
};

}  // namespace jax_flashattn::wgmma

#include "ffi/cuda/wgmma/forward_consumer_softmax.cuh"
