// Element conversions of the CPU kernels: float32 <-> bfloat16 / float16 with round to nearest
// even (the rounding XLA uses), and row loads/stores between ElemType buffers and float32.
#pragma once

#include <cstdint>
#include <cstring>

#include "ffi/params.h"

namespace jax_flashattn::cpu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// bfloat16 is the top half of a float32, so widening is exact.
inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t{h} << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  // NaN: keep sign and top payload and force the quiet bit, since rounding could carry a NaN
  // with a low-only payload into infinity.
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float32.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13));
}

inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t magnitude = u & 0x7fffffffu;
  constexpr uint32_t kInf32 = 0x7f800000u;
  constexpr uint32_t kInf16 = 0x7c00u;
  if (magnitude >= kInf32) {
    // Inf stays inf; NaN stays a quiet NaN with the top of its payload.
    const uint32_t nan_bits = magnitude > kInf32 ? 0x0200u | ((magnitude >> 13) & 0x3ffu) : 0u;
    return static_cast<uint16_t>(sign | kInf16 | nan_bits);
  }
  // 65520 = 0x477ff000 lies halfway between fp16's largest finite 65504 and 2^16; the tie goes to
  // the even side, which is infinity.
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | kInf16);
  if (magnitude < 0x38800000u) {
    // Below fp16's smallest normal 2^-14 the result is a multiple of 2^-24. Adding 0.5 (whose
    // float32 ulp is 2^-24) makes the float32 adder round to that grid, to nearest even, and
    // leaves the fp16 subnormal (or the smallest normal, on carry) in the low mantissa bits.
    const float shifted = bits_float(magnitude) + 0.5f;
    return static_cast<uint16_t>(sign | (float_bits(shifted) - float_bits(0.5f)));
  }
  // Normal: rebias the exponent, then round the 13 dropped mantissa bits to nearest even; a
  // carry out of the mantissa correctly bumps the exponent.
  const uint32_t lsb = (magnitude >> 13) & 1u;
  const uint32_t rebiased = magnitude - ((127u - 15u) << 23);
  return static_cast<uint16_t>(sign | ((rebiased + 0xfffu + lsb) >> 13));
}

// A float8_e4m3fn value (sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinity, NaN at
// magnitude 0x7f) as float32, exactly.
inline float e4m3_to_float(uint8_t x) {
  const uint32_t sign = uint32_t{x & 0x80u} << 24;
  const uint32_t exponent = (x >> 3) & 0xfu, mantissa = x & 0x7u;
  if ((x & 0x7fu) == 0x7fu) return bits_float(sign | 0x7fc00000u);
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-9, exact in float32.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-9f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + (127 - 7)) << 23) | (mantissa << 20));
}

// dst[i] = float(base[offset + i]) * descale for i in [0, n), base holding e4m3 values: their
// dequantised float32 values, as fp8.dequantize_fp8 computes them.
inline void load_e4m3_row(const void* base, int64_t offset, int64_t n, float descale,
                          float* dst) {
  const uint8_t* src = static_cast<const uint8_t*>(base) + offset;
  for (int64_t i = 0; i < n; ++i) dst[i] = e4m3_to_float(src[i]) * descale;
}

// dst[i] = float(base[offset + i * stride]) for i in [0, n). stride 0 broadcasts one element.
inline void load_row(ElemType type, const void* base, int64_t offset, int64_t n, float* dst,
                     int64_t stride = 1) {
  switch (type) {
    case ElemType::kFloat32: {
      const float* src = static_cast<const float*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = src[i * stride];
      return;
    }
    case ElemType::kBFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i * stride]);
      return;
    }
    case ElemType::kFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_float(src[i * stride]);
      return;
    }
  }
}

// base[offset + i] = src[i] rounded to `type`, for i in [0, n).
inline void store_row(ElemType type, const float* src, int64_t n, void* base, int64_t offset) {
  switch (type) {
    case ElemType::kFloat32: {
      float* dst = static_cast<float*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
      return;
    }
    case ElemType::kBFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
      return;
    }
    case ElemType::kFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = float_to_fp16(src[i]);
      return;
    }
  }
}

}  // namespace jax_flashattn::cpu
