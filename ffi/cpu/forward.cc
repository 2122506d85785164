// CPU forward: FlashAttention's tiled online softmax in float32. A task is kTileRows query rows
// of one (batch, head); per tile of kTileKeys keys it computes
//   S = Q K^T           matmul, Q scaled by scale log2(e) (base-2 logits)
//   masks and bias      TileLogits
//   P = 2^(S - m)       online softmax against the running row maxima m, exp2_row
//   O = O c + P V       matmul, c = 2^(m_old - m_new) per row
// and finally O / l and lse. Tiles are float32 copies padded with zeros to the matmul's blocks
// (e4m3 keys and values dequantised by their descales as they are copied).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ffi/cpu/attention_cpu.h"
#include "ffi/cpu/common.h"
#include "ffi/cpu/elem.h"
#include "ffi/cpu/parallel.h"
#include "ffi/cpu/tile_math.h"

namespace jax_flashattn::cpu {
namespace {

// Writes O = 0 and lse = -inf for rows [r0, r1) of head n of batch element b.
void write_unseen_rows(const AttentionParams& p, int64_t b, int64_t n, int64_t r0, int64_t r1,
                       const std::vector<float>& zeros) {
  float* lse = p.lse + (b * p.num_heads + n) * p.seqlen_q;
  for (int64_t t = r0; t < r1; ++t) {
    lse[t] = kNegInf;
    store_row(p.dtype, zeros.data(), p.head_dim, p.out, q_offset(p, b, t, n));
  }
}

// Rows [r0, r0 + kTileRows) of head n of batch element b.
JAX_FLASHATTN_CPU_TASK
void forward_task(const AttentionParams& p, int64_t b, int64_t n, int64_t r0) {
  const int64_t h = p.head_dim, hp = round_up(h, kMatCols);
  const int64_t kv_head = n / p.group_size();
  const auto window = variant::KeyWindow<int64_t>::make(p, b);
  const int64_t r_end = std::min(p.seqlen_q, r0 + kTileRows);
  const int64_t r1 = std::min(window.q_len, r_end);  // rows [r0, r1) may see keys
  const std::vector<float> zeros(h, 0.0f);
  if (r1 <= r0 || !window.sees_any(r0, r1, 0, window.kv_len)) {
    write_unseen_rows(p, b, n, r0, r_end, zeros);
    return;
  }
  const int64_t rows = r1 - r0;

  std::vector<float> q(kTileRows * hp, 0.0f), o(kTileRows * hp, 0.0f);
  std::vector<float> k_rows(kTileKeys * hp, 0.0f), kt(hp * kTileKeys, 0.0f);
  std::vector<float> v(kTileKeys * hp, 0.0f), s(kTileRows * kTileKeys);
  std::vector<float> m(kTileRows, kNegInf), l(kTileRows, 0.0f), bias_row(kTileKeys);
  load_query_rows(p, p.q, b, n, r0, rows, p.scale * kLog2e, q.data(), hp);
  const TileLogits logits(p, window, b, n);
  const auto segments = variant::SegmentIds::make(p, b);

  int64_t key_begin, key_end;
  window.key_range(r0, r1, key_begin, key_end);
  variant::VisibleSpans::keys_of_rows(p, b).narrow(r0, r1, key_begin, key_end);
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kTileKeys) {
    const int64_t count = std::min(kTileKeys, key_end - k0);
    if (!segments.may_share(r0, r1, k0, k0 + count)) continue;  // no pair of it is visible
    if (count < kTileKeys) {  // the last tile: the previous tile's keys must not linger
      std::fill(kt.begin(), kt.end(), 0.0f);
      std::fill(v.begin(), v.end(), 0.0f);
    }
    load_key_rows(p, p.k, b, kv_head, k0, count, k_rows.data(), hp, kt.data(), p.k_descale);
    load_key_rows(p, p.v, b, kv_head, k0, count, v.data(), hp, nullptr, p.v_descale);
    matmul(q.data(), hp, kt.data(), kTileKeys, s.data(), kTileKeys, kTileRows, hp, kTileKeys,
           false);

    for (int64_t i = 0; i < kTileRows; ++i) {
      float* x = s.data() + i * kTileKeys;
      // Rows that see no key of the tile (and the padding rows) add nothing: P = 0.
      if (i >= rows || !logits.apply(r0 + i, k0, x, bias_row)) {
        std::fill(x, x + kTileKeys, 0.0f);
        continue;
      }
      const float m_new = max_row(x, kTileKeys, m[i]);
      // Every visible logit so far is -inf: nothing to add, and 2^(x - m_new) would be NaN. A
      // NaN (or a +inf, through inf - inf) reaches O, l and lse from here, as in jax.nn.
      if (m_new == kNegInf) {
        std::fill(x, x + kTileKeys, 0.0f);
        continue;
      }
      const float correction = exp2_fast(m[i] - m_new);  // 0 while m was -inf
      if (correction != 1.0f) {
        float* o_row = o.data() + i * hp;
        for (int64_t d = 0; d < hp; ++d) o_row[d] *= correction;
        l[i] *= correction;
      }
      l[i] += exp2_row(x, kTileKeys, m_new);
      m[i] = m_new;
    }
    matmul(s.data(), kTileKeys, v.data(), hp, o.data(), hp, kTileRows, kTileKeys, hp, true);
  }

  float* lse = p.lse + (b * p.num_heads + n) * p.seqlen_q;
  for (int64_t i = 0; i < rows; ++i) {
    float* o_row = o.data() + i * hp;
    // m = -inf exactly when every visible logit was -inf (or no key was visible): O = 0 and
    // lse = -inf. Otherwise l >= 1 (the maximum contributes 1), or NaN, which O and lse carry.
    if (m[i] == kNegInf) {
      lse[r0 + i] = kNegInf;
      store_row(p.dtype, zeros.data(), h, p.out, q_offset(p, b, r0 + i, n));
      continue;
    }
    const float inv = 1.0f / l[i];
    for (int64_t d = 0; d < h; ++d) o_row[d] *= inv;
    lse[r0 + i] = m[i] * kLn2 + std::log(l[i]);
    store_row(p.dtype, o_row, h, p.out, q_offset(p, b, r0 + i, n));
  }
  write_unseen_rows(p, b, n, r1, r_end, zeros);
}

}  // namespace

void forward(const AttentionParams& p) {
  if (p.num_heads <= 0 || p.num_kv_heads <= 0) return;
  const int64_t row_tiles = (p.seqlen_q + kTileRows - 1) / kTileRows;
  parallel_for(p.batch * p.num_heads * row_tiles, [&p, row_tiles](int64_t task) {
    const int64_t bn = task / row_tiles;
    forward_task(p, bn / p.num_heads, bn % p.num_heads, (task % row_tiles) * kTileRows);
  });
}

}  // namespace jax_flashattn::cpu
