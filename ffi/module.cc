// The Python extension: hands the FFI handlers to Python as capsules, per platform.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ffi/call_frame.h"
#include "ffi/decode_plan.h"
#ifdef JAX_FLASHATTN_WITH_CUDA
#include <stdexcept>

#include "ffi/cuda/copy_bandwidth.h"
#include "ffi/cuda/dispatch.h"
#endif

namespace nb = nanobind;

namespace {

template <typename Handler>
nb::capsule Encapsulate(Handler* handler) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

// "80,90a" (set by CMake) -> {"80", "90a"}; empty when built without CUDA.
std::vector<std::string> CudaArchitectures() {
  std::vector<std::string> archs;
#ifdef JAX_FLASHATTN_CUDA_ARCHS
  std::istringstream list(JAX_FLASHATTN_CUDA_ARCHS);
  for (std::string arch; std::getline(list, arch, ',');)
    if (!arch.empty()) archs.push_back(arch);
#endif
  return archs;
}

// Floats of decode workspace the C++ split rule (ffi/decode_plan.h) needs for a call of
// this shape, dtype code (0 float32, 1 bfloat16, 2 float16) and options on a device with
// `multiprocessors` SMs; 0 when the shape never takes the decode kernel. Python sizes the
// forward call's decode workspace with it (jax_flashattn._ffi.decode_workspace_size), so the
// rule lives in one place.
int64_t DecodeWorkspaceFloats(int dtype, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              float scale, bool has_bias, bool has_mask,
                              int64_t multiprocessors) {
  namespace mma_sync = jax_flashattn::mma_sync;
  static const char buffer[16] = {};
  jax_flashattn::AttentionParams p;
  p.dtype = static_cast<jax_flashattn::ElemType>(dtype);
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.scale = scale;
  p.bias = has_bias ? buffer : nullptr;
  p.mask = has_mask ? reinterpret_cast<const bool*>(buffer) : nullptr;
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || batch < 1 ||
      !mma_sync::decode_shape_fits(p))
    return 0;
  // The most splits a call of this shape asks for (with per-batch key lengths): the size
  // depends on the shape alone, and a call that aims at fewer splits runs them in it.
  const int64_t splits = mma_sync::decode_splits_wanted(
      batch * num_kv_heads, seqlen_k, multiprocessors, mma_sync::kDecodeBlocksPerSmRagged);
  return mma_sync::decode_workspace_floats(p, splits);
}

#ifdef JAX_FLASHATTN_WITH_CUDA
// Params of a call of this shape and dtype (0 float32, 1 bfloat16, 2 float16) with the default
// scale and these kernel switches, for the dispatchers' kernel choice only: contiguous buffers
// as XLA lays them out, every pointer at one aligned dummy that nothing reads or writes.
jax_flashattn::AttentionParams ShapeOnlyParams(int dtype, int64_t head_dim, int64_t seqlen_k,
                                               bool has_bias, bool has_mask, int64_t batch,
                                               int64_t seqlen_q, int64_t num_heads,
                                               int64_t num_kv_heads, bool disable_sm90,
                                               bool sm80_cp_async) {
  using jax_flashattn::ElemType;
  if (dtype < 0 || dtype > 2) throw std::invalid_argument("dtype code must be 0, 1 or 2");
  if (batch < 1 || seqlen_q < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0)
    throw std::invalid_argument("batch, seqlen_q and num_kv_heads must be positive and "
                                "num_heads a multiple of num_kv_heads");
  alignas(256) static const char buffer[16] = {};
  char* writable = const_cast<char*>(buffer);
  jax_flashattn::AttentionParams p;
  p.dtype = static_cast<ElemType>(dtype);
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.scale = head_dim > 0 ? 1.f / std::sqrt(float(head_dim)) : 1.f;
  p.seqlen_k = seqlen_k;
  p.head_dim = head_dim;
  p.q_head_stride = p.kv_head_stride = head_dim;
  p.q_row_stride = num_heads * head_dim;
  p.kv_row_stride = num_kv_heads * head_dim;
  p.q_batch_stride = seqlen_q * p.q_row_stride;
  p.kv_batch_stride = seqlen_k * p.kv_row_stride;
  p.q = p.k = p.v = p.d_out = buffer;
  p.out = p.dq = p.dk = p.dv = writable;
  p.dq_accum = p.delta = reinterpret_cast<float*>(writable);
  p.tile_counter = reinterpret_cast<int*>(writable);  // every forward call has one
  p.bias = has_bias ? buffer : nullptr;
  p.mask = has_mask ? reinterpret_cast<const bool*>(buffer) : nullptr;
  // The backward's bias gradient exists exactly when there is a bias.
  p.dbias = has_bias ? reinterpret_cast<float*>(writable) : nullptr;
  p.disable_sm90 = disable_sm90;
  p.sm80_cp_async = sm80_cp_async;
  return p;
}

// The forward kernel family the CUDA dispatcher picks on CUDA device `device` for a call of
// this shape and dtype (ShapeOnlyParams) with a decode workspace of `decode_workspace_floats`
// floats. Leaves the current device alone.
std::string CudaForwardKernel(int device, int dtype, int64_t head_dim, int64_t seqlen_k,
                              bool has_bias, bool has_mask, int64_t batch, int64_t seqlen_q,
                              int64_t num_heads, int64_t num_kv_heads,
                              int64_t decode_workspace_floats, bool disable_sm90,
                              bool sm80_cp_async) {
  jax_flashattn::AttentionParams p =
      ShapeOnlyParams(dtype, head_dim, seqlen_k, has_bias, has_mask, batch, seqlen_q, num_heads,
                      num_kv_heads, disable_sm90, sm80_cp_async);
  // Only the dispatcher's capacity check reads these; nothing is written.
  p.decode_workspace = p.dq_accum;
  p.decode_workspace_floats = decode_workspace_floats;
  switch (jax_flashattn::cuda::choose_forward_kernel(p, device)) {
    case jax_flashattn::cuda::ForwardKernel::kSm90:
      return "sm90";
    case jax_flashattn::cuda::ForwardKernel::kSm80:
      return "sm80";
    case jax_flashattn::cuda::ForwardKernel::kSimt:
      return "simt";
    case jax_flashattn::cuda::ForwardKernel::kDecode:
      return "decode";
    case jax_flashattn::cuda::ForwardKernel::kDecodeSm90:
      return "decode_sm90";
  }
  return "unknown";
}

// (splits, merge) of a decode call of this shape and dtype (as CudaForwardKernel, no bias or
// mask, with or without per-batch key lengths, which change the split count) on CUDA device
// `device`: merge "cluster", "paired_cluster" (two splits per block, merged in the cluster) or
// "combine"; (0, "") when the call takes no split-KV decode kernel. Makes `device` current for
// the query (the cluster occupancy is asked of the current device) and restores the caller's.
std::pair<int64_t, std::string> CudaDecodeLayout(int device, int dtype, int64_t head_dim,
                                                 int64_t seqlen_k, int64_t batch,
                                                 int64_t seqlen_q, int64_t num_heads,
                                                 int64_t num_kv_heads, bool has_kv_seqlens,
                                                 int64_t decode_workspace_floats,
                                                 bool disable_sm90) {
  jax_flashattn::AttentionParams p =
      ShapeOnlyParams(dtype, head_dim, seqlen_k, false, false, batch, seqlen_q, num_heads,
                      num_kv_heads, disable_sm90, false);
  if (has_kv_seqlens) p.kv_seqlens = reinterpret_cast<const int32_t*>(p.q);
  p.decode_workspace = p.dq_accum;
  p.decode_workspace_floats = decode_workspace_floats;
  int caller = 0;
  if (cudaGetDevice(&caller) != cudaSuccess || cudaSetDevice(device) != cudaSuccess)
    throw std::runtime_error("cannot make CUDA device " + std::to_string(device) + " current");
  const jax_flashattn::cuda::DecodeLayout layout = jax_flashattn::cuda::decode_layout(p, device);
  cudaSetDevice(caller);
  if (layout.splits == 0) return {0, ""};
  if (!layout.cluster_merge) return {layout.splits, "combine"};
  return {layout.splits, layout.splits_per_block == 2 ? "paired_cluster" : "cluster"};
}

// The backward kernel family the CUDA dispatcher picks on CUDA device `device` for a call of
// this shape and dtype (ShapeOnlyParams), with or without the deterministic dQ pass. Leaves the
// current device alone.
std::string CudaBackwardKernel(int device, int dtype, int64_t head_dim, int64_t seqlen_k,
                               bool has_bias, bool has_mask, bool deterministic, int64_t batch,
                               int64_t seqlen_q, int64_t num_heads, int64_t num_kv_heads,
                               bool disable_sm90, bool sm80_cp_async) {
  jax_flashattn::AttentionParams p =
      ShapeOnlyParams(dtype, head_dim, seqlen_k, has_bias, has_mask, batch, seqlen_q, num_heads,
                      num_kv_heads, disable_sm90, sm80_cp_async);
  p.deterministic = deterministic;
  switch (jax_flashattn::cuda::choose_backward_kernel(p, device)) {
    case jax_flashattn::cuda::BackwardKernel::kSm90:
      return "sm90";
    case jax_flashattn::cuda::BackwardKernel::kSm80:
      return "sm80";
    case jax_flashattn::cuda::BackwardKernel::kSimt:
      return "simt";
  }
  return "unknown";
}
#endif

}  // namespace

NB_MODULE(_jax_flashattn, m) {
  m.def("registrations", [] {
    nb::dict registrations;
    nb::dict cpu;
    cpu["jax_flashattn_fwd"] = Encapsulate(jax_flashattn_forward_cpu);
    cpu["jax_flashattn_bwd"] = Encapsulate(jax_flashattn_backward_cpu);
    registrations["cpu"] = cpu;
#ifdef JAX_FLASHATTN_WITH_CUDA
    nb::dict cuda;
    cuda["jax_flashattn_fwd"] = Encapsulate(jax_flashattn_forward_cuda);
    cuda["jax_flashattn_bwd"] = Encapsulate(jax_flashattn_backward_cuda);
    registrations["CUDA"] = cuda;
#endif
    return registrations;
  });
  m.def("cuda_architectures", &CudaArchitectures);
  m.def("decode_workspace_floats", &DecodeWorkspaceFloats);
  m.attr("DECODE_MAX_MULTIPROCESSORS") = jax_flashattn::mma_sync::kDecodeMaxMultiprocessors;
#ifdef JAX_FLASHATTN_WITH_CUDA
  m.def("cuda_forward_kernel", &CudaForwardKernel);
  m.def("cuda_decode_layout", &CudaDecodeLayout);
  m.def("cuda_backward_kernel", &CudaBackwardKernel);
  // (median, best) bytes per second of cudaMemcpy device to device, read plus written.
  m.def("cuda_copy_bandwidth", [](int device, size_t bytes, int runs) {
    const auto bw = jax_flashattn::cuda::measure_copy_bandwidth(device, bytes, runs);
    return std::make_pair(bw.median_bytes_per_s, bw.best_bytes_per_s);
  });
#endif
}
