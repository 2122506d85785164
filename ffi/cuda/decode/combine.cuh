// Split-KV decode forward, second kernel: merges the splits' partial results (workspace layout
// in ffi/decode_plan.h) into out (the input dtype) and the float32 lse [batch, N, T] the
// backward reads.
//
// One warp per output row (b, n, t). With lse_s the splits' natural-log lse and O_s their
// normalised outputs: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) O_s. Splits
// that saw no key for the row have lse_s = -inf, weight 0, and their O_s is never read; a row
// no split saw gets out = 0 and lse = -inf, like the other kernels. A NaN lse_s (a NaN or +inf
// logit in that split) makes the maximum, hence lse and out, NaN.
#pragma once

#include <cmath>
#include <cstdint>

#include "ffi/cuda/common/ptx.cuh"
#include "ffi/decode_plan.h"
#include "ffi/params.h"

namespace jax_flashattn::mma_sync {

inline constexpr int kCombineWarps = 4;  // rows per block
// float4 column groups a lane owns: head dims up to 256 = 64 groups over 32 lanes.
inline constexpr int kCombineGroupsPerLane = int(kDecodeMaxHeadDim / 4 / 32);

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    x = ptx::max_propagating_nan(x, __shfl_xor_sync(0xffffffff, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffff, x, offset);
  return x;
}

template <typename Elem>
__global__ void __launch_bounds__(kCombineWarps * 32)
    decode_combine_kernel(const __grid_constant__ AttentionParams p, const DecodePlan plan) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The output row in lse order: ((b * N) + n) * T + t.
  const int64_t row_id = int64_t(blockIdx.x) * kCombineWarps + warp;
  if (row_id >= p.batch * p.num_heads * p.seqlen_q) return;
  const int64_t t = row_id % p.seqlen_q, bn = row_id / p.seqlen_q;
  const int64_t n = bn % p.num_heads, b = bn / p.num_heads;
  const int64_t group = p.group_size();
  const int64_t unit = b * p.num_kv_heads + n / group, r = t * group + n % group;
  // Launched while the split kernel finishes (launch_decode_combine): its partials are complete
  // and visible only past this wait.
  ptx::grid_dependency_wait();

  const float* lse_s = plan.lse_partial + plan.partial_row(unit, 0, r);  // stride plan.rows
  float max_lse = -INFINITY;
  for (int64_t s = lane; s < plan.splits; s += 32) max_lse = ptx::max_propagating_nan(max_lse, lse_s[s * plan.rows]);
  max_lse = warp_max(max_lse);
  float sum = 0.f;
  if (max_lse != -INFINITY)
    for (int64_t s = lane; s < plan.splits; s += 32) sum += expf(lse_s[s * plan.rows] - max_lse);
  sum = warp_sum(sum);
  const float lse = max_lse == -INFINITY ? -INFINITY : max_lse + logf(sum);

  const int groups = int(p.head_dim / 4);  // float4 column groups of a row
  float4 acc[kCombineGroupsPerLane] = {};
  if (max_lse != -INFINITY)
    for (int64_t s = 0; s < plan.splits; ++s) {
      const float lse_split = lse_s[s * plan.rows];
      if (lse_split == -INFINITY) continue;  // warp-uniform: every lane reads the same value
      const float weight = expf(lse_split - lse);
      const float4* o = reinterpret_cast<const float4*>(
          plan.o_partial + plan.partial_row(unit, s, r) * plan.head_dim);
#pragma unroll
      for (int i = 0; i < kCombineGroupsPerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < groups) {
          const float4 x = o[c];
          acc[i].x += weight * x.x;
          acc[i].y += weight * x.y;
          acc[i].z += weight * x.z;
          acc[i].w += weight * x.w;
        }
      }
    }

  Elem* out = static_cast<Elem*>(p.out) + b * p.q_batch_stride + t * p.q_row_stride +
              n * p.q_head_stride;
#pragma unroll
  for (int i = 0; i < kCombineGroupsPerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < groups)
      *reinterpret_cast<uint2*>(out + 4 * c) =
          make_uint2(ptx::pack2<Elem>(acc[i].x, acc[i].y), ptx::pack2<Elem>(acc[i].z, acc[i].w));
  }
  if (lane == 0) p.lse[row_id] = lse;
}

}  // namespace jax_flashattn::mma_sync
