// CPU forward: FlashAttention's tiled online softmax in float32, one task per (batch, head).
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

// Running softmax state of the rows of one query tile.
struct RowTile {
  std::vector<float> acc;  // [kBlockQ, H]: sum_j 2^(x_j - m) v_j
  std::vector<float> m;    // [kBlockQ]: running max of the base-2 logits
  std::vector<float> l;    // [kBlockQ]: sum_j 2^(x_j - m)

  explicit RowTile(int64_t h) : acc(kBlockQ * h), m(kBlockQ), l(kBlockQ) {}

  void reset() {
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(m.begin(), m.end(), kNegInf);
    std::fill(l.begin(), l.end(), 0.0f);
  }
};

// Folds the logits x[0, count) of keys j0.. into row i's state; v holds the float32 value rows.
// A NaN logit (or a +inf one, through inf - inf) makes the row's max, sum and output NaN, as
// in jax.nn: the maxima propagate NaN instead of dropping it as std::max does.
void online_softmax_update(RowTile& tile, int64_t i, const float* x, int64_t count,
                           const float* v, int64_t j0, int64_t h) {
  float block_max = kNegInf;
  for (int64_t j = 0; j < count; ++j) block_max = max_propagating_nan(block_max, x[j]);
  const float m_new = max_propagating_nan(tile.m[i], block_max);
  // Every visible logit so far is -inf: nothing to add, and 2^(x - m_new) would be NaN.
  if (m_new == kNegInf) return;
  float* o = tile.acc.data() + i * h;
  const float alpha = std::exp2(tile.m[i] - m_new);  // 0 while m was -inf
  if (alpha != 1.0f) {
    scale_row(alpha, o, h);
    tile.l[i] *= alpha;
  }
  float row_sum = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    const float weight = std::exp2(x[j] - m_new);
    if (weight == 0.0f) continue;  // masked key, or one too small to matter in float32
    row_sum += weight;
    axpy(weight, v + (j0 + j) * h, o, h);
  }
  tile.l[i] += row_sum;
  tile.m[i] = m_new;
}

void forward_head(const AttentionParams& p, int64_t b, int64_t n) {
  const int64_t h = p.head_dim;
  const int64_t kv_head = n / p.group_size();
  const KeyRange range(p, b);
  const RowLogits logits(p, b, n);
  const int64_t q_len = range.q_len();
  const int64_t kv_len = range.kv_len();

  // Float32 copies of this head's valid query rows and its kv head's valid key/value rows.
  std::vector<float> q(q_len * h), k(kv_len * h), v(kv_len * h);
  for (int64_t t = 0; t < q_len; ++t)
    load_row(p.dtype, p.q, q_offset(p, b, t, n), h, q.data() + t * h);
  for (int64_t s = 0; s < kv_len; ++s) {
    load_row(p.dtype, p.k, kv_offset(p, b, s, kv_head), h, k.data() + s * h);
    load_row(p.dtype, p.v, kv_offset(p, b, s, kv_head), h, v.data() + s * h);
  }

  RowTile tile(h);
  std::vector<float> x(kBlockK);
  std::vector<float> zeros(h, 0.0f);
  float* lse = p.lse + (b * p.num_heads + n) * p.seqlen_q;

  for (int64_t r0 = 0; r0 < q_len; r0 += kBlockQ) {
    const int64_t r1 = std::min(q_len, r0 + kBlockQ);
    tile.reset();
    // Key blocks outside every row's range of this tile are never visited.
    const int64_t key_end = range.end(r1 - 1);
    for (int64_t k0 = range.begin(r0); k0 < key_end; k0 += kBlockK) {
      const int64_t k1 = std::min(key_end, k0 + kBlockK);
      for (int64_t t = r0; t < r1; ++t) {
        const int64_t j0 = std::max(k0, range.begin(t));
        const int64_t j1 = std::min(k1, range.end(t));
        if (j0 >= j1) continue;
        logits.compute(t, q.data() + t * h, k.data(), j0, j1, x.data());
        online_softmax_update(tile, t - r0, x.data(), j1 - j0, v.data(), j0, h);
      }
    }
    for (int64_t t = r0; t < r1; ++t) {
      const int64_t i = t - r0;
      float* o = tile.acc.data() + i * h;
      // m = -inf exactly when every visible logit was -inf (or no key was visible): O = 0 and
      // lse = -inf. Otherwise l >= 1 (the max contributes 1), or NaN, which O and lse carry.
      if (tile.m[i] != kNegInf) {
        scale_row(1.0f / tile.l[i], o, h);
        lse[t] = tile.m[i] * kLn2 + std::log(tile.l[i]);
        store_row(p.dtype, o, h, p.out, q_offset(p, b, t, n));
      } else {
        lse[t] = kNegInf;
        store_row(p.dtype, zeros.data(), h, p.out, q_offset(p, b, t, n));
      }
    }
  }
  for (int64_t t = q_len; t < p.seqlen_q; ++t) {
    lse[t] = kNegInf;
    store_row(p.dtype, zeros.data(), h, p.out, q_offset(p, b, t, n));
  }
}

}  // namespace

void forward(const AttentionParams& p) {
  if (p.num_heads <= 0 || p.num_kv_heads <= 0) return;
  parallel_for(p.batch * p.num_heads,
               [&p](int64_t task) { forward_head(p, task / p.num_heads, task % p.num_heads); });
}

}  // namespace jax_flashattn::cpu
