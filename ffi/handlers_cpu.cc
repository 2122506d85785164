// CPU handlers: decode the call, run the C++ kernels on the calling thread (plus workers).
#include <exception>
#include <string>

#include "ffi/call_frame.h"
#include "ffi/cpu/attention_cpu.h"

namespace jax_flashattn {
namespace {

// The kernels allocate float32 scratch; an allocation failure becomes an error, not a crash.
template <typename Fn>
ffi::Error RunGuarded(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_flashattn CPU kernel failed: ") + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error ForwardCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> workspace,
                      ffi::Result<ffi::AnyBuffer> decode_workspace, CallAttrs attrs) {
  // The workspaces are decoded (so both platforms check the same call) and left untouched.
  AttentionParams p;
  if (ffi::Error e = DecodeForward(q, k, v, optional, out, lse, workspace, decode_workspace,
                                   attrs, p);
      e.failure())
    return e;
  if (p.e4m3_attention)
    return ffi::Error::InvalidArgument(
        "jax_flashattn: FP8 attention (a float8_e4m3fn query) runs on the Hopper kernels only; "
        "on the CPU the caller dequantises it first");
  return RunGuarded([&] { cpu::forward(p); });
}

ffi::Error BackwardCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                       ffi::AnyBuffer lse, ffi::AnyBuffer d_out, ffi::RemainingArgs optional,
                       ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                       ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dq_accum,
                       ffi::Result<ffi::AnyBuffer> delta,
                       ffi::Result<ffi::AnyBuffer> dq_semaphores, ffi::RemainingRets dbias,
                       CallAttrs attrs) {
  // The workspaces are decoded (so both platforms check the same call); the CPU kernels keep D
  // in `delta` and leave dq_accum and dq_semaphores untouched (each task owns the dQ rows it
  // writes, so they are deterministic already).
  AttentionParams p;
  if (ffi::Error e = DecodeBackward(q, k, v, out, lse, d_out, optional, dq, dk, dv, dq_accum,
                                    delta, dq_semaphores, dbias, attrs, p);
      e.failure())
    return e;
  return RunGuarded([&] { cpu::backward(p); });
}

}  // namespace
}  // namespace jax_flashattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_flashattn_forward_cpu, jax_flashattn::ForwardCpu,
                              jax_flashattn::BindForward(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_flashattn_backward_cpu, jax_flashattn::BackwardCpu,
                              jax_flashattn::BindBackward(xla::ffi::Ffi::Bind()));
