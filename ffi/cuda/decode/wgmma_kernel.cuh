// Split-KV decode forward for Hopper (sm_90a): each warpgroup computes one split's partial
// attention with wgmma (one or two warpgroups per block: decode/wgmma_traits.h); the splits merge
// as the mma.sync decode kernel's do, whose plan, rows and workspace this one shares
// (decode/block.cuh): through the workspace and the combine kernel
// (decode/combine.cuh), or, with plan.cluster_merge, inside the cluster of the unit's
// blocks (decode/cluster_merge.cuh).
//
// Each warpgroup streams its split's key tiles through its own cp.async ring, synchronising
// with a named barrier of its own (the warpgroups of a block never wait for each other before
// the merge); per tile it computes
//   S = Q K^T              wgmma, Q from registers (loaded once from global memory), K from
//                          shared memory
//   soft-cap               (mma_sync::DecodeWithSoftCap) tanh(s scale / cap), c = cap log2(e)
//                          the softmax's factor
//   bias, mask, ALiBi      (mma_sync::DecodeWithBiasAndMask) s scale log2(e) - slope log2(e)
//                          |t + shift - key| + bias log2(e), -inf where the mask hides it; the
//                          softmax's factor 1
//   mask                   per-row key bounds (lengths, causal, window), on the threads whose
//                          rows do not see the whole tile
//   online softmax         exp2 with the scale folded into one FFMA
//   O += P V               wgmma, P re-packed from the S accumulators
// and writes its normalised O and lse to the workspace or, for the cluster merge, to its
// ring's shared memory. With float8_e4m3fn keys and values (Traits::kFp8Kv) the ring holds them
// as stored and the warpgroup widens each tile (mma_sync::widen_e4m3_tile: to float16 from
// sm_89, q converted to it, else to q's dtype) into the tiles the products read, between the
// tile's barrier and one more; the key descale folds into Q's fragments and the softmax's
// factor (cuda::fold_key_descale), the value descale scales O.
#pragma once

#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/e4m3.cuh"
#include "ffi/cuda/common/fragments.cuh"
#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/smem_tile.cuh"
#include "ffi/cuda/common/softmax.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/decode/block.cuh"
#include "ffi/cuda/decode/cluster_merge.cuh"
#include "ffi/decode_plan.h"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// A warpgroup's ring: stage s holds its K tile, then its V tile, of q's dtype in the layout
// wgmma's descriptors read, or (kFp8Kv) of e4m3 byte pairs in dense rows.
template <typename Elem, typename Traits>
struct DecodeRing {
  using Unit = std::conditional_t<Traits::kFp8Kv, cuda::E4m3Pair, Elem>;
  using Layout = std::conditional_t<Traits::kFp8Kv, mma_sync::DenseRows<Traits::kSmemDim>,
                                    mma_sync::SwizzledSpans<Traits::kBlockN>>;
  static constexpr int kTileElems = Traits::kBlockN * Traits::kHeadDim * Traits::kKvBytes / 2;
  Unit* start;

  __device__ Unit* k(int stage) const { return start + stage * 2 * kTileElems; }
  __device__ Unit* v(int stage) const { return k(stage) + kTileElems; }
  // Stage `stage` <- key tile `tile` of split sp (keys past the length zero-filled), by the
  // warpgroup's thread `thread`.
  __device__ void load(const AttentionParams& p, const mma_sync::DecodeSplit& sp, int tile,
                       int stage, int thread) const {
    mma_sync::load_split_tile<typename Traits::WarpgroupCopies, Layout>(k(stage), v(stage), p, sp,
                                                                        tile, thread);
  }
};

// The warpgroup's own barrier: the block's (barrier 0) for one warpgroup, else named barrier
// 1 + warpgroup, each with its id as a constant (a computed id makes ptxas reserve all 16).
template <typename Traits>
__device__ __forceinline__ void sync_decode_warpgroup(int warpgroup) {
  if constexpr (Traits::kSplitsPerBlock == 1)
    __syncthreads();
  else if (warpgroup == 0)
    ptx::named_barrier_sync(1, Traits::kWarpgroupThreads);
  else
    ptx::named_barrier_sync(2, Traits::kWarpgroupThreads);
}

// Descriptors as in the forward kernel: K is K-major (head dim contiguous), k-step ks in span
// ks / 4, 32 bytes per step into each 128-byte row; V is MN-major for O += P V, k-step kk 16
// rows down, spans kBlockN rows apart (LBO). Each is stage 0's, advanced by a byte offset.
template <typename Traits>
struct DecodeDescriptors {
  uint64_t k0, v0;

  __device__ static DecodeDescriptors make(uint32_t ring_base) {
    return {ptx::smem_descriptor_sw128(ring_base, 16, kGroupBytes),
            ptx::smem_descriptor_sw128(ring_base + Traits::kKVBytes,
                                       Traits::kBlockN * kRowBytes, kGroupBytes)};
  }
  __device__ uint64_t k(int stage, int ks) const {
    return ptx::smem_descriptor_advance(
        k0, stage * Traits::kStageBytes + k_major_step_bytes(Traits::kBlockN, ks));
  }
  __device__ uint64_t v(int stage, int kk) const {
    return ptx::smem_descriptor_advance(v0, stage * Traits::kStageBytes + mn_major_step_bytes(kk));
  }
};

// A warpgroup's parts of the tile loop, each a function of the state it takes (the kernel
// holds the fragments and accumulators as local arrays, which keeps ptxas's schedule of the
// kernel written as one function: every decode kernel's SASS is the same). Elem: the products'
// element type (the kernel's Mma).
template <typename Elem, typename Traits>
struct DecodeWarpgroup {
  static constexpr int kStages = Traits::kStages;
  static constexpr int kKSteps = Traits::kHeadDim / 16;  // k16 steps of S = Q K^T
  static constexpr int kPSteps = Traits::kBlockN / 16;   // k16 steps of O += P V
  static constexpr int kNTiles = Traits::kBlockN / 8;    // 8-key column tiles of S
  static constexpr int kDTiles = Traits::kHeadDim / 8;   // 8-wide column tiles of O

  // Prologue: kStages - 1 tiles in flight, one commit group each (possibly empty).
  // copy_terms(tile, stage): the copies that go with a tile's K and V into its commit group (the
  // staged terms; nothing in the kernels without them).
  template <typename CopyTerms>
  __device__ __forceinline__ static void start_loads(const DecodeRing<Elem, Traits>& ring,
                                                     const AttentionParams& p,
                                                     const mma_sync::DecodeSplit& sp,
                                                     int group_tid, const CopyTerms& copy_terms) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (sp.tile_begin + s < sp.tile_end) {
        ring.load(p, sp, sp.tile_begin + s, s, group_tid);
        copy_terms(sp.tile_begin + s, s);
      }
      ptx::cp_async_commit();
    }
  }

  // Waits for key tile `tile` (the split's j-th) and refills the stage of tile j - 1 with tile
  // j + kStages - 1; returns tile j's stage. This thread's copies of tile j have landed; the
  // proxy fence makes them visible to wgmma, which reads shared memory through the async
  // proxy, and the barrier makes every thread's of the warpgroup visible, and tells that every
  // warp is done with tile j - 1, whose stage the load refills (its products were waited for).
  template <typename CopyTerms>
  __device__ __forceinline__ static int next_tile(const DecodeRing<Elem, Traits>& ring,
                                                  const AttentionParams& p,
                                                  const mma_sync::DecodeSplit& sp, int tile,
                                                  int warpgroup, int group_tid,
                                                  const CopyTerms& copy_terms) {
    const int j = tile - sp.tile_begin;
    ptx::cp_async_wait<kStages - 2>();
    ptx::fence_proxy_async_shared();
    sync_decode_warpgroup<Traits>(warpgroup);
    if (tile + kStages - 1 < sp.tile_end) {
      ring.load(p, sp, tile + kStages - 1, (j + kStages - 1) % kStages, group_tid);
      copy_terms(tile + kStages - 1, (j + kStages - 1) % kStages);
    }
    ptx::cp_async_commit();
    return j % kStages;
  }

  // kFp8Kv: the e4m3 tile in `stage` widened into the K and V tiles the products read (the
  // region's start, `widened`), by every thread of the warpgroup; next_tile's barrier told
  // that every warp is done with the tile before, and the one here that every thread's part of
  // this one is in place (the proxy fence: wgmma reads through the async proxy).
  __device__ __forceinline__ static void widen(const DecodeRing<Elem, Traits>& ring, int stage,
                                               Elem* widened, int warpgroup, int group_tid) {
    using Copies = typename Traits::WarpgroupCopies;
    using To = mma_sync::SwizzledSpans<Traits::kBlockN>;
    using From = mma_sync::DenseRows<Traits::kSmemDim>;
    mma_sync::widen_e4m3_tile<Copies, Elem, From, To>(ring.k(stage), widened, group_tid);
    mma_sync::widen_e4m3_tile<Copies, Elem, From, To>(
        ring.v(stage), widened + Traits::kBlockN * Traits::kHeadDim, group_tid);
    ptx::fence_proxy_async_shared();
    sync_decode_warpgroup<Traits>(warpgroup);
  }

  // S = Q K^T of the tile in `stage`, waited for.
  __device__ __forceinline__ static void scores(float (&s_acc)[kNTiles][4],
                                                const uint32_t (&q_frag)[kKSteps][4],
                                                const DecodeDescriptors<Traits>& desc,
                                                int stage) {
    ptx::fence_registers(s_acc);
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      ptx::wgmma_rs_k_major<Traits::kBlockN, Elem>(s_acc, q_frag[ks], desc.k(stage, ks), ks > 0);
    ptx::wgmma_commit_group();
    ptx::wgmma_wait<0>();
    ptx::fence_registers(s_acc);
  }

  // O += P V of the tile in `stage`, P re-packed from the S accumulators, waited for.
  __device__ __forceinline__ static void add_pv(float (&o_acc)[kDTiles][4],
                                                const float (&s_acc)[kNTiles][4],
                                                const DecodeDescriptors<Traits>& desc,
                                                int stage) {
    uint32_t p_frag[kPSteps][4];
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) mma_sync::pack_a<Elem>(p_frag[kk], s_acc, kk);
    ptx::fence_registers(o_acc);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk)
      ptx::wgmma_rs<Traits::kHeadDim, Elem>(o_acc, p_frag[kk], desc.v(stage, kk));
    ptx::wgmma_commit_group();
    ptx::wgmma_wait<0>();
    ptx::fence_registers(o_acc);
  }
};

template <typename Elem, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    decode_split_kernel(const __grid_constant__ AttentionParams p,
                        const mma_sync::DecodePlan plan) {
#ifdef JAX_FLASHATTN_SM90_BODY
  using Mma = cuda::ProductElem<Elem, Traits::kFp8Kv>;  // the products' element type
  using Warpgroup = DecodeWarpgroup<Mma, Traits>;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kSplitsPerBlock = Traits::kSplitsPerBlock;
  constexpr int kGroupThreads = Traits::kWarpgroupThreads;
  static_assert(kSplitsPerBlock <= 2, "one named barrier per warpgroup (sync_decode_warpgroup)");
  static_assert(!Traits::kFp8Kv || !(Traits::kSoftCap || Traits::kBiasAndMask),
                "e4m3 keys and values take the plain kernels (decode_fp8_kv_fits)");
  static_assert(Traits::kMinBlocks * (Traits::kSmemBytes + 1024) <= 228 * 1024,
                "the blocks of an SM (and their 1 KiB of reserved shared memory) fit it");

  const int tid = threadIdx.x, lane = tid % 32;
  const int warpgroup = tid / kGroupThreads, group_tid = tid % kGroupThreads;
  const int warp = group_tid / 32;  // the warp's 16-row slab
  const int quad_col = 2 * (lane % 4);  // accumulator column pair

  // The rings (DecodeRing) from the next 1024-byte boundary (the 128-byte swizzle's period), one
  // per warpgroup.
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_address = ptx::smem_address(smem_raw);
  const uint32_t rings = (raw_address + kGroupBytes - 1) & ~(kGroupBytes - 1);
  const uint32_t base = rings + warpgroup * Traits::kRingBytes;
  // kFp8Kv: the widened K and V tiles first, at base, then the ring.
  unsigned char* const region = smem_raw + (base - raw_address);
  using Ring = DecodeRing<Mma, Traits>;
  const Ring ring{reinterpret_cast<typename Ring::Unit*>(region + Traits::kWidenedBytes)};

  // The split, then at once its first tiles' requests (DecodeSplit, decode/block.cuh).
  // plan.blocks_per_unit() in 32 bits, divided by a constant (its splits_per_block is this
  // configuration's kSplitsPerBlock): no 64-bit division before the first requests
  // (docs/decisions/decode-kv-streaming.md).
  const int blocks_per_unit = int(plan.splits) / kSplitsPerBlock;
  const int block = int(blockIdx.x);
  const mma_sync::DecodeSplit sp = mma_sync::DecodeSplit::make<kBlockN, Traits::kBiasAndMask>(
      p, plan, block / blocks_per_unit, block % blocks_per_unit * kSplitsPerBlock + warpgroup);
  // kStagedTerms: the warpgroup's stages of terms after the rings
  // (mma_sync::DecodeWithBiasAndMask), each filled with its tile's K and V.
  [[maybe_unused]] unsigned char* const terms_region =
      smem_raw + (rings - raw_address) + kSplitsPerBlock * Traits::kRingBytes +
      warpgroup * Traits::kStages * Traits::kTermStageBytes;
  const auto copy_terms = [&](int tile, int stage) {
    if constexpr (Traits::kStagedTerms)
      mma_sync::DecodeBiasAndMask::copy_tile<kBlockN>(
          terms_region + stage * Traits::kTermStageBytes, p, sp, tile, group_tid, kGroupThreads);
    if constexpr (Traits::kSegments)
      mma_sync::DecodeBiasAndMask::copy_key_ids<kBlockN>(
          terms_region + stage * Traits::kTermStageBytes, p, sp, tile, group_tid, kGroupThreads);
  };
  Warpgroup::start_loads(ring, p, sp, group_tid, copy_terms);

  // Where the split's result goes: the workspace, or its ring's shared memory (drained) for the
  // cluster merge, which finds the block's splits' partials a ring apart.
  using ClusterPartial = mma_sync::ClusterPartial<kHeadDim>;
  static_assert(ClusterPartial::kBytes <= Traits::kRingBytes,
                "the cluster merge's partial fits in a ring");
  float* cluster_partials =
      reinterpret_cast<float*>(smem_raw + (rings - raw_address));  // warpgroup 0's
  constexpr int kPartialStride = Traits::kRingBytes / int(sizeof(float));
  const mma_sync::PartialRows partial =
      plan.cluster_merge ? ClusterPartial::at(reinterpret_cast<float*>(region))
                         : mma_sync::workspace_partial(plan, sp.unit, sp.split);
  if (sp.tile_begin >= sp.tile_end) {
    mma_sync::store_empty_split(partial, plan, group_tid, kGroupThreads);
    if (plan.cluster_merge)
      mma_sync::merge_cluster_splits<Elem, kHeadDim, kSplitsPerBlock>(
          p, plan, sp, cluster_partials, kPartialStride, tid, Traits::kThreads);
    return;
  }

  const mma_sync::DecodeRows rows =
      mma_sync::DecodeRows::make(sp.vis, warp, lane, int(plan.rows), sp.group);
  uint32_t q_frag[Warpgroup::kKSteps][4];
  mma_sync::load_q_fragments<Elem>(q_frag, p, sp, rows, plan.rows, quad_col);
  float o_acc[1][Warpgroup::kDTiles][4] = {};
  cuda::OnlineSoftmax<1> softmax;
  softmax.init();
  float scale_log2 = mma_sync::decode_softmax_scale<Traits>(p);
  // A bfloat16 query's rows as float16, each with the factor its scores take back.
  [[maybe_unused]] float q_row_factor[2];
  if constexpr (!std::is_same_v<Mma, Elem>) cuda::q_fragments_to_half(q_frag, q_row_factor);
  if constexpr (Traits::kFp8Kv)
    scale_log2 *= cuda::fold_key_descale<Mma>(p.k_descale[sp.unit], q_frag);
  [[maybe_unused]] mma_sync::DecodeBiasAndMask terms;
  if constexpr (Traits::kBiasAndMask) {
    terms = mma_sync::DecodeBiasAndMask::make<Traits::kStagedTerms>(p, sp, rows);
    if constexpr (!Traits::kStagedTerms)
      terms.prefetch(p, sp.tile_begin * kBlockN, kBlockN, lane);
  }

  const auto desc = DecodeDescriptors<Traits>::make(base);

  float s_acc[1][Warpgroup::kNTiles][4];
  for (int tile = sp.tile_begin; tile < sp.tile_end; ++tile) {
    int stage = Warpgroup::next_tile(ring, p, sp, tile, warpgroup, group_tid, copy_terms);
    if constexpr (Traits::kFp8Kv) {
      Warpgroup::widen(ring, stage, reinterpret_cast<Mma*>(region), warpgroup, group_tid);
      stage = 0;  // the products read the widened tiles
    }
    if constexpr (Traits::kBiasAndMask && !Traits::kStagedTerms)
      if (tile + 1 < sp.tile_end)
        terms.prefetch(p, (tile + 1) * kBlockN, kBlockN, lane);
    Warpgroup::scores(s_acc[0], q_frag, desc, stage);
    if constexpr (!std::is_same_v<Mma, Elem>) cuda::scale_score_rows(s_acc[0], q_row_factor);
    const int key0 = tile * kBlockN;
    mma_sync::cap_decode_scores<Traits::kSoftCap>(p, s_acc[0]);
    if constexpr (Traits::kStagedTerms)
      terms.template apply_staged<kBlockN>(p, sp, s_acc[0], key0, quad_col,
                                           terms_region + stage * Traits::kTermStageBytes);
    else if constexpr (Traits::kBiasAndMask)
      if (mma_sync::decode_applies_terms<Traits>(p))
        terms.template apply<Traits::kAlibi>(p, sp, rows, s_acc[0], key0, quad_col);
    if constexpr (Traits::kSegments)
      mma_sync::DecodeBiasAndMask::hide_other_documents<kBlockN>(
          p, sp, rows, s_acc[0], key0, quad_col, terms_region + stage * Traits::kTermStageBytes);
    if (!rows.sees_all(key0, kBlockN)) rows.mask(s_acc[0], key0, quad_col);
    softmax.update(s_acc, o_acc, scale_log2);
    Warpgroup::add_pv(o_acc[0], s_acc[0], desc, stage);
  }
  ptx::cp_async_wait<0>();

  float row_lse[1][2];
  softmax.finalize(o_acc, scale_log2, row_lse);
  if constexpr (Traits::kFp8Kv) {
    const float v_descale = p.v_descale[sp.unit];
#pragma unroll
    for (int d = 0; d < Warpgroup::kDTiles; ++d)
#pragma unroll
      for (int i = 0; i < 4; ++i) o_acc[0][d][i] *= v_descale;
  }
  if (plan.cluster_merge) {
    // Every warp's last products have read the ring that the partial overwrites.
    sync_decode_warpgroup<Traits>(warpgroup);
    mma_sync::store_split_partial(partial, plan, rows, o_acc[0], row_lse[0], lane);
    mma_sync::merge_cluster_splits<Elem, kHeadDim, kSplitsPerBlock>(
        p, plan, sp, cluster_partials, kPartialStride, tid, Traits::kThreads);
  } else {
    // The combine may launch now; it waits for this grid's stores before it reads them.
    ptx::launch_dependents();
    mma_sync::store_split_partial(partial, plan, rows, o_acc[0], row_lse[0], lane);
  }
#endif
}

}  // namespace jax_flashattn::wgmma
