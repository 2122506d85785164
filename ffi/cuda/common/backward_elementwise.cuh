// The memory-bound steps around the mma.sync backward kernels, for head dims that are a
// multiple of 8 up to 256 (one 16-byte chunk per lane of a row):
//   preprocess: D_t = dO_t . O_t in float32 per (batch, query, head) row (0 where the row's lse
//               is NaN), and a zeroed float32 dQ accumulator row where the passes add into it
//               (all but the mma.sync family's deterministic mode, whose dQ pass writes dQ);
//   convert:    dQ = scale * accumulator, rounded to the input dtype.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "ffi/cuda/common/scalar.cuh"
#include "ffi/params.h"

namespace jax_flashattn::mma_sync {

inline constexpr int kElementwiseThreads = 256;

// One warp per row of q's layout [batch, T, N, H], rows in memory order.
template <typename Elem>
__global__ void __launch_bounds__(kElementwiseThreads)
    backward_preprocess_kernel(const __grid_constant__ AttentionParams p, bool zero_dq_accum) {
  const int64_t row = (int64_t(blockIdx.x) * kElementwiseThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.batch * p.seqlen_q * p.num_heads) return;
  const int64_t n = row % p.num_heads, t = row / p.num_heads % p.seqlen_q;
  const int64_t b = row / (p.num_heads * p.seqlen_q);
  const int64_t offset = b * p.q_batch_stride + t * p.q_row_stride + n * p.q_head_stride + lane * 8;
  float partial = 0.f;
  if (lane * 8 < p.head_dim) {
    const uint4 out_chunk = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.out) + offset);
    const uint4 d_out_chunk =
        *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.d_out) + offset);
    const Elem* o = reinterpret_cast<const Elem*>(&out_chunk);
    const Elem* d = reinterpret_cast<const Elem*>(&d_out_chunk);
#pragma unroll
    for (int i = 0; i < 8; ++i) partial = fmaf(cuda::to_float(o[i]), cuda::to_float(d[i]), partial);
    if (zero_dq_accum) {
      float4* accum = reinterpret_cast<float4*>(p.dq_accum + offset);
      accum[0] = float4{};
      accum[1] = float4{};
    }
  }
  const float sum = cuda::warp_sum(partial);
  // A row whose lse is NaN (a NaN or +inf logit) has P NaN wherever it sees a key, which makes
  // its gradients NaN there; its hidden keys have P = 0, and dS = P (dP - D) must stay 0 for
  // them, which a NaN D (from its NaN output) would turn into 0 x NaN.
  const int64_t stat = (b * p.num_heads + n) * p.seqlen_q + t;
  if (lane == 0) p.delta[stat] = isnan(p.lse[stat]) ? 0.f : sum;
}

// Eight elements per thread: two float4 loads, one 16-byte store.
template <typename Elem>
__global__ void __launch_bounds__(kElementwiseThreads)
    backward_convert_dq_kernel(const __grid_constant__ AttentionParams p) {
  const int64_t i = (int64_t(blockIdx.x) * kElementwiseThreads + threadIdx.x) * 8;
  if (i >= p.batch * p.seqlen_q * p.num_heads * p.head_dim) return;
  const float4* accum = reinterpret_cast<const float4*>(p.dq_accum + i);
  const float4 lo = accum[0], hi = accum[1];
  const float x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  uint4 chunk;
  Elem* out = reinterpret_cast<Elem*>(&chunk);
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] = cuda::from_float<Elem>(p.scale * x[j]);
  *reinterpret_cast<uint4*>(static_cast<Elem*>(p.dq) + i) = chunk;
}

}  // namespace jax_flashattn::mma_sync
