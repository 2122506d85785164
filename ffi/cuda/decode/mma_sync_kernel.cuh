// Split-KV decode forward with mma.sync (sm_80 and newer): each block computes one split's
// partial attention; the splits merge through the workspace and a second kernel
// (decode/combine.cuh) or, with plan.cluster_merge (9.0+), inside the cluster of the
// unit's splits (decode/cluster_merge.cuh).
//
// The block (its rows and its split: decode/block.cuh) streams its split's key tiles
// through a three-stage cp.async ring; per step (16 keys or a whole tile: decode/mma_sync_traits.h)
// a warp computes
//   S = Q K^T              (Q fragments in registers, loaded once from global memory)
//   soft-cap               (DecodeWithSoftCap) tanh(s scale / cap), c = cap log2(e) the factor
//   bias, mask, ALiBi      (DecodeWithBiasAndMask) s scale log2(e) - slope log2(e) |t + shift
//                          - key| + bias log2(e), -inf where the mask hides it; the softmax's
//                          factor 1
//   mask                   (per-row key bounds: lengths, causal, window)
//   online softmax         (exp2 with the scale folded into one FFMA)
//   O += P V               (P re-packed from the S accumulators, V via ldmatrix.trans)
// With float8_e4m3fn keys and values (Traits::kFp8Kv, a quantised KV cache) the ring holds their
// bytes, widened (common/e4m3.cuh: to float16 from sm_89, q converted to it, else to q's dtype)
// in registers after each ldmatrix (one slab of rows) or once per tile into shared memory that
// the warps read as a 2-byte stage (Traits::kWidenInSmem, more rows); the descales of the
// unit's kv head scale the scores (folded into the softmax's factor) and the split's O.
// Warps that computed the same rows on other keys merge their states through shared memory,
// and the split writes its normalised O and lse to the workspace (layout: ffi/decode_plan.h) or,
// for the cluster merge, to its shared memory.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/e4m3.cuh"
#include "ffi/cuda/common/fragments.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/smem_tile.cuh"
#include "ffi/cuda/common/softmax.cuh"
#include "ffi/cuda/decode/block.cuh"
#include "ffi/cuda/decode/cluster_merge.cuh"
#include "ffi/decode_plan.h"
#include "ffi/params.h"

namespace jax_flashattn::mma_sync {

template <typename Elem, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    decode_split_kernel(const __grid_constant__ AttentionParams p, const DecodePlan plan) {
  constexpr int kBlockN = Traits::kBlockN, kSmemDim = Traits::kSmemDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kKSteps = Traits::kHeadDim / 16;  // QK^T reduction steps
  constexpr int kDTiles = Traits::kHeadDim / 8;   // 8-wide column tiles of O
  constexpr int kStepChunks = Traits::kStepChunks;  // 16-key chunks of a warp step
  constexpr int kStepKeys = kStepChunks * Traits::kChunkKeys;
  constexpr bool kFp8Kv = Traits::kFp8Kv, kWiden = Traits::kWidenInSmem;
  // The warps' K and V fragments are e4m3, widened in registers (the one-slab e4m3 configs).
  constexpr bool kE4m3Fragments = kFp8Kv && !kWiden;
  static_assert(!kFp8Kv || !(Traits::kSoftCap || Traits::kBiasAndMask),
                "e4m3 keys and values take the plain kernels (decode_fp8_kv_fits)");
  // The ring's 2-byte units: q's elements, or pairs of e4m3 bytes.
  using Unit = std::conditional_t<kFp8Kv, cuda::E4m3Pair, Elem>;
  using Mma = cuda::ProductElem<Elem, kFp8Kv>;  // the products' element type

  // Aligned to a whole swizzled row (at most 512 bytes) for LdmatrixAddress's XOR.
  extern __shared__ __align__(512) unsigned char smem_raw[];
  Unit* ring = reinterpret_cast<Unit*>(smem_raw);  // [kStages][K, V][kBlockN][kSmemDim]
  auto stage_k = [&](int stage) { return ring + stage * 2 * kBlockN * kSmemDim; };
  auto stage_v = [&](int stage) { return stage_k(stage) + kBlockN * kSmemDim; };
  // kWiden: each tile widened to Mma after the ring, [K, V][kBlockN][kWidenedDim], where the
  // warps read it as a 2-byte ring stage.
  constexpr int kReadDim = kWiden ? Traits::kWidenedDim : kSmemDim;
  Mma* widened_k = reinterpret_cast<Mma*>(smem_raw + Traits::kRingBytes);
  Mma* widened_v = widened_k + kBlockN * Traits::kWidenedDim;
  // kStagedTerms: each stage's terms after the ring (DecodeWithBiasAndMask).
  [[maybe_unused]] auto stage_terms = [&](int stage) {
    return smem_raw + Traits::kRingBytes + Traits::kWidenedBytes +
           stage * Traits::kTermStageBytes;
  };
  static_assert(Traits::kSmemBytes <= 99 * 1024,
                "fits the opt-in shared memory of every sm_8x/sm_120");

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int quad_col = 2 * (lane % 4);  // mma accumulator column pair

  // Warp roles: slab `slab` of the rows, steps key_group, key_group + key_groups, ... of a tile.
  const int slabs = int((plan.rows + 15) / 16);
  const int key_groups = Traits::kWarps / slabs;
  const int slab = warp % slabs, key_group = warp / slabs;
  const bool computes = warp < slabs * key_groups;

  // The split, then at once its first tiles' requests (DecodeSplit, decode/block.cuh;
  // docs/decisions/decode-kv-streaming.md).
  const int splits = int(plan.splits), block = int(blockIdx.x);
  const DecodeSplit sp =
      DecodeSplit::make<kBlockN, Traits::kBiasAndMask>(p, plan, block / splits, block % splits);
  const variant::KeyWindow<int>& vis = sp.vis;
  const int key_lo = sp.key_lo, key_hi = sp.key_hi;
  const int tile_begin = sp.tile_begin, tile_end = sp.tile_end;
  // The ring's stage `stage` <- key tile `tile` (keys past the length zero-filled).
  const auto load_stage = [&](int tile, int stage) {
    load_split_tile<Traits, SwizzledRows<kSmemDim>>(stage_k(stage), stage_v(stage), p, sp, tile,
                                                    tid);
    if constexpr (Traits::kStagedTerms)
      DecodeBiasAndMask::copy_tile<kBlockN>(stage_terms(stage), p, sp, tile, tid,
                                            Traits::kThreads);
    if constexpr (Traits::kSegments)
      DecodeBiasAndMask::copy_key_ids<kBlockN>(stage_terms(stage), p, sp, tile, tid,
                                               Traits::kThreads);
  };
  // Prologue: kStages - 1 tiles in flight, one commit group each (possibly empty).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (tile_begin + s < tile_end) load_stage(tile_begin + s, s);
    ptx::cp_async_commit();
  }

  // Where the split's result goes: the workspace, or this block's shared memory (over the
  // drained ring) for the cluster merge.
  using Partial = ClusterPartial<Traits::kHeadDim>;
  static_assert(Partial::kBytes <= Traits::kSmemBytes, "the cluster merge's partial fits");
  float* cluster_partial = reinterpret_cast<float*>(smem_raw);
  const PartialRows partial = plan.cluster_merge ? Partial::at(cluster_partial)
                                                : workspace_partial(plan, sp.unit, sp.split);
  if (tile_begin >= tile_end) {
    store_empty_split(partial, plan, tid, Traits::kThreads);
    if (plan.cluster_merge)
      merge_cluster_splits<Elem, Traits::kHeadDim, 1>(p, plan, sp, cluster_partial, 0, tid,
                                                      Traits::kThreads);
    return;
  }

  const DecodeRows rows = DecodeRows::make(vis, slab, lane, int(plan.rows), sp.group);
  uint32_t q_frag[kKSteps][4];
  load_q_fragments<Elem, kKSteps, kE4m3Fragments>(q_frag, p, sp, rows, plan.rows, quad_col);
  float o_acc[1][kDTiles][4] = {};
  cuda::OnlineSoftmax<1> softmax;
  softmax.init();
  float scale_log2 = decode_softmax_scale<Traits>(p);
  // A bfloat16 query's rows as float16, each with the factor its scores take back.
  [[maybe_unused]] float q_row_factor[2];
  if constexpr (!std::is_same_v<Mma, Elem>) cuda::q_fragments_to_half(q_frag, q_row_factor);
  if constexpr (kFp8Kv) scale_log2 *= cuda::fold_key_descale<Mma>(p.k_descale[sp.unit], q_frag);
  [[maybe_unused]] DecodeBiasAndMask terms;
  if constexpr (Traits::kBiasAndMask) {
    terms = DecodeBiasAndMask::make<Traits::kStagedTerms>(p, sp, rows);
    if constexpr (!Traits::kStagedTerms) terms.prefetch(p, tile_begin * kBlockN, kBlockN, lane);
  }

  // ldmatrix lane addressing as in mma_sync/forward_kernel.cuh: K as B operand pairs (keys x k),
  // V transposed with keys as rows.
  const int ld_row = lane % 8, ld_matrix = lane / 8;

  for (int tile = tile_begin; tile < tile_end; ++tile) {
    const int j = tile - tile_begin;
    ptx::cp_async_wait<kStages - 2>();
    // Tile j landed for every thread, and every warp is done with tile j - 1, whose stage the
    // load below refills.
    __syncthreads();
    if (tile + kStages - 1 < tile_end) load_stage(tile + kStages - 1, (j + kStages - 1) % kStages);
    ptx::cp_async_commit();
    const int stage = j % kStages;
    if constexpr (kWiden) {
      // Every thread widens its share of tile j (every warp is done reading tile j - 1's).
      widen_e4m3_tile<Traits>(stage_k(stage), widened_k, tid);
      widen_e4m3_tile<Traits>(stage_v(stage), widened_v, tid);
      __syncthreads();
    }
    if (!computes) continue;
    if constexpr (Traits::kBiasAndMask && !Traits::kStagedTerms)
      if (tile + 1 < tile_end) terms.prefetch(p, (tile + 1) * kBlockN, kBlockN, lane);

    using Address = LdmatrixAddress<SwizzledRows<kReadDim>>;
    const void* k_tile = kWiden ? static_cast<const void*>(widened_k) : stage_k(stage);
    const void* v_tile = kWiden ? static_cast<const void*>(widened_v) : stage_v(stage);
    const Address k_address(k_tile, (ld_matrix >> 1) * 8 + ld_row, ld_matrix & 1);
    const Address v_address(v_tile, (ld_matrix & 1) * 8 + ld_row, ld_matrix >> 1);
    for (int step = key_group; step < Traits::kStepsPerTile; step += key_groups) {
      const int key0 = tile * kBlockN + step * kStepKeys;
      if (key0 >= key_hi) break;                // past every row's last key
      if (key0 + kStepKeys <= key_lo) continue;  // before every row's first key
      const int chunk0 = step * kStepChunks;

      // S = Q K^T for 16 rows x kStepKeys keys: one accumulator chain per 16-key chunk, the
      // chunks interleaved per k-step so that consecutive mma do not wait on each other.
      float s_acc[1][2 * kStepChunks][4] = {};
      if constexpr (kE4m3Fragments) {
        // One ldmatrix of e4m3 K: per 16 keys and 32 head-dim elements, four 8 x 16-byte
        // matrices (keys 0-7 then 8-15, each for columns 0-15 then 16-31), each a whole B
        // operand of one k-step: lane l's 4 bytes are key l / 4's columns 4 (l % 4) + {0..3},
        // widened to the pairs {0, 1} and {2, 3} (Q's fragments are in that order).
#pragma unroll
        for (int kp = 0; kp < kKSteps / 2; ++kp)
#pragma unroll
          for (int c = 0; c < kStepChunks; ++c) {
            uint32_t k8[4], b[4][2];
            ptx::ldmatrix_x4(k8, k_address(chunk0 + c, kp));
            cuda::widen_e4m3_x4<Mma, 0, 1, 2, 3>(k8, b);
#pragma unroll
            for (int m = 0; m < 4; ++m)
              ptx::mma_m16n8k16<Mma>(s_acc[0][2 * c + m / 2], q_frag[2 * kp + m % 2], b[m]);
          }
      } else {
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks)
#pragma unroll
          for (int c = 0; c < kStepChunks; ++c) {
            uint32_t k_frag[4];
            ptx::ldmatrix_x4(k_frag, k_address(chunk0 + c, ks));
            mma_pair<Mma>(s_acc[0], c, q_frag[ks], k_frag);
          }
      }
      if constexpr (!std::is_same_v<Mma, Elem>) cuda::scale_score_rows(s_acc[0], q_row_factor);
      cap_decode_scores<Traits::kSoftCap>(p, s_acc[0]);
      if constexpr (Traits::kStagedTerms)
        terms.template apply_staged<kBlockN>(p, sp, s_acc[0], key0, quad_col,
                                             stage_terms(stage));
      else if constexpr (Traits::kBiasAndMask)
        if (decode_applies_terms<Traits>(p))
          terms.template apply<Traits::kAlibi>(p, sp, rows, s_acc[0], key0, quad_col);
      if constexpr (Traits::kSegments)
        DecodeBiasAndMask::hide_other_documents<kBlockN>(p, sp, rows, s_acc[0], key0, quad_col,
                                                         stage_terms(stage));
      rows.mask(s_acc[0], key0, quad_col);
      softmax.update(s_acc, o_acc, scale_log2);

      // O += P V: the S accumulators of chunk c's two 8-key tiles are the A operand of k-step c;
      // k-steps outermost, so each O tile's accumulation chain has a whole k-step between links.
      uint32_t p_frag[kStepChunks][4];
#pragma unroll
      for (int c = 0; c < kStepChunks; ++c) pack_a<Mma>(p_frag[c], s_acc[0], c);
      if constexpr (kE4m3Fragments) {
        // One transposed ldmatrix of e4m3 V: per 16 keys and 32 columns, four matrices (keys
        // 0-7 then 8-15 of columns 0-15, then of 16-31) whose 2-byte elements are column
        // pairs: lane l's register holds keys 2 (l % 4) and + 1 of columns 2 (l / 4) and + 1,
        // i.e. a B operand pair for column 2 (l / 4) (bytes 0 and 2) and one for column
        // 2 (l / 4) + 1 (bytes 1 and 3). O's tiles 2 j and 2 j + 1 take the even and the odd
        // columns of [16 j, 16 j + 16) (store_split_partial's kE4m3Order).
#pragma unroll
        for (int c = 0; c < kStepChunks; ++c)
#pragma unroll
          for (int dq = 0; dq < kDTiles / 4; ++dq) {
            uint32_t v8[4], v_pairs[4][2];
            ptx::ldmatrix_x4_trans(v8, v_address(chunk0 + c, dq));
            cuda::widen_e4m3_x4<Mma, 0, 2, 1, 3>(v8, v_pairs);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              // Registers 2 half and 2 half + 1: keys 0-7 and 8-15 of columns [16 half, +16).
              const uint32_t b_even[2] = {v_pairs[2 * half][0], v_pairs[2 * half + 1][0]};
              const uint32_t b_odd[2] = {v_pairs[2 * half][1], v_pairs[2 * half + 1][1]};
              ptx::mma_m16n8k16<Mma>(o_acc[0][4 * dq + 2 * half], p_frag[c], b_even);
              ptx::mma_m16n8k16<Mma>(o_acc[0][4 * dq + 2 * half + 1], p_frag[c], b_odd);
            }
          }
      } else {
#pragma unroll
        for (int c = 0; c < kStepChunks; ++c)
#pragma unroll
          for (int dp = 0; dp < kDTiles / 2; ++dp) {
            uint32_t v_frag[4];
            ptx::ldmatrix_x4_trans(v_frag, v_address(chunk0 + c, dp));
            mma_pair<Mma>(o_acc[0], dp, p_frag[c], v_frag);
          }
      }
    }
  }

  // Merge the warps of each slab through the drained ring: warps of key group > 0 publish their
  // state, the key-group-0 warp of the slab folds them in (same lane, same fragment elements).
  ptx::cp_async_wait<0>();
  __syncthreads();
  float* merge = reinterpret_cast<float*>(smem_raw);  // [kWarps][kDTiles * 4 + 4][32]
  constexpr int kStateFloats = kDTiles * 4;  // O floats per lane; then 2 maxima, 2 sums
  if (computes && key_group > 0) {
    float* mine = merge + warp * Traits::kMergeFloatsPerWarp + lane;
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
      for (int i = 0; i < 4; ++i) mine[(d * 4 + i) * 32] = o_acc[0][d][i];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mine[(kStateFloats + h) * 32] = softmax.row_max[0][h];
      mine[(kStateFloats + 2 + h) * 32] = softmax.row_sum[0][h];
    }
  }
  __syncthreads();
  // The key-group-0 warp of each slab holds its rows' whole state after the fold.
  const bool folds = computes && key_group == 0;
  if (!plan.cluster_merge && !folds) return;

  if (folds) {
    for (int g = 1; g < key_groups; ++g) {
      const float* other = merge + (g * slabs + slab) * Traits::kMergeFloatsPerWarp + lane;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float other_max = other[(kStateFloats + h) * 32];
        const float new_max = fmaxf(softmax.row_max[0][h], other_max);
        if (new_max == -INFINITY) {
          // Neither has seen a finite score for this row: both sums are 0, or NaN where that
          // side's scores held a NaN (which its maximum dropped), which the sum must carry.
          softmax.row_sum[0][h] += other[(kStateFloats + 2 + h) * 32];
          continue;
        }
        // Scores are unscaled: a row's weights are exp2 of its offset (max * scale_log2, as
        // the softmax rounds it, which its probabilities were taken against) less the new one.
        using Softmax = decltype(softmax);
        const float new_offset = Softmax::offset_for(new_max, scale_log2);
        const auto factor = [&](float max) {
          if (max == -INFINITY) return 0.f;
          return ptx::exp2_approx(__fsub_rn(Softmax::offset_for(max, scale_log2), new_offset));
        };
        const float mine_factor = factor(softmax.row_max[0][h]);
        const float other_factor = factor(other_max);
        softmax.row_max[0][h] = new_max;
        softmax.row_sum[0][h] = softmax.row_sum[0][h] * mine_factor +
                                other[(kStateFloats + 2 + h) * 32] * other_factor;
#pragma unroll
        for (int d = 0; d < kDTiles; ++d)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            o_acc[0][d][2 * h + e] = o_acc[0][d][2 * h + e] * mine_factor +
                                     other[(d * 4 + 2 * h + e) * 32] * other_factor;
      }
    }
  }

  // Normalise this split's O and write it with its lse.
  float row_lse[1][2];
  softmax.finalize(o_acc, scale_log2, row_lse);
  if constexpr (kFp8Kv) {
    const float v_descale = p.v_descale[sp.unit];
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
      for (int i = 0; i < 4; ++i) o_acc[0][d][i] *= v_descale;
  }
  if (plan.cluster_merge) {
    // Every warp has read the states the partial overwrites.
    __syncthreads();
    if (folds)
      store_split_partial<kDTiles, kE4m3Fragments>(partial, plan, rows, o_acc[0], row_lse[0],
                                                   lane);
    merge_cluster_splits<Elem, Traits::kHeadDim, 1>(p, plan, sp, cluster_partial, 0, tid,
                                                    Traits::kThreads);
  } else {
    // The combine may launch now; it waits for this grid's stores before it reads them.
    ptx::launch_dependents();
    store_split_partial<kDTiles, kE4m3Fragments>(partial, plan, rows, o_acc[0], row_lse[0], lane);
  }
}

}  // namespace jax_flashattn::mma_sync
