// float8_e4m3fn values (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinity, NaN
// at magnitude 0x7f; largest finite 448) widened to the mma operand pairs of bfloat16 or
// float16, exactly: every e4m3 value, subnormals included, is one of theirs. From sm_89 the
// hardware converts two values to float16 in one instruction (cvt.rn.f16x2.e4m3x2), so the
// products run in float16 whatever q's dtype (ProductElem; a bfloat16 query's fragments
// converted once per block, q_fragments_to_half). Before it, in integer and 16-bit arithmetic:
// per two values a byte permute, a shift, a logic op and one multiply, and per 4 bytes three
// more for the NaN check.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/ptx.cuh"

namespace jax_flashattn::cuda {

// Whether this compilation target converts e4m3 in hardware (sm_89 and newer). Device code
// reads it (the host pass sees false; no kernel's signature depends on it).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
inline constexpr bool kE4m3Convert = true;
#else
inline constexpr bool kE4m3Convert = false;
#endif

// The element type of a decode kernel's products of q (of type Elem) with its keys and values:
// Elem, but with e4m3 keys and values (kFp8Kv) float16 where the hardware converts e4m3 to it
// (a pair per instruction against four with the integer widening; Elem otherwise, into which
// the integer widening goes as cheaply).
template <typename Elem, bool kFp8Kv>
using ProductElem = std::conditional_t<kFp8Kv && kE4m3Convert, __half, Elem>;

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
// kLo0 and kHi0 of r[i], out[i][1] of bytes kLo1 and kHi1. With the integer widening the NaN
// check (e4m3_nan_bytes) is a few instructions per register and one warp vote per call.
// With the hardware conversion (float16 pairs, kE4m3Convert): one permute where the pairs are
// not bytes {0, 1} and {2, 3}, then one convert per pair; NaNs come out NaN.
template <typename Elem, int kLo0, int kHi0, int kLo1, int kHi1>
__device__ __forceinline__ void widen_e4m3_x4(const uint32_t (&r)[4], uint32_t (&out)[4][2]) {
  if constexpr (kE4m3Convert && std::is_same_v<Elem, __half>) {
    constexpr uint32_t kSelector = kLo0 | (kHi0 << 4) | (kLo1 << 8) | (kHi1 << 12);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t x = kSelector == 0x3210u ? r[i] : __byte_perm(r[i], 0u, kSelector);
      out[i][0] = ptx::cvt_f16x2_e4m3x2(uint16_t(x));
      out[i][1] = ptx::cvt_f16x2_e4m3x2(uint16_t(x >> 16));
    }
    return;
  }
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

// This thread's bfloat16 Q fragments (the mma A layout: its rows lane / 4 and lane / 4 + 8 of
// a 16-row slab, registers h and h + 2 of each k-step for row h, a row's columns over the
// lanes of a quad) as float16, for products with e4m3 keys widened to float16: row h's elements
// times 2^e_h, e_h set by the row's largest finite magnitude m so that m 2^e_h lies in
// [2^14, 2^15) (float16's largest finite is 65504), and row_factor[h] = 2^-e_h, which that
// row's scores take back (scale_score_rows) before the softmax sees them. bfloat16's 8-bit
// significands fit float16's 11, so an element is exact where its float16 is normal (down to
// 2^-29 m) and off by at most 2^-39 m below: a row's scores err by at most 2^-39 of the
// largest sum of |q| |k| it could have, far under bfloat16's own rounding of q. Infinities and
// NaNs (left out of m) stay what they are; e_h is at most 126 (for any m below 2^-112, whose
// elements all convert exactly even so), so 2^e_h and 2^-e_h are normal floats.
template <int kSteps>
__device__ __forceinline__ void q_fragments_to_half(uint32_t (&q_frag)[kSteps][4],
                                                    float (&row_factor)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t top = 0;  // bits of the row's largest finite magnitude (ordered as magnitudes)
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
#pragma unroll
      for (int r = h; r < 4; r += 2)
#pragma unroll
        for (int half = 0; half < 32; half += 16) {
          const uint32_t m = (q_frag[s][r] >> half) & 0x7fffu;
          if (m < 0x7f80u) top = max(top, m);
        }
    top = max(top, __shfl_xor_sync(0xffffffffu, top, 1));
    top = max(top, __shfl_xor_sync(0xffffffffu, top, 2));
    // m < 2^(E - 126) for biased exponent E = top >> 7, so 2^e = 2^(141 - E) puts it under 2^15.
    const int e = min(141 - int(top >> 7), 126);
    const float up = __int_as_float((127 + e) << 23);
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
#pragma unroll
      for (int r = h; r < 4; r += 2) {
        const float lo = __uint_as_float(q_frag[s][r] << 16);
        const float hi = __uint_as_float(q_frag[s][r] & 0xffff0000u);
        const __half2 pair = __floats2half2_rn(lo * up, hi * up);
        q_frag[s][r] = *reinterpret_cast<const uint32_t*>(&pair);
      }
    row_factor[h] = __int_as_float((127 - e) << 23);
  }
}

// Scores of this thread's two rows (an mma accumulator: elements 2 h and 2 h + 1 of each tile
// in row h) times that row's factor from q_fragments_to_half: exact (powers of two), one
// multiply a score.
template <int kNTiles>
__device__ __forceinline__ void scale_score_rows(float (&s)[kNTiles][4],
                                                 const float (&factor)[2]) {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] *= factor[e / 2];
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
