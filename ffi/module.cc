// The Python extension: hands the FFI handlers to Python as capsules, per platform.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <sstream>
#include <string>
#include <vector>

#include "ffi/decode.h"

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
}
