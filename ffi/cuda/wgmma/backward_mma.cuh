// The wgmma operand descriptors of the Hopper backward.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"

namespace jax_flashattn::wgmma {

// Descriptors. K-major operands (head dim contiguous) of S^T = K Q^T and dP^T = V dO^T:
// k-step ks lies in span ks / 4, 32 bytes per step into each 128-byte row, as the forward's
// Q K^T. MN-major B operands of dV += P^T dO and dK += dS^T Q (head dim contiguous, queries
// along the reduction), as the forward's V: k-step kk is 16 rows down, spans kBlockM rows apart
// (LBO). dQ = dS K reads dS^T [key][query] as an MN-major A (a consumer's 64 queries are one
// span, so no LBO) and K [key][head dim] as an MN-major B from this warpgroup's first column:
// k-step kk is 16 keys down both.
template <typename Traits>
struct BackwardDescriptors {
  // K or V (rows = kBlockN) as A, Q or dO (rows = kBlockM) as B of S^T or dP^T.
  __device__ static uint64_t k_major(uint32_t tile, int rows, int ks) {
    return ptx::smem_descriptor_sw128(tile + k_major_step_bytes(rows, ks), 16, kGroupBytes);
  }
  // Q or dO as B of dK or dV.
  __device__ static uint64_t query_tile(uint32_t tile, int kk) {
    return ptx::smem_descriptor_sw128(tile + mn_major_step_bytes(kk),
                                      Traits::kBlockM * kRowBytes, kGroupBytes);
  }
  // K from this warpgroup's first dQ column, as B of dQ.
  __device__ static uint64_t k_for_dq(uint32_t k_dq_tile, int kk) {
    return ptx::smem_descriptor_sw128(k_dq_tile + mn_major_step_bytes(kk),
                                      Traits::kBlockN * kRowBytes, kGroupBytes);
  }
  // The span of a dS^T buffer that holds this warpgroup's dQ queries, as A of dQ.
  __device__ static uint64_t ds(uint32_t ds_tile, int kk) {
    return ptx::smem_descriptor_sw128(ds_tile + mn_major_step_bytes(kk), Traits::kDsBytes,
                                      kGroupBytes);
  }
};

}  // namespace jax_flashattn::wgmma
