// The Python extension: hands the FFI handlers to Python as capsules, per platform.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <sstream>
#include <string>
#include <vector>

#include "ffi/decode.h"
#ifdef JAX_FLASHATTN_WITH_CUDA
#include <stdexcept>

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

#ifdef JAX_FLASHATTN_WITH_CUDA
// The forward kernel family the CUDA dispatcher picks on CUDA device `device` for a call of
// this shape and dtype (0 float32, 1 bfloat16, 2 float16) with the default scale, assuming
// contiguous, aligned buffers as XLA allocates them. Leaves the current device alone.
std::string CudaForwardKernel(int device, int dtype, int64_t head_dim, int64_t seqlen_k,
                              bool has_bias, bool has_mask) {
  using jax_flashattn::ElemType;
  if (dtype < 0 || dtype > 2) throw std::invalid_argument("dtype code must be 0, 1 or 2");
  alignas(256) static const char buffer[16] = {};
  jax_flashattn::AttentionParams p;
  p.dtype = static_cast<ElemType>(dtype);
  p.batch = p.num_heads = p.num_kv_heads = p.seqlen_q = 1;
  p.seqlen_k = seqlen_k;
  p.head_dim = head_dim;
  p.q_head_stride = p.kv_head_stride = p.q_row_stride = p.kv_row_stride = head_dim;
  p.q_batch_stride = head_dim;
  p.kv_batch_stride = seqlen_k * head_dim;
  p.q = p.k = p.v = buffer;
  p.out = const_cast<char*>(buffer);
  p.bias = has_bias ? buffer : nullptr;
  p.mask = has_mask ? reinterpret_cast<const bool*>(buffer) : nullptr;
  const jax_flashattn::cuda::ForwardKernel kernel =
      jax_flashattn::cuda::choose_forward_kernel(p, device);
  switch (kernel) {
    case jax_flashattn::cuda::ForwardKernel::kSm90:
      return "sm90";
    case jax_flashattn::cuda::ForwardKernel::kSm80:
      return "sm80";
    case jax_flashattn::cuda::ForwardKernel::kSimt:
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
#ifdef JAX_FLASHATTN_WITH_CUDA
  m.def("cuda_forward_kernel", &CudaForwardKernel);
#endif
}
