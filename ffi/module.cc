// The Python extension: hands the FFI handlers to Python as capsules, per platform, and the
// planner (ffi/plan.h) its call shapes by field name.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ffi/call_frame.h"
#include "ffi/call_shape.h"
#include "ffi/decode_plan.h"
#include "ffi/plan.h"
#ifdef JAX_FLASHATTN_WITH_CUDA
#include "ffi/cuda/copy_bandwidth.h"
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
  m.attr("DECODE_MAX_MULTIPROCESSORS") = jax_flashattn::mma_sync::kDecodeMaxMultiprocessors;

  using jax_flashattn::CallPlan;
  using jax_flashattn::CallShape;
  // Fields set by name (jax_flashattn._ffi.call_shape); dtype as its code, 0 float32,
  // 1 bfloat16, 2 float16 (any other code plans no kernel).
  nb::class_<CallShape>(m, "CallShape")
      .def(nb::init<>())
      .def_prop_rw(
          "dtype", [](const CallShape& s) { return static_cast<int>(s.dtype); },
          [](CallShape& s, int code) { s.dtype = static_cast<jax_flashattn::ElemType>(code); })
      .def_rw("batch", &CallShape::batch)
      .def_rw("batch_inner", &CallShape::batch_inner)
      .def_rw("seqlen_q", &CallShape::seqlen_q)
      .def_rw("seqlen_k", &CallShape::seqlen_k)
      .def_rw("num_heads", &CallShape::num_heads)
      .def_rw("num_kv_heads", &CallShape::num_kv_heads)
      .def_rw("head_dim", &CallShape::head_dim)
      .def_rw("scale", &CallShape::scale)
      .def_rw("logits_soft_cap", &CallShape::logits_soft_cap)
      .def_rw("window_left", &CallShape::window_left)
      .def_rw("window_right", &CallShape::window_right)
      .def_rw("align_window_to_lengths", &CallShape::align_window_to_lengths)
      .def_rw("has_bias", &CallShape::has_bias)
      .def_rw("has_mask", &CallShape::has_mask)
      .def_rw("has_q_seqlens", &CallShape::has_q_seqlens)
      .def_rw("has_kv_seqlens", &CallShape::has_kv_seqlens)
      .def_rw("has_segment_ids", &CallShape::has_segment_ids)
      .def_rw("has_alibi", &CallShape::has_alibi)
      .def_rw("bias_broadcasts_keys", &CallShape::bias_broadcasts_keys)
      .def_rw("mask_broadcasts_keys", &CallShape::mask_broadcasts_keys)
      .def_rw("deterministic", &CallShape::deterministic)
      .def_rw("disable_sm90", &CallShape::disable_sm90)
      .def_rw("sm80_cp_async", &CallShape::sm80_cp_async)
      .def_rw("e4m3_attention", &CallShape::e4m3_attention);
  nb::class_<CallPlan>(m, "CallPlan")
      .def_ro("decode_workspace_floats", &CallPlan::decode_workspace_floats)
      .def_ro("dq_semaphores", &CallPlan::dq_semaphores)
      .def_ro("forward_workspace_ints", &CallPlan::forward_workspace_ints)
      .def_ro("backward_workspace_ints", &CallPlan::backward_workspace_ints)
      .def_ro("dslopes_slots", &CallPlan::dslopes_slots)
      .def_ro("forward", &CallPlan::forward)
      .def_ro("backward", &CallPlan::backward)
      .def_ro("decode_splits", &CallPlan::decode_splits)
      .def_ro("decode_merge", &CallPlan::decode_merge);
  // plan(shape, device): device -1 for the workspace alone (ffi/plan.h).
  m.def("plan", &jax_flashattn::Plan, nb::arg("shape"), nb::arg("device"));
  m.def("decode_workspace_floats", &jax_flashattn::DecodeWorkspaceFloats, nb::arg("shape"),
        nb::arg("multiprocessors"));
#ifdef JAX_FLASHATTN_WITH_CUDA
  // (median, best) bytes per second of cudaMemcpy device to device, read plus written.
  m.def("cuda_copy_bandwidth", [](int device, size_t bytes, int runs) {
    const auto bw = jax_flashattn::cuda::measure_copy_bandwidth(device, bytes, runs);
    return std::make_pair(bw.median_bytes_per_s, bw.best_bytes_per_s);
  });
#endif
}
