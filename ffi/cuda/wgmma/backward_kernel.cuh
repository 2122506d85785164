// FlashAttention backward for Hopper (sm_90a), dK/dV/dQ in one pass: TMA loads, wgmma, warp
// specialisation (FlashAttention-3's structure).
//
// One block per (128-key block, kv head, batch). Warpgroup 0 is the producer: one thread loads K
// and V of the block once, then for every query head of the GQA group and every query tile
// (kBlockM queries: backward_traits.h) that can see the block the Q and dO tiles, into a ring of
// kStages buffers guarded by a full barrier (the loads landed) and an empty barrier (every
// consumer warp is done with them), with the tile's lse and D beside them. Warpgroups 1 and 2
// are consumers of 64 keys each; per tile they compute
//   S^T  = K_wg Q^T                 wgmma, both operands K-major in shared memory
//   dP^T = V_wg dO^T                the same, in a second commit group
//   P^T  = exp2(S^T scale log2(e) - lse log2(e))     0 where hidden; while dP^T computes
//   dS^T = P^T (dP^T - D)
//   dV  += P^T dO,  dK += dS^T Q   wgmma, P^T / dS^T from registers, dO / Q read MN-major
//   dQ  += dS K                     wgmma from shared memory: dS^T of both consumers (A, read
//                                   MN-major) times K (B, MN-major), each consumer taking half
//                                   of the head-dim columns (of a 128-query tile, half of the
//                                   queries) over all 128 keys; staged in shared memory and
//                                   added into the float32 accumulator (which other key
//                                   blocks add to as well) by a TMA reduction
// Keys on the rows of S^T make P^T and dS^T the A operands of dV and dK as they are computed;
// dQ needs them transposed, which the MN-major descriptor does for free, so dS^T is stored as it
// lies. One named barrier per tile publishes both consumers' dS^T (double-buffered, so the same
// barrier retires the buffer the tile before used). At the end dK (times the scale) and dV,
// summed over the group's heads, are staged in the K and V tiles and written with TMA stores,
// which clip rows past S and head-dim columns past H. In deterministic mode
// (BackwardDeterministic) the dQ writer, a thread of the producer's second warp, adds each
// step's dQ into dq_accum in the tile's turn (backward_dq_writer.cuh).
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/fragments.cuh"  // pack_a
#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/id_box.cuh"
#include "ffi/cuda/common/mask.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/soft_cap.cuh"
#include "ffi/cuda/common/softmax.cuh"  // kLog2e
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/cuda/wgmma/backward_dq_writer.cuh"
#include "ffi/cuda/wgmma/backward_epilogue.cuh"
#include "ffi/cuda/wgmma/backward_mma.cuh"
#include "ffi/cuda/wgmma/backward_pipeline.cuh"
#include "ffi/cuda/wgmma/backward_traits.h"
#include "ffi/cuda/wgmma/traits.h"  // register_budgets_fit
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

template <typename Elem, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    backward_kernel(const __grid_constant__ AttentionParams p,
                    const __grid_constant__ BackwardMapsFor<Traits::kSegments> maps) {
#ifdef JAX_FLASHATTN_SM90_BODY
  static_assert(register_budgets_fit<Traits>(), "setmaxnreg would wait forever");
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages, kHeadDim = Traits::kHeadDim;
  constexpr int kSpans = Traits::kSpans, kSpanElems = Traits::kSpanElems;
  constexpr int kKSteps = kHeadDim / 16;   // k16 steps of S^T and dP^T (over the head dim)
  constexpr int kQSteps = kBlockM / 16;    // k16 steps of dV and dK (over the tile's queries)
  constexpr int kKeySteps = kBlockN / 16;  // k16 steps of dQ (over the block's keys)
  constexpr int kQTiles = kBlockM / 8;     // 8-query column tiles of S^T and dP^T
  constexpr int kDTiles = Traits::kDkvCols / 8;  // 8-wide column tiles of a consumer's dK, dV
  constexpr int kDqTiles = Traits::kDqCols / 8;  // 8-wide column tiles of a consumer's dQ

  extern __shared__ unsigned char smem_raw[];
  using Layout = BackwardSmemLayout<Traits>;
  const uint32_t raw_address = ptx::smem_address(smem_raw);
  const uint32_t base = (raw_address + kGroupBytes - 1) & ~(kGroupBytes - 1);
  unsigned char* smem = smem_raw + (base - raw_address);
  const uint32_t sK = base, sV = base + Traits::kKVBytes;
  const auto sQ = [&](int stage) { return base + Layout::kQOffset + stage * Traits::kQBytes; };
  const auto sdO = [&](int stage) { return base + Layout::kDoOffset + stage * Traits::kQBytes; };
  const auto sdS = [&](int buffer) {
    return base + Layout::kDsOffset + buffer * Traits::kDsBytes;
  };
  const auto sDq = [&](int consumer) {
    return base + Layout::kDqOffset + consumer * Traits::kDqBytes;
  };
  constexpr int kStatsStride = Traits::kStatsStride;
  const uint32_t sStats = base + Layout::kStatsOffset;
  const float* stats = reinterpret_cast<const float*>(smem + Layout::kStatsOffset);
  const auto sQIds = [&](int stage) {
    return base + Layout::kQIdsOffset + stage * Traits::QIdBox::kStageBytes;
  };
  auto& bars = *reinterpret_cast<BackwardBarriers<Traits>*>(smem + Layout::kBarrierOffset);
  // DqWriterBarriers, in deterministic mode only (BackwardDeterministic's kWriterBarrierBytes):
  // no bytes of it exist otherwise, and only code under Traits::kDeterministic touches it.
  const uint32_t writer_bars = base + Layout::kWriterBarrierOffset;
  const auto dq_done = [&](int c) { return DqWriterBarriers::done_at(writer_bars, c); };
  const auto dq_free = [&](int c) { return DqWriterBarriers::free_at(writer_bars, c); };
  const auto bar = [](uint64_t& barrier) { return ptx::smem_address(&barrier); };

  const int tid = threadIdx.x;
  const BackwardBlock<Traits> block = BackwardBlock<Traits>::make(p);
  // Row (b, n, q0) of lse and D: int32, as backward_tma_compatible checks.
  const auto stats_row = [&](int n, int q0) {
    return (block.b * int(p.num_heads) + n) * int(p.seqlen_q) + q0;
  };

  if (tid == 0) {
    ptx::mbarrier_init(bar(bars.kv_full), 1);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(bar(bars.q_full[s]), 1);
      ptx::mbarrier_init(bar(bars.q_empty[s]), Traits::kConsumerWarps);
    }
    if constexpr (Traits::kDeterministic) {
      static_assert(sizeof(DqWriterBarriers) <= Traits::kWriterBarrierBytes, "barriers fit");
      for (int c = 0; c < Traits::kConsumers; ++c) {
        ptx::mbarrier_init(dq_done(c), 4);
        ptx::mbarrier_init(dq_free(c), 1);
      }
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  const int warpgroup = tid / 128;
  // The n-th step uses stage n % kStages; its full barrier completes phase (n / kStages) & 1, and
  // the producer refilling it waits for the empty barrier's phase of step n - kStages.
  const auto phase = [](int step) { return uint32_t(step / kStages) & 1; };
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<Traits::kProducerRegisters>();
    if (tid == 0) {  // every TMA load
      if (block.steps > 0) {
        ptx::mbarrier_arrive_expect_tx(bar(bars.kv_full), 2 * Traits::kKVBytes);
        for (int span = 0; span < kSpans; ++span) {
          ptx::tma_load_4d(sK + span * kBlockN * kRowBytes, &maps.k, bar(bars.kv_full),
                           span * kSpanElems, block.kv_head, block.key0, block.b);
          ptx::tma_load_4d(sV + span * kBlockN * kRowBytes, &maps.v, bar(bars.kv_full),
                           span * kSpanElems, block.kv_head, block.key0, block.b);
        }
      }
      int n = block.head0, tile = block.tile_begin;
      for (int step = 0; step < block.steps; ++step) {
        const int stage = step % kStages;
        if (step >= kStages) ptx::mbarrier_wait(bar(bars.q_empty[stage]), phase(step) ^ 1);
        const uint32_t full = bar(bars.q_full[stage]);
        ptx::mbarrier_arrive_expect_tx(full, 2 * Traits::kQBytes +
                                                 2 * Traits::kStatsBox * sizeof(float) +
                                                 Traits::QIdBox::kBytes);
        for (int span = 0; span < kSpans; ++span) {
          ptx::tma_load_4d(sQ(stage) + span * kBlockM * kRowBytes, &maps.q, full,
                           span * kSpanElems, n, tile * kBlockM, block.b);
          ptx::tma_load_4d(sdO(stage) + span * kBlockM * kRowBytes, &maps.d_out, full,
                           span * kSpanElems, n, tile * kBlockM, block.b);
        }
        const int box0 = stats_row(n, tile * kBlockM) & -kFlatAlignElems;
        const uint32_t stage_stats = sStats + stage * Traits::kStatsStageBytes;
        ptx::tma_load_1d(stage_stats, &maps.lse, full, box0);
        ptx::tma_load_1d(stage_stats + kStatsStride * sizeof(float), &maps.delta, full, box0);
        if constexpr (Traits::kSegments)
          ptx::tma_load_1d(sQIds(stage), &maps.q_ids, full,
                           cuda::id_box_start(block.b, int(p.seqlen_q), tile * kBlockM));
        if (++tile == block.tile_begin + block.tiles) tile = block.tile_begin, ++n;
      }
    }
    if constexpr (Traits::kDeterministic)
      if (tid == 32) write_dq_in_order<Traits>(p, maps, block, writer_bars, sDq(0));
    return;
  }

  // Consumers.
  ptx::setmaxnreg_inc<Traits::kConsumerRegisters>();
  const int consumer = warpgroup - 1, warp = (tid / 32) % 4, lane = tid % 32;
  constexpr bool kSplit = Traits::kSplitHeadDim;
  const int wg_key0 = kSplit ? 0 : consumer * 64;  // this warpgroup's keys of the block
  const int warp_key0 = wg_key0 + warp * 16;       // this warp's 16 keys (its accumulator rows)
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);
  // This warpgroup's dQ: its first query of the tile and its first column.
  const int dq_row0 = Traits::kDqSplitRows ? consumer * Traits::kDqRows : 0;
  const int dq_col0 = Traits::kDqSplitRows ? 0 : consumer * Traits::kDqCols;
  // The first span of this warpgroup's dK / dV columns (the head dim split between consumers).
  const int dkv_span0 = kSplit ? consumer * (Traits::kDkvCols / kSpanElems) : 0;

  // The K, V and dQ-K descriptors are the same on every tile: without an opaque copy of their
  // base per tile ptxas hoists all of them out of the tile loop (64-bit each: 48 registers at
  // head dim 128, which spills); rebuilt per tile they cost two integer ops each
  // (docs/decisions/hopper-kernels-without-spills.md).
  const uint32_t k_dq_offset = (dq_col0 / kSpanElems) * kBlockN * kRowBytes +
                               (dq_col0 % kSpanElems) * 2;
  using Desc = BackwardDescriptors<Traits>;

  constexpr int kConsumersBarrier = BackwardNamedBarriers::kConsumers;
  constexpr int kWarpgroupBarrier = BackwardNamedBarriers::kWarpgroup;
  constexpr int kConsumerThreads = 128 * Traits::kConsumers;
  // One arrival per warp: __syncwarp orders every lane's accesses (its reads of a Q/dO stage,
  // its dQ stores or additions) before lane 0's arrival.
  const auto release = [&](uint32_t barrier) {
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(barrier);
  };
  const auto fence = [](auto& acc) {
#pragma unroll
    for (auto& tile : acc)
#pragma unroll
      for (auto& x : tile) ptx::fence_register(x);
  };

  float dk_acc[kDTiles][4], dv_acc[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[d][e] = dv_acc[d][e] = 0.f;
  // The factor on the scores in P^T's exponent: scale log2(e), or c = cap log2(e) where they
  // are tanh(s scale / cap) (kSoftCap; the capped base-2 logit is c times that).
  [[maybe_unused]] const auto soft_cap =
      Traits::kSoftCap ? cuda::SoftCapLogits::make(p) : cuda::SoftCapLogits{};
  const float score_scale = Traits::kSoftCap ? soft_cap.cap2 : p.scale * cuda::kLog2e;
  // kSegments: the id of this warp's key lane % 16 (the last key's past S), read once per
  // block: the tests below take the keys' ids from it by shuffles, and the queries' from the
  // ids that land with each Q tile (cuda::id_box_start's box).
  [[maybe_unused]] int32_t lane_key_id = 0;
  [[maybe_unused]] uint32_t q_ids_skip = 0;
  if constexpr (Traits::kSegments) {
    lane_key_id = p.kv_segment_ids[int64_t(block.b) * p.seqlen_k +
                                   min(block.key0 + warp_key0 + lane % 16, int(p.seqlen_k) - 1)];
    q_ids_skip = cuda::id_box_skip_bytes(block.b, int(p.seqlen_q));
  }

  if (block.steps > 0) {
    ptx::mbarrier_wait(bar(bars.kv_full), 0);
    // The tensor maps span S, so a block that holds a batch entry's key length loaded the
    // cache's rows past it, which may hold NaN or Inf: hidden P and dS of 0 would still multiply
    // them (dP^T = V dO^T, dQ = dS K). Each consumer zeroes its own 64 rows of K and V; its
    // products read them after the warpgroup barrier below, the other's dQ after the first
    // consumers' barrier. With the head dim split both consumers have the same 64 rows: each
    // zeroes every other chunk of them, and both meet before either reads them.
    const int first_row = p.kv_seqlens == nullptr
                              ? kBlockN
                              : int(block_visibility(p, block.b).kv_len) - block.key0;
    if (first_row < wg_key0 + 64) {
      constexpr int kRowChunks = kRowBytes / 16;
      constexpr int kZeroThreads = kSplit ? kConsumerThreads : 128;
      const int row0 = first_row > wg_key0 ? first_row : wg_key0;
      const int chunks = (wg_key0 + 64 - row0) * kRowChunks;
      for (int i = kSplit ? tid - 128 : tid % 128; i < kSpans * chunks; i += kZeroThreads) {
        const uint32_t offset = (i / chunks) * kBlockN * kRowBytes +
                                (row0 + (i % chunks) / kRowChunks) * kRowBytes +
                                (i % kRowChunks) * 16;
        ptx::st_shared_v4_b32(sK + offset, 0, 0, 0, 0);
        ptx::st_shared_v4_b32(sV + offset, 0, 0, 0, 0);
      }
      ptx::fence_proxy_async_shared();  // generic stores that wgmma (async proxy) reads
      if constexpr (kSplit)
        ptx::named_barrier_sync(kConsumersBarrier, kConsumerThreads);
      else
        ptx::named_barrier_sync(kWarpgroupBarrier + consumer, 128);
    }
  }
  int n = block.head0, tile = block.tile_begin;
  for (int step = 0; step < block.steps; ++step) {
    // With the head dim split each consumer has the tile's whole dS^T, in a buffer of its own.
    const int stage = step % kStages, ds_buffer = kSplit ? consumer : step % Traits::kDsBuffers;
    const int q0 = tile * kBlockM;
    // lse and D of the tile's queries, which start this many rows into their boxes.
    const int box_shift = stats_row(n, q0) % kFlatAlignElems;
    const float* lse = stats + stage * 2 * kStatsStride + box_shift;
    const float* delta = lse + kStatsStride;
    ptx::mbarrier_wait(bar(bars.q_full[stage]), phase(step));
    // kSegments: whether one document holds the tile's queries and this warp's keys, asked
    // here, before the products, which then hold none of its registers (asked under them with
    // the ids in global memory, it spilled at head dim 128). The answer counts only where every
    // pair is inside the lengths.
    bool one_document = true;
    if constexpr (Traits::kSegments)
      one_document = cuda::one_segment<kBlockM>(lane_key_id, sQIds(stage) + q_ids_skip, lane);

    // S^T = K_wg Q^T and dP^T = V_wg dO^T (64 keys x kBlockM queries each), as two commit
    // groups, so that P^T is computed while dP^T is still running.
    float s_acc[kQTiles][4], dp_acc[kQTiles][4];
    const uint32_t k_tile = ptx::opaque(sK + wg_key0 * kRowBytes);
    const uint32_t v_tile = ptx::opaque(sV + wg_key0 * kRowBytes);
    fence(s_acc);
    fence(dp_acc);
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      ptx::wgmma_ss<kBlockM, Elem>(s_acc, Desc::k_major(k_tile, kBlockN, ks),
                                   Desc::k_major(sQ(stage), kBlockM, ks), ks > 0);
    ptx::wgmma_commit_group();
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      ptx::wgmma_ss<kBlockM, Elem>(dp_acc, Desc::k_major(v_tile, kBlockN, ks),
                                   Desc::k_major(sdO(stage), kBlockM, ks), ks > 0);
    ptx::wgmma_commit_group();

    // P^T. This thread's elements [j][e]: query q0 + 8 j + quad_col + e % 2, key
    // key0 + quad_row + 8 (e / 2) of the warp's first key key0. A row that saw no key has
    // lse = -inf, whose -lse log2(e) is taken as -inf, and exp2 turns its scores into 0 (scale > 0,
    // so never inf - inf). Only tiles that straddle a length or window boundary test elements:
    // a hidden element's P is set to 0 after exp2, as its row's lse may be NaN (a row that saw a
    // NaN logit, or in the last query tile of a head the slot of a row past T, which holds the
    // next head's row: the stats box is flat), and NaN must not reach the keys it hides.
    static_assert(kQTiles * 4 <= 64, "one bit per element of a thread's S^T");
    using HiddenBits = std::conditional_t<kQTiles * 4 <= 32, uint32_t, uint64_t>;
    HiddenBits hidden = 0;  // bit 4 j + e: element [j][e] is hidden
    ptx::wgmma_wait<1>();
    fence(s_acc);
    {
      const cuda::Visibility vis = block_visibility(p, block.b);
      const int key0 = block.key0 + warp_key0;
      // kSegments: and one document holds the tile's queries and the warp's keys; else each
      // visible element tests its ids.
      if (!vis.all_visible(q0, q0 + kBlockM, key0, key0 + 16) || !one_document) {
        const cuda::TileVisibility tile_vis =
            cuda::TileVisibility::make(vis, q0 + quad_col, key0 + quad_row, kBlockM + 16);
#pragma unroll
        for (int j = 0; j < kQTiles; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (!tile_vis.visible(8 * j + e % 2, 8 * (e / 2)))
              hidden |= HiddenBits(1) << (4 * j + e);
        if constexpr (Traits::kSegments) {
          // The ids of every element (what the lengths hide stays hidden). One 8-query tile at
          // a time: unrolled, the reads in flight together spill at head dim 128.
          const uint32_t q_ids = sQIds(stage) + q_ids_skip + uint32_t(quad_col) * 4;
          int32_t key_id[2];
#pragma unroll
          for (int h = 0; h < 2; ++h)
            key_id[h] = __shfl_sync(0xffffffff, lane_key_id, quad_row + 8 * h);
#pragma unroll 1
          for (int j = 0; j < kQTiles; ++j) {
            const int32_t query_id[2] = {int32_t(ptx::ld_shared_b32(q_ids + 32 * j)),
                                         int32_t(ptx::ld_shared_b32(q_ids + 32 * j + 4))};
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (query_id[e % 2] != key_id[e / 2]) hidden |= HiddenBits(1) << (4 * j + e);
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
      // Two scalar loads: box_shift leaves the pair 8-byte aligned only half the time.
      const auto neg_log2 = [](float x) { return x == -INFINITY ? -INFINITY : -x * cuda::kLog2e; };
      const float bias0 = neg_log2(lse[8 * j + quad_col]);
      const float bias1 = neg_log2(lse[8 * j + quad_col + 1]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (Traits::kSoftCap) s_acc[j][e] = soft_cap.tanh_of(s_acc[j][e]);
        s_acc[j][e] = ptx::exp2_approx(fmaf(s_acc[j][e], score_scale, e % 2 ? bias1 : bias0));
      }
    }
    if (hidden != 0) {
#pragma unroll
      for (int j = 0; j < kQTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if ((hidden >> (4 * j + e)) & 1) s_acc[j][e] = 0.f;
    }

    // dS^T = P^T (dP^T - D), in place of dP^T.
    ptx::wgmma_wait<0>();
    fence(dp_acc);
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
      const float d0 = delta[8 * j + quad_col], d1 = delta[8 * j + quad_col + 1];
#pragma unroll
      for (int e = 0; e < 4; ++e) dp_acc[j][e] = s_acc[j][e] * (dp_acc[j][e] - (e % 2 ? d1 : d0));
      if constexpr (Traits::kSoftCap) {
        // The cap's slope at the capped logit log2(P) + lse log2(e). A dS of 0 (a hidden
        // element, a row that saw nothing, an underflowed P: log2(0) = -inf) stays 0.
        const float lse0 = lse[8 * j + quad_col] * cuda::kLog2e;
        const float lse1 = lse[8 * j + quad_col + 1] * cuda::kLog2e;
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (dp_acc[j][e] != 0.f)
            dp_acc[j][e] *= soft_cap.slope(ptx::log2_approx(s_acc[j][e]) + (e % 2 ? lse1 : lse0));
      }
    }

    // P^T and dS^T rounded to Elem: the A operands of dV and dK (the S^T accumulators of 8-query
    // tiles 2 kk, 2 kk + 1 are k-step kk), and dS^T into shared memory for dQ, [key][query]
    // rows in spans of 64 queries with chunk c of row r at chunk c ^ (r % 8) (the 128-byte
    // swizzle).
    uint32_t p_frag[kQSteps][4], ds_frag[kQSteps][4];
#pragma unroll
    for (int kk = 0; kk < kQSteps; ++kk) {
      mma_sync::pack_a<Elem>(p_frag[kk], s_acc, kk);
      mma_sync::pack_a<Elem>(ds_frag[kk], dp_acc, kk);
    }
    // The offset of 8-query tile j in a dS^T row: chunk j % 8 of span j / 8; 64-query tiles
    // keep the one-span form (the general one makes ptxas reorder their code).
    const auto ds_chunk = [](uint32_t row_offset, int j) -> uint32_t {
      if constexpr (kQTiles > 8)
        return (j / 8) * kBlockN * kRowBytes + (row_offset ^ ((j % 8) << 4));
      else
        return row_offset ^ (j << 4);
    };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Register (j % 2) * 2 + h of k-step j / 2 holds key row quad_row + 8 h, queries
      // 8 j + quad_col, +1 (pack_a's order): chunk j % 8 of the row in span j / 8. Chunk c of a
      // swizzled row sits at ((c ^ row % 8) << 4): with the row's bits above bit 6 and
      // quad_col * 2 below bit 4, that is this row's chunk-0 offset XOR (c << 4).
      const int row = warp_key0 + quad_row + 8 * h;
      const uint32_t row_offset = (row * kRowBytes + ((row & 7) << 4)) | (quad_col * 2);
#pragma unroll
      for (int j = 0; j < kQTiles; ++j)
        ptx::st_shared_b32(sdS(ds_buffer) + ds_chunk(row_offset, j),
                           ds_frag[j / 2][(j % 2) * 2 + h]);
    }
    // The stores above are generic-proxy writes that wgmma (async proxy) reads.
    ptx::fence_proxy_async_shared();

    // dV += P^T dO and dK += dS^T Q over this warpgroup's keys x its kDkvCols head-dim columns,
    // reducing over the tile's queries; they run while the consumers meet at the barrier (with
    // the head dim split they are waited for before it: see dQ below).
    const uint32_t dkv_offset = dkv_span0 * kBlockM * kRowBytes;
    fence(dv_acc);
    fence(dk_acc);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kQSteps; ++kk) {
      ptx::wgmma_rs<Traits::kDkvCols, Elem>(dv_acc, p_frag[kk],
                                            Desc::query_tile(sdO(stage) + dkv_offset, kk));
      ptx::wgmma_rs<Traits::kDkvCols, Elem>(dk_acc, ds_frag[kk],
                                            Desc::query_tile(sQ(stage) + dkv_offset, kk));
    }
    ptx::wgmma_commit_group();

    // dQ = dS K over this warpgroup's 64 queries x kDqCols columns of the tile, reducing over
    // the block's keys: once both consumers have stored their dS^T, or with the head dim split
    // once this one's warps have. The thread that issues this warpgroup's dQ reductions waits
    // for the last one to have read its staging tile before the barrier, after which the
    // warpgroup overwrites it (in deterministic mode the dQ writer issues them: dq_free).
    if constexpr (Traits::kDqStaged && !Traits::kDeterministic)
      if (tid % 128 == 0) ptx::bulk_wait_group_read_all();
    if constexpr (kSplit) {
      // With the head dim split, dV and dK hold 2 x 64 accumulator registers: dQ issued while
      // they are in flight leaves ptxas too few registers to keep the wgmma chain
      // asynchronous, and it serializes every wgmma of the kernel (BackwardConfig<256>).
      ptx::wgmma_wait<0>();
      fence(dv_acc);
      fence(dk_acc);
      fence(p_frag);
      fence(ds_frag);
      ptx::named_barrier_sync(kWarpgroupBarrier + consumer, 128);
    } else {
      ptx::named_barrier_sync(kConsumersBarrier, kConsumerThreads);
    }
    float dq_acc[kDqTiles][4];
    const uint32_t k_dq_tile = ptx::opaque(sK + k_dq_offset);
    const uint32_t ds_rows = sdS(ds_buffer) + (dq_row0 / kSpanElems) * kBlockN * kRowBytes;
    fence(dq_acc);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeySteps; ++kk)
      ptx::wgmma_ss_mn_major<Traits::kDqCols, Elem>(dq_acc, Desc::ds(ds_rows, kk),
                                                    Desc::k_for_dq(k_dq_tile, kk), kk > 0);
    ptx::wgmma_commit_group();

    // dV and dK have read the stage's dO and Q (and lse / D were read above): release it.
    ptx::wgmma_wait<1>();
    fence(dv_acc);
    fence(dk_acc);
    fence(p_frag);
    fence(ds_frag);
    release(bar(bars.q_empty[stage]));

    ptx::wgmma_wait<0>();
    fence(dq_acc);
    if constexpr (Traits::kDqStaged) {
      // dQ into this warpgroup's staging tile, then one TMA reduction per 32-column box adds it
      // into dq_accum (clipping rows past T and columns past H; rows past a query length have
      // dS = 0). This thread's rows 16 warp + quad_row + 8 h, columns 8 j + quad_col, +1 of the
      // warpgroup's: column c of row r is word c % 4 of 16-byte chunk (c % 32) / 4 of the row's
      // 128 bytes in box c / 32, the chunk index XORed with r % 8 (the 128-byte swizzle of the
      // map's boxes). Chunk 2 (j % 4) + quad_col / 4 is (j % 4) << 1 XOR quad_col / 4. Rows r
      // and r ^ 1 of a half-warp would write the same banks: threads of odd rows store tile
      // j ^ 2 where the others store tile j (chunk bits XOR 2 << 5), which spreads the
      // half-warp over all 32.
      // In deterministic mode the dQ writer issues the reduction, once the reductions of the step
      // before have read the tile (dq_free).
      static_assert(kDqTiles % 4 == 0, "tiles j and j ^ 2 lie in one box");
      const bool odd_row = quad_row & 1;
      if constexpr (Traits::kDeterministic)
        if (step > 0)
          ptx::mbarrier_wait(dq_free(consumer), uint32_t(step - 1) & 1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp * 16 + quad_row + 8 * h;
        const uint32_t row_offset =
            ((row * kRowBytes + (((row & 7) ^ (quad_col / 4)) << 4)) | ((quad_col % 4) * 4)) ^
            (odd_row ? 2u << 5 : 0u);
#pragma unroll
        for (int j = 0; j < kDqTiles; ++j) {
          const uint32_t offset =
              (j / 4) * Traits::kDqRows * kRowBytes + (row_offset ^ ((j % 4) << 5));
          const float x0 = odd_row ? dq_acc[j ^ 2][2 * h] : dq_acc[j][2 * h];
          const float x1 = odd_row ? dq_acc[j ^ 2][2 * h + 1] : dq_acc[j][2 * h + 1];
          ptx::st_shared_v2_f32(sDq(consumer) + offset, x0, x1);
        }
      }
      // Generic stores that the TMA reduction (async proxy) reads.
      ptx::fence_proxy_async_shared();
      if constexpr (Traits::kDeterministic) {
        release(dq_done(consumer));
      } else {
        ptx::named_barrier_sync(kWarpgroupBarrier + consumer, 128);
        if (tid % 128 == 0) {
          for (int box = 0; box < Traits::kDqBoxes; ++box)
            ptx::tma_reduce_add_4d(&maps.dq_accum,
                                   sDq(consumer) + box * Traits::kDqRows * kRowBytes,
                                   dq_col0 + box * Traits::kDqBoxCols, n, q0 + dq_row0, block.b);
          ptx::bulk_commit_group();
        }
      }
    } else {
      // This thread's dQ rows q0 + dq_row0 + 16 warp + quad_row + 8 h, columns
      // dq_col0 + 8 j + quad_col, +1, added with red.global.add: rows past the query length
      // have dS = 0 and columns past H do not exist, so neither is added. In deterministic mode
      // once the dQ writer has said that the tile's turn has come (dq_free); each warp then says
      // it is done (dq_done), and the writer's release at GPU scope, which follows that arrival,
      // publishes the adds with it (a release is cumulative).
      if constexpr (Traits::kDeterministic)
        ptx::mbarrier_wait(dq_free(consumer), uint32_t(step) & 1);
      const int t0 = q0 + dq_row0 + warp * 16 + quad_row;
      const int col0 = dq_col0 + quad_col;
      float* dq = p.dq_accum + int64_t(block.b) * p.q_batch_stride + n * p.q_head_stride +
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
      if constexpr (Traits::kDeterministic) release(dq_done(consumer));
    }
    if (++tile == block.tile_begin + block.tiles) tile = block.tile_begin, ++n;
  }

  if constexpr (Traits::kDqStaged && !Traits::kDeterministic)
    if (tid % 128 == 0) ptx::bulk_wait_group_read_all();  // the staging tiles outlive the reads
  store_dk_dv<Elem, Traits>(p, maps, block, dk_acc, dv_acc, sK, sV,
                            BackwardEpilogueThread{tid, consumer, wg_key0, warp_key0, quad_row,
                                                   quad_col, dkv_span0});
#endif
}

}  // namespace jax_flashattn::wgmma
