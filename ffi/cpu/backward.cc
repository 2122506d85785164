// CPU backward: recomputes P from the saved LSE, one task per (batch, kv head) so that the task
// owns dk and dv of its kv head (summed over the query heads of its group) and dq of those heads:
// no two tasks write the same element.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ffi/cpu/attention_cpu.h"
#include "ffi/cpu/common.h"
#include "ffi/cpu/elem.h"
#include "ffi/cpu/parallel.h"

namespace jax_flashattn::cpu {
namespace {

// Float32 copies of what one query head needs: its valid rows of q, d_out, their dq accumulator,
// and per row D = dO.O and the LSE in base 2.
struct QueryHead {
  std::vector<float> q, d_out, dq;  // [q_len, H]
  std::vector<float> delta;         // [q_len]
  std::vector<float> lse2;          // [q_len]

  QueryHead(int64_t q_len, int64_t h)
      : q(q_len * h), d_out(q_len * h), dq(q_len * h), delta(q_len), lse2(q_len) {}

  void load(const AttentionParams& p, int64_t b, int64_t n, int64_t q_len, float* out_row) {
    const int64_t h = p.head_dim;
    const float* lse = p.lse + (b * p.num_heads + n) * p.seqlen_q;
    std::fill(dq.begin(), dq.end(), 0.0f);
    for (int64_t t = 0; t < q_len; ++t) {
      const int64_t offset = q_offset(p, b, t, n);
      load_row(p.dtype, p.q, offset, h, q.data() + t * h);
      load_row(p.dtype, p.d_out, offset, h, d_out.data() + t * h);
      load_row(p.dtype, p.out, offset, h, out_row);
      delta[t] = dot(d_out.data() + t * h, out_row, h);
      lse2[t] = lse[t] * kLog2e;
    }
  }
};

void backward_group(const AttentionParams& p, int64_t b, int64_t kv_head) {
  const int64_t h = p.head_dim;
  const int64_t t_size = p.seqlen_q;
  const int64_t s_size = p.seqlen_k;
  const KeyRange range(p, b);
  const int64_t q_len = range.q_len();
  const int64_t kv_len = range.kv_len();

  std::vector<float> k(kv_len * h), v(kv_len * h), dk(kv_len * h, 0.0f), dv(kv_len * h, 0.0f);
  for (int64_t s = 0; s < kv_len; ++s) {
    load_row(p.dtype, p.k, kv_offset(p, b, s, kv_head), h, k.data() + s * h);
    load_row(p.dtype, p.v, kv_offset(p, b, s, kv_head), h, v.data() + s * h);
  }

  QueryHead head(q_len, h);
  std::vector<float> x(kBlockK);
  std::vector<float> row(h);
  const std::vector<float> zeros(h, 0.0f);

  const int64_t group = p.group_size();
  for (int64_t n = kv_head * group; n < (kv_head + 1) * group; ++n) {
    const RowLogits logits(p, b, n);
    head.load(p, b, n, q_len, row.data());
    // dS is written where P > 0; every other element of this head's dbias plane is zero.
    float* dbias = p.dbias != nullptr ? p.dbias + (b * p.num_heads + n) * t_size * s_size : nullptr;
    if (dbias != nullptr) std::fill(dbias, dbias + t_size * s_size, 0.0f);

    for (int64_t r0 = 0; r0 < q_len; r0 += kBlockQ) {
      const int64_t r1 = std::min(q_len, r0 + kBlockQ);
      const int64_t key_end = range.end(r1 - 1);
      for (int64_t k0 = range.begin(r0); k0 < key_end; k0 += kBlockK) {
        const int64_t k1 = std::min(key_end, k0 + kBlockK);
        for (int64_t t = r0; t < r1; ++t) {
          // A row the forward found empty (lse = -inf) has P = 0 everywhere.
          if (head.lse2[t] == kNegInf) continue;
          const int64_t j0 = std::max(k0, range.begin(t));
          const int64_t j1 = std::min(k1, range.end(t));
          if (j0 >= j1) continue;
          const float* q_t = head.q.data() + t * h;
          const float* do_t = head.d_out.data() + t * h;
          float* dq_t = head.dq.data() + t * h;
          logits.compute(t, q_t, k.data(), j0, j1, x.data());
          for (int64_t j = j0; j < j1; ++j) {
            const float prob = std::exp2(x[j - j0] - head.lse2[t]);
            if (prob == 0.0f) continue;
            // dS = P * (dP - D) with dP = dO.v; the scale of dq and dk is applied once at the end.
            const float ds = prob * (dot(do_t, v.data() + j * h, h) - head.delta[t]);
            if (dbias != nullptr) dbias[t * s_size + j] = ds;
            axpy(prob, do_t, dv.data() + j * h, h);
            axpy(ds, q_t, dk.data() + j * h, h);
            axpy(ds, k.data() + j * h, dq_t, h);
          }
        }
      }
    }

    for (int64_t t = 0; t < q_len; ++t) {
      float* dq_t = head.dq.data() + t * h;
      scale_row(p.scale, dq_t, h);
      store_row(p.dtype, dq_t, h, p.dq, q_offset(p, b, t, n));
    }
    for (int64_t t = q_len; t < t_size; ++t)
      store_row(p.dtype, zeros.data(), h, p.dq, q_offset(p, b, t, n));
  }

  for (int64_t s = 0; s < kv_len; ++s) {
    scale_row(p.scale, dk.data() + s * h, h);
    store_row(p.dtype, dk.data() + s * h, h, p.dk, kv_offset(p, b, s, kv_head));
    store_row(p.dtype, dv.data() + s * h, h, p.dv, kv_offset(p, b, s, kv_head));
  }
  for (int64_t s = kv_len; s < s_size; ++s) {
    store_row(p.dtype, zeros.data(), h, p.dk, kv_offset(p, b, s, kv_head));
    store_row(p.dtype, zeros.data(), h, p.dv, kv_offset(p, b, s, kv_head));
  }
}

}  // namespace

void backward(const AttentionParams& p) {
  if (p.num_heads <= 0 || p.num_kv_heads <= 0) return;
  parallel_for(p.batch * p.num_kv_heads, [&p](int64_t task) {
    backward_group(p, task / p.num_kv_heads, task % p.num_kv_heads);
  });
}

}  // namespace jax_flashattn::cpu
