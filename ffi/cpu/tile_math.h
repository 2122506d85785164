// The arithmetic of the CPU kernels' tiles: one matrix product (C += A B on small row-major
// float32 tiles) and a 2^x over a row, both written so that the compiler vectorises them, and
// the attribute that compiles a kernel's task for several x86-64 levels (picked at run time).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace jax_flashattn::cpu {

// A task function compiled for AVX-512, AVX2 + FMA and the baseline, the best the CPU runs
// chosen when the library loads (GCC and Clang on x86-64 Linux, through an ifunc); elsewhere
// the baseline only. The tile arithmetic below is inlined into each copy.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define JAX_FLASHATTN_CPU_TASK \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define JAX_FLASHATTN_CPU_TASK
#endif

// For the helpers a task calls: inlined into each of its copies, so that they run with its
// instruction set (an out-of-line call would run the baseline's code).
#if defined(__GNUC__) || defined(__clang__)
#define JAX_FLASHATTN_CPU_INLINE inline __attribute__((always_inline))
#else
#define JAX_FLASHATTN_CPU_INLINE inline
#endif

// Register block of matmul: kMatRows rows of C by kMatCols columns, 4 x 16 floats, which fits
// the 16 vector registers of AVX2 (8 accumulators) and leaves room for the operands.
inline constexpr int64_t kMatRows = 4;
inline constexpr int64_t kMatCols = 16;

// Eight floats as one value, GCC's and Clang's generic vector type: the compiler maps it to one
// AVX register, or two SSE ones, or whatever the target has, with no per-ISA code here. A
// scalar times a vector broadcasts the scalar.
using Float8 = float __attribute__((vector_size(32)));
inline constexpr int64_t kFloat8 = 8;
static_assert(kMatCols % kFloat8 == 0, "whole vectors per register block row");

JAX_FLASHATTN_CPU_INLINE Float8 load_float8(const float* p) {
  Float8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

JAX_FLASHATTN_CPU_INLINE void store_float8(float* p, Float8 v) { std::memcpy(p, &v, sizeof(v)); }

// C[m][n] (+)= sum_k A[m][k] B[k][n] for m < rows, n < cols, with rows a multiple of kMatRows
// and cols of kMatCols (the callers pad their tiles with zeros), row strides lda, ldb, ldc.
// `accumulate` false overwrites C. Each 4 x 16 block of C stays in registers over the whole k.
JAX_FLASHATTN_CPU_INLINE void matmul(const float* __restrict a, int64_t lda,
                                     const float* __restrict b, int64_t ldb,
                                     float* __restrict c, int64_t ldc, int64_t rows,
                                     int64_t depth, int64_t cols, bool accumulate) {
  constexpr int64_t kVectors = kMatCols / kFloat8;
  for (int64_t m0 = 0; m0 < rows; m0 += kMatRows) {
    for (int64_t n0 = 0; n0 < cols; n0 += kMatCols) {
      Float8 acc[kMatRows][kVectors];
      for (int64_t m = 0; m < kMatRows; ++m)
        for (int64_t v = 0; v < kVectors; ++v)
          acc[m][v] = accumulate ? load_float8(c + (m0 + m) * ldc + n0 + v * kFloat8)
                                 : Float8{};
      for (int64_t k = 0; k < depth; ++k) {
        Float8 b_k[kVectors];
        for (int64_t v = 0; v < kVectors; ++v)
          b_k[v] = load_float8(b + k * ldb + n0 + v * kFloat8);
        for (int64_t m = 0; m < kMatRows; ++m) {
          const float a_mk = a[(m0 + m) * lda + k];
          for (int64_t v = 0; v < kVectors; ++v) acc[m][v] += a_mk * b_k[v];
        }
      }
      for (int64_t m = 0; m < kMatRows; ++m)
        for (int64_t v = 0; v < kVectors; ++v)
          store_float8(c + (m0 + m) * ldc + n0 + v * kFloat8, acc[m][v]);
    }
  }
}

// dst[c][r] = src[r][c] for r < rows, c < cols.
JAX_FLASHATTN_CPU_INLINE void transpose(const float* src, int64_t ld_src, float* dst,
                                        int64_t ld_dst, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
}

JAX_FLASHATTN_CPU_INLINE float float_from_bits(uint32_t bits) {
  float y;
  std::memcpy(&y, &bits, sizeof(y));
  return y;
}

// 2^x, to ~2 float32 ulp, without branches so that a loop of it vectorises: -inf gives exactly
// 0 (a hidden key's weight), +inf gives +inf, NaN gives NaN, and results past float32's range
// underflow or overflow as IEEE arithmetic does. Cody and Waite's split x = i + f into 2^i (two
// exponent-bit factors, so that i may reach +-200) and 2^f for f in [-1/2, 1/2] (Cephes'
// exp2f polynomial).
JAX_FLASHATTN_CPU_INLINE float exp2_fast(float x) {
  // Comparisons leave a NaN as it is: it flows through and is returned as x at the end.
  const float low_clamped = x < -200.0f ? -200.0f : x;
  const float clamped = low_clamped > 200.0f ? 200.0f : low_clamped;
  // Round to the nearest integer: adding and subtracting 1.5 * 2^23 leaves no fraction bits.
  const float i = (clamped + 12582912.0f) - 12582912.0f;
  const float f = clamped - i;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  // 2^i as 2^(i >> 1) * 2^(i - (i >> 1)), each a float built from its exponent bits.
  const int32_t e = static_cast<int32_t>(__builtin_isnan(i) ? 0.0f : i), low = e >> 1;
  const float scale_low = float_from_bits(static_cast<uint32_t>(low + 127) << 23);
  const float scale_high = float_from_bits(static_cast<uint32_t>(e - low + 127) << 23);
  const float y = (1.0f + p * f) * scale_low * scale_high;
  return __builtin_isnan(x) ? x : y;
}

// x[i] = 2^(x[i] - offset) for i < n (exp2_fast), and exactly 0 where x[i] is -inf (a hidden
// key) whatever the offset, a NaN one included. Returns their sum, kept in kSumLanes partial
// sums so that the loop vectorises without reordering float additions by itself.
inline constexpr int64_t kSumLanes = 16;
JAX_FLASHATTN_CPU_INLINE float exp2_row(float* x, int64_t n, float offset) {
  constexpr float kHidden = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] == kHidden ? 0.0f : exp2_fast(x[i] - offset);
  float partial[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes)
    for (int64_t u = 0; u < kSumLanes; ++u) partial[u] += x[i + u];
  float sum = 0.0f;
  for (; i < n; ++i) sum += x[i];
  for (int64_t u = 0; u < kSumLanes; ++u) sum += partial[u];
  return sum;
}

// max(m, x[0..n)), NaN when any of them is NaN (std::max and fmax drop a NaN, which must reach
// its row's output).
JAX_FLASHATTN_CPU_INLINE float max_row(const float* x, int64_t n, float m) {
  int nan = __builtin_isnan(m);
  for (int64_t i = 0; i < n; ++i) {
    nan |= __builtin_isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

}  // namespace jax_flashattn::cpu
