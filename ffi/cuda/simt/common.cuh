// Helpers shared by the CUDA-core kernels: row dot products and weighted row sums.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ffi/cuda/common/scalar.cuh"
#include "ffi/cuda/common/softmax.cuh"  // kLog2e, kLn2

namespace jax_flashattn::cuda::simt {

constexpr int kWarps = 4;  // rows (query or key) per block, one warp each
// A block's float32 row buffers must fit the opt-in shared memory of every sm_80+ GPU.
constexpr int64_t kMaxSmemBytes = 99 * 1024;

// Dot product of a float row in shared memory with a global row of Elem, by one lane.
template <typename Elem>
__device__ __forceinline__ float dot_shared(const float* a, const Elem* b, int64_t n) {
  float acc = 0.f;
  for (int64_t h = 0; h < n; ++h) acc = fmaf(a[h], to_float(b[h]), acc);
  return acc;
}

// Dot product of two global rows, by one lane.
template <typename Elem>
__device__ __forceinline__ float dot_global(const Elem* a, const Elem* b, int64_t n) {
  float acc = 0.f;
  for (int64_t h = 0; h < n; ++h) acc = fmaf(to_float(a[h]), to_float(b[h]), acc);
  return acc;
}

// acc[h] += sum_j w_j * rows_j[h] over the warp's 32 weights (w_j held by lane j, row j at
// rows + j * row_stride), for the columns h = lane, lane + 32, ... < n. Lanes with w_j == 0
// are skipped, so rows past the end of a tensor are never read when their weight is 0.
template <typename Elem>
__device__ __forceinline__ void accumulate_rows(float* acc, float w, const Elem* rows,
                                                int64_t row_stride, int64_t n, int lane) {
  for (int64_t h0 = 0; h0 < n; h0 += 32) {
    const int64_t h = h0 + lane;
    float sum = 0.f;
    for (int j = 0; j < 32; ++j) {
      const float wj = __shfl_sync(0xffffffff, w, j);
      if (wj != 0.f && h < n) sum = fmaf(wj, to_float(rows[j * row_stride + h]), sum);
    }
    if (h < n) acc[h] += sum;
  }
}

}  // namespace jax_flashattn::cuda::simt
