// CPU backward: recomputes P from the saved lse, tile by tile as the forward, in three parallel
// passes that each own what they write (no two tasks write the same element):
//   D = rowsum(dO * O)                     per (batch, head), into the delta workspace
//   dK, dV (and dbias) per key tile        S = Q K^T, P = 2^(S - lse), dP = dO V^T,
//                                          dS = P (dP - D), dV += P^T dO, dK += dS^T Q
//                                          (with a soft-cap, dS times its slope after dbias
//                                          has summed it, for dK and dQ)
//                                          over every query row of the kv head's group
//   dQ per query tile                      the same S, P, dP, dS, then dQ += dS K
// dbias (zeroed first) sums dS over the bias's broadcast dims inside the key-tile pass: where
// it broadcasts over the batch, the kv heads or the keys, one task runs the key tiles that
// share its elements in a fixed order, so the sums are deterministic and O(bias) in memory.
// That costs the pass its parallelism over those dims (a [1, 1, 1, S] bias leaves one task
// per key tile, a bias broadcast over the keys one task per outer batch entry): the price of
// memory that does not grow with T * S and of gradients that are bit-identical across runs.
// The ALiBi slopes' gradient, -|t + d - s| dS summed over a head's pairs, comes from the dQ
// pass: each query tile's part in a slot of its own, summed in order after it.
// Q is scaled by scale log2(e) as in the forward (base-2 logits), so dK comes out scaled by
// log2(e) and dQ's dS K lacks the scale; both are fixed when stored.
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

// The float32 operands of one (query tile, key tile) step of one head, zero-padded.
struct StepTiles {
  int64_t hp;
  std::vector<float> q;      // [kTileRows][hp], scaled by scale log2(e)
  std::vector<float> d_out;  // [kTileRows][hp]
  std::vector<float> lse2;   // [kTileRows]: lse log2(e)
  std::vector<float> delta;  // [kTileRows]: D
  std::vector<float> p;      // [kTileRows][kTileKeys]: S, then P
  std::vector<float> ds;     // [kTileRows][kTileKeys]: dP, then dS
  std::vector<float> slope;  // [kTileRows][kTileKeys]: the soft-cap's derivative, if capped
  std::vector<float> bias_row;

  explicit StepTiles(int64_t padded_head_dim)
      : hp(padded_head_dim), q(kTileRows * hp), d_out(kTileRows * hp), lse2(kTileRows),
        delta(kTileRows), p(kTileRows * kTileKeys), ds(kTileRows * kTileKeys),
        slope(kTileRows * kTileKeys), bias_row(kTileKeys) {}

  // Rows [r0, r0 + rows) of head n: Q, dO, lse and D; the rows past them are zeros (lse -inf).
  JAX_FLASHATTN_CPU_INLINE void load_rows(const AttentionParams& prm, int64_t b, int64_t n,
                                          int64_t r0, int64_t rows) {
    std::fill(q.begin(), q.end(), 0.0f);
    std::fill(d_out.begin(), d_out.end(), 0.0f);
    load_query_rows(prm, prm.q, b, n, r0, rows, prm.scale * kLog2e, q.data(), hp);
    load_query_rows(prm, prm.d_out, b, n, r0, rows, 1.0f, d_out.data(), hp);
    const int64_t stats = (b * prm.num_heads + n) * prm.seqlen_q + r0;
    for (int64_t i = 0; i < kTileRows; ++i) {
      lse2[i] = i < rows ? prm.lse[stats + i] * kLog2e : kNegInf;
      delta[i] = i < rows ? prm.delta[stats + i] : 0.0f;
    }
  }

  // P and dS of the loaded rows against keys [k0, k0 + kTileKeys) (K^T and V^T given as
  // [hp][kTileKeys]): hidden elements, rows that saw no key (lse -inf) and padding get P = 0 and
  // dS = 0. A row whose lse is NaN (it saw a NaN or +inf logit) gets NaN wherever it sees a key.
  JAX_FLASHATTN_CPU_INLINE void compute(const TileLogits& logits, int64_t r0, int64_t k0,
                                        const float* kt, const float* vt) {
    matmul(q.data(), hp, kt, kTileKeys, p.data(), kTileKeys, kTileRows, hp, kTileKeys, false);
    matmul(d_out.data(), hp, vt, kTileKeys, ds.data(), kTileKeys, kTileRows, hp, kTileKeys,
           false);
    for (int64_t i = 0; i < kTileRows; ++i) {
      float* x = p.data() + i * kTileKeys;
      float* d = ds.data() + i * kTileKeys;
      float* slope_row = logits.soft_capped() ? slope.data() + i * kTileKeys : nullptr;
      if (lse2[i] == kNegInf || !logits.apply(r0 + i, k0, x, bias_row, slope_row)) {
        std::fill(x, x + kTileKeys, 0.0f);
        std::fill(d, d + kTileKeys, 0.0f);
        continue;
      }
      exp2_row(x, kTileKeys, lse2[i]);
      // Where P = 0 exactly (hidden keys, or a probability that underflowed) dS is 0 too,
      // whatever dP holds there.
      for (int64_t j = 0; j < kTileKeys; ++j)
        d[j] = x[j] == 0.0f ? 0.0f : x[j] * (d[j] - delta[i]);
    }
  }

  // dS of the capped logits (what dbias sums) to dS of scale q.k, for dQ and dK: times the
  // cap's derivative. A dS of 0 (a hidden key, a row that saw nothing) stays 0 whatever the
  // slope there holds, NaN included (the slope of a masked key whose q.k is NaN).
  JAX_FLASHATTN_CPU_INLINE void through_soft_cap(const TileLogits& logits) {
    if (!logits.soft_capped()) return;
    for (int64_t e = 0; e < kTileRows * kTileKeys; ++e)
      if (ds[e] != 0.0f) ds[e] *= slope[e];
  }
};

// D_t = dO_t . O_t for every row of head n of batch element b (0 past the query length).
void delta_task(const AttentionParams& p, int64_t b, int64_t n) {
  const int64_t h = p.head_dim;
  const int64_t q_len = variant::clamp_length(p.q_seqlens, b, p.seqlen_q);
  std::vector<float> d_out(h), out(h);
  float* delta = p.delta + (b * p.num_heads + n) * p.seqlen_q;
  for (int64_t t = 0; t < p.seqlen_q; ++t) {
    if (t >= q_len) {
      delta[t] = 0.0f;
      continue;
    }
    load_row(p.dtype, p.d_out, q_offset(p, b, t, n), h, d_out.data());
    load_row(p.dtype, p.out, q_offset(p, b, t, n), h, out.data());
    float sum = 0.0f;
    for (int64_t d = 0; d < h; ++d) sum += d_out[d] * out[d];
    delta[t] = sum;
  }
}

// dK and dV of keys [s0, s0 + kTileKeys) of kv head kv_head of batch element b, summed over the
// query heads of its group, and their dS added into dbias.
JAX_FLASHATTN_CPU_TASK
void key_tile_task(const AttentionParams& p, int64_t b, int64_t kv_head, int64_t s0) {
  const int64_t h = p.head_dim, hp = round_up(h, kMatCols);
  const auto window = variant::KeyWindow<int64_t>::make(p, b);
  const int64_t s_end = std::min(p.seqlen_k, s0 + kTileKeys);
  const int64_t count = std::max<int64_t>(0, std::min(window.kv_len, s_end) - s0);

  std::vector<float> k_rows(kTileKeys * hp, 0.0f), kt(hp * kTileKeys, 0.0f);
  std::vector<float> v_rows(kTileKeys * hp, 0.0f), vt(hp * kTileKeys, 0.0f);
  std::vector<float> dk(kTileKeys * hp, 0.0f), dv(kTileKeys * hp, 0.0f);
  std::vector<float> pt(kTileKeys * kTileRows), dst(kTileKeys * kTileRows);
  load_key_rows(p, p.k, b, kv_head, s0, count, k_rows.data(), hp, kt.data());
  load_key_rows(p, p.v, b, kv_head, s0, count, v_rows.data(), hp, vt.data());
  StepTiles tiles(hp);

  const int64_t group = p.group_size();
  const auto segments = variant::SegmentIds::make(p, b);
  // The rows that may see a key of the tile through the spans, from the tile-aligned start.
  int64_t rows_begin = 0, rows_end = p.seqlen_q;
  variant::VisibleSpans::rows_of_keys(p, b).narrow(s0, s_end, rows_begin, rows_end);
  rows_begin -= rows_begin % kTileRows;
  const BroadcastStrides& db = p.dbias_strides;
  for (int64_t n = kv_head * group; n < (kv_head + 1) * group; ++n) {
    const TileLogits logits(p, window, b, n);
    float* dbias = p.dbias != nullptr ? p.dbias + db.offset(b, p.batch_inner, n, 0, s0)
                                      : nullptr;
    for (int64_t r0 = rows_begin; r0 < rows_end; r0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, window.q_len - r0);
      if (count <= 0 || rows <= 0 || !window.sees_any(r0, r0 + rows, s0, s0 + count) ||
          !segments.may_share(r0, r0 + rows, s0, s0 + count))
        continue;
      tiles.load_rows(p, b, n, r0, rows);
      tiles.compute(logits, r0, s0, kt.data(), vt.data());
      if (dbias != nullptr) {
        for (int64_t i = 0; i < rows; ++i) {
          const float* ds = tiles.ds.data() + i * kTileKeys;
          float* row = dbias + (r0 + i) * db.row;
          for (int64_t j = 0; j < count; ++j) row[j * db.col] += ds[j];
        }
      }
      tiles.through_soft_cap(logits);
      transpose(tiles.p.data(), kTileKeys, pt.data(), kTileRows, kTileRows, kTileKeys);
      transpose(tiles.ds.data(), kTileKeys, dst.data(), kTileRows, kTileRows, kTileKeys);
      matmul(pt.data(), kTileRows, tiles.d_out.data(), hp, dv.data(), hp, kTileKeys, kTileRows,
             hp, true);
      matmul(dst.data(), kTileRows, tiles.q.data(), hp, dk.data(), hp, kTileKeys, kTileRows, hp,
             true);
    }
  }

  // dS^T Q with Q scaled by scale log2(e) is log2(e) times dK. Keys past the length store 0.
  for (int64_t j = 0; j < s_end - s0; ++j) {
    float* dk_row = dk.data() + j * hp;
    for (int64_t d = 0; d < h; ++d) dk_row[d] *= 1.0f / kLog2e;
    store_row(p.dtype, dk_row, h, p.dk, kv_offset(p, b, s0 + j, kv_head));
    store_row(p.dtype, dv.data() + j * hp, h, p.dv, kv_offset(p, b, s0 + j, kv_head));
  }
}

// dQ of rows [r0, r0 + kTileRows) of head n of batch element b; with dslopes, also the ALiBi
// slope's gradient from these rows, -|t + d - s| dS summed over their pairs, into *dslope.
JAX_FLASHATTN_CPU_TASK
void query_tile_task(const AttentionParams& p, int64_t b, int64_t n, int64_t r0,
                     double* dslope) {
  const int64_t h = p.head_dim, hp = round_up(h, kMatCols);
  const int64_t kv_head = n / p.group_size();
  const auto window = variant::KeyWindow<int64_t>::make(p, b);
  const int64_t r_end = std::min(p.seqlen_q, r0 + kTileRows);
  const int64_t rows = std::max<int64_t>(0, std::min(window.q_len, r_end) - r0);

  std::vector<float> dq(kTileRows * hp, 0.0f);
  if (rows > 0 && window.sees_any(r0, r0 + rows, 0, window.kv_len)) {
    std::vector<float> k_rows(kTileKeys * hp, 0.0f), kt(hp * kTileKeys, 0.0f);
    std::vector<float> v_rows(kTileKeys * hp, 0.0f), vt(hp * kTileKeys, 0.0f);
    StepTiles tiles(hp);
    tiles.load_rows(p, b, n, r0, rows);
    const TileLogits logits(p, window, b, n);
    const auto segments = variant::SegmentIds::make(p, b);
    int64_t key_begin, key_end;
    window.key_range(r0, r0 + rows, key_begin, key_end);
    variant::VisibleSpans::keys_of_rows(p, b).narrow(r0, r0 + rows, key_begin, key_end);
    for (int64_t k0 = key_begin; k0 < key_end; k0 += kTileKeys) {
      const int64_t count = std::min(kTileKeys, key_end - k0);
      if (!segments.may_share(r0, r0 + rows, k0, k0 + count)) continue;
      if (count < kTileKeys) {  // the last tile: the previous tile's keys must not linger
        std::fill(k_rows.begin(), k_rows.end(), 0.0f);
        std::fill(kt.begin(), kt.end(), 0.0f);
        std::fill(vt.begin(), vt.end(), 0.0f);
      }
      load_key_rows(p, p.k, b, kv_head, k0, count, k_rows.data(), hp, kt.data());
      load_key_rows(p, p.v, b, kv_head, k0, count, v_rows.data(), hp, vt.data());
      tiles.compute(logits, r0, k0, kt.data(), vt.data());
      if (dslope != nullptr) {  // dS of the logits the slope's term is added to (after a cap)
        double sum = 0.0;
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < count; ++j) {
            const float ds = tiles.ds[i * kTileKeys + j];
            if (ds != 0.0f) sum -= double(ds) * logits.alibi().distance(r0 + i, k0 + j);
          }
        *dslope += sum;
      }
      tiles.through_soft_cap(logits);
      matmul(tiles.ds.data(), kTileKeys, k_rows.data(), hp, dq.data(), hp, kTileRows,
             kTileKeys, hp, true);
    }
  }
  const std::vector<float> zeros(h, 0.0f);
  for (int64_t t = r0; t < r_end; ++t) {
    float* dq_row = dq.data() + (t - r0) * hp;
    for (int64_t d = 0; d < h; ++d) dq_row[d] *= p.scale;
    store_row(p.dtype, t - r0 < rows ? dq_row : zeros.data(), h, p.dq, q_offset(p, b, t, n));
  }
}

}  // namespace

void backward(const AttentionParams& p) {
  if (p.dbias != nullptr) std::fill(p.dbias, p.dbias + p.dbias_elements, 0.0f);
  const int64_t slots = dslopes_slots(p.seqlen_k);
  if (p.dslopes != nullptr) std::fill(p.dslopes, p.dslopes + p.batch * p.num_heads * slots, 0.0f);
  if (p.num_heads <= 0 || p.num_kv_heads <= 0) return;
  parallel_for(p.batch * p.num_heads,
               [&p](int64_t task) { delta_task(p, task / p.num_heads, task % p.num_heads); });
  const int64_t key_tiles = (p.seqlen_k + kTileKeys - 1) / kTileKeys;
  // The key tiles, kv heads and batch entries that add into shared dbias elements run in one
  // task each, in order (the vmapped outer batch dimensions are never broadcast).
  const BroadcastStrides& db = p.dbias_strides;
  const bool sums = p.dbias != nullptr;
  const int64_t tile_tasks = sums && db.col == 0 ? 1 : key_tiles;
  const int64_t head_tasks = sums && db.head == 0 ? 1 : p.num_kv_heads;
  const int64_t inner = sums && db.batch_inner == 0 && p.batch_inner > 1 ? p.batch_inner : 1;
  parallel_for(p.batch / inner * head_tasks * tile_tasks, [&](int64_t task) {
    const int64_t tile = task % tile_tasks, head = task / tile_tasks % head_tasks;
    const int64_t b0 = task / tile_tasks / head_tasks * inner;
    for (int64_t b = b0; b < b0 + inner; ++b)
      for (int64_t kv = head; kv < p.num_kv_heads; kv += head_tasks)
        for (int64_t s = tile; s < key_tiles; s += tile_tasks)
          key_tile_task(p, b, kv, s * kTileKeys);
  });
  // dslopes: each query tile's part in a slot of its own, summed per head in tile order after
  // the pass, so that the sum does not depend on the threads.
  const int64_t row_tiles = (p.seqlen_q + kTileRows - 1) / kTileRows;
  std::vector<double> dslope_parts(p.dslopes != nullptr ? p.batch * p.num_heads * row_tiles : 0,
                                   0.0);
  parallel_for(p.batch * p.num_heads * row_tiles, [&p, row_tiles, &dslope_parts](int64_t task) {
    const int64_t bn = task / row_tiles;
    query_tile_task(p, bn / p.num_heads, bn % p.num_heads, (task % row_tiles) * kTileRows,
                    dslope_parts.empty() ? nullptr : &dslope_parts[task]);
  });
  if (p.dslopes == nullptr || slots == 0) return;
  for (int64_t bn = 0; bn < p.batch * p.num_heads; ++bn) {
    double sum = 0.0;
    for (int64_t tile = 0; tile < row_tiles; ++tile) sum += dslope_parts[bn * row_tiles + tile];
    p.dslopes[bn * slots] = float(sum);  // the whole sum in the first slot, the others 0
  }
}

}  // namespace jax_flashattn::cpu
