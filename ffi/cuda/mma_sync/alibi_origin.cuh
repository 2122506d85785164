// ALiBi (cuda::AlibiLogits) over a thread's mma.sync accumulator elements: their distances
// |t + shift - s| measured from one origin element (t0, s0). A kernel takes the origin's
// distance in 64 bits once per tile, at a point its warp shares (uniform arithmetic), and moves
// it to the thread's first element; every element's offset from there, (s - s0) - (t - t0), is
// a compile-time constant of the unrolled loops, so an element costs one FADD for its distance
// (shared by the elements of equal offset) and one FFMA for its term (the absolute value is an
// operand modifier) instead of 64-bit arithmetic and a conversion.
//
// Exact where the origin's and the elements' distances stay below 2^24, as
// variant::Alibi::distance (the CPU kernels' too) is: every operand is then an integer that
// float holds.
#pragma once

#include <cmath>
#include <cstdint>

#include "ffi/cuda/common/alibi.cuh"

namespace jax_flashattn::mma_sync {

struct AlibiOrigin {
  float slope2;  // slope log2(e), AlibiLogits::slope2
  float origin;  // t0 + shift - s0

  __device__ __forceinline__ static AlibiOrigin at(const cuda::AlibiLogits& alibi, int64_t t0,
                                                   int64_t s0) {
    return {alibi.slope2, float(t0 + alibi.shift - s0)};
  }

  // The origin moved to its element `offset` = (s - s0) - (t - t0): how a kernel adds a
  // thread's own offset to an origin of the block's (whose 64-bit arithmetic is then uniform).
  __device__ __forceinline__ AlibiOrigin moved(int offset) const {
    return {slope2, origin - float(offset)};
  }

  // |t + shift - s| of the element `offset` = (s - s0) - (t - t0) from the origin.
  __device__ __forceinline__ float distance(int offset) const {
    return fabsf(origin - float(offset));
  }

  // x plus the element's base-2 term -slope log2(e) |t + shift - s|.
  __device__ __forceinline__ float add_term(float x, int offset) const {
    return fmaf(-slope2, distance(offset), x);
  }
};

}  // namespace jax_flashattn::mma_sync
