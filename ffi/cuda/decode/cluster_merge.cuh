// Split-KV decode forward: the merge of a work unit's splits inside the split kernel, for
// compute capability 9.0+ (decode/combine.cuh is the other merge: a second kernel over
// the workspace). The unit's blocks run as one thread block cluster (block i of the unit has
// rank i and runs splits [i * kSplitsPerBlock, (i + 1) * kSplitsPerBlock), one per warpgroup),
// each split leaves its normalised O and lse in its block's shared memory, and after a cluster
// barrier each block merges a share of the unit's rows from every block's shared memory
// (distributed shared memory) into out and lse:
//   lse = log sum_s exp(lse_s),  out = sum_s exp(lse_s - lse) O_s
// with splits whose lse_s is -inf (no key for the row) weighing 0, their O_s never used; a row
// no split saw gets out = 0 and lse = -inf, as from the combine. No partial result goes through
// global memory and no second kernel runs, which at short S is a visible share of a call. Only
// where every unit's cluster is resident at once (decode/mma_sync_launch.cuh). Why, with
// measurements: docs/decisions/decode-cluster-merge.md.
#pragma once

#include <cmath>
#include <cstdint>

#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/softmax.cuh"
#include "ffi/cuda/decode/block.cuh"
#include "ffi/decode_plan.h"
#include "ffi/params.h"

namespace jax_flashattn::mma_sync {

// The most blocks a cluster merge takes: the portable cluster size, which any kernel whose block
// fits on an SM may launch with.
inline constexpr int kMaxClusterBlocks = 8;

// A block's partial result in its shared memory (over its drained K/V ring): O
// [kDecodeMaxRows][kRowFloats], then lse [kDecodeMaxRows].
template <int kHeadDim>
struct ClusterPartial {
  // 8 floats of padding per row: the float2 stores of a warp (8 rows x 4 column pairs) then
  // spread over the banks instead of all 8 rows starting on the same one; rows stay 16-byte
  // aligned for the merge's float4 loads.
  static constexpr int kRowFloats = kHeadDim + 8;
  static constexpr int kLseOffset = int(kDecodeMaxRows) * kRowFloats;
  static constexpr int kBytes = (kLseOffset + int(kDecodeMaxRows)) * int(sizeof(float));
  static_assert(kRowFloats % 4 == 0, "rows start 16-byte aligned");

  __device__ static PartialRows at(float* base) { return {base, kRowFloats, base + kLseOffset}; }
};

// Merges the unit's splits (every block of the cluster calls it, with every thread, after
// writing its splits' partials, ClusterPartial<kHeadDim>'s layout, split i of the block at
// `partials` + i * partial_stride floats): block `rank` (= sp.split / kSplitsPerBlock) takes
// rows [rank * share, (rank + 1) * share) of the unit's plan.rows and writes them to out and
// lse. kRowThreads threads per row, each kItems float4 column groups kRowThreads apart (a row's
// threads read consecutive 16-byte chunks). Each thread loads its row's lse of every split and
// the O of its groups of the first kSplitStep splits at once, then computes the row's lse and
// the splits' weights in registers and adds; splits past the first step (units of more than
// kSplitStep splits) follow one at a time.
// Few warps run it (8 per SM on the paired wgmma kernel), once per call from a cold instruction
// cache, so its time is its chain of dependent steps (round trips to another SM's shared
// memory, barriers) and its instruction count: hence one load round, weights in registers and
// no block barrier (the longer chains measured: docs/decisions/decode-cluster-merge.md).
// Returns once no block of the cluster reads this block's shared memory any more.
template <typename Elem, int kHeadDim, int kSplitsPerBlock>
__device__ __forceinline__ void merge_cluster_splits(const AttentionParams& p,
                                                     const DecodePlan& plan,
                                                     const DecodeSplit& sp, const float* partials,
                                                     int partial_stride, int tid, int threads) {
  using Layout = ClusterPartial<kHeadDim>;
  constexpr int kMaxSplits = kMaxClusterBlocks * kSplitsPerBlock;
  // Two splits at once in one-split blocks (the mma.sync kernel's, the wgmma kernel's unpaired
  // configuration; T = 1 has two): with four, the mma.sync kernel's 64+-row configurations
  // spill (docs/decisions/decode-cluster-merge.md).
  constexpr int kItems = 4, kSplitStep = kSplitsPerBlock == 1 ? 2 : 4;
  constexpr int kGroups = kHeadDim / 4, kRowThreads = kGroups / kItems;
  static_assert(kGroups % kItems == 0 && 32 % kRowThreads == 0, "a warp holds whole rows");
  static_assert(kMaxSplits > kSplitStep, "splits past the first step have lse slots");
  // Every block's partial is written (release) and visible here (acquire). The barrier is
  // .aligned: the warp reconverges first (its threads may have left the stores' loops apart).
  __syncwarp();
  ptx::cluster_arrive();
  ptx::cluster_wait();

  const int splits = int(plan.splits), rows = int(plan.rows);
  const int blocks = splits / kSplitsPerBlock;  // plan.blocks_per_unit(), a constant divisor
  const int share = (rows + blocks - 1) / blocks;
  const int row_begin = sp.split / kSplitsPerBlock * share;
  const int share_rows = row_begin + share < rows ? share : rows > row_begin ? rows - row_begin : 0;
  // Split s's partial: block s / kSplitsPerBlock, at `partials` + (s % kSplitsPerBlock) *
  // partial_stride floats in its shared memory, whose shared::cluster window is contiguous.
  const uint32_t base = ptx::smem_address(partials);
  const auto split_base = [&](int s) {
    return ptx::map_shared_rank(base + 4 * (s % kSplitsPerBlock) * partial_stride,
                                s / kSplitsPerBlock);
  };
  const int group = sp.group;
  const int head_groups = int(p.head_dim / 4);
  const int row_lane = tid % kRowThreads;
  // A load whose value feeds no store before the closing barrier: an O loaded and not added
  // (its split saw no key for the row), or any load of a thread that owns no column (head dims
  // below kRowThreads column groups), whose lse work could be dropped as dead.
  bool skipped_loads = row_lane >= head_groups;

  for (int local_row = tid / kRowThreads; local_row < share_rows;
       local_row += threads / kRowThreads) {
    const int r = row_begin + local_row;
    const auto lse_address = [&](uint32_t split) {
      return split + 4 * (Layout::kLseOffset + r);
    };
    const auto o_address = [&](uint32_t split, int c) {
      return split + 4 * (r * Layout::kRowFloats + 4 * c);
    };
    float step_lse[kSplitStep], rest_lse[kMaxSplits - kSplitStep];
    float4 step_o[kSplitStep][kItems];
#pragma unroll
    for (int j = 0; j < kSplitStep; ++j) {
      if (j >= splits) break;
      const uint32_t split = split_base(j);
      step_lse[j] = ptx::ld_shared_cluster_f32(lse_address(split));
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        const int c = row_lane + i * kRowThreads;
        if (c < head_groups) step_o[j][i] = ptx::ld_shared_cluster_v4_f32(o_address(split, c));
      }
    }
#pragma unroll
    for (int s = kSplitStep; s < kMaxSplits; ++s) {
      if (s >= splits) break;
      rest_lse[s - kSplitStep] = ptx::ld_shared_cluster_f32(lse_address(split_base(s)));
    }
    const auto split_lse = [&](int s) {
      return s < kSplitStep ? step_lse[s] : rest_lse[s - kSplitStep];
    };

    // lse = log sum_s exp(lse_s), in base 2 on the special-function unit: a few instructions
    // per split where expf and logf are tens each (docs/decisions/decode-cluster-merge.md).
    // exp2(-inf) = 0 for a split without a key for the row; a NaN split lse makes the row NaN.
    float max_lse = -INFINITY;
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      if (s >= splits) break;
      max_lse = ptx::max_propagating_nan(max_lse, split_lse(s));
    }
    float lse = -INFINITY;
    if (max_lse != -INFINITY) {
      float sum = 0.f;
#pragma unroll
      for (int s = 0; s < kMaxSplits; ++s) {
        if (s >= splits) break;
        sum += ptx::exp2_approx((split_lse(s) - max_lse) * cuda::kLog2e);
      }
      lse = max_lse + ptx::log2_approx(sum) * cuda::kLn2;
    }

    // out = sum_s exp(lse_s - lse) O_s over the splits that saw a key for the row; a split
    // that saw none weighs 0 and its O (loaded, and may be anything) is not added.
    float4 acc[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    const auto add = [&](float split_lse, const float4 (&o)[kItems]) {
      if (split_lse == -INFINITY) {
        skipped_loads = true;
        return;
      }
      const float weight = ptx::exp2_approx((split_lse - lse) * cuda::kLog2e);
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        acc[i].x += weight * o[i].x;
        acc[i].y += weight * o[i].y;
        acc[i].z += weight * o[i].z;
        acc[i].w += weight * o[i].w;
      }
    };
#pragma unroll
    for (int j = 0; j < kSplitStep; ++j) {
      if (j >= splits) break;
      add(step_lse[j], step_o[j]);
    }
    // The rest one at a time (unrolled, their loads cost the paired kernel some 40 registers),
    // each lse loaded again beside its O: rest_lse takes constant indices only.
#pragma unroll 1
    for (int s = kSplitStep; s < splits; ++s) {
      const uint32_t split = split_base(s);
      const float split_lse = ptx::ld_shared_cluster_f32(lse_address(split));
      float4 o[kItems];
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        const int c = row_lane + i * kRowThreads;
        if (c < head_groups) o[i] = ptx::ld_shared_cluster_v4_f32(o_address(split, c));
      }
      add(split_lse, o);
    }

    // Row r is query t of head n (decode/block.cuh's row order).
    const int t = r / group, n = sp.kv_head * group + r % group;
    if (row_lane == 0) p.lse[(sp.b * p.num_heads + n) * p.seqlen_q + t] = lse;
    Elem* out = static_cast<Elem*>(p.out) + sp.b * p.q_batch_stride + t * p.q_row_stride +
                n * p.q_head_stride;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int c = row_lane + i * kRowThreads;
      if (c < head_groups)
        *reinterpret_cast<uint2*>(out + 4 * c) = make_uint2(ptx::pack2<Elem>(acc[i].x, acc[i].y),
                                                             ptx::pack2<Elem>(acc[i].z, acc[i].w));
    }
  }

  // No block leaves (and frees its shared memory) while another may still read it. Where every
  // value a warp loaded feeds a store issued before the arrival (the barrier's memory clobber
  // keeps the stores, hence their inputs, above it), its loads are done and its arrival needs
  // no ordering (out and lse need none here): relaxed, not waiting for those stores as a
  // release does (docs/decisions/decode-cluster-merge.md). Any other warp arrives with
  // release, which waits for its loads.
  __syncwarp();
  if (__any_sync(0xffffffffu, skipped_loads))
    ptx::cluster_arrive();
  else
    ptx::cluster_arrive_relaxed();
  ptx::cluster_wait();
}

}  // namespace jax_flashattn::mma_sync
