// The Hopper backward's consumers: warpgroups 1 and 2, 64 keys of the block each (with the head
// dim split, the same 64 keys and some of the head-dim columns each). Per step (a query tile of
// one head) they compute
//   S^T  = K_wg Q^T                 wgmma, both operands K-major in shared memory
//   dP^T = V_wg dO^T                the same, in a second commit group
//   P^T  = exp2(S^T scale log2(e) - lse log2(e))     0 where hidden; while dP^T computes
//   dS^T = P^T (dP^T - D)
//   dV  += P^T dO,  dK += dS^T Q   wgmma, P^T / dS^T from registers, dO / Q read MN-major
//   dQ  += dS K                     wgmma from shared memory: dS^T of both consumers (A, read
//                                   MN-major) times K (B, MN-major), each consumer taking half
//                                   of the head-dim columns (of a 128-query tile, half of the
//                                   queries; with the split its dK / dV columns) over all the
//                                   block's keys; staged in shared memory and
//                                   added into the float32 accumulator (which other key
//                                   blocks add to as well) by a TMA reduction, at 256 by
//                                   red.global.add (backward_dq_add.cuh)
// Up to head dim 128 the products overlap the next step's and the elementwise work: a step's
// S^T is issued by the step before, before that step waits for its dQ and stages it
// (kScoresAhead), and at 128 dV is issued as soon as P^T is packed, under dS^T (kDvFirst).
// Keys on the rows of S^T make P^T and dS^T the A operands of dV and dK as they are computed;
// dQ needs them transposed, which the MN-major descriptor does for free, so dS^T is stored as it
// lies. One named barrier per step publishes both consumers' dS^T (double-buffered, so the same
// barrier retires the buffer the step before used). dK and dV stay in registers through the
// block and go to backward_epilogue.cuh at the end.
//
// run() is the step loop; each part of a step but the test of hidden elements is a function
// that takes its state as arguments: the thread's coordinates (BackwardConsumerThread), the
// step's (BackwardStep), and the accumulators and fragments, which are local arrays of run().
// These forms keep the code ptxas schedules for the measured kernel (benchmarks/compare_sass.py
// guards it): an object holding the dK / dV accumulators stays in memory until unrolling is
// done, and the fences' memory clobbers then keep loads of them. Where reaching a value through
// one more function changed the optimizer's order, and with it ptxas's schedule, a comment says
// how the value is formed instead.
#pragma once

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
#include "ffi/cuda/wgmma/backward_bias_and_mask.cuh"
#include "ffi/cuda/wgmma/backward_dq_add.cuh"
#include "ffi/cuda/wgmma/backward_epilogue.cuh"
#include "ffi/cuda/wgmma/backward_mma.cuh"
#include "ffi/cuda/wgmma/backward_pipeline.cuh"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// kConsumer: with an uneven head dim split (Traits::kUnevenSplit) each consumer warpgroup runs
// an instance of its own, for its number of columns; otherwise -1, one instance for both.
template <typename Elem, typename Traits, int kConsumer = -1>
struct BackwardConsumer {
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  static constexpr int kStages = Traits::kStages, kHeadDim = Traits::kHeadDim;
  static constexpr int kSpans = Traits::kSpans, kSpanElems = Traits::kSpanElems;
  static constexpr int kKSteps = Traits::kUsedDim / 16;  // k16 steps of S^T and dP^T (head dim)
  static constexpr int kQSteps = kBlockM / 16;    // k16 steps of dV and dK (over the queries)
  static constexpr int kKeySteps = kBlockN / 16;  // k16 steps of dQ (over the block's keys)
  static constexpr int kQTiles = kBlockM / 8;     // 8-query column tiles of S^T and dP^T
  static_assert(Traits::kUnevenSplit == (kConsumer >= 0), "an instance per consumer if uneven");
  static constexpr bool kLast = kConsumer == Traits::kConsumers - 1;
  // This consumer's dK / dV and dQ columns.
  static constexpr int kDkvCols = kLast ? Traits::kLastDkvCols : Traits::kDkvCols;
  static constexpr int kDqCols = kLast ? Traits::kLastDqCols : Traits::kDqCols;
  static constexpr int kDTiles = kDkvCols / 8;  // 8-wide column tiles of dK, dV
  static constexpr int kDqTiles = kDqCols / 8;  // 8-wide column tiles of dQ
  static constexpr bool kSplit = Traits::kSplitHeadDim;
  // S^T of the next step issued before this step's dQ is added (run()). With the head dim
  // split, S^T beside dK, dV and dQ (224 accumulator registers) spills and serializes the
  // wgmma chain (ptxas, CUDA 13.0), so there each step issues its own.
  static constexpr bool kScoresAhead = !kSplit;
  // dV += P^T dO issued as soon as P^T is packed, under dS^T's computation, dK once dS^T is
  // (kDvFirst). S^T, dP^T, the P^T fragments and dK + dV are live together then: 208 registers
  // at head dim 128; at 64 (128-query tiles) 224, which spills 48-104 B and serializes the
  // wgmma chain (ptxas C7512), so there dV and dK go together once dS^T is stored; and with a
  // bias or mask (whose reads and dbias stores spill 56 B at 128 with dV first, none without).
  static constexpr int kDvFirstRegisters = 2 * kQTiles * 4 + kQSteps * 4 + 2 * kDTiles * 4;
  static constexpr bool kDvFirst =
      !kSplit && kDvFirstRegisters <= 208 && !Traits::kBiasAndMask;
  static constexpr int kConsumersBarrier = BackwardNamedBarriers::kConsumers;
  static constexpr int kWarpgroupBarrier = BackwardNamedBarriers::kWarpgroup;
  static constexpr int kConsumerThreads = 128 * Traits::kConsumers;
  static_assert(kQTiles * 4 <= 64, "one bit per element of a thread's S^T");
  // Bit 4 j + e: element [j][e] of this thread's S^T is hidden.
  using HiddenBits = std::conditional_t<kQTiles * 4 <= 32, uint32_t, uint64_t>;
  using Desc = BackwardDescriptors<Traits>;
  using Thread = BackwardConsumerThread;
  using Barriers = BackwardBarriers<Traits>;
  using Layout = BackwardSmemLayout<Traits>;
  // The factor on the scores in P^T's exponent: scale log2(e), or c = cap log2(e) where they
  // are tanh(s scale / cap) (kSoftCap; the capped base-2 logit is c times that), or 1 where
  // they are base-2 logits with the bias added already (kBiasAndMask).
  struct Scores {
    cuda::SoftCapLogits soft_cap;
    float scale;
  };

  const AttentionParams& p;
  const BackwardMapsFor<Traits::kSegments>& maps;
  const BackwardSmem<Traits>& smem;
  const BackwardBlock<Traits>& block;

  template <typename Fragment>
  __device__ __forceinline__ static void fence(Fragment& acc) {
#pragma unroll
    for (auto& tile : acc)
#pragma unroll
      for (auto& x : tile) ptx::fence_register(x);
  }

  // consumer: tid / 128 - 1, from the kernel's warpgroup index.
  __device__ __forceinline__ static Thread thread(int tid, int consumer) {
    Thread th;
    th.tid = tid, th.consumer = consumer, th.warp = (tid / 32) % 4, th.lane = tid % 32;
    th.wg_key0 = kSplit ? 0 : consumer * 64;
    th.warp_key0 = th.wg_key0 + th.warp * 16;
    th.quad_row = th.lane / 4, th.quad_col = 2 * (th.lane % 4);
    th.dq_row0 = Traits::kDqSplitRows ? consumer * Traits::kDqRows : 0;
    th.dq_col0 = Traits::kDqSplitRows ? 0 : consumer * Traits::kDqCols;
    th.dkv_span0 = kSplit ? consumer * (Traits::kDkvCols / kSpanElems) : 0;
    return th;
  }

  // The tensor maps span S, so a block that holds a batch entry's key length loaded the
  // cache's rows past it, which may hold NaN or Inf: hidden P and dS of 0 would still multiply
  // them (dP^T = V dO^T, dQ = dS K). Each consumer zeroes its own 64 rows of K and V; its
  // products read them after the warpgroup barrier below, the other's dQ after the first
  // consumers' barrier. With the head dim split both consumers have the same 64 rows: each
  // zeroes every other chunk of them, and both meet before either reads them.
  __device__ __forceinline__ void zero_kv_past_length(const Thread& th) const {
    // th.wg_key0, spelled out as the constant it is with the head dim split: the products below
    // fold as they did in the unsplit kernel only where the constant is in sight.
    const int wg_key0 = kSplit ? 0 : th.wg_key0;
    const int first_row = p.kv_seqlens == nullptr
                              ? kBlockN
                              : int(block_visibility(p, block.b).kv_len) - block.key0;
    if (first_row < wg_key0 + 64) {
      constexpr int kRowChunks = kRowBytes / 16;
      constexpr int kZeroThreads = kSplit ? kConsumerThreads : 128;
      const int row0 = first_row > wg_key0 ? first_row : wg_key0;
      const int chunks = (wg_key0 + 64 - row0) * kRowChunks;
      for (int i = kSplit ? th.tid - 128 : th.tid % 128; i < kSpans * chunks;
           i += kZeroThreads) {
        const uint32_t offset = (i / chunks) * kBlockN * kRowBytes +
                                (row0 + (i % chunks) / kRowChunks) * kRowBytes +
                                (i % kRowChunks) * 16;
        ptx::st_shared_v4_b32(smem.k() + offset, 0, 0, 0, 0);
        ptx::st_shared_v4_b32(smem.v() + offset, 0, 0, 0, 0);
      }
      ptx::fence_proxy_async_shared();  // generic stores that wgmma (async proxy) reads
      if constexpr (kSplit)
        ptx::named_barrier_sync(kConsumersBarrier, kConsumerThreads);
      else
        ptx::named_barrier_sync(kWarpgroupBarrier + th.consumer, 128);
    }
  }

  // S^T = K_wg Q^T (kS) and dP^T = V_wg dO^T (kDp), 64 keys x kBlockM queries each, each a
  // commit group of its own, so that P^T is computed while dP^T is still running; with
  // kScoresAhead S^T is issued while the step before adds its dQ, dP^T at the step's start.
  // kSSteps < kKSteps: the first k-steps of S^T only, a product whose result is discarded
  // (run()). The K, V and dQ-K descriptors are the same on every step: without an opaque copy
  // of their base per step ptxas hoists all of them out of the step loop (64-bit each: 48
  // registers at head dim 128, which spills); rebuilt per step they cost two integer ops each
  // (docs/decisions/hopper-kernels-without-spills.md).
  template <bool kS, bool kDp, int kSSteps = kKSteps>
  __device__ __forceinline__ void issue_scores(const Thread& th, int stage,
                                               float (&s_acc)[kQTiles][4],
                                               float (&dp_acc)[kQTiles][4]) const {
    const uint32_t k_tile = ptx::opaque(smem.k() + th.wg_key0 * kRowBytes);
    const uint32_t v_tile = ptx::opaque(smem.v() + th.wg_key0 * kRowBytes);
    if constexpr (kS) fence(s_acc);
    if constexpr (kDp) fence(dp_acc);
    ptx::wgmma_fence();
    if constexpr (kS) {
#pragma unroll
      for (int ks = 0; ks < kSSteps; ++ks)
        ptx::wgmma_ss<kBlockM, Elem>(s_acc, Desc::k_major(k_tile, kBlockN, ks),
                                     Desc::k_major(smem.q(stage), kBlockM, ks), ks > 0);
      ptx::wgmma_commit_group();
    }
    if constexpr (kDp) {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks)
        ptx::wgmma_ss<kBlockM, Elem>(dp_acc, Desc::k_major(v_tile, kBlockN, ks),
                                     Desc::k_major(smem.d_out(stage), kBlockM, ks), ks > 0);
      ptx::wgmma_commit_group();
    }
  }

  __device__ __forceinline__ Scores score_factors() const {
    Scores scores;
    scores.soft_cap = Traits::kSoftCap ? cuda::SoftCapLogits::make(p) : cuda::SoftCapLogits{};
    scores.scale = Traits::kSoftCap        ? scores.soft_cap.cap2
                   : Traits::kBiasAndMask ? 1.f
                                          : p.scale * cuda::kLog2e;
    return scores;
  }

  // kBiasAndMask: this thread's reads of the bias and mask, ALiBi's term, and its writes of
  // dbias and dslopes.
  __device__ __forceinline__ BackwardBiasAndMask<Traits, HiddenBits> bias_and_mask(
      const Thread& th) const {
    const int64_t key = int64_t(block.key0) + th.warp_key0 + th.quad_row;
    return {p, block.b, key, th.quad_col, th.consumer, th.lane, th.warp_key0, smem.term(0)};
  }

  // kSegments: the id of this warp's key lane % 16 (the last key's past S), read once per
  // block: the element tests take the keys' ids from it by shuffles, and the queries' from the
  // ids that land with each Q tile (cuda::id_box_start's box), q_ids_skip bytes into it.
  struct KeyIds {
    int32_t lane_key_id;
    uint32_t q_ids_skip;
  };
  __device__ __forceinline__ KeyIds key_ids(const Thread& th) const {
    KeyIds ids;
    ids.lane_key_id =
        p.kv_segment_ids[int64_t(block.b) * p.seqlen_k +
                         min(block.key0 + th.warp_key0 + th.lane % 16, int(p.seqlen_k) - 1)];
    ids.q_ids_skip = cuda::id_box_skip_bytes(block.b, int(p.seqlen_q));
    return ids;
  }

  // P^T in place of S^T. A row that saw no key has lse = -inf, whose -lse log2(e) is taken as
  // -inf, and exp2 turns its scores into 0 (scale > 0, so never inf - inf). A hidden element's
  // P is set to 0 after exp2, as its row's lse may be NaN (a row that saw a NaN logit, or in the
  // last query tile of a head the slot of a row past T, which holds the next head's row: the
  // stats box is flat), and NaN must not reach the keys it hides.
  __device__ __forceinline__ static void probabilities(const Thread& th, const Scores& scores,
                                                       const float* lse, HiddenBits hidden,
                                                       float (&s_acc)[kQTiles][4]) {
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
      // Two scalar loads: box_shift leaves the pair 8-byte aligned only half the time.
      const auto neg_log2 = [](float x) { return x == -INFINITY ? -INFINITY : -x * cuda::kLog2e; };
      const float bias0 = neg_log2(lse[8 * j + th.quad_col]);
      const float bias1 = neg_log2(lse[8 * j + th.quad_col + 1]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (Traits::kSoftCap) s_acc[j][e] = scores.soft_cap.tanh_of(s_acc[j][e]);
        s_acc[j][e] = ptx::exp2_approx(fmaf(s_acc[j][e], scores.scale, e % 2 ? bias1 : bias0));
      }
    }
    if (hidden != 0) {
#pragma unroll
      for (int j = 0; j < kQTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if ((hidden >> (4 * j + e)) & 1) s_acc[j][e] = 0.f;
    }
  }

  // dS^T = P^T (dP^T - D), in place of dP^T; soft-capped, times the cap's slope at the capped
  // logit log2(P) + lse log2(e). A dS of 0 (a hidden element, a row that saw nothing, an
  // underflowed P: log2(0) = -inf) stays 0.
  __device__ __forceinline__ static void score_gradients(const Thread& th, const Scores& scores,
                                                         const float* lse, const float* delta,
                                                         const float (&s_acc)[kQTiles][4],
                                                         float (&dp_acc)[kQTiles][4]) {
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
      const float d0 = delta[8 * j + th.quad_col], d1 = delta[8 * j + th.quad_col + 1];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dp_acc[j][e] = s_acc[j][e] * (dp_acc[j][e] - (e % 2 ? d1 : d0));
      if constexpr (Traits::kSoftCap) {
        const float lse0 = lse[8 * j + th.quad_col] * cuda::kLog2e;
        const float lse1 = lse[8 * j + th.quad_col + 1] * cuda::kLog2e;
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (dp_acc[j][e] != 0.f)
            dp_acc[j][e] *= scores.soft_cap.slope(ptx::log2_approx(s_acc[j][e]) +
                                                  (e % 2 ? lse1 : lse0));
      }
    }
  }

  // P^T and dS^T rounded to Elem: the A operands of dV and dK (the S^T accumulators of 8-query
  // tiles 2 kk, 2 kk + 1 are k-step kk), and dS^T into dS^T buffer `buffer` for dQ,
  // [key][query] rows in spans of 64 queries with chunk c of row r at chunk c ^ (r % 8) (the
  // 128-byte swizzle).
  template <bool kPackP = true>
  __device__ __forceinline__ void store_ds(const Thread& th, int buffer,
                                           const float (&s_acc)[kQTiles][4],
                                           const float (&dp_acc)[kQTiles][4],
                                           uint32_t (&p_frag)[kQSteps][4],
                                           uint32_t (&ds_frag)[kQSteps][4]) const {
#pragma unroll
    for (int kk = 0; kk < kQSteps; ++kk) {
      if constexpr (kPackP) mma_sync::pack_a<Elem>(p_frag[kk], s_acc, kk);
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
      const int row = th.warp_key0 + th.quad_row + 8 * h;
      const uint32_t row_offset = (row * kRowBytes + ((row & 7) << 4)) | (th.quad_col * 2);
#pragma unroll
      for (int j = 0; j < kQTiles; ++j)
        ptx::st_shared_b32(smem.ds(buffer) + ds_chunk(row_offset, j),
                           ds_frag[j / 2][(j % 2) * 2 + h]);
    }
    // The stores above are generic-proxy writes that wgmma (async proxy) reads.
    ptx::fence_proxy_async_shared();
  }

  // dV += P^T dO and dK += dS^T Q over this warpgroup's keys x its kDkvCols head-dim columns,
  // reducing over the tile's queries, from `stage`.
  template <bool kDv = true, bool kDk = true>
  __device__ __forceinline__ void issue_dv_dk(const Thread& th, int stage,
                                              uint32_t (&p_frag)[kQSteps][4],
                                              uint32_t (&ds_frag)[kQSteps][4],
                                              float (&dv_acc)[kDTiles][4],
                                              float (&dk_acc)[kDTiles][4]) const {
    const uint32_t dkv_offset = th.dkv_span0 * kBlockM * kRowBytes;
    if constexpr (kDv) fence(dv_acc);
    if constexpr (kDk) fence(dk_acc);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kQSteps; ++kk) {
      if constexpr (kDv)
        ptx::wgmma_rs<kDkvCols, Elem>(
            dv_acc, p_frag[kk], Desc::query_tile(smem.d_out(stage) + dkv_offset, kk));
      if constexpr (kDk)
        ptx::wgmma_rs<kDkvCols, Elem>(
            dk_acc, ds_frag[kk], Desc::query_tile(smem.q(stage) + dkv_offset, kk));
    }
    ptx::wgmma_commit_group();
  }

  // dQ = dS K over this warpgroup's 64 queries x kDqCols columns of the tile, reducing over
  // the block's keys, from dS^T buffer `buffer`. k_dq_offset: the warpgroup's first dQ column
  // of K.
  __device__ __forceinline__ void issue_dq(const Thread& th, int buffer, uint32_t k_dq_offset,
                                           float (&dq_acc)[kDqTiles][4]) const {
    const uint32_t k_dq_tile = ptx::opaque(smem.k() + k_dq_offset);
    const uint32_t ds_rows = smem.ds(buffer) + (th.dq_row0 / kSpanElems) * kBlockN * kRowBytes;
    fence(dq_acc);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeySteps; ++kk)
      ptx::wgmma_ss_mn_major<kDqCols, Elem>(dq_acc, Desc::ds(ds_rows, kk),
                                            Desc::k_for_dq(k_dq_tile, kk), kk > 0);
    ptx::wgmma_commit_group();
  }

  // Before dQ reads the step's dS^T: both consumers have stored theirs, or with the head dim
  // split this one's warps have. The thread that issues this warpgroup's dQ reductions first
  // waits for the last one to have read its staging tile, which the warpgroup overwrites after
  // the barrier (in deterministic mode the dQ writer issues them: dq_free). dV and dK run on
  // while the consumers meet, but with the head dim split they hold up to 2 x 64 accumulator
  // registers: dQ issued while they are in flight leaves ptxas too few registers to keep the
  // wgmma chain asynchronous, and it serializes every wgmma of the kernel
  // (BackwardConfig<256>), so there they are waited for first.
  __device__ __forceinline__ static void wait_for_ds(const Thread& th,
                                                     float (&dv_acc)[kDTiles][4],
                                                     float (&dk_acc)[kDTiles][4],
                                                     uint32_t (&p_frag)[kQSteps][4],
                                                     uint32_t (&ds_frag)[kQSteps][4]) {
    if constexpr (Traits::kDqStaged && !Traits::kDeterministic)
      if (th.tid % 128 == 0) ptx::bulk_wait_group_read_all();
    if constexpr (kSplit) {
      ptx::wgmma_wait<0>();
      fence(dv_acc);
      fence(dk_acc);
      fence(p_frag);
      fence(ds_frag);
      ptx::named_barrier_sync(kWarpgroupBarrier + th.consumer, 128);
    } else {
      ptx::named_barrier_sync(kConsumersBarrier, kConsumerThreads);
    }
  }

  // The block's steps, in BackwardBlock's order, then the epilogue. consumer: tid / 128 - 1,
  // the kernel's warpgroup index less the producer's.
  __device__ __forceinline__ void run(int tid, int consumer) {
    auto& bars = *reinterpret_cast<Barriers*>(smem.start + Layout::kBarrierOffset);
    const float* stats = smem.stats_ptr();
    const Thread th = thread(tid, consumer);
    // This warpgroup's first dQ column of K (issue_dq).
    const uint32_t k_dq_offset = (th.dq_col0 / kSpanElems) * kBlockN * kRowBytes +
                                 (th.dq_col0 % kSpanElems) * 2;
    float dk_acc[kDTiles][4], dv_acc[kDTiles][4];
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk_acc[d][e] = dv_acc[d][e] = 0.f;
    const Scores scores = score_factors();
    // Called for kSegments only: the call alone, folding to zeros, moved the other kernels' lse
    // loads.
    KeyIds ids{0, 0};
    if constexpr (Traits::kSegments) ids = key_ids(th);

    if (block.steps > 0) {
      ptx::mbarrier_wait(ptx::barrier_address(bars.kv_full), 0);
      zero_kv_past_length(th);
    }
    int n = block.head0, tile = block.tile_begin;
    // kScoresAhead: each step's S^T is issued by the step before (the first step's here), before
    // that step adds its dQ, so that the tensor cores have work while dQ is staged.
    float s_acc[kQTiles][4];
    if constexpr (kScoresAhead)
      if (block.steps > 0) {
        ptx::mbarrier_wait(ptx::barrier_address(bars.q_full[0]), 0);
        issue_scores<true, false>(th, 0, s_acc, s_acc);
      }
    for (int step = 0; step < block.steps; ++step) {
      BackwardStep s;
      s.step = step, s.n = n, s.q0 = tile * kBlockM;
      // With the head dim split each consumer has the tile's whole dS^T, in a buffer of its own.
      s.stage = step % kStages, s.ds_buffer = kSplit ? consumer : step % Traits::kDsBuffers;
      // lse and D of the tile's queries, which start this many rows into their boxes.
      const int box_shift = block.stats_row(p, n, s.q0) % kFlatAlignElems;
      s.lse = stats + s.stage * 2 * Traits::kStatsStride + box_shift;
      s.delta = s.lse + Traits::kStatsStride;
      if constexpr (!kScoresAhead)
        ptx::mbarrier_wait(ptx::barrier_address(bars.q_full[s.stage]),
                           step_phase<kStages>(step));
      // kSegments: whether one document holds the tile's queries and this warp's keys, asked
      // here, before the products, which then hold none of its registers (asked under them
      // with the ids in global memory, it spilled at head dim 128). The answer counts only
      // where every pair is inside the lengths.
      bool one_document = true;
      if constexpr (Traits::kSegments)
        one_document = cuda::one_segment<kBlockM>(ids.lane_key_id,
                                                  smem.q_ids(s.stage) + ids.q_ids_skip, th.lane);

      // kStagedTerm: the elements a staged mask hides, read before S^T lands.
      HiddenBits hidden = 0;
      if constexpr (Traits::kStagedTerm) hidden = bias_and_mask(th).staged_mask_bits(s);

      float dp_acc[kQTiles][4];
      if constexpr (kScoresAhead) {
        // S^T, in flight since the step before: a wait for all groups, as ptxas serializes
        // every wgmma of the kernel (C7514) where a group issued before the loop's back edge is
        // retired by a wait that leaves a later one in flight.
        ptx::wgmma_wait<0>();
        fence(s_acc);
        issue_scores<false, true>(th, s.stage, dp_acc, dp_acc);
      } else {
        issue_scores<true, true>(th, s.stage, s_acc, dp_acc);
        ptx::wgmma_wait<1>();
        fence(s_acc);
      }
      // The elements of this thread's S^T that are hidden: element [j][e] is query
      // q0 + 8 j + quad_col + e % 2, key key0 + quad_row + 8 (e / 2) of the warp's first key
      // key0. Only tiles that straddle a length or window boundary (or, kSegments, whose
      // queries and the warp's keys are not of one document) test elements. Written here, not
      // as a function: as one, with the segment ids, ptxas numbered the accumulators'
      // registers differently and the kernel's code changed.
      {
        const cuda::Visibility vis = block_visibility(p, block.b);
        const int key0 = block.key0 + th.warp_key0;
        if (!vis.all_visible(s.q0, s.q0 + kBlockM, key0, key0 + 16) || !one_document) {
          const cuda::TileVisibility tile_vis = cuda::TileVisibility::make(
              vis, s.q0 + th.quad_col, key0 + th.quad_row, kBlockM + 16);
#pragma unroll
          for (int j = 0; j < kQTiles; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (!tile_vis.visible(8 * j + e % 2, 8 * (e / 2)))
                hidden |= HiddenBits(1) << (4 * j + e);
          // kSegments, unless one document holds the tile's queries and the warp's keys (a
          // warp vote: the branch is uniform): the ids of every element (what the lengths
          // hide stays hidden). One 8-query tile at a time: unrolled, the reads in flight
          // together spill at head dim 128.
          if constexpr (Traits::kSegments)
            if (!one_document) {
              const uint32_t q_ids =
                  smem.q_ids(s.stage) + ids.q_ids_skip + uint32_t(th.quad_col) * 4;
              int32_t key_id[2];
#pragma unroll
              for (int h = 0; h < 2; ++h)
                key_id[h] = __shfl_sync(0xffffffff, ids.lane_key_id, th.quad_row + 8 * h);
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
      if constexpr (Traits::kBiasAndMask)
        bias_and_mask(th).apply(s, p.scale * cuda::kLog2e, hidden, s_acc);
      probabilities(th, scores, s.lse, hidden, s_acc);
      uint32_t p_frag[kQSteps][4], ds_frag[kQSteps][4];
      if constexpr (kDvFirst) {
#pragma unroll
        for (int kk = 0; kk < kQSteps; ++kk) mma_sync::pack_a<Elem>(p_frag[kk], s_acc, kk);
        issue_dv_dk<true, false>(th, s.stage, p_frag, ds_frag, dv_acc, dk_acc);
        ptx::wgmma_wait<1>();
      } else {
        ptx::wgmma_wait<0>();
      }
      fence(dp_acc);
      score_gradients(th, scores, s.lse, s.delta, s_acc, dp_acc);
      [[maybe_unused]] float distance_ds = 0.f;
      if constexpr (Traits::kBiasAndMask) {
        bias_and_mask(th).store_dbias(s, hidden, dp_acc);
        distance_ds = bias_and_mask(th).distance_ds(s, hidden, dp_acc);
      }

      store_ds<!kDvFirst>(th, s.ds_buffer, s_acc, dp_acc, p_frag, ds_frag);
      issue_dv_dk<!kDvFirst, true>(th, s.stage, p_frag, ds_frag, dv_acc, dk_acc);
      // kBiasAndMask: the warp's sum of distance_ds (shuffles) goes out under dV and dK, not
      // before them.
      if constexpr (Traits::kBiasAndMask) bias_and_mask(th).add_slope_gradient(s, distance_ds);
      wait_for_ds(th, dv_acc, dk_acc, p_frag, ds_frag);
      float dq_acc[kDqTiles][4];
      issue_dq(th, s.ds_buffer, k_dq_offset, dq_acc);

      // dV and dK have read the stage's dO and Q (and lse / D were read above): release it.
      ptx::wgmma_wait<1>();
      fence(dv_acc);
      fence(dk_acc);
      fence(p_frag);
      fence(ds_frag);
      release_by_warp(th, ptx::barrier_address(bars.q_empty[s.stage]));

      // kScoresAhead: the next step's S^T goes in flight before this step's dQ is waited for
      // and added. The last step issues one k-step of S^T instead, from its own stage (which no
      // load replaces any more), and discards it: with S^T in flight on one path into the
      // loop's back edge and not on the other, ptxas serializes every wgmma (C7515).
      if constexpr (kScoresAhead) {
        if (step + 1 < block.steps) {
          const int next_stage = (step + 1) % kStages;
          ptx::mbarrier_wait(ptx::barrier_address(bars.q_full[next_stage]),
                             step_phase<kStages>(step + 1));
          issue_scores<true, false>(th, next_stage, s_acc, s_acc);
        } else {
          issue_scores<true, false, 1>(th, s.stage, s_acc, s_acc);
        }
        ptx::wgmma_wait<1>();
      } else {
        ptx::wgmma_wait<0>();
      }
      fence(dq_acc);
      BackwardDqAdd<Traits, kDqCols>{p, maps, smem, block}.add(th, s, dq_acc);
      if (++tile == block.tile_begin + block.tiles) tile = block.tile_begin, ++n;
    }

    if constexpr (kScoresAhead) ptx::wgmma_wait<0>();  // the discarded S^T, before K is reused
    if constexpr (Traits::kDqStaged && !Traits::kDeterministic)
      if (tid % 128 == 0) ptx::bulk_wait_group_read_all();  // the staging tiles outlive the reads
    store_dk_dv<Elem, Traits, kDkvCols>(
        p, maps, block, dk_acc, dv_acc, smem.k(), smem.v(),
        BackwardEpilogueThread{tid, consumer, th.wg_key0, th.warp_key0, th.quad_row, th.quad_col,
                               th.dkv_span0});
  }
};

}  // namespace jax_flashattn::wgmma
