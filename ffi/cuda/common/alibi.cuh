// ALiBi (variant::Alibi) in the CUDA kernels: the base-2 logit of query t and key s gains
// -slope log2(e) |t + shift - s|, added where the bias is (after scaling and any soft-cap),
// and the backward sums -|t + shift - s| dS into the slopes' gradient, a writer's partial sum
// at a time (dslopes_slots, ffi/params.h).
//
// The distance is exact in float32 up to 2^24 positions; the term is one rounding of
// slope log2(e) times it, as the CPU kernels' slope times it is one.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/softmax.cuh"  // kLog2e
#include "ffi/params.h"
#include "ffi/variant.h"

namespace jax_flashattn::cuda {

struct AlibiLogits {
  float slope2;   // slope log2(e); 0 without ALiBi, which makes every term 0
  int64_t shift;  // the diagonal: query t sits at key t + shift

  __device__ static AlibiLogits make(const AttentionParams& p, int64_t b, int64_t n) {
    const variant::Alibi policy = variant::Alibi::make(p, b, n);
    return {policy.slope * kLog2e, policy.shift};
  }

  // The base-2 term -slope log2(e) |t + shift - s| (the distance variant::Alibi's).
  __device__ __forceinline__ float log2_term(int64_t t, int64_t s) const {
    return -slope2 * variant::Alibi{0.f, shift, true}.distance(t, s);
  }
};

// Adds a warp's partial sums of |t + shift - s| dS (dS the gradient of the natural-log logit)
// into slot `slot` of (b, n)'s dslopes, negated: the slope's gradient. Every lane calls it
// with its own sum (0 where it had none); lane 0 is the slot's one writer. The caller picks
// `slot` by the rule of dslopes_slots.
__device__ __forceinline__ void add_dslopes(const AttentionParams& p, int64_t b, int64_t n,
                                            int64_t slot, float distance_ds) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    distance_ds += __shfl_xor_sync(0xffffffffu, distance_ds, offset);
  if (threadIdx.x % 32 == 0)
    ptx::red_add_f32(p.dslopes + (b * p.num_heads + n) * dslopes_slots(p.seqlen_k) + slot,
                     -distance_ds);
}

// The slot of a writer whose keys start at `first_key`, `writer` (< kDslopesWriters) among
// those starting in the same granule.
__device__ __forceinline__ int64_t dslopes_slot(int64_t first_key, int writer) {
  return first_key / kDslopesGranule * kDslopesWriters + writer;
}

}  // namespace jax_flashattn::cuda
