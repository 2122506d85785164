// Split-KV decode forward: the merge of a work unit's splits inside the split kernel, for
// compute capability 9.0+ (sm80/decode_combine.cuh is the other merge: a second kernel over
// the workspace). The unit's blocks run as one thread block cluster (block i of the unit has
// rank i and runs splits [i * kSplitsPerBlock, (i + 1) * kSplitsPerBlock), one per warpgroup),
// each split leaves its normalised O and lse in its block's shared memory, and after a cluster
// barrier each block merges a share of the unit's rows from every block's shared memory
// (distributed shared memory) into out and lse:
//   lse = log sum_s exp(lse_s),  out = sum_s exp(lse_s - lse) O_s
// with splits whose lse_s is -inf (no key for the row) weighing 0, their O_s never used; a row
// no split saw gets out = 0 and lse = -inf, as from the combine. No partial result goes through
// global memory and no second kernel runs, which at short S is a visible share of a call: on an
// H200, T = 1 of the decode preset at S = 8192 ran 68.5 us per call on the device timeline
// against 69.7 with the combine (bench: 0.99-1.00x cuDNN before, 1.01-1.02x after; S = 65536
// 1.02-1.03x). Only where every unit's cluster is resident at once (sm80/decode_launch.cuh):
// docs/kernel_notes.md, "The cluster merge".
#pragma once

#include <cmath>
#include <cstdint>

#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/sm80/decode_block.cuh"
#include "ffi/cuda/sm80/decode_plan.h"
#include "ffi/params.h"

namespace jax_flashattn::sm80 {

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
  static_assert(kBytes % 8 == 0, "the merge's scratch after it starts 8-byte aligned");

  __device__ static PartialRows at(float* base) { return {base, kRowFloats, base + kLseOffset}; }
  // The merge's scratch (ClusterMergeScratch) right after the partial at `base`.
  __device__ static void* scratch_after(float* base) { return base + kBytes / int(sizeof(float)); }
};

// A block's scratch for the merge, in its shared memory beside its partials: for each of its
// rows, the weight of each split, then where the row starts in out (elements).
template <int kSplitsPerBlock>
struct ClusterMergeScratch {
  static constexpr int kMaxSplits = kMaxClusterBlocks * kSplitsPerBlock;
  static constexpr int kRowOutOffset = int(kDecodeMaxRows) * kMaxSplits * int(sizeof(float));
  static constexpr int kBytes = kRowOutOffset + int(kDecodeMaxRows) * int(sizeof(int64_t));
  static_assert(kRowOutOffset % 8 == 0, "the row offsets are 8-byte aligned");

  float* weights;        // [kDecodeMaxRows][kMaxSplits]
  int64_t* row_out;      // [kDecodeMaxRows]

  __device__ static ClusterMergeScratch at(void* base) {
    unsigned char* bytes = static_cast<unsigned char*>(base);
    return {reinterpret_cast<float*>(bytes), reinterpret_cast<int64_t*>(bytes + kRowOutOffset)};
  }
};

// The named barrier of a block's merge: 0 is __syncthreads', and the paired wgmma decode
// kernel's warpgroups use 1 and 2 (sm90/decode_kernel.cuh).
inline constexpr int kMergeBarrier = 3;

// Merges the unit's splits (every block of the cluster calls it, with every thread, after
// writing its splits' partials, ClusterPartial<kHeadDim>'s layout, split i of the block at
// `partials` + i * partial_stride floats; `scratch` is ClusterMergeScratch's bytes, 8-byte
// aligned, in this block's shared memory): block `rank` (= sp.split / kSplitsPerBlock) takes
// rows [rank * share, (rank + 1) * share) of the unit's plan.rows and writes them to out and
// lse, in two steps:
//   1. one lane per (row, split), a row's splits in adjacent lanes: lse = log sum_s exp(lse_s)
//      by shuffles, lse to p.lse, each split's weight exp(lse_s - lse) (0 where lse_s is -inf)
//      and the row's place in out to the scratch;
//   2. kItems float4 column groups per thread: out = sum_s weight_s O_s, with the O of
//      kSplitStep splits of all of them loaded before any is added.
// Few warps run it (8 per SM on the paired wgmma kernel), so it is bound by the latency of its
// instruction chains: a first version, in which each column group reloaded and reduced its
// row's lse over every split, located its row in out with 64-bit divisions and loaded one
// split's O after another, executed ~1100 instructions per column group and took ~7 us on an
// H200 for the decode preset at T = 16 (paired blocks: 4 splits of 64 rows, 4 column groups
// per thread), most of the gap between that call and 3.7 TB/s (docs/kernel_notes.md).
// Returns once no block of the cluster reads this block's shared memory any more.
template <typename Elem, int kHeadDim, int kSplitsPerBlock>
__device__ __forceinline__ void merge_cluster_splits(const AttentionParams& p,
                                                     const DecodePlan& plan,
                                                     const DecodeSplit& sp, const float* partials,
                                                     int partial_stride, void* scratch_bytes,
                                                     int tid, int threads) {
  using Layout = ClusterPartial<kHeadDim>;
  using Scratch = ClusterMergeScratch<kSplitsPerBlock>;
  constexpr int kMaxSplits = Scratch::kMaxSplits;
  const Scratch scratch = Scratch::at(scratch_bytes);
  // Every block's partial is written (release) and visible here (acquire). The barrier is
  // .aligned: the warp reconverges first (its threads may have left the stores' loops apart).
  __syncwarp();
  ptx::cluster_arrive();
  ptx::cluster_wait();

  const int splits = int(plan.splits), rows = int(plan.rows);
  const int blocks = int(plan.blocks_per_unit());
  const int share = (rows + blocks - 1) / blocks;
  const int row_begin = int(sp.split / kSplitsPerBlock) * share;
  const int share_rows = row_begin + share < rows ? share : rows > row_begin ? rows - row_begin : 0;
  // Split s's partial: block s / kSplitsPerBlock, at `partials` + (s % kSplitsPerBlock) *
  // partial_stride floats in its shared memory, whose shared::cluster window is contiguous.
  const uint32_t base = ptx::smem_address(partials);
  const auto split_base = [&](int s) {
    return ptx::map_shared_rank(base + 4 * (s % kSplitsPerBlock) * partial_stride,
                                s / kSplitsPerBlock);
  };

  // 1. Weights: a row's lanes are 2^lane_bits >= splits adjacent ones, and whole warps step
  // together, so the shuffles stay inside a row's lanes.
  int lane_bits = 0;
  while ((1 << lane_bits) < splits) ++lane_bits;
  const int lanes = 1 << lane_bits;
  const int lane = tid % 32;
  const int slots = share_rows << lane_bits;
  const int64_t group = p.group_size();
  for (int slot0 = tid - lane; slot0 < slots; slot0 += threads) {
    const int slot = slot0 + lane;
    const int local_row = slot >> lane_bits, s = slot & (lanes - 1);
    const int r = row_begin + local_row;
    const bool real = slot < slots && s < splits;
    const float lse_s =
        real ? ptx::ld_shared_cluster_f32(split_base(s) + 4 * (Layout::kLseOffset + r))
             : -INFINITY;
    float max_lse = lse_s;
    for (int offset = lanes / 2; offset > 0; offset /= 2)
      max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, offset));
    float sum = lse_s == -INFINITY ? 0.f : expf(lse_s - max_lse);
    for (int offset = lanes / 2; offset > 0; offset /= 2)
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    const float lse = max_lse == -INFINITY ? -INFINITY : max_lse + logf(sum);
    if (real)
      scratch.weights[local_row * kMaxSplits + s] = lse_s == -INFINITY ? 0.f : expf(lse_s - lse);
    if (real && s == 0) {
      // Row r is query t of head n (decode_block.cuh's row order).
      const int64_t t = r / group, n = sp.kv_head * group + r % group;
      p.lse[(sp.b * p.num_heads + n) * p.seqlen_q + t] = lse;
      scratch.row_out[local_row] = sp.b * p.q_batch_stride + t * p.q_row_stride +
                                   n * p.q_head_stride;
    }
  }
  ptx::named_barrier_sync(kMergeBarrier, threads);

  // 2. Out. Column groups past the head dim (the configuration's kHeadDim / 4 per row, for
  // shifts instead of divisions) are skipped.
  constexpr int kItems = 4, kSplitStep = 4, kGroups = kHeadDim / 4;
  const int head_groups = int(p.head_dim / 4);
  const int items = share_rows * kGroups;
  for (int item0 = tid; item0 < items; item0 += kItems * threads) {
    float4 acc[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < splits; s0 += kSplitStep) {
      // Loaded for every split (an empty split's O is whatever its shared memory holds), used
      // only where the split saw a key for the row (weight > 0).
      float4 o_s[kItems][kSplitStep];
#pragma unroll
      for (int j = 0; j < kSplitStep; ++j) {
        if (s0 + j >= splits) break;
        const uint32_t split_o = split_base(s0 + j);
#pragma unroll
        for (int i = 0; i < kItems; ++i) {
          const int item = item0 + i * threads;
          const int r = row_begin + item / kGroups, c = item % kGroups;
          if (item < items && c < head_groups)
            o_s[i][j] =
                ptx::ld_shared_cluster_v4_f32(split_o + 4 * (r * Layout::kRowFloats + 4 * c));
        }
      }
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        const int item = item0 + i * threads;
        if (item >= items) break;
        const float* row_weights = scratch.weights + item / kGroups * kMaxSplits;
#pragma unroll
        for (int j = 0; j < kSplitStep; ++j) {
          if (s0 + j >= splits) break;
          const float weight = row_weights[s0 + j];
          if (weight == 0.f) continue;
          acc[i].x += weight * o_s[i][j].x;
          acc[i].y += weight * o_s[i][j].y;
          acc[i].z += weight * o_s[i][j].z;
          acc[i].w += weight * o_s[i][j].w;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int item = item0 + i * threads;
      const int c = item % kGroups;
      if (item >= items) break;
      if (c >= head_groups) continue;
      Elem* out = static_cast<Elem*>(p.out) + scratch.row_out[item / kGroups] + 4 * c;
      *reinterpret_cast<uint2*>(out) =
          make_uint2(ptx::pack2<Elem>(acc[i].x, acc[i].y), ptx::pack2<Elem>(acc[i].z, acc[i].w));
    }
  }

  // No block leaves (and frees its shared memory) while another may still read it.
  __syncwarp();
  ptx::cluster_arrive();
  ptx::cluster_wait();
}

}  // namespace jax_flashattn::sm80
