// Picks the backward kernels for a call: on Hopper the TMA + wgmma kernel where it applies, else
// the mma.sync family for bf16/fp16 with head dims that are a multiple of 8 up to the largest
// instantiated one (on the smallest instantiated head dim that holds it; above 128 only where the
// device has the large table's shared memory) and a scale > 0, the CUDA-core kernels for
// everything else. Both tensor-core families are three stream-ordered steps: preprocess (D,
// zeroed dQ accumulator), the passes, dQ conversion; the Hopper kernel's deterministic mode
// zeroes its dQ semaphores before them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <iterator>

#include "ffi/cuda/common/backward_elementwise.cuh"
#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/cuda/dispatch.h"
#include "ffi/cuda/hopper_availability.h"
#include "ffi/cuda/launch.h"
#include "ffi/cuda/mma_sync/backward_traits.h"
#include "ffi/cuda/wgmma/backward_traits.h"
#include "ffi/cuda/wgmma/traits.h"

namespace jax_flashattn::cuda {
namespace {

template <typename Elem>
cudaError_t launch_sm80_for_head_dim(const AttentionParams& p, cudaStream_t stream) {
  return for_head_dim<mma_sync::kBackwardHeadDims>(p.head_dim, [&](auto h) {
    return launch_backward_sm80<Elem, decltype(h)::value>(p, stream);
  });
}

template <typename Elem>
cudaError_t launch_sm90_for_head_dim(const AttentionParams& p, cudaStream_t stream) {
  return for_head_dim<wgmma::kBackwardHeadDims>(p.head_dim, [&](auto h) {
    return launch_backward_sm90<Elem, decltype(h)::value>(p, stream);
  });
}

int64_t elementwise_blocks(int64_t threads) {
  return (threads + mma_sync::kElementwiseThreads - 1) / mma_sync::kElementwiseThreads;
}

// The preprocess at preprocess_lanes(head_dim) lanes a row (head dims up to 256: 32 lanes).
template <typename Elem>
cudaError_t launch_preprocess(const AttentionParams& p, bool zero_dq_accum, cudaStream_t stream) {
  const int lanes = mma_sync::preprocess_lanes(p.head_dim);
  const int64_t runs = (p.seqlen_q * lanes + mma_sync::kElementwiseThreads - 1) /
                       mma_sync::kElementwiseThreads;
  const int64_t head_pairs = p.batch * p.num_heads;
  if (head_pairs > 0x7fffffff || lanes > 32) return cudaErrorInvalidConfiguration;
  const dim3 grid(unsigned(head_pairs),
                  unsigned(runs < mma_sync::kPreprocessMaxQueryRuns
                               ? runs
                               : mma_sync::kPreprocessMaxQueryRuns));
  const auto launch = [&](auto kernel) {
    kernel<<<grid, mma_sync::kElementwiseThreads, 0, stream>>>(p, zero_dq_accum);
    return cudaGetLastError();
  };
  switch (lanes) {
    case 1: return launch(mma_sync::backward_preprocess_kernel<Elem, 1>);
    case 2: return launch(mma_sync::backward_preprocess_kernel<Elem, 2>);
    case 4: return launch(mma_sync::backward_preprocess_kernel<Elem, 4>);
    case 8: return launch(mma_sync::backward_preprocess_kernel<Elem, 8>);
    case 16: return launch(mma_sync::backward_preprocess_kernel<Elem, 16>);
    default: return launch(mma_sync::backward_preprocess_kernel<Elem, 32>);
  }
}

// The preprocess, the passes of `kernel` (kSm90 or kSm80), then the dQ conversion unless the
// passes wrote dQ themselves (the mma.sync family's deterministic mode). The Hopper kernel's
// deterministic mode starts from zeroed dQ semaphores.
template <typename Elem>
cudaError_t launch_tensor_core(const AttentionParams& p, BackwardKernel kernel,
                               cudaStream_t stream) {
  const int64_t rows = p.batch * p.seqlen_q * p.num_heads;
  const int64_t convert_blocks = elementwise_blocks(rows * p.head_dim / 8);
  if (convert_blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const bool dq_pass = p.deterministic && kernel == BackwardKernel::kSm80;
  if (p.deterministic && kernel == BackwardKernel::kSm90) {
    const size_t bytes = size_t(p.dq_semaphores_needed()) * sizeof(int32_t);
    if (cudaError_t e = cudaMemsetAsync(p.dq_semaphores, 0, bytes, stream); e != cudaSuccess)
      return e;
  }
  if (cudaError_t e = launch_preprocess<Elem>(p, !dq_pass, stream); e != cudaSuccess) return e;
  const cudaError_t passes = kernel == BackwardKernel::kSm90
                                 ? launch_sm90_for_head_dim<Elem>(p, stream)
                                 : launch_sm80_for_head_dim<Elem>(p, stream);
  if (passes != cudaSuccess) return passes;
  if (dq_pass) return cudaSuccess;
  mma_sync::backward_convert_dq_kernel<Elem>
      <<<unsigned(convert_blocks), mma_sync::kElementwiseThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// The Hopper kernel's grid is one-dimensional: one block per (key block, kv head, batch). Its
// deterministic mode needs the call's dQ semaphores and no segment ids (such calls keep the
// mma.sync family's dQ pass). Soft-capped calls take the kernel's instantiations for them
// (BackwardWithSoftCap), without segment ids (such calls take the mma.sync family's). Calls with
// a bias, boolean mask or ALiBi take its instantiations for them (BackwardWithBiasAndMask)
// where the tensors have unit stride along the keys, without ids or a soft-cap, and in
// deterministic mode only where each element of dbias has one writer (its red.global.add has
// no fixed order).
bool sm90_applies(const AttentionParams& p, int device) {
  const int64_t max_head_dim = wgmma::kBackwardHeadDims[std::size(wgmma::kBackwardHeadDims) - 1];
  constexpr int64_t kBlockN = wgmma::kBackwardMinBlockN;
  const int64_t blocks = (p.seqlen_k + kBlockN - 1) / kBlockN * p.batch * p.num_kv_heads;
  const bool ordered_dq = p.dq_semaphores != nullptr && p.q_segment_ids == nullptr &&
                          p.dq_semaphore_count >= p.dq_semaphores_needed();
  const bool soft_cap_fits = !p.soft_capped() || p.q_segment_ids == nullptr;
  const bool bias_or_mask_fits =
      !p.has_elementwise_terms() ||
      (p.q_segment_ids == nullptr && !p.soft_capped() &&
       !(p.deterministic && p.dbias_accumulates) && wgmma::bias_and_mask_fit(p));
  return (!p.deterministic || ordered_dq) && soft_cap_fits && bias_or_mask_fits &&
         p.head_dim <= max_head_dim && blocks <= 0x7fffffff &&
         wgmma::backward_tma_compatible(p) && wgmma::segment_ids_tma_compatible(p) &&
         wgmma::hopper_kernels_apply(p, device);
}

}  // namespace

BackwardKernel choose_backward_kernel(const AttentionParams& p, int device) {
  const bool tensor_core_dtype = p.dtype == ElemType::kBFloat16 || p.dtype == ElemType::kFloat16;
  const int64_t max_head_dim =
      mma_sync::kBackwardHeadDims[std::size(mma_sync::kBackwardHeadDims) - 1];
  // scale > 0: the recomputed P multiplies masked (-inf) scores by the scale.
  if (!tensor_core_dtype || p.head_dim <= 0 || p.head_dim % 8 != 0 ||
      p.head_dim > max_head_dim || !(p.scale > 0.f))
    return BackwardKernel::kSimt;
  if (sm90_applies(p, device)) return BackwardKernel::kSm90;
  // Head dims past the 99 KiB table need the large one (mma_sync/backward_traits.h).
  bool large = false;
  if (p.head_dim > mma_sync::kSmallTableMaxHeadDim &&
      (mma_sync::large_tables_fit(device, large) != cudaSuccess || !large))
    return BackwardKernel::kSimt;
  return BackwardKernel::kSm80;
}

cudaError_t launch_backward(const AttentionParams& p, cudaStream_t stream) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const BackwardKernel kernel = choose_backward_kernel(p, device);
  // dbias is zeroed where the kernels add into it (params.h), and for the Hopper kernel, which
  // stores dS only at the pairs it visits and sees, wherever some pair inside [T, S] may be
  // neither: with a bound, lengths or a mask (the mma.sync family visits every query tile and
  // stores 0 at hidden pairs).
  const bool sm90_skips_pairs = kernel == BackwardKernel::kSm90 &&
                                (p.mask != nullptr || !p.unwindowed() ||
                                 p.q_seqlens != nullptr || p.kv_seqlens != nullptr);
  if (p.dbias != nullptr && (p.dbias_accumulates || sm90_skips_pairs)) {
    const cudaError_t e =
        cudaMemsetAsync(p.dbias, 0, size_t(p.dbias_elements) * sizeof(float), stream);
    if (e != cudaSuccess) return e;
  }
  // The kernels add the slopes' gradient into its slots (dslopes_slots).
  if (p.dslopes != nullptr) {
    const size_t slots = size_t(p.batch * p.num_heads * dslopes_slots(p.seqlen_k));
    if (cudaError_t e = cudaMemsetAsync(p.dslopes, 0, slots * sizeof(float), stream);
        e != cudaSuccess)
      return e;
  }
  if (p.batch == 0 || p.num_heads == 0 || p.seqlen_q == 0) return cudaSuccess;
  const bool bf16 = p.dtype == ElemType::kBFloat16;
  switch (kernel) {
    case BackwardKernel::kSm90:
    case BackwardKernel::kSm80:
      return bf16 ? launch_tensor_core<__nv_bfloat16>(p, kernel, stream)
                  : launch_tensor_core<__half>(p, kernel, stream);
    case BackwardKernel::kSimt:
      return launch_backward_simt(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flashattn::cuda
