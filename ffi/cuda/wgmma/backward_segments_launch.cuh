// Launch of the Hopper backward's instantiation for calls with segment ids, for one (element
// type, head dim) configuration; cuda/instantiations/backward_wgmma_segments.cu.in (generated
// by CMake) instantiates it, apart from the other kernels (backward_launch.cuh says why).
#pragma once

#include "ffi/cuda/wgmma/backward_launch.cuh"

namespace jax_flashattn::cuda {

template <typename Elem, int kHeadDim>
cudaError_t launch_backward_sm90_segments(const AttentionParams& p, cudaStream_t stream) {
  return launch_backward_sm90_with<Elem,
                                   wgmma::BackwardWithSegmentIds<wgmma::BackwardConfig<kHeadDim>>>(
      p, stream);
}

}  // namespace jax_flashattn::cuda
