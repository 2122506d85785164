// What the CPU forward and backward share: the tile shape, float32 row primitives, which keys a
// query row may see, and the base-2 logits of a query row against a run of keys.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "ffi/cpu/elem.h"
#include "ffi/params.h"

namespace jax_flashattn::cpu {

// A tile is kBlockQ query rows of one head against kBlockK keys: the kBlockK K/V rows (64 KiB
// each at H = 256) stay in L2 while every row of the tile reads them.
inline constexpr int64_t kBlockQ = 16;
inline constexpr int64_t kBlockK = 64;

// Logits are kept in base 2 so that softmax is exp2 with scale * log2(e) folded into one
// multiply-add.
inline constexpr float kLog2e = 1.44269504088896340736f;
inline constexpr float kLn2 = 0.69314718055994530942f;
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Width of the fixed-trip-count inner loops below: GCC's -O2 cost model vectorises only loops
// that need no scalar remainder, and a dot product vectorises without -ffast-math only when it
// keeps independent partial sums. Measured no slower at -O3 than wider or unrolled variants.
inline constexpr int64_t kLanes = 8;

inline float dot(const float* __restrict x, const float* __restrict y, int64_t n) {
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t u = 0; u < kLanes; ++u) partial[u] += x[i + u] * y[i + u];
  float sum = 0.0f;
  for (; i < n; ++i) sum += x[i] * y[i];
  for (int64_t u = 0; u < kLanes; ++u) sum += partial[u];
  return sum;
}

// max(a, b) that is NaN when either is: a NaN logit must reach its row's output (std::max and
// fmax drop it).
inline float max_propagating_nan(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return a + b;
  return a < b ? b : a;
}

// y += a * x
inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t u = 0; u < kLanes; ++u) y[i + u] += a * x[i + u];
  for (; i < n; ++i) y[i] += a * x[i];
}

// x *= a
inline void scale_row(float a, float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}

// Element offsets of row t, head n of batch element b in q-like ([batch, T, N, H]) and k-like
// ([batch, S, K, H]) tensors.
inline int64_t q_offset(const AttentionParams& p, int64_t b, int64_t t, int64_t n) {
  return b * p.q_batch_stride + t * p.q_row_stride + n * p.q_head_stride;
}
inline int64_t kv_offset(const AttentionParams& p, int64_t b, int64_t s, int64_t kv_head) {
  return b * p.kv_batch_stride + s * p.kv_row_stride + kv_head * p.kv_head_stride;
}

// A sequence length clamped to [0, limit]; a missing length is the whole sequence.
inline int64_t valid_length(const int32_t* lengths, int64_t b, int64_t limit) {
  if (lengths == nullptr) return limit;
  return std::clamp<int64_t>(lengths[b], 0, limit);
}

// The keys a query row of batch element b may see before mask and bias: [begin(t), end(t)), its
// window cut to the valid keys. Rows at or past q_len() see none. begin and end never decrease
// with t, so the keys of rows [r0, r1) all lie in [begin(r0), end(r1 - 1)).
class KeyRange {
 public:
  KeyRange(const AttentionParams& p, int64_t b)
      : q_len_(valid_length(p.q_seqlens, b, p.seqlen_q)),
        kv_len_(valid_length(p.kv_seqlens, b, p.seqlen_k)),
        // A side past T + S (or unbounded) changes nothing for t < T, s < S; clamping there
        // keeps t - left and t + right + 1 far from overflow.
        left_(p.window_left == kUnboundedWindow
                  ? p.seqlen_q
                  : std::clamp<int64_t>(p.window_left, -(p.seqlen_k + 1), p.seqlen_q)),
        right_(p.window_right == kUnboundedWindow
                   ? p.seqlen_k
                   : std::clamp<int64_t>(p.window_right, -(p.seqlen_q + 1), p.seqlen_k)) {}

  int64_t q_len() const { return q_len_; }
  int64_t kv_len() const { return kv_len_; }
  int64_t begin(int64_t t) const { return std::clamp<int64_t>(t - left_, 0, kv_len_); }
  int64_t end(int64_t t) const { return std::clamp<int64_t>(t + right_ + 1, 0, kv_len_); }

 private:
  int64_t q_len_;
  int64_t kv_len_;
  int64_t left_;
  int64_t right_;
};

// Base-2 logits of the query rows of head n of batch element b:
// x = (scale * q.k + bias) * log2(e), and -inf where the mask drops the key.
class RowLogits {
 public:
  RowLogits(const AttentionParams& p, int64_t b, int64_t n)
      : p_(p), b_(b), n_(n), batch_inner_(std::max<int64_t>(1, p.batch_inner)),
        scale_log2_(p.scale * kLog2e) {}

  // x[j - j0] for keys j in [j0, j1); q is the float32 query row t, k the float32 key rows
  // ([S, H], row j at k + j * H).
  void compute(int64_t t, const float* q, const float* k, int64_t j0, int64_t j1,
               float* x) const {
    const int64_t count = j1 - j0;
    const int64_t h = p_.head_dim;
    if (p_.bias != nullptr) {
      const BroadcastStrides& st = p_.bias_strides;
      load_row(p_.bias_dtype, p_.bias, st.offset(b_, batch_inner_, n_, t, j0), count, x, st.col);
      for (int64_t j = 0; j < count; ++j)
        x[j] = dot(q, k + (j0 + j) * h, h) * scale_log2_ + x[j] * kLog2e;
    } else {
      for (int64_t j = 0; j < count; ++j) x[j] = dot(q, k + (j0 + j) * h, h) * scale_log2_;
    }
    if (p_.mask != nullptr) {
      const BroadcastStrides& st = p_.mask_strides;
      const bool* keep = p_.mask + st.offset(b_, batch_inner_, n_, t, j0);
      for (int64_t j = 0; j < count; ++j)
        if (!keep[j * st.col]) x[j] = kNegInf;
    }
  }

 private:
  const AttentionParams& p_;
  int64_t b_;
  int64_t n_;
  int64_t batch_inner_;
  float scale_log2_;
};

}  // namespace jax_flashattn::cpu
