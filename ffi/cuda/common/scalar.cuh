// Per-element conversions between the kernels' storage types and float, and warp-wide
// reductions: the scalar helpers of the CUDA-core kernels, of the backward's elementwise steps
// and of the Hopper forward's bias reads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jax_flashattn::cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename Elem>
__device__ __forceinline__ Elem from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffff, x, offset);
  return x;
}

}  // namespace jax_flashattn::cuda
