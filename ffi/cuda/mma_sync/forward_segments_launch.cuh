// Launch of the mma.sync forward's instantiation for calls with segment ids, for one (element
// type, head dim) configuration; cuda/instantiations/forward_mma_sync_segments.cu.in (generated
// by CMake) instantiates it, apart from the other kernels (forward_launch.cuh says why).
#pragma once

#include "ffi/cuda/mma_sync/forward_launch.cuh"

namespace jax_flashattn::cuda {

template <typename Elem, int kHeadDim>
cudaError_t launch_forward_sm80_segments(const AttentionParams& p, bool tma_kv,
                                         cudaStream_t stream) {
  return launch_forward_sm80_loads<Elem, mma_sync::ForwardConfig<kHeadDim>, true, true>(
      p, tma_kv, stream);
}

}  // namespace jax_flashattn::cuda
