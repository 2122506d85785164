// Split-KV decode forward: the merge of a work unit's splits inside the split kernel, for
// compute capability 9.0+ (sm80/decode_combine.cuh is the other merge: a second kernel over
// the workspace). The unit's splits run as one thread block cluster (rank = split), each block
// leaves its normalised O and lse in its own shared memory, and after a cluster barrier each
// block merges a share of the unit's rows from every block's shared memory (distributed shared
// memory) into out and lse:
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

// The most splits a cluster merge takes: the portable cluster size, which any kernel whose block
// fits on an SM may launch with.
inline constexpr int kMaxClusterSplits = 8;

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
// writing its partial at `partial`, ClusterPartial<kHeadDim>'s layout): block `split` takes
// rows [split * share, (split + 1) * share) of the unit's plan.rows, one float4 column group of
// one row per thread and step, and writes them to out and lse. Returns once no block of the
// cluster reads this block's shared memory any more.
template <typename Elem, int kHeadDim>
__device__ __forceinline__ void merge_cluster_splits(const AttentionParams& p,
                                                     const DecodePlan& plan,
                                                     const DecodeSplit& sp, const float* partial,
                                                     int tid, int threads) {
  using Layout = ClusterPartial<kHeadDim>;
  // Every block's partial is written (release) and visible here (acquire). The barrier is
  // .aligned: the warp reconverges first (its threads may have left the stores' loops apart).
  __syncwarp();
  ptx::cluster_arrive();
  ptx::cluster_wait();

  const uint32_t base = ptx::smem_address(partial);
  const int splits = int(plan.splits), rows = int(plan.rows);
  const int share = (rows + splits - 1) / splits;
  const int row_begin = int(sp.split) * share;
  const int row_end = row_begin + share < rows ? row_begin + share : rows;
  const int groups = int(p.head_dim / 4);  // float4 column groups of a row
  const int64_t group = p.group_size();
  for (int item = tid; item < (row_end - row_begin) * groups; item += threads) {
    const int r = row_begin + item / groups, c = item % groups;
    float lse_s[kMaxClusterSplits];
    float max_lse = -INFINITY;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      lse_s[s] = s < splits ? ptx::ld_shared_cluster_f32(
                                  ptx::map_shared_rank(base + 4 * (Layout::kLseOffset + r), s))
                            : -INFINITY;
      max_lse = fmaxf(max_lse, lse_s[s]);
    }
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s)
      if (lse_s[s] != -INFINITY) sum += expf(lse_s[s] - max_lse);
    const float lse = max_lse == -INFINITY ? -INFINITY : max_lse + logf(sum);

    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      if (s >= splits) break;
      // Loaded for every split (an empty split's O is whatever its shared memory holds), used
      // only where the split saw a key for the row.
      const float4 x = ptx::ld_shared_cluster_v4_f32(
          ptx::map_shared_rank(base + 4 * (r * Layout::kRowFloats + 4 * c), s));
      if (lse_s[s] == -INFINITY) continue;
      const float weight = expf(lse_s[s] - lse);
      acc.x += weight * x.x;
      acc.y += weight * x.y;
      acc.z += weight * x.z;
      acc.w += weight * x.w;
    }

    // Row r is query t of head n (decode_block.cuh's row order).
    const int64_t t = r / group, n = sp.kv_head * group + r % group;
    Elem* out = static_cast<Elem*>(p.out) + sp.b * p.q_batch_stride + t * p.q_row_stride +
                n * p.q_head_stride;
    *reinterpret_cast<uint2*>(out + 4 * c) =
        make_uint2(ptx::pack2<Elem>(acc.x, acc.y), ptx::pack2<Elem>(acc.z, acc.w));
    if (c == 0) p.lse[(sp.b * p.num_heads + n) * p.seqlen_q + t] = lse;
  }

  // No block leaves (and frees its shared memory) while another may still read it.
  __syncwarp();
  ptx::cluster_arrive();
  ptx::cluster_wait();
}

}  // namespace jax_flashattn::sm80
