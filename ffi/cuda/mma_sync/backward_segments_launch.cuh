// Launch of the mma.sync backward's instantiation for calls with segment ids, for one (element
// type, head dim) configuration; cuda/instantiations/backward_mma_sync_segments.cu.in (generated
// by CMake) instantiates it, apart from the other kernels (mma_sync/forward_launch.cuh says why).
#pragma once

#include "ffi/cuda/mma_sync/backward_launch.cuh"

namespace jax_flashattn::cuda {

template <typename Elem, int kHeadDim>
cudaError_t launch_backward_sm80_segments(const AttentionParams& p, cudaStream_t stream) {
  return launch_backward_tables<Elem, kHeadDim, true>(p, stream);
}

}  // namespace jax_flashattn::cuda
