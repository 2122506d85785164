// float8_e4m3fn values (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinity, NaN
// at magnitude 0x7f; largest finite 448) widened to the mma operand pairs of bfloat16 or
// float16, exactly: every e4m3 value, subnormals included, is one of theirs. In integer and
// 16-bit arithmetic that every sm_80+ GPU has (the e4m3 convert instructions start at sm_89):
// per two values a byte permute, a shift, two logic ops and one multiply, and per 4 bytes
// three more for the NaN check.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/ptx.cuh"

namespace jax_flashattn::cuda {

// Two e4m3 bytes: the unit in which shared tiles of e4m3 keys and values are copied and
// addressed (ldmatrix's b16 elements).
struct E4m3Pair {
  uint16_t bytes;
};

// Whether any of the 4 bytes of x is an e4m3fn NaN (low 7 bits all set): adding 1 to the low 7
// bits of each byte carries into its bit 7 for those bytes only, and never into the next byte.
__device__ __forceinline__ uint32_t e4m3_nan_bytes(uint32_t x) {
  return ((x & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
}

// Two e4m3 values as an Elem pair, from `halves`: each 16-bit half an e4m3 byte in its low
// byte and that byte's sign replicated over its high byte (e4m3_pair's byte permute). Shifted
// left by kShift, each half has a copy of the sign at bit 15 and the 7 magnitude bits
// (exponent, mantissa) under Elem's exponent field's low bits; one mask keeps those (and drops
// what the low half shifted into the high one), which reads as value * 2^(7 - bias): 2^-120 for
// bfloat16 (bias 127), 2^-8 for float16 (bias 15), subnormals included (both types have them
// where these land); one exact multiply by 2^120 or 2^8 restores the value. An e4m3 NaN
// becomes 480 here (magnitude 0x7f reads as 1.875 * 2^8), which e4m3_nans_to_elem turns into
// Elem's NaN. Four instructions a pair with the permute.
template <typename Elem>
__device__ __forceinline__ uint32_t e4m3_spread_pair(uint32_t halves);

template <>
__device__ __forceinline__ uint32_t e4m3_spread_pair<__nv_bfloat16>(uint32_t halves) {
  constexpr uint32_t kTwoPow120 = 0x7b807b80u;  // bfloat16 2^120, both halves
  constexpr uint32_t kMinusZero = 0x80008000u;
  const uint32_t x = (halves << 4) & 0x87f087f0u;  // sign at 15, magnitude at 10:4
  return ptx::fma_bf16x2(x, kTwoPow120, kMinusZero);
}

template <>
__device__ __forceinline__ uint32_t e4m3_spread_pair<__half>(uint32_t halves) {
  constexpr uint32_t kTwoPow8 = 0x5c005c00u;  // float16 256, both halves
  const uint32_t x = (halves << 7) & 0xbf80bf80u;  // sign at 15, magnitude at 13:7
  return ptx::mul_f16x2(x, kTwoPow8);
}

// The Elem pair of bytes i and j of x (byte i in the low half): each byte and its replicated
// sign put in one half by one byte permute, then widened.
template <typename Elem, int kLowByte, int kHighByte>
__device__ __forceinline__ uint32_t e4m3_pair(uint32_t x) {
  // prmt selector nibbles, result byte 0 first: a byte of x, then its sign (bit 3 set).
  constexpr uint32_t kSelector =
      kLowByte | ((8 | kLowByte) << 4) | (kHighByte << 8) | ((8 | kHighByte) << 12);
  return e4m3_spread_pair<Elem>(ptx::prmt<kSelector>(x, 0u));
}

// An Elem pair from e4m3_pair with its 480s (e4m3 NaNs: the largest finite e4m3 is 448) made
// NaN. The widening runs it only for fragments that hold a NaN (a warp vote), behind a branch
// that the common path jumps over.
template <typename Elem>
__device__ __forceinline__ uint32_t e4m3_nans_to_elem(uint32_t pair) {
  constexpr bool kBf16 = std::is_same_v<Elem, __nv_bfloat16>;
  constexpr uint32_t k480 = kBf16 ? 0x43f0u : 0x5f80u;
  constexpr uint32_t kNanBits = kBf16 ? 0x7fc0u : 0x7e00u;  // OR-ed in: exponent all ones
  for (int half = 0; half < 32; half += 16)
    if (((pair >> half) & 0x7fffu) == k480) pair |= kNanBits << half;
  return pair;
}

// The 8 Elem pairs of the 4 registers of one x4 ldmatrix of e4m3 bytes: out[i][0] of bytes
// kLo0 and kHi0 of r[i], out[i][1] of bytes kLo1 and kHi1. The NaN check (e4m3_nan_bytes) is a
// few instructions per register and one warp vote per call.
template <typename Elem, int kLo0, int kHi0, int kLo1, int kHi1>
__device__ __forceinline__ void widen_e4m3_x4(const uint32_t (&r)[4], uint32_t (&out)[4][2]) {
  uint32_t nan = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[i][0] = e4m3_pair<Elem, kLo0, kHi0>(r[i]);
    out[i][1] = e4m3_pair<Elem, kLo1, kHi1>(r[i]);
    nan |= e4m3_nan_bytes(r[i]);
  }
  if (__any_sync(0xffffffffu, nan != 0)) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) out[i][j] = e4m3_nans_to_elem<Elem>(out[i][j]);
  }
}

// A call's key descale d (the real keys are the stored ones times d) folded into q's fragments
// and the softmax's factor, which must stay > 0 (each row's maximum is taken before it
// scales): returns the factor |d| (1 for d = 0 or NaN), with the fragments negated for d < 0
// (each Elem's sign bit), zeroed for d = 0 (every score 0, as the dequantised keys give) and
// made NaN for a NaN d (as the dequantised keys are). Scores q . k |d| then equal q . (k d),
// exactly, and hidden ones stay -inf: a row that sees no key still gives 0 (a NaN factor
// would make its -inf scores NaN).
template <typename Elem, int kSteps>
__device__ __forceinline__ float fold_key_descale(float d, uint32_t (&q_frag)[kSteps][4]) {
  constexpr bool kBf16 = std::is_same_v<Elem, __nv_bfloat16>;
  constexpr uint32_t kNanPair = kBf16 ? 0x7fc07fc0u : 0x7e007e00u;
  if (!(d > 0.f)) {  // the common case, d > 0, leaves the fragments as they are
    const uint32_t flip = d < 0.f ? 0x80008000u : 0u;
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        q_frag[s][r] = d == 0.f ? 0u : d != d ? kNanPair : q_frag[s][r] ^ flip;
  }
  return d == 0.f || d != d ? 1.f : fabsf(d);
}

}  // namespace jax_flashattn::cuda
