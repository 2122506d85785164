// Host-side conditions for launching the Hopper (sm_90a) kernels, shared by the forward and
// backward dispatchers: the device and the JAX_FLASHATTN_DISABLE_SM90 switch. (Whether the build
// holds an sm_90a image at all is JAX_FLASHATTN_HAS_SM90A, set by cmake/cuda.cmake.)
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "ffi/cuda/launch.h"

namespace jax_flashattn::sm90 {

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

// JAX_FLASHATTN_DISABLE_SM90=1 sends Hopper calls to the mma.sync family. Read per call, so a
// benchmark or test can compare the two families in one process; change it only while no
// attention call runs (getenv does not synchronise with a concurrent setenv).
inline bool disabled_by_environment() {
  const char* value = std::getenv("JAX_FLASHATTN_DISABLE_SM90");
  return value != nullptr && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
}

}  // namespace jax_flashattn::sm90
