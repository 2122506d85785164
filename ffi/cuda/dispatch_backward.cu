// Picks the backward kernels for a call: the mma.sync family for bf16/fp16 with head dims that
// are a multiple of 8 up to the largest instantiated one (on the smallest instantiated head
// dim that holds it) and a scale > 0, the CUDA-core kernels for everything else. The mma.sync path is three
// stream-ordered steps: preprocess (D, zeroed dQ accumulator), the passes, dQ conversion.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <iterator>

#include "ffi/cuda/dispatch.h"
#include "ffi/cuda/launch.h"
#include "ffi/cuda/sm80/backward_elementwise.cuh"
#include "ffi/cuda/sm80/backward_traits.h"

namespace jax_flashattn::cuda {
namespace {

template <typename Elem>
cudaError_t launch_sm80_for_head_dim(const AttentionParams& p, cudaStream_t stream) {
  if (p.head_dim <= 32) return launch_backward_sm80<Elem, 32>(p, stream);
  if (p.head_dim <= 64) return launch_backward_sm80<Elem, 64>(p, stream);
  if (p.head_dim <= 96) return launch_backward_sm80<Elem, 96>(p, stream);
  return launch_backward_sm80<Elem, 128>(p, stream);
}

int64_t elementwise_blocks(int64_t threads) {
  return (threads + sm80::kElementwiseThreads - 1) / sm80::kElementwiseThreads;
}

template <typename Elem>
cudaError_t launch_sm80(const AttentionParams& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.seqlen_q * p.num_heads;
  const int64_t preprocess_blocks = elementwise_blocks(rows * 32);
  const int64_t convert_blocks = elementwise_blocks(rows * p.head_dim / 8);
  if (preprocess_blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  sm80::backward_preprocess_kernel<Elem>
      <<<unsigned(preprocess_blocks), sm80::kElementwiseThreads, 0, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (cudaError_t e = launch_sm80_for_head_dim<Elem>(p, stream); e != cudaSuccess) return e;
  if (p.deterministic) return cudaSuccess;
  sm80::backward_convert_dq_kernel<Elem>
      <<<unsigned(convert_blocks), sm80::kElementwiseThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

BackwardKernel choose_backward_kernel(const AttentionParams& p) {
  const bool tensor_core_dtype = p.dtype == ElemType::kBFloat16 || p.dtype == ElemType::kFloat16;
  const int64_t max_head_dim =
      sm80::kBackwardHeadDims[std::size(sm80::kBackwardHeadDims) - 1];
  // scale > 0: the recomputed P multiplies masked (-inf) scores by the scale.
  if (tensor_core_dtype && p.head_dim > 0 && p.head_dim % 8 == 0 && p.head_dim <= max_head_dim &&
      p.scale > 0.f)
    return BackwardKernel::kSm80;
  return BackwardKernel::kSimt;
}

cudaError_t launch_backward(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_heads == 0 || p.seqlen_q == 0) return cudaSuccess;
  switch (choose_backward_kernel(p)) {
    case BackwardKernel::kSm80:
      return p.dtype == ElemType::kBFloat16 ? launch_sm80<__nv_bfloat16>(p, stream)
                                            : launch_sm80<__half>(p, stream);
    case BackwardKernel::kSimt:
      return launch_backward_simt(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flashattn::cuda
