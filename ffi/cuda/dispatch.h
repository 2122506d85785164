// Kernel selection for the CUDA handlers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/params.h"

namespace jax_flashattn::cuda {

enum class ForwardKernel { kSm90, kSm80, kSimt, kDecode, kDecodeSm90 };

// The forward kernel a call runs on CUDA device `device` (the current device for a launch).
ForwardKernel choose_forward_kernel(const AttentionParams& p, int device);

// How a call that takes a split-KV decode kernel runs on CUDA device `device` (the current
// one): its key ranges (splits) per work unit, how many of them one block runs (one per
// warpgroup), and whether they merge inside each unit's thread block cluster or through the
// workspace and the combine kernel (decode/mma_sync_launch.cuh). splits = 0 for a call that takes
// no decode kernel.
struct DecodeLayout {
  int64_t splits = 0;
  int64_t splits_per_block = 0;
  bool cluster_merge = false;
};
// `kernel` is the call's forward family (choose_forward_kernel's answer), which the caller has.
DecodeLayout decode_layout(const AttentionParams& p, int device, ForwardKernel kernel);

// Launches the chosen forward kernel on `stream`.
cudaError_t launch_forward(const AttentionParams& p, cudaStream_t stream);

enum class BackwardKernel { kSm90, kSm80, kSimt };

// The backward kernel family a call runs on CUDA device `device` (the current device for a
// launch).
BackwardKernel choose_backward_kernel(const AttentionParams& p, int device);

// Launches the chosen backward kernels on `stream` (preprocess, passes, dQ conversion).
cudaError_t launch_backward(const AttentionParams& p, cudaStream_t stream);

}  // namespace jax_flashattn::cuda
