// The soft-cap (variant::SoftCap) in the tensor-core kernels: the raw score s = q.k becomes the
// base-2 capped logit x = c tanh(s scale / cap), c = cap log2(e), in three instructions: FMUL,
// MUFU.TANH, FMUL; two where the kernel folds c into its own FFMA (the Hopper kernels: the
// softmax's, P^T's exponent).
//
// tanh.approx (MUFU.TANH) errs by at most about 1.1e-5 of x: at a cap of 50 and a logit at the
// cap, 8e-4 in x, 5.5e-4 relative in P, about twice fp16's rounding of P (half an ulp) and a
// quarter of bf16's. It is one special-function op per score beside the softmax's exp2, which
// the forward's consumers contend for; the ulp-accurate forms (ex2 and rcp) took two and ran
// slower (docs/decisions/soft-cap-on-the-cuda-kernels.md). The ends hold: +-inf give +-c, NaN
// stays NaN.
#pragma once

#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/softmax.cuh"  // kLog2e
#include "ffi/params.h"
#include "ffi/variant.h"

namespace jax_flashattn::cuda {

struct SoftCapLogits {
  float cap2;       // c = cap log2(e)
  float inv_cap2;   // 1 / c
  float argument;   // scale / cap: s times it is tanh's argument

  __device__ static SoftCapLogits make(const AttentionParams& p) {
    const variant::SoftCap policy = variant::SoftCap::make(p);
    SoftCapLogits c;
    c.cap2 = policy.cap2;
    c.inv_cap2 = 1.f / policy.cap2;
    c.argument = p.scale * kLog2e / policy.cap2;
    return c;
  }

  // tanh(s scale / cap) from the raw score s: x / c, for kernels that fold c into a product of
  // their own.
  __device__ __forceinline__ float tanh_of(float score) const {
    return ptx::tanh_approx(score * argument);
  }

  // x from the raw score s.
  __device__ __forceinline__ float apply(float score) const { return cap2 * tanh_of(score); }

  // dx / d(scale s log2(e)) = 1 - tanh^2 from x: the factor that dS takes on its way to dQ and
  // dK (not to dbias: the bias is added after the cap).
  __device__ __forceinline__ float slope(float capped) const {
    const float t = capped * inv_cap2;
    return fmaf(-t, t, 1.f);
  }
};

}  // namespace jax_flashattn::cuda
