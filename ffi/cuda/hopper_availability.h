// Host-side conditions for launching the Hopper (sm_90a) kernels, shared by the forward and
// backward dispatchers: the build, the device, the call's kernel switches (AttentionParams::
// disable_sm90, sm80_cp_async, traced from the environment) and what both kernels require of a
// call.
#pragma once

#include <cuda_runtime.h>

#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/cuda/decode/wgmma_traits.h"
#include "ffi/cuda/launch.h"
#include "ffi/cuda/wgmma/traits.h"
#include "ffi/decode_plan.h"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// Whether CUDA device `device` is compute capability 9.0 (the only one sm_90a code runs on),
// queried once per device.
inline bool device_is_sm90(int device) {
  return cuda::once_per_device(device, false, [](int d) {
    int major = 0, minor = 0;
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) == cudaSuccess &&
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d) == cudaSuccess &&
           major == 9 && minor == 0;
  });
}

// What both Hopper kernels need, beside their own head-dim and alignment rules and the terms
// each has (the dispatchers ask those): a build with an sm_90a image (JAX_FLASHATTN_HAS_SM90A,
// set by cmake/cuda.cmake), keys, 32-bit tile indices, the driver's tensor-map entry point, no
// disable_sm90 switch, and a compute capability 9.0 device.
inline bool hopper_kernels_apply(const AttentionParams& p, int device) {
#ifdef JAX_FLASHATTN_HAS_SM90A
  return p.seqlen_k > 0 && indices_fit_32_bits(p) &&
         tensor_maps_available() && !p.disable_sm90 && device_is_sm90(device);
#else
  (void)p;
  (void)device;
  return false;
#endif
}

// Whether a call that takes a split-KV decode kernel (mma_sync::make_decode_plan accepted it) takes
// the Hopper one: an sm_90a build on a compute capability 9.0 device, no
// disable_sm90 switch, a head dim up to the largest of kDecodeHeadDims, and at least
// kDecodeMinRows query rows per block (decode/wgmma_traits.h). It loads by cp.async, so it needs
// neither the tensor-map entry point nor TMA's alignment.
inline bool decode_kernel_applies(const AttentionParams& p, int device) {
#ifdef JAX_FLASHATTN_HAS_SM90A
  constexpr int kMaxHeadDim = kDecodeHeadDims[sizeof(kDecodeHeadDims) / sizeof(int) - 1];
  return p.head_dim <= kMaxHeadDim && mma_sync::decode_rows(p) >= kDecodeMinRows &&
         !p.disable_sm90 && device_is_sm90(device);
#else
  (void)p;
  (void)device;
  return false;
#endif
}

// Whether the mma.sync forward loads K and V by TMA (its kTmaKV kernels, compiled only into
// the sm_90a image): on a compute capability 9.0 device, with the driver's tensor-map entry
// point, keys (a tensor map has no empty dimension), 16-byte aligned tensors, and keys, kv
// heads and batch entries addressable by TMA's int32 coordinates (a tile starts below S).
// Bias and mask calls take it too (they run on the mma.sync family on Hopper). The
// sm80_cp_async switch keeps the cp.async loads of other GPUs (for comparing the two loads in
// one process, and for testing the cp.async path on the Hopper cards the tests run on);
// disable_sm90 does not change it: that switch picks the family
// (docs/decisions/mma-sync-tma-kv-loads-on-hopper.md).
inline bool tma_loads_apply(const AttentionParams& p, int device) {
#ifdef JAX_FLASHATTN_HAS_SM90A
  constexpr int64_t kInt32 = 0x7fffffff;
  return p.seqlen_k > 0 && p.seqlen_k <= kInt32 && p.num_kv_heads <= kInt32 &&
         p.batch <= kInt32 && tma_compatible(p) && tensor_maps_available() &&
         !p.sm80_cp_async && device_is_sm90(device);
#else
  (void)p;
  (void)device;
  return false;
#endif
}

}  // namespace jax_flashattn::wgmma
