// The memory-bound steps around the tensor-core backward kernels, for head dims that are a
// multiple of 8 up to 256 (one 16-byte chunk per lane of a row, at most 32 lanes):
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

// Lanes per row in the preprocess: the row's 16-byte chunks (head_dim / 8) rounded up to a power
// of two, so that a row's lanes are an aligned group of its warp that xor-shuffles reduce over.
// Idle lanes per row: none at head dims 8 x 2^k, at most 43% (head dim 72: 9 of 16 work).
constexpr int preprocess_lanes(int64_t head_dim) {
  int lanes = 1;
  while (lanes * 8 < head_dim) lanes *= 2;
  return lanes;
}
// The preprocess's grid: blockIdx.x is the (batch, head) pair, blockIdx.y a run of
// kElementwiseThreads / kLanes consecutive queries, striding by gridDim.y runs (gridDim.y is at
// most 65535).
inline constexpr int kPreprocessMaxQueryRuns = 65535;

// One row of q's layout [batch, T, N, H] per kLanes lanes, a 16-byte chunk each. A block's rows
// are consecutive queries of one (batch, head), so that its lse reads and D writes, [batch, N,
// T] in memory, are contiguous, and no lane divides by a runtime size per row. One warp per row
// in memory order (idle lanes below head dim 256, 64-bit divisions per row) took 1.4x this
// kernel's time at head dim 128 and 2.5x at 64, where this one runs at its bytes' time.
template <typename Elem, int kLanes>
__global__ void __launch_bounds__(kElementwiseThreads)
    backward_preprocess_kernel(const __grid_constant__ AttentionParams p, bool zero_dq_accum) {
  constexpr int kRowsPerBlock = kElementwiseThreads / kLanes;
  const int64_t head_pair = blockIdx.x;  // b * N + n
  const int64_t b = head_pair / p.num_heads, n = head_pair % p.num_heads;
  const int chunk = threadIdx.x % kLanes;
  const int64_t base = b * p.q_batch_stride + n * p.q_head_stride + chunk * 8;
  const bool has_chunk = chunk * 8 < p.head_dim;
  // Every lane runs every run (the shuffles below name the whole warp); rows past T idle.
  for (int64_t t0 = int64_t(blockIdx.y) * kRowsPerBlock; t0 < p.seqlen_q;
       t0 += int64_t(gridDim.y) * kRowsPerBlock) {
    const int64_t t = t0 + threadIdx.x / kLanes;
    const bool row = t < p.seqlen_q;
    const int64_t offset = base + t * p.q_row_stride;
    float partial = 0.f;
    if (row && has_chunk) {
      const uint4 out_chunk =
          *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.out) + offset);
      const uint4 d_out_chunk =
          *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.d_out) + offset);
      const Elem* o = reinterpret_cast<const Elem*>(&out_chunk);
      const Elem* d = reinterpret_cast<const Elem*>(&d_out_chunk);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        partial = fmaf(cuda::to_float(o[i]), cuda::to_float(d[i]), partial);
      if (zero_dq_accum) {
        float4* accum = reinterpret_cast<float4*>(p.dq_accum + offset);
        accum[0] = float4{};
        accum[1] = float4{};
      }
    }
#pragma unroll
    for (int lanes = kLanes / 2; lanes > 0; lanes /= 2)
      partial += __shfl_xor_sync(0xffffffff, partial, lanes);
    // A row whose lse is NaN (a NaN or +inf logit) has P NaN wherever it sees a key, which
    // makes its gradients NaN there; its hidden keys have P = 0, and dS = P (dP - D) must stay
    // 0 for them, which a NaN D (from its NaN output) would turn into 0 x NaN.
    const int64_t stat = head_pair * p.seqlen_q + t;
    if (row && chunk == 0) p.delta[stat] = isnan(p.lse[stat]) ? 0.f : partial;
  }
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
