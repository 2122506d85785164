// The per-element terms both backward kernels recompute for one (batch, query head):
//   P_ts  = exp2(scale log2(e) q_t.k_s + log2(e) bias_ts - slope log2(e) |t + shift - s|
//                - log2(e) lse_t)                                           (0 where hidden)
//   dS_ts = P_ts (dP_ts - D_t)
// (soft-capped, the kernels pass the capped base-2 logit in place of scale log2(e) q_t.k_s;
// ALiBi's term, in the kernels' instantiations for it, they add per element from an
// AlibiOrigin, with -lse_t log2(e)).
// lse is the forward's natural-log residual; a row that saw no key has lse = -inf and gets
// P = 0 (never exp2(+inf) or NaN), as do rows past the end of the tile's tensor.
#pragma once

#include <cmath>
#include <cstdint>

#include "ffi/cuda/common/mask.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/softmax.cuh"  // kLog2e
#include "ffi/params.h"

namespace jax_flashattn::mma_sync {

struct HeadTerms {
  cuda::Visibility vis;
  const float* lse;    // [T], natural log
  const float* delta;  // [T], D_t = dO_t . O_t
  float* dbias;        // element (t = 0, s = 0) of dbias (strides in p), or nullptr
  int64_t bias_offset;

  // kSegments: with the call's segment ids (the kernels' instantiation for them).
  template <bool kSegments = false>
  __device__ static HeadTerms make(const AttentionParams& p, int64_t b, int64_t n) {
    HeadTerms h;
    h.vis = kSegments ? cuda::Visibility::make_with_segments(p, b, n)
                      : cuda::Visibility::make(p, b, n);
    const int64_t row_stats = (b * p.num_heads + n) * p.seqlen_q;
    h.lse = p.lse + row_stats;
    h.delta = p.delta + row_stats;
    h.dbias = p.dbias ? p.dbias + p.dbias_strides.offset(b, p.batch_inner, n, 0, 0) : nullptr;
    h.bias_offset = p.bias ? p.bias_strides.offset(b, p.batch_inner, n, 0, 0) : 0;
    return h;
  }

  // -lse_t log2(e), or -inf where row t saw no key or lies past T.
  __device__ float neg_lse_log2(const AttentionParams& p, int64_t t) const {
    const float l = t < p.seqlen_q ? lse[t] : -INFINITY;
    return l == -INFINITY ? -INFINITY : -l * cuda::kLog2e;
  }

  __device__ float row_delta(const AttentionParams& p, int64_t t) const {
    return t < p.seqlen_q ? delta[t] : 0.f;
  }

  // log2(e) bias_ts, 0 without a bias or outside [T, S].
  __device__ float bias_log2(const AttentionParams& p, int64_t t, int64_t s) const {
    if (p.bias == nullptr || t >= p.seqlen_q || s >= p.seqlen_k) return 0.f;
    return cuda::kLog2e *
           variant::AdditiveBias::element(p.bias, p.bias_dtype,
                                          bias_offset + t * p.bias_strides.row +
                                              s * p.bias_strides.col);
  }

  // P_ts from the score: q_t.k_s with score_scale = scale log2(e), or the soft-capped base-2
  // logit with 1. neg_lse2: -lse_t log2(e), plus ALiBi's term of (t, s) where the call has one.
  // `check` false when the caller knows (t, s) is visible.
  __device__ float prob(const AttentionParams& p, int64_t t, int64_t s, float score,
                        float score_scale, float neg_lse2, bool check) const {
    if (check && !vis.visible(t, s)) return 0.f;
    return ptx::exp2_approx(fmaf(score, score_scale, bias_log2(p, t, s) + neg_lse2));
  }
};

}  // namespace jax_flashattn::mma_sync
