// What a call will run and which workspaces it needs, from its CallShape alone: the one question
// the Python side asks the extension (jax_flashattn._ffi.plan), at trace time for the workspace
// sizes and on demand for the kernel families a call takes.
#pragma once

#include <cstdint>
#include <string>

#include "ffi/call_shape.h"

namespace jax_flashattn {

struct CallPlan {
  // Float32 elements of the forward's decode workspace, its splits' partial O and lse:
  // DecodeWorkspaceFloats at kDecodeMaxMultiprocessors SMs (a device with more runs as many
  // splits as this holds). Known without a device.
  int64_t decode_workspace_floats = 0;
  // Int32 elements of the backward's dQ semaphores: AttentionParams::dq_semaphores_needed() for
  // a deterministic call (which the Hopper kernel may take), 0 otherwise. Known without a device.
  int64_t dq_semaphores = 0;
  // Int32 elements of the forward's workspace: the Hopper kernel's tile counter, and for a call
  // with segment ids its tile order (AttentionParams::tile_order_needed). Known without a
  // device.
  int64_t forward_workspace_ints = 1;
  // Int32 elements of the backward's workspace: dq_semaphores, then for a call with segment ids
  // the Hopper kernel's block order (AttentionParams::block_order_needed). Known without a
  // device.
  int64_t backward_workspace_ints = 0;
  // Float32 partial sums per (batch entry, head) of the ALiBi slopes' gradient:
  // dslopes_slots(S) (ffi/params.h). Known without a device.
  int64_t dslopes_slots = 0;
  // On a CUDA device (empty without one): the forward family the dispatcher picks ("sm90",
  // "sm80", "decode", "decode_sm90", "simt"), given that workspace; the backward family ("sm90",
  // "sm80", "simt"); and a decode call's key splits per (batch entry, kv head) and how they
  // merge ("cluster", "paired_cluster", "combine"; 0 and "" for any other call).
  std::string forward;
  std::string backward;
  int64_t decode_splits = 0;
  std::string decode_merge;
};

// Float32 elements of decode workspace that the split rule (ffi/decode_plan.h) needs for
// `shape` on a GPU with `multiprocessors` SMs, with per-batch key lengths (the most splits);
// 0 when the shape never takes a decode kernel. The plan's is this at
// kDecodeMaxMultiprocessors.
int64_t DecodeWorkspaceFloats(const CallShape& shape, int64_t multiprocessors);

// The plan of `shape` on CUDA device `device`, or without a device when `device` < 0 (the
// workspace alone). With a device, throws std::invalid_argument for a shape no kernel is asked
// to run (an unknown dtype, no batch entry or query row, N not a multiple of K), and
// std::runtime_error when the device cannot be made current or this build has no CUDA kernels.
// Leaves the caller's current device as it was.
CallPlan Plan(const CallShape& shape, int device);

}  // namespace jax_flashattn
