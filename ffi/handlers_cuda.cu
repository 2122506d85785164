// CUDA handlers: decode the call and launch on XLA's stream. Never synchronises, never
// allocates, never queries the stream: every buffer the kernels touch is an operand or a result
// of the call, and the launches depend only on the call's shapes, attributes and buffers. That
// makes them safe to record into XLA's command buffers (CUDA graphs, by stream capture), so the
// handlers say so (kCmdBufferCompatible): a jitted step then replays our kernels in the same
// graph as its fusions instead of leaving the graph for each call
// (docs/decisions/command-buffer-compatible-handlers.md).
#include <cuda_runtime.h>

#include <string>

#include "ffi/call_frame.h"
#include "ffi/cuda/dispatch.h"
#include "ffi/cuda/launch.h"

namespace jax_flashattn {
namespace {

ffi::Error ForwardCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> workspace,
                       ffi::Result<ffi::AnyBuffer> decode_workspace, CallAttrs attrs) {
  AttentionParams p;
  if (ffi::Error e = DecodeForward(q, k, v, optional, out, lse, workspace, decode_workspace,
                                   attrs, p);
      e.failure())
    return e;
  if (p.e4m3_attention) {
    // FP8 attention runs on the Hopper forward's e4m3 configurations only; the Python side
    // sends a call here only where they apply (the plan's forward kernel).
    int device = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_flashattn: ") + cudaGetErrorString(e));
    if (cuda::choose_forward_kernel(p, device) != cuda::ForwardKernel::kSm90)
      return ffi::Error::InvalidArgument(
          "jax_flashattn: FP8 attention runs on the Hopper (sm_90a) forward only: head dim a "
          "multiple of 16 up to 128, no bias, mask, ALiBi, soft-cap or segment ids");
  } else if (p.page_table != nullptr || p.k_descale != nullptr) {
    // Only the split-KV decode kernels read pages and e4m3 keys and values (ffi/params.h);
    // the Python side sends such a call here only where they apply (decode_shape_fits,
    // decode_fp8_kv_fits).
    int device = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_flashattn: ") + cudaGetErrorString(e));
    const cuda::ForwardKernel kernel = cuda::choose_forward_kernel(p, device);
    if (kernel != cuda::ForwardKernel::kDecode && kernel != cuda::ForwardKernel::kDecodeSm90)
      return ffi::Error::InvalidArgument(
          std::string("jax_flashattn: ") +
          (p.k_descale != nullptr
               ? "float8_e4m3fn keys and values run on the split-KV decode kernels only (head "
                 "dim a multiple of 16 up to 256, no bias, mask, ALiBi or soft-cap"
               : "a paged call runs on the split-KV decode kernels only (head dim a multiple "
                 "of 8 up to 256") +
          ", bf16 or float16 query, T (N / K) <= 64 query rows per kv head, >= 256 keys)");
  }
  if (cudaError_t e = cuda::launch_forward(p, stream); e != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_flashattn: CUDA forward launch failed: ") +
                                cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error BackwardCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                        ffi::AnyBuffer d_out, ffi::RemainingArgs optional,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dq_accum,
                        ffi::Result<ffi::AnyBuffer> delta,
                        ffi::Result<ffi::AnyBuffer> dq_semaphores, ffi::RemainingRets dbias,
                        CallAttrs attrs) {
  AttentionParams p;
  if (ffi::Error e = DecodeBackward(q, k, v, out, lse, d_out, optional, dq, dk, dv, dq_accum,
                                    delta, dq_semaphores, dbias, attrs, p);
      e.failure())
    return e;
  if (cudaError_t e = cuda::launch_backward(p, stream); e != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_flashattn: CUDA backward launch failed: ") +
                                cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_flashattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_flashattn_forward_cuda, jax_flashattn::ForwardCuda,
    jax_flashattn::BindForward(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_flashattn_backward_cuda, jax_flashattn::BackwardCuda,
    jax_flashattn::BindBackward(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
