// What the CUDA handlers can launch. Each returns the launch's error (cudaSuccess when
// queued); none synchronises.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>
#include <utility>

#include "ffi/decode_plan.h"
#include "ffi/params.h"

namespace jax_flashattn::cuda {

// f(std::integral_constant<int, H>{}) for the first H of kHeadDims (an instantiated head-dim
// list, smallest first) that holds `head_dim`, the last one past it (the dispatcher has checked
// that the largest holds the call). The dispatchers walk the families' lists with it, and
// cmake/kernels/CMakeLists.txt reads the same lists to instantiate them, so the head dims a
// family builds and the ones it dispatches to are one list.
template <const auto& kHeadDims, size_t kIndex = 0, typename F>
auto for_head_dim(int64_t head_dim, F&& f) {
  constexpr int kDim = kHeadDims[kIndex];
  if constexpr (kIndex + 1 == std::extent_v<std::remove_reference_t<decltype(kHeadDims)>>) {
    return f(std::integral_constant<int, kDim>{});
  } else {
    if (head_dim <= kDim) return f(std::integral_constant<int, kDim>{});
    return for_head_dim<kHeadDims, kIndex + 1>(head_dim, std::forward<F>(f));
  }
}

// Tensor-core forward for bf16/fp16 and head dims that are a multiple of 8 up to kHeadDim; with
// tma_kv (wgmma::tma_loads_apply) K and V tiles load by TMA.
template <typename Elem, int kHeadDim>
cudaError_t launch_forward_sm80(const AttentionParams& p, bool tma_kv, cudaStream_t stream);

// TMA + wgmma forward for Hopper (an sm_90a build on a compute capability 9.0 device): bf16/fp16,
// head dims that are a multiple of 8 up to kHeadDim, 16-byte aligned tensors
// (wgmma::tma_compatible); at most one of segment ids, a soft-cap, and a bias or mask.
template <typename Elem, int kHeadDim>
cudaError_t launch_forward_sm90(const AttentionParams& p, cudaStream_t stream);

// The same for FP8 attention (AttentionParams::e4m3_attention: e4m3 q, k and V^T, Elem out's
// type; wgmma::ForwardE4m3Config), head dims that are a multiple of 16 up to kHeadDim.
template <typename Elem, int kHeadDim>
cudaError_t launch_forward_sm90_e4m3(const AttentionParams& p, cudaStream_t stream);

// Split-KV decode forward for bf16/fp16 and head dims that are a multiple of 8 up to kHeadDim:
// the splits' partial results, merged into out and lse inside each work unit's thread block
// cluster with plan.cluster_merge, else through plan's workspace and a combine kernel; with
// kSoftCap, on the kernels' soft-capped instantiations (mma_sync::DecodeWithSoftCap), with
// kBiasAndMask on those for the elementwise terms (mma_sync::DecodeWithBiasAndMask; with
// ALiBi, where the call has it, on kernels of their own), each in translation units of their
// own. forward_decode_merges_in_cluster says whether a plan's clusters fit on CUDA device
// `device`, the current one, for call p (with ALiBi or without, its terms staged or not: each
// its own kernel; the dispatcher sets plan.cluster_merge from it).
template <typename Elem, int kHeadDim, bool kSoftCap = false, bool kBiasAndMask = false>
cudaError_t launch_forward_decode(const AttentionParams& p, const mma_sync::DecodePlan& plan,
                                  cudaStream_t stream);
template <typename Elem, int kHeadDim, bool kSoftCap = false, bool kBiasAndMask = false>
bool forward_decode_merges_in_cluster(const AttentionParams& p, const mma_sync::DecodePlan& plan,
                                      int device);

// The same for float8_e4m3fn keys and values beside an Elem query (AttentionParams::k_descale),
// on the plain kernels' e4m3 configurations (mma_sync::DecodeFp8Config; decode_fp8_kv_fits).
template <typename Elem, int kHeadDim>
cudaError_t launch_forward_decode_fp8(const AttentionParams& p, const mma_sync::DecodePlan& plan,
                                      cudaStream_t stream);
template <typename Elem, int kHeadDim>
bool forward_decode_fp8_merges_in_cluster(const mma_sync::DecodePlan& plan, int device);

// The same with the Hopper decode kernel (an sm_90a build on a compute capability 9.0 device;
// head dims up to kHeadDim of wgmma::kDecodeHeadDims).
template <typename Elem, int kHeadDim, bool kSoftCap = false, bool kBiasAndMask = false>
cudaError_t launch_forward_decode_sm90(const AttentionParams& p, const mma_sync::DecodePlan& plan,
                                       cudaStream_t stream);
template <typename Elem, int kHeadDim, bool kSoftCap = false, bool kBiasAndMask = false>
bool forward_decode_sm90_merges_in_cluster(const AttentionParams& p,
                                           const mma_sync::DecodePlan& plan, int device);

// The same on the Hopper decode kernel's e4m3 configurations (wgmma::DecodeFp8Config).
template <typename Elem, int kHeadDim>
cudaError_t launch_forward_decode_sm90_fp8(const AttentionParams& p,
                                           const mma_sync::DecodePlan& plan, cudaStream_t stream);
template <typename Elem, int kHeadDim>
bool forward_decode_sm90_fp8_merges_in_cluster(const mma_sync::DecodePlan& plan, int device);

// CUDA-core forward for any dtype and head dim (float32 arithmetic throughout).
cudaError_t launch_forward_simt(const AttentionParams& p, cudaStream_t stream);

// Tensor-core backward for bf16/fp16 and head dims that are a multiple of 8 up to kHeadDim:
// the dK/dV pass (with dQ summed into p.dq_accum by atomics unless p.deterministic), then the
// dQ pass in deterministic mode. Expects p.delta (and the zeroed accumulator) from the
// preprocess that launch_backward runs first.
template <typename Elem, int kHeadDim>
cudaError_t launch_backward_sm80(const AttentionParams& p, cudaStream_t stream);

// TMA + wgmma backward for Hopper (an sm_90a build on a compute capability 9.0 device):
// bf16/fp16, no bias or boolean mask, head dims that are a multiple of 8 up to kHeadDim, 16-byte
// aligned tensors (wgmma::backward_tma_compatible). dK, dV and dQ in one pass, between the same
// preprocess and dQ conversion as the mma.sync family. dQ is summed into p.dq_accum by float32
// atomic reductions in any order; with p.deterministic (no segment ids; p.dq_semaphores zeroed
// beforehand, as launch_backward does) each query tile's key blocks add it one after another
// in a fixed order (wgmma::BackwardDeterministic), so that dQ is bit-identical across runs.
template <typename Elem, int kHeadDim>
cudaError_t launch_backward_sm90(const AttentionParams& p, cudaStream_t stream);

// CUDA-core backward for any dtype and head dim: dq (and dbias), then dk and dv, with no
// atomics but the adds into a dbias summed over broadcast dims (params.h), so results are
// otherwise bit-identical across runs.
cudaError_t launch_backward_simt(const AttentionParams& p, cudaStream_t stream);

// Holds the process-wide lock under which once_per_device's queries run (launch.cu), for its
// lifetime. A recursive lock, so that a query may itself ask once_per_device. Out of line so
// that this header, which every kernel's translation unit includes, need not include <mutex>:
// with it and <iterator> each unit took about 1.5 s more to compile (its front end runs once
// per architecture), some 3 minutes of a two-core build.
class OnceLock {
 public:
  OnceLock();
  ~OnceLock();
  OnceLock(const OnceLock&) = delete;
  OnceLock& operator=(const OnceLock&) = delete;
};

// query(device), computed once per CUDA device and cached (out_of_range for ordinals past the
// cache); thread-safe, so concurrent handlers on several GPUs each ask exactly once: a device's
// first callers take OnceLock, and the first of them asks; once its result is published
// (release), callers read it without the lock (acquire). Every call site's query is a lambda of
// its own type, so each has its own cache.
template <typename Result, typename Query>
Result once_per_device(int device, Result out_of_range, const Query& query) {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> ready[kMaxDevices];  // static storage: false until published
  static Result results[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return out_of_range;
  if (!ready[device].load(std::memory_order_acquire)) {
    const OnceLock lock;
    if (!ready[device].load(std::memory_order_relaxed)) {
      results[device] = query(device);
      ready[device].store(true, std::memory_order_release);
    }
  }
  return results[device];
}

// Raises kKernel's dynamic shared-memory limit once per device. Keyed on the kernel itself (a
// template argument), not its type: every kernel of a family has the same signature.
template <auto kKernel>
cudaError_t ensure_smem_limit(int bytes) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  return once_per_device(device, cudaErrorInvalidDevice, [bytes](int) {
    return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  });
}

// CUDA device `device`'s attribute kAttribute, queried once per device (each attribute's
// instantiation has a cache of its own).
template <cudaDeviceAttr kAttribute>
cudaError_t device_attribute(int device, int& value) {
  const auto query = [](int d) {
    int n = 0;
    const cudaError_t e = cudaDeviceGetAttribute(&n, kAttribute, d);
    return std::pair{e, n};
  };
  const auto [error, result] = once_per_device(device, std::pair{cudaErrorInvalidDevice, 0}, query);
  value = result;
  return error;
}

// CUDA device `device`'s multiprocessor count (the grid of persistent kernels, the decode
// kernel's split count).
inline cudaError_t multiprocessor_count(int device, int& count) {
  return device_attribute<cudaDevAttrMultiProcessorCount>(device, count);
}

// The same for the current device.
inline cudaError_t multiprocessor_count(int& count) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  return multiprocessor_count(device, count);
}

// CUDA device `device`'s opt-in shared memory per block in bytes (which tile tables fit).
inline cudaError_t opt_in_smem_bytes(int device, int& bytes) {
  return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device, bytes);
}

// Whether kKernel, as loaded on CUDA device `device` (the current one: the kernel's attributes
// are the current device's), runs from an image compiled for compute
// capability 9.0+ on a 9.0+ device (PTX version 9.0+), so the sm_90 instructions in its body
// exist: griddepcontrol.wait for a programmatic dependent launch, the cluster barrier and
// distributed shared memory for a cluster merge. A build without an sm_90 image runs there from
// JIT-compiled sm_80 PTX, where those are compiled out: such a kernel must launch plainly.
// False where a query fails, whose error is cleared so that no later launch reports it.
template <auto kKernel>
bool runs_sm90_image(int device) {
  return once_per_device(device, false, [](int d) {
    int major = 0;
    cudaFuncAttributes attributes = {};
    const bool sm90 =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) == cudaSuccess &&
        major >= 9 && cudaFuncGetAttributes(&attributes, kKernel) == cudaSuccess &&
        attributes.ptxVersion >= 90;
    if (!sm90) cudaGetLastError();
    return sm90;
  });
}

}  // namespace jax_flashattn::cuda
