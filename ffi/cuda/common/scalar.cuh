// Per-element conversions between the kernels' storage types and float, and warp-wide
// reductions: the scalar helpers of the CUDA-core kernels, of the backward's elementwise steps
// and of the bias reads of the Hopper and decode kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

namespace jax_flashattn::cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Two adjacent 2-byte elements of one 32-bit word (the first in its low half), as floats. A
// bfloat16's float is its bits shifted up, so the high one takes a mask alone (one LOP3, where
// converting each element took a PRMT and a shift for it).
template <typename Elem>
__device__ __forceinline__ float2 pair_to_float2(uint32_t bits);
template <>
__device__ __forceinline__ float2 pair_to_float2<__nv_bfloat16>(uint32_t bits) {
  return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
}
template <>
__device__ __forceinline__ float2 pair_to_float2<__half>(uint32_t bits) {
  __half2 pair;
  memcpy(&pair, &bits, 4);
  return __half22float2(pair);
}

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
