// Picks the forward kernel for a call: the mma.sync family for bf16/fp16 with head dims that
// are a multiple of 8 up to 256 (on the smallest instantiated head dim that holds it), the
// CUDA-core kernel for everything else.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <iterator>

#include "ffi/cuda/dispatch.h"
#include "ffi/cuda/launch.h"
#include "ffi/cuda/sm80/traits.h"

namespace jax_flashattn::cuda {
namespace {

template <typename Elem>
cudaError_t launch_sm80_for_head_dim(const AttentionParams& p, cudaStream_t stream) {
  if (p.head_dim <= 32) return launch_forward_sm80<Elem, 32>(p, stream);
  if (p.head_dim <= 64) return launch_forward_sm80<Elem, 64>(p, stream);
  if (p.head_dim <= 96) return launch_forward_sm80<Elem, 96>(p, stream);
  if (p.head_dim <= 128) return launch_forward_sm80<Elem, 128>(p, stream);
  if (p.head_dim <= 192) return launch_forward_sm80<Elem, 192>(p, stream);
  return launch_forward_sm80<Elem, 256>(p, stream);
}

}  // namespace

ForwardKernel choose_forward_kernel(const AttentionParams& p) {
  const bool tensor_core_dtype = p.dtype == ElemType::kBFloat16 || p.dtype == ElemType::kFloat16;
  const int64_t max_head_dim = sm80::kHeadDims[std::size(sm80::kHeadDims) - 1];
  if (tensor_core_dtype && p.head_dim % 8 == 0 && p.head_dim <= max_head_dim)
    return ForwardKernel::kSm80;
  return ForwardKernel::kSimt;
}

cudaError_t launch_forward(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_heads == 0 || p.seqlen_q == 0) return cudaSuccess;
  switch (choose_forward_kernel(p)) {
    case ForwardKernel::kSm80:
      return p.dtype == ElemType::kBFloat16 ? launch_sm80_for_head_dim<__nv_bfloat16>(p, stream)
                                            : launch_sm80_for_head_dim<__half>(p, stream);
    case ForwardKernel::kSimt:
      return launch_forward_simt(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flashattn::cuda
