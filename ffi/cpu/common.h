// What the CPU forward and backward share: the tile shape, the float32 tiles a task works on,
// which keys a query row may see, and the base-2 logits of a tile.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ffi/cpu/elem.h"
#include "ffi/cpu/tile_math.h"
#include "ffi/params.h"
#include "ffi/variant.h"

namespace jax_flashattn::cpu {

// A tile is kTileRows query rows of one head against kTileKeys keys, a multiple of the matmul's
// register block both ways. A task's float32 tiles (the forward's Q and O [32][H], K, Kᵀ and
// V [64][H]) take 128 KiB at H = 128, about an L2 slice: each K/V element converted from the
// input dtype serves 32 query rows.
inline constexpr int64_t kTileRows = 32;
inline constexpr int64_t kTileKeys = 64;
static_assert(kTileRows % kMatRows == 0 && kTileKeys % kMatRows == 0, "matmul row blocks");
static_assert(kTileKeys % kMatCols == 0, "matmul column blocks");

// Logits are kept in base 2 so that softmax is exp2, with scale * log2(e) folded into Q once.
inline constexpr float kLog2e = 1.44269504088896340736f;
inline constexpr float kLn2 = 0.69314718055994530942f;
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// n rounded up to a multiple of `to`.
inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Element offsets of row t, head n of batch element b in q-like ([batch, T, N, H]) and k-like
// ([batch, S, K, H], or pages of it: AttentionParams::page_table) tensors.
inline int64_t q_offset(const AttentionParams& p, int64_t b, int64_t t, int64_t n) {
  return b * p.q_batch_stride + t * p.q_row_stride + n * p.q_head_stride;
}
inline int64_t kv_offset(const AttentionParams& p, int64_t b, int64_t s, int64_t kv_head) {
  return p.kv_row_offset(b, s) + kv_head * p.kv_head_stride;
}

// Rows [s0, s0 + count) of a k-like tensor (kv head kv_head of batch element b) as float32:
// rows[j][0, H) with row stride `ld`, and, where `transposed` is given, transposed[d][j] with row
// stride kTileKeys. Padding (rows past count, columns past H) keeps the zeros it was made with.
// With `descale` (float32 [batch, K], AttentionParams::k_descale or v_descale) the tensor holds
// e4m3 values, dequantised by their kv head's descale.
inline void load_key_rows(const AttentionParams& p, const void* base, int64_t b, int64_t kv_head,
                          int64_t s0, int64_t count, float* rows, int64_t ld,
                          float* transposed = nullptr, const float* descale = nullptr) {
  for (int64_t j = 0; j < count; ++j) {
    float* row = rows + j * ld;
    const int64_t offset = kv_offset(p, b, s0 + j, kv_head);
    if (descale != nullptr)
      load_e4m3_row(base, offset, p.head_dim, descale[b * p.num_kv_heads + kv_head], row);
    else
      load_row(p.dtype, base, offset, p.head_dim, row);
    if (transposed != nullptr)
      for (int64_t d = 0; d < p.head_dim; ++d) transposed[d * kTileKeys + j] = row[d];
  }
}

// Base-2 logits of a tile of head n of batch element b: x = (softcap(scale q.k) + bias + ALiBi)
// log2(e) for the keys a row sees (window, lengths, mask, segment ids), -inf for the others,
// where x holds scale log2(e) q.k on entry (Q was scaled).
// The policies of ffi/variant.h, applied a row at a time: the bias row is converted in one pass.
class TileLogits {
 public:
  TileLogits(const AttentionParams& p, const variant::KeyWindow<int64_t>& window, int64_t b,
             int64_t n)
      : window_(window),
        mask_(variant::ElementMask::make(p, b, n)),
        segments_(variant::SegmentIds::make(p, b)),
        bias_(variant::AdditiveBias::make(p, b, n)),
        alibi_(variant::Alibi::make(p, b, n)),
        softcap_(variant::SoftCap::make(p)) {}

  const variant::Alibi& alibi() const { return alibi_; }

  bool soft_capped() const { return softcap_.present(); }

  // Row t's kTileKeys logits x of keys [k0, k0 + kTileKeys); false when it sees none of them
  // (then x is all -inf). With soft-capping and `slope` given, slope[j] is the cap's derivative
  // at key j (1 outside the row's window and lengths; at keys the mask or the ids hide, what
  // q.k gives, which the backward's dS of 0 there makes moot).
  JAX_FLASHATTN_CPU_INLINE bool apply(int64_t t, int64_t k0, float* x,
                                       std::vector<float>& bias_row,
                                       float* slope = nullptr) const {
    int64_t begin, end;  // the keys row t sees before mask and bias; end <= begin when none
    window_.key_range(t, t + 1, begin, end);
    const int64_t j0 = std::max(k0, begin) - k0;
    const int64_t j1 = std::min(k0 + kTileKeys, end) - k0;
    if (j0 >= j1) {
      std::fill(x, x + kTileKeys, kNegInf);
      return false;
    }
    std::fill(x, x + j0, kNegInf);
    std::fill(x + j1, x + kTileKeys, kNegInf);
    if (softcap_.present()) {
      for (int64_t j = j0; j < j1; ++j) x[j] = softcap_.apply(x[j]);
      if (slope != nullptr) {
        std::fill(slope, slope + kTileKeys, 1.0f);
        for (int64_t j = j0; j < j1; ++j) slope[j] = softcap_.slope(x[j]);
      }
    }
    if (bias_.present()) {
      load_row(bias_.type, bias_.base, bias_.slice.at(t, k0 + j0), j1 - j0, bias_row.data(),
               bias_.slice.col);
      for (int64_t j = j0; j < j1; ++j) x[j] += bias_row[j - j0] * kLog2e;
    }
    if (alibi_.present())
      for (int64_t j = j0; j < j1; ++j) x[j] += alibi_.term(t, k0 + j) * kLog2e;
    if (mask_.present()) {
      const variant::ElementMask row = mask_.from(t, k0);
      for (int64_t j = j0; j < j1; ++j)
        if (!row.keeps(0, j)) x[j] = kNegInf;
    }
    if (segments_.present())
      for (int64_t j = j0; j < j1; ++j)
        if (!segments_.keeps(t, k0 + j)) x[j] = kNegInf;
    return true;
  }

 private:
  variant::KeyWindow<int64_t> window_;
  variant::ElementMask mask_;
  variant::SegmentIds segments_;
  variant::AdditiveBias bias_;
  variant::Alibi alibi_;
  variant::SoftCap softcap_;
};

// Rows [r0, r0 + rows) of head n of a q-like tensor as float32 times `scale`: dst[i][0, H) with
// row stride ld; the padding keeps its zeros.
inline void load_query_rows(const AttentionParams& p, const void* base, int64_t b, int64_t n,
                            int64_t r0, int64_t rows, float scale, float* dst, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = dst + i * ld;
    load_row(p.dtype, base, q_offset(p, b, r0 + i, n), p.head_dim, row);
    if (scale != 1.0f)
      for (int64_t d = 0; d < p.head_dim; ++d) row[d] *= scale;
  }
}

}  // namespace jax_flashattn::cpu
