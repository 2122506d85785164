#include "ffi/plan.h"

#include <stdexcept>
#include <string>

#include "ffi/decode_plan.h"
#ifdef JAX_FLASHATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "ffi/cuda/dispatch.h"
#endif

namespace jax_flashattn {
namespace {

bool KnownDtype(ElemType dtype) {
  return dtype == ElemType::kFloat32 || dtype == ElemType::kBFloat16 ||
         dtype == ElemType::kFloat16;
}

// The AttentionParams the planner asks the dispatchers about: SetLayout's sizes and strides,
// and every buffer the call will have (the optional ones where `s` flags them, the forward's
// tile counter, the backward's workspaces) at one aligned address that nothing reads or
// writes. The dispatchers look only at which buffers exist and at their alignment, which
// XLA's buffers always have.
AttentionParams PlanningParams(const CallShape& s) {
  alignas(256) static char buffer[16] = {};
  AttentionParams p;
  SetLayout(s, p);
  p.q = p.k = p.v = p.d_out = buffer;
  p.out = p.dq = p.dk = p.dv = buffer;
  p.lse = p.dq_accum = p.delta = reinterpret_cast<float*>(buffer);
  p.tile_counter = reinterpret_cast<int*>(buffer);
  if (s.deterministic) {
    p.dq_semaphores = reinterpret_cast<int32_t*>(buffer);
    p.dq_semaphore_count = p.dq_semaphores_needed();
  }
  if (s.has_bias) {
    p.bias = buffer;
    p.bias_strides.col = s.bias_broadcasts_keys ? 0 : 1;
  }
  if (s.has_mask) {
    p.mask = reinterpret_cast<const bool*>(buffer);
    p.mask_strides.col = s.mask_broadcasts_keys ? 0 : 1;
  }
  if (s.has_q_seqlens) p.q_seqlens = reinterpret_cast<const int32_t*>(buffer);
  if (s.has_kv_seqlens) p.kv_seqlens = reinterpret_cast<const int32_t*>(buffer);
  if (s.has_segment_ids)
    p.q_segment_ids = p.kv_segment_ids = reinterpret_cast<const int32_t*>(buffer);
  if (s.has_alibi) p.alibi_slopes = reinterpret_cast<const float*>(buffer);
  if (s.e4m3_attention) p.k_descale = p.v_descale = reinterpret_cast<const float*>(buffer);
  return p;
}

#ifdef JAX_FLASHATTN_WITH_CUDA
const char* Name(cuda::ForwardKernel kernel) {
  switch (kernel) {
    case cuda::ForwardKernel::kSm90: return "sm90";
    case cuda::ForwardKernel::kSm80: return "sm80";
    case cuda::ForwardKernel::kSimt: return "simt";
    case cuda::ForwardKernel::kDecode: return "decode";
    case cuda::ForwardKernel::kDecodeSm90: return "decode_sm90";
  }
  return "unknown";
}

const char* Name(cuda::BackwardKernel kernel) {
  switch (kernel) {
    case cuda::BackwardKernel::kSm90: return "sm90";
    case cuda::BackwardKernel::kSm80: return "sm80";
    case cuda::BackwardKernel::kSimt: return "simt";
  }
  return "unknown";
}

// The families and decode layout on `device`, the current device (the cluster occupancy of a
// decode call is asked of the current one).
void PlanKernels(const CallShape& s, int device, CallPlan& plan) {
  AttentionParams p = PlanningParams(s);
  p.decode_workspace_floats = plan.decode_workspace_floats;
  if (plan.decode_workspace_floats > 0) p.decode_workspace = p.dq_accum;
  const cuda::ForwardKernel forward = cuda::choose_forward_kernel(p, device);
  plan.forward = Name(forward);
  plan.backward = Name(cuda::choose_backward_kernel(p, device));
  const cuda::DecodeLayout layout = cuda::decode_layout(p, device, forward);
  plan.decode_splits = layout.splits;
  if (layout.splits > 0)
    plan.decode_merge = !layout.cluster_merge           ? "combine"
                        : layout.splits_per_block == 2 ? "paired_cluster"
                                                       : "cluster";
}
#endif

}  // namespace

int64_t DecodeWorkspaceFloats(const CallShape& s, int64_t multiprocessors) {
  if (!KnownDtype(s.dtype) || s.batch < 1 || s.num_kv_heads < 1 ||
      s.num_heads % s.num_kv_heads != 0 || multiprocessors < 1)
    return 0;
  const AttentionParams p = PlanningParams(s);
  if (!mma_sync::decode_shape_fits(p)) return 0;
  // The most splits a call of this shape asks for (with per-batch key lengths): the size
  // depends on the shape alone, and a call that aims at fewer splits runs them in it.
  const int64_t splits =
      mma_sync::decode_splits_wanted(s.batch * s.num_kv_heads, s.seqlen_k, multiprocessors,
                                     mma_sync::kDecodeBlocksPerSmRagged);
  return mma_sync::decode_workspace_floats(p, splits);
}

CallPlan Plan(const CallShape& shape, int device) {
  CallPlan plan;
  plan.decode_workspace_floats =
      DecodeWorkspaceFloats(shape, mma_sync::kDecodeMaxMultiprocessors);
  const AttentionParams planning = PlanningParams(shape);
  if (shape.deterministic) plan.dq_semaphores = planning.dq_semaphores_needed();
  plan.forward_workspace_ints = 1 + planning.tile_order_needed();
  plan.backward_workspace_ints = plan.dq_semaphores + planning.block_order_needed();
  plan.dslopes_slots = dslopes_slots(shape.seqlen_k);
  if (device < 0) return plan;
  if (!KnownDtype(shape.dtype))
    throw std::invalid_argument("dtype code must be 0 (float32), 1 (bfloat16) or 2 (float16)");
  if (shape.batch < 1 || shape.seqlen_q < 1 || shape.num_kv_heads < 1 ||
      shape.num_heads % shape.num_kv_heads != 0)
    throw std::invalid_argument("batch, seqlen_q and num_kv_heads must be positive and "
                                "num_heads a multiple of num_kv_heads");
#ifdef JAX_FLASHATTN_WITH_CUDA
  int caller = 0;
  if (cudaGetDevice(&caller) != cudaSuccess || cudaSetDevice(device) != cudaSuccess)
    throw std::runtime_error("cannot make CUDA device " + std::to_string(device) + " current");
  PlanKernels(shape, device, plan);
  cudaSetDevice(caller);
  return plan;
#else
  throw std::runtime_error("this build of jax_flashattn has no CUDA kernels");
#endif
}

}  // namespace jax_flashattn
