// Kernel selection for the CUDA handlers.
#pragma once

#include <cuda_runtime.h>

#include "ffi/params.h"

namespace jax_flashattn::cuda {

enum class ForwardKernel { kSm90, kSm80, kSimt, kDecode, kDecodeSm90 };

// The forward kernel a call runs on CUDA device `device` (the current device for a launch).
ForwardKernel choose_forward_kernel(const AttentionParams& p, int device);

// Launches the chosen forward kernel on `stream`.
cudaError_t launch_forward(const AttentionParams& p, cudaStream_t stream);

enum class BackwardKernel { kSm90, kSm80, kSimt };

// The backward kernel family a call runs on CUDA device `device` (the current device for a
// launch).
BackwardKernel choose_backward_kernel(const AttentionParams& p, int device);

// Launches the chosen backward kernels on `stream` (preprocess, passes, dQ conversion).
cudaError_t launch_backward(const AttentionParams& p, cudaStream_t stream);

}  // namespace jax_flashattn::cuda
