// Attention variants as policies: one definition of each concept, host and device alike.
//
//   KeyWindow<Index>  sequence lengths, causal and local windows: key_range() / query_range()
//                     for the tiles a block visits, all_visible_tiles() for the tiles that need
//                     no element test; per element, query t sees key s iff t < q_len,
//                     s < kv_len and t - left <= s <= t + right
//   ElementMask       the boolean mask: keeps(t, s)
//   SoftCap           logit soft-capping, cap tanh(s / cap) before the bias and the masks
//   AdditiveBias      the bias operand, added to scale q.k
//   Alibi             ALiBi: -slope |t + d - s| added to scale q.k, d the aligned diagonal
//   SegmentIds        packed sequences: keeps(t, s), may_share() for tiles to skip
//   VisibleSpans      the positions a block may see through the ids or mask: narrow() a range
//
// Callers: the CPU kernels (ffi/cpu/common.h) and, through cuda::Visibility and its
// tile-relative form (ffi/cuda/common/mask.cuh), every CUDA family: KeyWindow<int> in the
// Hopper forward and the decode kernels, KeyWindow<int64_t> in the others. docs/design.md lists
// what a new variant touches.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "ffi/params.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace jax_flashattn::variant {

template <typename T>
JAX_FLASHATTN_HOST_DEVICE constexpr T min_of(T a, T b) { return b < a ? b : a; }
template <typename T>
JAX_FLASHATTN_HOST_DEVICE constexpr T max_of(T a, T b) { return a < b ? b : a; }

// A sequence length clamped to [0, size]; a missing length is the whole sequence.
JAX_FLASHATTN_HOST_DEVICE inline int64_t clamp_length(const int32_t* lengths, int64_t b,
                                                      int64_t size) {
  if (lengths == nullptr) return size;
  const int64_t length = lengths[b];
  return length < 0 ? 0 : (length > size ? size : length);
}

// Window side w (left or right, kUnboundedWindow for an open one) with the queries moved d
// positions towards the keys' end: left - d, right + d (AttentionParams::align_window_to_lengths,
// |d| <= max(T, S)). A bounded side first saturates at +-2^62, beyond which it hides all or
// nothing of any call, so the sum cannot overflow.
JAX_FLASHATTN_HOST_DEVICE inline int64_t moved_side(int64_t w, int64_t d) {
  if (w == kUnboundedWindow) return w;
  constexpr int64_t kFar = int64_t(1) << 62;
  return (w > kFar ? kFar : (w < -kFar ? -kFar : w)) + d;
}

// Sequence lengths and the local window of one batch entry: query t sees key s iff t < q_len,
// s < kv_len and t - left <= s <= t + right (causal is right = 0). With
// p.align_window_to_lengths the call's sides move by the entry's kv_len - q_len
// (align_to_lengths), here and in KeyWindow<int64_t> alike.
//
// The bounds are clamped so that no side is "unbounded" and no test branches on one: a query
// t < T and a key s < S have -T < s - t < S, so a left bound of T or more hides no key and one
// of -S or less hides every key (the right bound the same, mirrored). Clamped to [-S, T] (left)
// and [-T, S] (right), after any move, each side decides every pair as the unclamped one
// does, and every sum below of a row, a key, a block of either (<= 1024) and a bound stays
// within T + S + 1024 in magnitude. For calls where that fits in int32 (the wgmma forward and
// decode kernels: indices_fit_32_bits); KeyWindow<int64_t> below serves every call.
template <typename Index>
struct KeyWindow {
  Index q_len, kv_len;  // rows t >= q_len see nothing, keys s >= kv_len are hidden
  Index left, right;

  // The call's windows with the call's lengths (make(p, b) has batch entry b's).
  JAX_FLASHATTN_HOST_DEVICE static KeyWindow make(const AttentionParams& p) {
    KeyWindow v;
    v.q_len = Index(p.seqlen_q);
    v.kv_len = Index(p.seqlen_k);
    v.left = clamp_left(p, p.window_left);
    v.right = clamp_right(p, p.window_right);
    if (p.align_window_to_lengths) v.align_to_lengths(p);
    return v;
  }

  JAX_FLASHATTN_HOST_DEVICE static KeyWindow make(const AttentionParams& p, Index b) {
    KeyWindow v = make(p);
    if (p.q_seqlens != nullptr) v.q_len = Index(clamp_length(p.q_seqlens, b, p.seqlen_q));
    if (p.kv_seqlens != nullptr) v.kv_len = Index(clamp_length(p.kv_seqlens, b, p.seqlen_k));
    if (p.align_window_to_lengths) v.align_to_lengths(p);
    return v;
  }

  // With p.align_window_to_lengths: the sides of an entry with this window's lengths, moved
  // from the call's as given (clamped after the move: clamped first, an open side would move
  // into a bound), for code that sets the lengths itself (the Hopper forward's tile slot).
  JAX_FLASHATTN_HOST_DEVICE void align_to_lengths(const AttentionParams& p) {
    const int64_t d = int64_t(kv_len) - int64_t(q_len);
    left = clamp_left(p, moved_side(p.window_left, -d));
    right = clamp_right(p, moved_side(p.window_right, d));
  }

  // Keys [lo, hi) that rows [row_begin, row_end) may see; hi <= lo when none. lo may exceed
  // kv_len (then hi <= lo).
  JAX_FLASHATTN_HOST_DEVICE void key_range(Index row_begin, Index row_end, Index& lo,
                                           Index& hi) const {
    row_end = min_of(row_end, q_len);
    lo = max_of(Index(0), row_begin - left);
    // The last row, row_end - 1, sees keys up to row_end - 1 + right.
    hi = row_end > row_begin ? min_of(kv_len, row_end + right) : Index(0);
  }

  // The key tiles every row of [row_begin, row_end) sees whole: tile j of a walk that starts
  // at tile tile_begin (keys [(tile_begin + j) * kBlockN, + kBlockN)) needs no element test
  // iff lo <= j < hi (every row below q_len, every key below kv_len, the tile's first key
  // inside the last row's window and its last key inside the first row's). Worked out once per block of rows, it leaves two
  // compares per tile.
  template <int kBlockN>
  JAX_FLASHATTN_HOST_DEVICE void all_visible_tiles(Index row_begin, Index row_end,
                                                   Index tile_begin, Index& lo,
                                                   Index& hi) const {
    lo = hi = 0;
    if (row_end > q_len) return;
    const Index key_lo = max_of(Index(0), row_end - 1 - left);
    const Index key_hi = min_of(kv_len, row_begin + right + 1);
    if (key_hi <= key_lo) return;
    // Both keys are >= 0 here: unsigned division is the cheaper one.
    using Unsigned = std::make_unsigned_t<Index>;
    lo = Index((Unsigned(key_lo) + kBlockN - 1) / kBlockN) - tile_begin;
    hi = Index(Unsigned(key_hi) / kBlockN) - tile_begin;
  }

 private:
  // A side clamped to [hides_all, hides_none] (above); kUnboundedWindow hides none.
  JAX_FLASHATTN_HOST_DEVICE static Index clamp_side(int64_t w, int64_t hides_all,
                                                    int64_t hides_none) {
    if (w == kUnboundedWindow || w > hides_none) return Index(hides_none);
    return Index(w < hides_all ? hides_all : w);
  }
  JAX_FLASHATTN_HOST_DEVICE static Index clamp_left(const AttentionParams& p, int64_t w) {
    return clamp_side(w, -p.seqlen_k, p.seqlen_q);
  }
  JAX_FLASHATTN_HOST_DEVICE static Index clamp_right(const AttentionParams& p, int64_t w) {
    return clamp_side(w, -p.seqlen_q, p.seqlen_k);
  }
};

// The same rule in 64 bits for calls whose indices may not fit int32 (the CPU, CUDA-core,
// mma.sync and Hopper backward kernels), with each window side as given (moved per entry
// under align_window_to_lengths): an unbounded side (kUnboundedWindow) is a branch around its
// test instead of a clamped bound. Those kernels were measured slower with clamped 64-bit
// bounds (docs/decisions/variant-policies.md).
template <>
struct KeyWindow<int64_t> {
  int64_t q_len, kv_len;              // rows t >= q_len see nothing, keys s >= kv_len are hidden
  int64_t window_left, window_right;  // kUnboundedWindow for an open side

  JAX_FLASHATTN_HOST_DEVICE static KeyWindow make(const AttentionParams& p, int64_t b) {
    KeyWindow v;
    v.q_len = p.seqlen_q;
    v.kv_len = p.seqlen_k;
    if (p.q_seqlens != nullptr) v.q_len = clamp_length(p.q_seqlens, b, p.seqlen_q);
    if (p.kv_seqlens != nullptr) v.kv_len = clamp_length(p.kv_seqlens, b, p.seqlen_k);
    v.window_left = p.window_left;
    v.window_right = p.window_right;
    if (p.align_window_to_lengths) {
      v.window_left = moved_side(p.window_left, v.q_len - v.kv_len);
      v.window_right = moved_side(p.window_right, v.kv_len - v.q_len);
    }
    return v;
  }

  // Keys [lo, hi) that rows [row_begin, row_end) may see; hi <= lo when none.
  JAX_FLASHATTN_HOST_DEVICE void key_range(int64_t row_begin, int64_t row_end, int64_t& lo,
                                           int64_t& hi) const {
    row_end = row_end < q_len ? row_end : q_len;
    lo = 0;
    hi = row_end > row_begin ? kv_len : 0;
    if (window_left != kUnboundedWindow && row_begin - window_left > lo)
      lo = row_begin - window_left;
    // The last row, row_end - 1, sees keys up to row_end - 1 + window_right.
    if (window_right != kUnboundedWindow && row_end + window_right < hi)
      hi = row_end + window_right;
  }

  // Queries [lo, hi) that may see a key of [key_begin, key_end); hi <= lo when none, for
  // kernels that walk the queries of a block of keys. Key s is seen by queries t with
  // s - window_right <= t <= s + window_left: key_range of the transposed window.
  JAX_FLASHATTN_HOST_DEVICE void query_range(int64_t key_begin, int64_t key_end, int64_t& lo,
                                             int64_t& hi) const {
    KeyWindow{kv_len, q_len, window_right, window_left}.key_range(key_begin, key_end, lo, hi);
  }

  // Whether some row of [row_begin, row_end) may see a key of [key_begin, key_end): a tile
  // without one is skipped.
  JAX_FLASHATTN_HOST_DEVICE bool sees_any(int64_t row_begin, int64_t row_end,
                                          int64_t key_begin, int64_t key_end) const {
    int64_t lo, hi;
    key_range(row_begin, row_end, lo, hi);
    return max_of(lo, key_begin) < min_of(hi, key_end);
  }
};

// The operand of one (batch, head) of a tensor that broadcasts to [batch, N, T, S]: element
// (t, s) at offset + t * row + s * col (in elements of its buffer).
struct HeadSlice {
  int64_t offset = 0, row = 0, col = 0;

  JAX_FLASHATTN_HOST_DEVICE static HeadSlice make(const BroadcastStrides& st,
                                                  const AttentionParams& p, int64_t b,
                                                  int64_t n) {
    const int64_t inner = p.batch_inner > 0 ? p.batch_inner : 1;
    return HeadSlice{st.offset(b, inner, n, 0, 0), st.row, st.col};
  }
  JAX_FLASHATTN_HOST_DEVICE int64_t at(int64_t t, int64_t s) const {
    return offset + t * row + s * col;
  }
  // The same elements with (t0, s0) as the origin: at(r, c) of the result is at(t0 + r, s0 + c).
  JAX_FLASHATTN_HOST_DEVICE HeadSlice from(int64_t t0, int64_t s0) const {
    return HeadSlice{at(t0, s0), row, col};
  }
};

// The boolean mask (true = keep) of one (batch, head); keep == nullptr when the call has none.
// Read only inside the KeyWindow's visible pairs, which lie inside [T, S].
struct ElementMask {
  const bool* keep = nullptr;
  HeadSlice slice;

  JAX_FLASHATTN_HOST_DEVICE static ElementMask make(const AttentionParams& p, int64_t b,
                                                    int64_t n) {
    ElementMask m;
    if (p.mask != nullptr) {
      m.keep = p.mask;
      m.slice = HeadSlice::make(p.mask_strides, p, b, n);
    }
    return m;
  }
  JAX_FLASHATTN_HOST_DEVICE bool present() const { return keep != nullptr; }
  JAX_FLASHATTN_HOST_DEVICE bool keeps(int64_t t, int64_t s) const {
    return keep == nullptr || keep[slice.at(t, s)];
  }
  JAX_FLASHATTN_HOST_DEVICE ElementMask from(int64_t t0, int64_t s0) const {
    return ElementMask{keep, slice.from(t0, s0)};
  }
};

// Segment ids of one batch entry (packed sequences): query t sees key s only where
// q[t] == kv[s]; q == nullptr when the call has none. Read only inside the KeyWindow's visible
// pairs, which lie inside [T, S].
struct SegmentIds {
  const int32_t* q = nullptr;   // the entry's [T] query ids
  const int32_t* kv = nullptr;  // its [S] key ids

  JAX_FLASHATTN_HOST_DEVICE static SegmentIds make(const AttentionParams& p, int64_t b) {
    SegmentIds ids;
    if (p.q_segment_ids != nullptr) {
      ids.q = p.q_segment_ids + b * p.seqlen_q;
      ids.kv = p.kv_segment_ids + b * p.seqlen_k;
    }
    return ids;
  }
  JAX_FLASHATTN_HOST_DEVICE bool present() const { return q != nullptr; }
  JAX_FLASHATTN_HOST_DEVICE bool keeps(int64_t t, int64_t s) const {
    return q == nullptr || q[t] == kv[s];
  }

  // Whether a row of [row_begin, row_end) may share a segment with a key of
  // [key_begin, key_end): false when the two ranges of ids are disjoint, so no pair of the tile
  // is visible and it is skipped. Both ranges must be non-empty and inside [T] and [S].
  JAX_FLASHATTN_HOST_DEVICE bool may_share(int64_t row_begin, int64_t row_end,
                                           int64_t key_begin, int64_t key_end) const {
    if (q == nullptr) return true;
    int32_t q_lo = q[row_begin], q_hi = q_lo, kv_lo = kv[key_begin], kv_hi = kv_lo;
    for (int64_t t = row_begin + 1; t < row_end; ++t) {
      q_lo = min_of(q_lo, q[t]);
      q_hi = max_of(q_hi, q[t]);
    }
    for (int64_t s = key_begin + 1; s < key_end; ++s) {
      kv_lo = min_of(kv_lo, kv[s]);
      kv_hi = max_of(kv_hi, kv[s]);
    }
    return q_lo <= kv_hi && kv_lo <= q_hi;
  }
};

// One batch entry's spans on one side (query rows or keys; params.h's q_key_spans,
// kv_query_spans; from the segment ids, the mask or both): the positions of the other side
// that a block of this side's positions may see lie in the union of the spans of the granules
// the block touches. Empty (spans == nullptr) without ids or mask: nothing is narrowed.
struct VisibleSpans {
  const int32_t* spans = nullptr;  // [granules][2]
  int64_t granules = 0;

  // The keys query rows may see, and the query rows that may see keys.
  JAX_FLASHATTN_HOST_DEVICE static VisibleSpans keys_of_rows(const AttentionParams& p,
                                                             int64_t b) {
    return of(p.q_key_spans, p.seqlen_q, b);
  }
  JAX_FLASHATTN_HOST_DEVICE static VisibleSpans rows_of_keys(const AttentionParams& p,
                                                             int64_t b) {
    return of(p.kv_query_spans, p.seqlen_k, b);
  }
  // [lo, hi) of the other side narrowed to what [begin, end) of this side may see (lo >= hi
  // when nothing). Index int where the caller's bounds are 32-bit (the Hopper forward's
  // producer thread, whose few registers a 64-bit loop spills).
  template <typename Index>
  JAX_FLASHATTN_HOST_DEVICE void narrow(Index begin, Index end, Index& lo, Index& hi) const {
    if (spans == nullptr) return;
    const Index g_end = min_of(Index((end + kSegmentGranule - 1) / kSegmentGranule),
                               Index(granules));
    // An empty span is (the other side's length, 0), which moves neither bound of the union.
    Index first = std::numeric_limits<Index>::max(), last = 0;
    const int32_t* span = spans + 2 * (begin / Index(kSegmentGranule));
    // A pointer walk, not unrolled: the Hopper forward's producer narrows each tile within its
    // 24 registers (indexed, or unrolled, the loop spilled its tile counter).
#ifdef __CUDA_ARCH__
#pragma unroll 1
#endif
    for (Index n = g_end - begin / Index(kSegmentGranule); n > 0; --n, span += 2) {
      first = min_of(first, Index(span[0]));
      last = max_of(last, Index(span[1]));
    }
    lo = max_of(lo, first);
    hi = min_of(hi, last);
  }

 private:
  JAX_FLASHATTN_HOST_DEVICE static VisibleSpans of(const int32_t* all, int64_t length,
                                                   int64_t b) {
    VisibleSpans s;
    if (all != nullptr) {
      s.granules = (length + kSegmentGranule - 1) / kSegmentGranule;
      s.spans = all + 2 * b * s.granules;
    }
    return s;
  }
};

// Logit soft-capping (Gemma 2): the scaled logits s = scale q.k become cap tanh(s / cap), before
// the bias and every mask. The kernels keep logits in base 2, x = s log2(e), where it reads
// x -> c tanh(x / c) with c = cap log2(e); its derivative 1 - tanh^2 is 1 - (x_capped / c)^2,
// which the backward's dS is multiplied by on its way to dQ and dK (not to dbias: the bias is
// added after the cap).
struct SoftCap {
  static constexpr float kLog2e = 1.44269504088896340736f;
  float cap2 = 0.0f;  // cap log2(e); 0 without capping

  // Whether a call may carry `cap`: 0 (none), or > 0 with a finite base-2 cap (NaN is
  // neither).
  JAX_FLASHATTN_HOST_DEVICE static bool valid(float cap) {
    return cap == 0.0f || (cap > 0.0f && cap * kLog2e <= std::numeric_limits<float>::max());
  }
  JAX_FLASHATTN_HOST_DEVICE static SoftCap make(const AttentionParams& p) {
    SoftCap c;
    c.cap2 = p.logits_soft_cap * kLog2e;
    return c;
  }
  JAX_FLASHATTN_HOST_DEVICE bool present() const { return cap2 > 0.0f; }
  JAX_FLASHATTN_HOST_DEVICE float apply(float x) const { return cap2 * tanhf(x / cap2); }
  JAX_FLASHATTN_HOST_DEVICE float slope(float capped) const {
    const float t = capped / cap2;
    return 1.0f - t * t;
  }
};

// ALiBi of one (batch, head): the logit of query t and key s gains -slope |t + shift - s|,
// with the bias, after scaling and any soft-cap. shift is the diagonal the window is aligned
// to: the call's alibi_shift, plus kv_len - q_len of the entry's lengths (clamped as the
// window's) under align_window_to_lengths.
struct Alibi {
  float slope = 0.0f;
  int64_t shift = 0;
  bool on = false;

  JAX_FLASHATTN_HOST_DEVICE static Alibi make(const AttentionParams& p, int64_t b, int64_t n) {
    Alibi a;
    if (p.alibi_slopes != nullptr) {
      a.on = true;
      a.slope = p.alibi_slopes[b * p.num_heads + n];
      a.shift = p.alibi_shift;
      if (p.align_window_to_lengths)
        a.shift += clamp_length(p.kv_seqlens, b, p.seqlen_k) -
                   clamp_length(p.q_seqlens, b, p.seqlen_q);
    }
    return a;
  }
  JAX_FLASHATTN_HOST_DEVICE bool present() const { return on; }
  // |t + shift - s|: the distance the slope multiplies.
  JAX_FLASHATTN_HOST_DEVICE float distance(int64_t t, int64_t s) const {
    const int64_t d = t + shift - s;
    return float(d < 0 ? -d : d);
  }
  JAX_FLASHATTN_HOST_DEVICE float term(int64_t t, int64_t s) const {
    return -slope * distance(t, s);
  }
};

// The additive bias of one (batch, head), in the element type `type`; base == nullptr when the
// call has none. Added after scaling: x = scale q.k + bias.
struct AdditiveBias {
  const void* base = nullptr;
  ElemType type = ElemType::kFloat32;
  HeadSlice slice;

  JAX_FLASHATTN_HOST_DEVICE static AdditiveBias make(const AttentionParams& p, int64_t b,
                                                     int64_t n) {
    AdditiveBias a;
    if (p.bias != nullptr) {
      a.base = p.bias;
      a.type = p.bias_dtype;
      a.slice = HeadSlice::make(p.bias_strides, p, b, n);
    }
    return a;
  }
  JAX_FLASHATTN_HOST_DEVICE bool present() const { return base != nullptr; }

#ifdef __CUDACC__
  // Element i of a bias buffer of element type `type`, as float: what the CUDA kernels read
  // per element (the CPU kernels convert whole rows, ffi/cpu/elem.h).
  __device__ __forceinline__ static float element(const void* base, ElemType type, int64_t i) {
    switch (type) {
      case ElemType::kBFloat16:
        return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
      case ElemType::kFloat16:
        return __half2float(static_cast<const __half*>(base)[i]);
      default:
        return static_cast<const float*>(base)[i];
    }
  }
#endif
};

}  // namespace jax_flashattn::variant
