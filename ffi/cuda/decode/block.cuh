// What the two split-KV decode kernels (decode/mma_sync_kernel.cuh with mma.sync,
// decode/wgmma_kernel.cuh with wgmma) share about one block: its query rows and their key
// bounds, its split's range of key tiles, its Q fragments, and how it writes its partial result
// (to the workspace, layout in ffi/decode_plan.h, or to its shared memory for the cluster
// merge, decode/cluster_merge.cuh).
//
// One block per (split, kv head, batch). Its query rows are the (t, head-in-group) pairs of the
// kv head's whole GQA group, T * (N / K) <= 64 of them (row r = t * group + g), so each K/V byte
// is read from HBM once per group.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/alibi.cuh"
#include "ffi/cuda/common/e4m3.cuh"
#include "ffi/cuda/common/mask.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/scalar.cuh"
#include "ffi/cuda/common/smem_tile.cuh"
#include "ffi/cuda/common/soft_cap.cuh"
#include "ffi/decode_plan.h"
#include "ffi/params.h"
#include "ffi/variant.h"

namespace jax_flashattn::mma_sync {

// Keys [lo, hi) that query rows [row_begin, row_end) may see, clamped to [0, kv_len].
// decode_shape_fits bounds seqlen_k, so key positions and lengths in the decode kernels are
// int32: 32-bit arithmetic on the path to a block's first K/V request (a 64-bit division is a
// branch and tens of instructions) and in its per-tile loop
// (docs/decisions/decode-kv-streaming.md).
__device__ __forceinline__ void decode_key_range(const variant::KeyWindow<int>& vis,
                                                 int row_begin, int row_end, int& lo, int& hi) {
  vis.key_range(row_begin, row_end, lo, hi);
  lo = min(lo, vis.kv_len);
  hi = max(hi, 0);
}

// A split's work unit (one batch entry's kv head), its index in the unit, the batch entry's
// visibility (every head of a group sees the same keys), and the split's key tiles: the keys
// any row of the unit sees, cut into kBlockN-key tiles, dealt to the splits in equal runs
// [tile_begin, tile_end) (empty for a split past the last tile); kSpans (a bias or mask
// instantiation): the keys narrowed to the mask's spans first, so that a cache whose unfilled
// tail the mask hides is not read. Both decode kernels compute it
// first, in 32-bit arithmetic, and issue their first tiles' requests right after it: a call's
// K/V stream starts once every SM's first blocks have issued theirs, so nothing else (the
// partial's address, the empty-split check, Q) comes before them; an empty split issues none
// (docs/decisions/decode-kv-streaming.md).
struct DecodeSplit {
  int unit, split, b, kv_head;
  int group;          // query heads per kv head
  int64_t kv_offset;  // elements from K's (and V's) start to the unit's first key
  variant::KeyWindow<int> vis;
  int key_lo, key_hi;  // keys some row of the unit sees
  int tile_begin, tile_end;

  template <int kBlockN, bool kSpans = false>
  __device__ static DecodeSplit make(const AttentionParams& p, const DecodePlan& plan, int unit,
                                     int split) {
    DecodeSplit s;
    s.unit = unit;
    s.split = split;
    const int kv_heads = int(p.num_kv_heads);
    s.b = unit / kv_heads;
    s.kv_head = unit - s.b * kv_heads;
    s.group = int(p.num_heads) / kv_heads;
    s.kv_offset = s.b * p.kv_batch_stride + s.kv_head * p.kv_head_stride;
    s.vis = variant::KeyWindow<int>::make(p, s.b);
    decode_key_range(s.vis, 0, int(p.seqlen_q), s.key_lo, s.key_hi);
    if constexpr (kSpans)
      variant::VisibleSpans::keys_of_rows(p, s.b).narrow(0, int(p.seqlen_q), s.key_lo, s.key_hi);
    const int first_tile = s.key_lo / kBlockN;
    const int tiles = s.key_hi > s.key_lo ? (s.key_hi + kBlockN - 1) / kBlockN - first_tile : 0;
    const int splits = int(plan.splits);
    const int per_split = (tiles + splits - 1) / splits;
    const int end = first_tile + tiles;
    // split * per_split < tiles + splits: no overflow. Past the last tile for a trailing split.
    s.tile_begin = min(first_tile + split * per_split, end);
    s.tile_end = min(s.tile_begin + per_split, end);
    return s;
  }
};

// This thread's two rows of a 16-row slab (lane / 4 and lane / 4 + 8) and, for each, the keys
// [lo, hi) its query sees; empty (hi <= lo) for padding rows and rows past q_seqlens.
struct DecodeRows {
  int row[2];
  int key_lo[2], key_hi[2];

  __device__ static DecodeRows make(const variant::KeyWindow<int>& vis, int slab, int lane,
                                    int rows, int group) {
    DecodeRows d;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      d.row[h] = slab * 16 + lane / 4 + h * 8;
      const int t = d.row[h] / group;
      d.key_lo[h] = 0;
      d.key_hi[h] = 0;
      if (d.row[h] < rows) decode_key_range(vis, t, t + 1, d.key_lo[h], d.key_hi[h]);
    }
    return d;
  }

  // Whether both rows see every key of [key0, key0 + keys): no score of theirs there to mask.
  __device__ bool sees_all(int key0, int keys) const {
    return key_lo[0] <= key0 && key_lo[1] <= key0 && key0 + keys <= key_hi[0] &&
           key0 + keys <= key_hi[1];
  }

  // Sets the scores of keys [key0, key0 + 8 kNTiles) this thread's rows do not see to -inf.
  template <int kNTiles>
  __device__ void mask(float (&s)[kNTiles][4], int key0, int quad_col) const {
    auto clamp = [](int x) { return x < 0 ? 0 : (x > 8 * kNTiles ? 8 * kNTiles : x); };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int lo = clamp(key_lo[h] - key0), hi = clamp(key_hi[h] - key0);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + quad_col + e;
          if (c < lo || c >= hi) s[nt][2 * h + e] = -INFINITY;
        }
    }
  }
};

// kBiasAndMask: the elementwise terms of this thread's two rows (DecodeRows; row r is query
// t = r / group of head kv_head group + r % group, padding rows clamped to the last query).
// The bias and mask as offsets of each row's key 0 in the bias's and the mask's buffers (the
// strides and pointers stay in the kernel's parameters), read only at the keys a row sees,
// which lie inside [T, S]; each tile's lines are prefetched into L2 while the tile before
// computes. Or (kStagedTerms: terms the same for every query, decode_terms_stage) each tile's
// rows of the group copied into shared memory with its K and V (copy_tile) and read from there
// (apply_staged): about 24 instructions per score read from global memory against a shared
// load per pair of keys, 1436 -> 749 us at T = 8 of the decode preset with a bias; skipping
// the padding rows' terms, 742 -> 694. ALiBi (kAlibi, kernels of its own: its term in the same
// kernel cost the calls without it 6-26 registers at head dim 128, and 4-7% of their time at
// T = 8 and 16 of the decode preset with a bias) as its slope and diagonal, made again at each
// step from the parameters (a load that hits L1). Segment ids (kSegments, kernels of their
// own: in the kernels without them, the ids' test and its pointers spilled 4-60 more bytes) as
// a mask: each tile's key ids staged with its K and V (copy_key_ids), the rows' query ids read
// at each step.
struct DecodeBiasAndMask {
  int64_t bias_row[2], mask_row[2];
  // kStagedTerms: row h's row g = row % group in the stage, or -1 where row h of every lane of
  // the warp sees no key (padding rows: DecodeRows::mask hides their scores whatever they are,
  // so apply_staged skips them; a warp of one query's group of 4 has 4 live rows of 16).
  int staged_row[2];

  __device__ static int query_of(const AttentionParams& p, const DecodeSplit& sp, int row) {
    return min(row / sp.group, int(p.seqlen_q) - 1);
  }
  __device__ static int head_of(const DecodeSplit& sp, int row) {
    return sp.kv_head * sp.group + row % sp.group;
  }

  // By every lane of the warp (kStaged: a vote over its rows).
  template <bool kStaged>
  __device__ static DecodeBiasAndMask make(const AttentionParams& p, const DecodeSplit& sp,
                                           const DecodeRows& rows) {
    DecodeBiasAndMask m;
    const int64_t inner = p.batch_inner > 0 ? p.batch_inner : 1;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = query_of(p, sp, rows.row[h]), n = head_of(sp, rows.row[h]);
      m.bias_row[h] = p.bias_strides.offset(sp.b, inner, n, t, 0);
      m.mask_row[h] = p.mask_strides.offset(sp.b, inner, n, t, 0);
      if constexpr (kStaged) {
        const bool live = __any_sync(0xffffffffu, rows.key_hi[h] > rows.key_lo[h]);
        m.staged_row[h] = live ? rows.row[h] % sp.group : -1;
      }
    }
    return m;
  }

  // kStagedTerms (decode_terms_stage): key tile `tile`'s terms into the stage at `stage`
  // in shared memory, the group's rows of the bias (row g: query head kv_head group + g, any
  // query: the terms are the same for all), kBlockN elements each, then, from mask_offset,
  // theirs of the mask. By thread `thread` of `threads`, in the commit group of the tile's K
  // and V: the bias's pieces from thread 0 up, the mask's from the last thread down, so that
  // one warp does not issue both while the others wait for it at the next tile's barrier.
  template <int kBlockN>
  __device__ __forceinline__ static void copy_tile(unsigned char* stage, const AttentionParams& p,
                                                   const DecodeSplit& sp, int tile, int thread,
                                                   int threads) {
    if (p.bias != nullptr)
      copy_rows<kBlockN>(stage, p.bias, p.bias_strides, bias_element_bytes(p), p, sp, tile,
                         thread, threads);
    if (p.mask != nullptr)
      copy_rows<kBlockN>(stage + mask_offset<kBlockN>(sp, p.bias != nullptr, bias_element_bytes(p)),
                         p.mask, p.mask_strides, 1, p, sp, tile, threads - 1 - thread, threads);
  }

  // One term's rows of copy_tile (elements of elem_bytes at base, through strides st, unit
  // stride along the keys), row g at dst + g kBlockN elem_bytes: one 16-byte cp.async a piece,
  // the pieces from S on zero-filled (their copies read nothing, from the buffer's start). The
  // rows' offsets with a 32-bit division (the batch entry is an int; offset's 64-bit one is a
  // call of tens of instructions), made again for each tile: held across the tile loop, they
  // cost 4 registers and spilled.
  template <int kBlockN>
  __device__ __forceinline__ static void copy_rows(unsigned char* dst, const void* base,
                                                   const BroadcastStrides& st, int elem_bytes,
                                                   const AttentionParams& p, const DecodeSplit& sp,
                                                   int tile, int thread, int threads) {
    static_assert(kBlockN >= 16 && (kBlockN & (kBlockN - 1)) == 0,
                  "a row's pieces are a power of two");
    const int pieces_log2 = 31 - __clz(kBlockN * elem_bytes / 16);  // a row's 16-byte pieces
    const char* const bytes = static_cast<const char*>(base);
    for (int i = thread; i < sp.group << pieces_log2; i += threads) {
      const int g = i >> pieces_log2, j = i & ((1 << pieces_log2) - 1);
      const int key = tile * kBlockN + j * 16 / elem_bytes;
      const bool valid = key < p.seqlen_k;
      const int64_t at =
          st.head_offset32(uint32_t(sp.b), p.batch_inner32(), sp.kv_head * sp.group + g) + key;
      ptx::cp_async_16(ptx::smem_address(dst + 16 * i), valid ? bytes + at * elem_bytes : bytes,
                       valid);
    }
  }

  // Where a stage's mask rows start: after the group's bias rows (elements of bias_bytes), if
  // any.
  template <int kBlockN>
  __device__ __forceinline__ static int mask_offset(const DecodeSplit& sp, bool bias,
                                                    int bias_bytes) {
    return bias ? sp.group * kBlockN * bias_bytes : 0;
  }

  // The same terms as apply, from the stage copy_tile filled with key0's tile, as natural-log
  // logits: the bias's s scale + b (one FFMA a score; decode_softmax_scale gives the softmax
  // the factor log2(e)), a mask's scores as they are (the factor scale log2(e)). Per pair of
  // keys one shared load of the bias and one of the mask (every key: those past S or a row's
  // range are zeros or data, which DecodeRows::mask hides after), one for both rows where they
  // are one head's (the group divides 8: rows lane / 4 and lane / 4 + 8 share their row of the
  // stage); none for a row h that no lane of the warp has live (staged_row). Both rows live
  // (every warp of 16 live rows) take one branch-free run, whose loads ptxas issues together.
  // The terms' kinds (the bias's element type, the mask's presence) are asked once per tile
  // (each call here), each kind a run of its own: asked per pair, they took about 25
  // instructions a pair (a constant load and both conversions, predicated) where a bf16 bias
  // needs 5. Every branch is the warp's: the parameters, the group and the vote behind
  // staged_row are.
  template <int kBlockN, int kNTiles>
  __device__ __forceinline__ void apply_staged(const AttentionParams& p, const DecodeSplit& sp,
                                               float (&s)[kNTiles][4], int key0, int quad_col,
                                               const unsigned char* stage) const {
    const int col0 = key0 % kBlockN + quad_col;
    const bool mask = p.mask != nullptr;
    const auto with_mask = [&](auto bias_kind) {
      constexpr int kKind = decltype(bias_kind)::value;
      if (mask)
        apply_staged_kind<kBlockN, kKind, true>(p, sp, s, col0, stage);
      else if constexpr (kKind != kNoBias)
        apply_staged_kind<kBlockN, kKind, false>(p, sp, s, col0, stage);
    };
    if (p.bias == nullptr)
      with_mask(std::integral_constant<int, kNoBias>{});
    else if (p.bias_dtype == ElemType::kBFloat16)
      with_mask(std::integral_constant<int, int(ElemType::kBFloat16)>{});
    else if (p.bias_dtype == ElemType::kFloat16)
      with_mask(std::integral_constant<int, int(ElemType::kFloat16)>{});
    else
      with_mask(std::integral_constant<int, int(ElemType::kFloat32)>{});
  }

  // apply_staged for one kind of terms: kBias the bias's ElemType or kNoBias, kMask a mask.
  static constexpr int kNoBias = -1;
  template <int kBlockN, int kBias, bool kMask, int kNTiles>
  __device__ __forceinline__ void apply_staged_kind(const AttentionParams& p,
                                                    const DecodeSplit& sp, float (&s)[kNTiles][4],
                                                    int col0, const unsigned char* stage) const {
    if (staged_row[0] >= 0 && staged_row[1] >= 0) {
      if (staged_row[0] == staged_row[1])
        apply_staged_rows<kBlockN, kBias, kMask, 0, 2, true>(p, sp, s, col0, stage);
      else
        apply_staged_rows<kBlockN, kBias, kMask, 0, 2, false>(p, sp, s, col0, stage);
    } else {
      if (staged_row[0] >= 0)
        apply_staged_rows<kBlockN, kBias, kMask, 0, 1, false>(p, sp, s, col0, stage);
      if (staged_row[1] >= 0)
        apply_staged_rows<kBlockN, kBias, kMask, 1, 2, false>(p, sp, s, col0, stage);
    }
  }

  // apply_staged's terms on rows h of [kFirst, kEnd), the thread's first key at column col0 of
  // the stage's rows; kOneRow: every row takes row kFirst's terms, read once per key pair.
  template <int kBlockN, int kBias, bool kMask, int kFirst, int kEnd, bool kOneRow, int kNTiles>
  __device__ __forceinline__ void apply_staged_rows(const AttentionParams& p,
                                                    const DecodeSplit& sp, float (&s)[kNTiles][4],
                                                    int col0, const unsigned char* stage) const {
    constexpr int kBiasBytes = kBias == int(ElemType::kFloat32) ? 4 : 2;
    const float scale = p.scale;
    const unsigned char* const mask_stage =
        stage + mask_offset<kBlockN>(sp, kBias != kNoBias, kBiasBytes);
    // Row h's terms of key pair nt added to the scores of rows [to_first, to_end).
    const auto add = [&](int h, int nt, int to_first, int to_end) {
      const int at = staged_row[h] * kBlockN + col0 + 8 * nt;
      float2 b{};
      uint16_t keep = 0;
      if constexpr (kBias != kNoBias)
        b = bias_pair<static_cast<ElemType>(kBias)>(stage + at * kBiasBytes);
      if constexpr (kMask) keep = *reinterpret_cast<const uint16_t*>(mask_stage + at);
#pragma unroll
      for (int to = to_first; to < to_end; ++to) {
        float& x0 = s[nt][2 * to];
        float& x1 = s[nt][2 * to + 1];
        if constexpr (kBias != kNoBias) {
          x0 = fmaf(x0, scale, b.x);
          x1 = fmaf(x1, scale, b.y);
        }
        if constexpr (kMask) {
          if ((keep & 0xff) == 0) x0 = -INFINITY;
          if ((keep >> 8) == 0) x1 = -INFINITY;
        }
      }
    };
    if constexpr (kOneRow) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) add(kFirst, nt, kFirst, kEnd);
    } else {
#pragma unroll
      for (int h = kFirst; h < kEnd; ++h)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) add(h, nt, h, h + 1);
    }
  }

  __device__ __forceinline__ static int bias_element_bytes(const AttentionParams& p) {
    return p.bias_dtype == ElemType::kFloat32 ? 4 : 2;
  }
  // Two adjacent bias elements of type kType at `at` in shared memory, as floats.
  template <ElemType kType>
  __device__ __forceinline__ static float2 bias_pair(const unsigned char* at) {
    if constexpr (kType == ElemType::kFloat32) {
      return *reinterpret_cast<const float2*>(at);
    } else {
      using Elem = std::conditional_t<kType == ElemType::kBFloat16, __nv_bfloat16, __half>;
      return cuda::pair_to_float2<Elem>(*reinterpret_cast<const uint32_t*>(at));
    }
  }

  // Into L2, the lines of keys [key0, key0 + keys) of this thread's rows: the quad's four
  // threads a quarter of the keys each (clamped to S, where the tensors end).
  __device__ __forceinline__ void prefetch(const AttentionParams& p, int key0, int keys,
                                           int lane) const {
    const int64_t key = min(key0 + (lane % 4) * (keys / 4), int(p.seqlen_k) - 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (p.bias != nullptr)
        ptx::prefetch_l2(static_cast<const char*>(p.bias) +
                         (bias_row[h] + key * p.bias_strides.col) *
                             (p.bias_dtype == ElemType::kFloat32 ? 4 : 2));
      if (p.mask != nullptr) ptx::prefetch_l2(p.mask + mask_row[h] + key * p.mask_strides.col);
    }
  }

  // Scores s of keys [key0, key0 + 8 kNTiles) as base-2 logits with the bias and ALiBi
  // added, -inf where the mask or the segment ids hide them; the keys a row does not see keep
  // a score, which DecodeRows::mask then hides. The bias's element type is asked per element:
  // a copy of the loop per type (a switch once per step) spilled 32-152 bytes beside the
  // decode kernels' accumulators.
  template <bool kAlibi, int kNTiles>
  __device__ __forceinline__ void apply(const AttentionParams& p, const DecodeSplit& sp,
                                        const DecodeRows& rows, float (&s)[kNTiles][4],
                                        int key0, int quad_col) const {
    const float scale_log2 = p.scale * cuda::kLog2e;
    const int bias_col = int(p.bias_strides.col), mask_col = int(p.mask_strides.col);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t key = key0 + quad_col;
      const int64_t bias_at = bias_row[h] + key * bias_col;
      const bool* keep = p.mask + mask_row[h] + key * mask_col;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[nt][2 * h + e];
          x *= scale_log2;
          const int c = nt * 8 + e;
          if (key0 + quad_col + c < rows.key_lo[h] || key0 + quad_col + c >= rows.key_hi[h])
            continue;
          if (p.bias != nullptr)
            x = fmaf(cuda::kLog2e,
                     variant::AdditiveBias::element(p.bias, p.bias_dtype, bias_at + c * bias_col),
                     x);
          if (p.mask != nullptr && !keep[c * mask_col]) x = -INFINITY;
        }
      if constexpr (kAlibi) add_alibi(p, sp, rows, h, s, key);
    }
  }

  // kSegments: key tile `tile`'s ids into `stage` in shared memory (after the tile's bias and
  // mask rows, which a kernel with ids does not stage), 4 bytes a copy from thread `thread` of
  // `threads` up, in the commit group of the tile's K and V; the ids of keys past S zero-filled
  // (their scores are hidden whatever their ids). Any S: the batch entry's ids start at b S.
  template <int kBlockN>
  __device__ __forceinline__ static void copy_key_ids(unsigned char* stage,
                                                      const AttentionParams& p,
                                                      const DecodeSplit& sp, int tile,
                                                      int thread, int threads) {
    const int32_t* const ids = p.kv_segment_ids + int64_t(sp.b) * p.seqlen_k;
    for (int i = thread; i < kBlockN; i += threads) {
      const int key = tile * kBlockN + i;
      const bool valid = key < p.seqlen_k;
      ptx::cp_async_4(ptx::smem_address(stage + 4 * i), valid ? ids + key : ids, valid);
    }
  }

  // kSegments: -inf for the scores of keys [key0, key0 + 8 kNTiles) whose id is not their row's
  // query's, the keys' ids from the stage copy_key_ids filled with key0's tile: one shared load
  // per pair of keys for both rows. Every id 0 (B = 8, N = 32, K = 8, S = 65536) takes
  // 1.07-1.08x the time of the call without ids at T = 1 (mma.sync kernel) and 1.03-1.08x at
  // T = 16 (wgmma; H200 0277696f), where the ids loaded from global memory, one id per load,
  // took 1.56x and 2.10x (H200 18f89092).
  template <int kBlockN, int kNTiles>
  __device__ __forceinline__ static void hide_other_documents(const AttentionParams& p,
                                                              const DecodeSplit& sp,
                                                              const DecodeRows& rows,
                                                              float (&s)[kNTiles][4], int key0,
                                                              int quad_col,
                                                              const unsigned char* stage) {
    const unsigned char* const ids = stage + 4 * (key0 % kBlockN + quad_col);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t row_id =
          __ldg(p.q_segment_ids + int64_t(sp.b) * p.seqlen_q + query_of(p, sp, rows.row[h]));
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const int2 id = *reinterpret_cast<const int2*>(ids + 32 * nt);
        if (id.x != row_id) s[nt][2 * h] = -INFINITY;
        if (id.y != row_id) s[nt][2 * h + 1] = -INFINITY;
      }
    }
  }

  // kAlibi: ALiBi's term on row h's scores of this thread's keys key + 8 nt + e (key: its
  // first): an FADD and an FFMA per score (on every score: -inf stays -inf, and the scores of
  // keys the row does not see are hidden after).
  template <int kNTiles>
  __device__ __forceinline__ static void add_alibi(const AttentionParams& p, const DecodeSplit& sp,
                                                   const DecodeRows& rows, int h,
                                                   float (&s)[kNTiles][4], int64_t key) {
    // t + shift - key: the distance of key + c is |at - c|, exact (as variant::Alibi's) up to
    // 2^24.
    const int t = query_of(p, sp, rows.row[h]);
    const cuda::AlibiLogits alibi = cuda::AlibiLogits::make(p, sp.b, head_of(sp, rows.row[h]));
    const float at = float(t + alibi.shift - key);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[nt][2 * h + e];
        x = fmaf(-alibi.slope2, fabsf(at - float(nt * 8 + e)), x);
      }
  }
};

// A decode configuration for soft-capped calls: the scores of each step become
// tanh(s scale / cap) as they land, before the row bounds mask them (cap_decode_scores), and
// the softmax takes them with factor c = cap log2(e) (decode_softmax_scale). Instantiations of
// their own (the launches' kSoftCap, decode/mma_sync_launch.cuh, in the *_softcap.cu.in
// translation units): the uncapped kernels' code does not depend on them.
template <typename Config>
struct DecodeWithSoftCap : Config {
  static constexpr bool kSoftCap = true;
};

// A decode configuration for calls with the elementwise terms, any of an additive bias, a
// boolean mask (a serving bias [B, N, 1, S], a cache's mask) and ALiBi: the scores of each step
// become base-2 logits with ALiBi and the bias added, -inf where the mask hides them
// (DecodeBiasAndMask), before the row bounds mask them, and the softmax takes them with factor
// 1; segment ids (kWithIds) hide the keys of other documents as the mask does. Instantiations
// of their own (the launches' kBiasAndMask, in the *_bias.cu.in translation units), those with
// ALiBi (kWithAlibi) and those with segment ids (kWithIds, besides a bias or mask but not
// ALiBi) apart from the others; with a soft-cap too a call takes the normal kernels
// (decode_shape_fits).
// kStaged: the bias and mask copied with each K/V tile into shared memory (the calls whose
// terms decode_terms_stage admits), each ring's stages of them after the family's shared
// memory, Config::kTermStageBytes each, and the logits in natural-log units (apply_staged);
// else each thread reads its elements from global memory. kWithIds: each tile's key ids in
// those stages (copy_key_ids), the bias and mask read from global memory.
template <typename Config, bool kWithAlibi = false, bool kStaged = false, bool kWithIds = false>
struct DecodeWithBiasAndMask : Config {
  static constexpr bool kBiasAndMask = true;
  static constexpr bool kAlibi = kWithAlibi;
  static constexpr bool kStagedTerms = kStaged;
  static constexpr bool kSegments = kWithIds;
  static_assert(!(kWithAlibi && kStaged), "ALiBi's calls read their terms element by element");
  static_assert(!(kWithIds && (kWithAlibi || kStaged)),
                "calls with segment ids read their terms element by element, without ALiBi");
  static_assert(!kWithIds || Config::kBlockN * 4 <= Config::kTermStageBytes,
                "a tile's key ids fit a stage");
  static constexpr int kTermBytes =
      kStaged || kWithIds ? Config::kStages * Config::kTermStageBytes : 0;
  static constexpr int kSmemBytes = Config::kSmemBytes + Config::kRings * kTermBytes;
};

// Whether a kernel of Traits makes each step's scores base-2 logits element by element
// (DecodeBiasAndMask::apply): the kBiasAndMask kernels that do not stage their terms, but of
// the ones with segment ids (never beside ALiBi) only for a call with a bias or mask beside
// them; with the ids alone the scores stay as they are, as in the plain kernels, and the ids
// hide their keys after. A branch per step, the same for the whole block: with apply's
// per-element branches on a call with ids alone, the wgmma kernel took 2.06x the plain call's
// time at T = 16 (every id 0, B = 8, N = 32, K = 8, S = 65536, H200 801ccd96).
template <typename Traits>
__device__ __forceinline__ bool decode_applies_terms(const AttentionParams& p) {
  if constexpr (!Traits::kBiasAndMask || Traits::kStagedTerms) return false;
  else if constexpr (Traits::kSegments) return p.bias != nullptr || p.mask != nullptr;
  else return true;
}

// The softmax's factor on a decode kernel's scores: scale log2(e), c = cap log2(e) with the
// soft-cap, 1 where the elementwise terms have made them base-2 logits already
// (decode_applies_terms), and for the staged terms log2(e) with a bias (natural-log logits) or
// scale log2(e) with a mask alone (the scores as they are).
template <typename Traits>
__device__ __forceinline__ float decode_softmax_scale(const AttentionParams& p) {
  if constexpr (Traits::kSoftCap) return variant::SoftCap::make(p).cap2;
  else if constexpr (Traits::kStagedTerms)
    return p.bias != nullptr ? cuda::kLog2e : p.scale * cuda::kLog2e;
  else return decode_applies_terms<Traits>(p) ? 1.f : p.scale * cuda::kLog2e;
}

// kSoftCap: a step's landed scores s as tanh(s scale / cap).
template <bool kSoftCap, int kNTiles>
__device__ __forceinline__ void cap_decode_scores(const AttentionParams& p,
                                                  float (&s)[kNTiles][4]) {
  if constexpr (kSoftCap) {
    const cuda::SoftCapLogits cap = cuda::SoftCapLogits::make(p);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = cap.tanh_of(s[nt][e]);
  }
}

// A operand fragments (16 rows x head dim) of one slab of split `sp`'s rows, straight from
// global memory: register i of k-step ks holds row lane / 4 + 8 (i % 2), columns
// 16 ks + 8 (i / 2) + 2 (lane % 4) + {0, 1} (the mma.sync m16n8k16 A layout, which is also a
// warp's share of wgmma's register A). Zero past the rows or the head dim. Q is read once per
// block, a few KiB against the split's K/V, so uncoalesced 4-byte loads cost nothing visible.
// kE4m3Order: columns 16 ks + 4 (lane % 4) + 2 (i / 2) + {0, 1} instead, the order in which an
// ldmatrix of e4m3 K gives each lane its head-dim elements (decode/mma_sync_kernel.cuh): the
// product sums over the head dim, so Q and K permuted alike give the same scores.
template <typename Elem, int kKSteps, bool kE4m3Order = false>
__device__ __forceinline__ void load_q_fragments(uint32_t (&q_frag)[kKSteps][4],
                                                 const AttentionParams& p, const DecodeSplit& sp,
                                                 const DecodeRows& rows, int64_t num_rows,
                                                 int quad_col) {
  const int group = sp.group;
  const Elem* q_group = static_cast<const Elem*>(p.q) + sp.b * p.q_batch_stride +
                        sp.kv_head * group * p.q_head_stride;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = rows.row[h];
    const Elem* q_row = q_group + (r / group) * p.q_row_stride + (r % group) * p.q_head_stride;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = kE4m3Order ? ks * 16 + 2 * quad_col + 2 * half
                                   : ks * 16 + half * 8 + quad_col;
        q_frag[ks][h + 2 * half] =
            r < num_rows && col < p.head_dim ? *reinterpret_cast<const uint32_t*>(q_row + col) : 0u;
      }
  }
}

// K/V elements per Elem of a shared tile, as a shift: 1 for e4m3 keys and values, copied and
// laid out by byte pairs (cuda::E4m3Pair) so that the 2-byte tile copies serve them; the
// parameters' offsets, strides and head dim count elements.
template <typename Elem>
inline constexpr int kKvUnitShift = std::is_same_v<Elem, cuda::E4m3Pair> ? 1 : 0;

// `elements` K/V elements (an offset, a stride, the head dim) in Elem units.
template <typename Elem>
__device__ __forceinline__ int64_t kv_units(int64_t elements) {
  if constexpr (kKvUnitShift<Elem> == 0) return elements;
  else return elements >> kKvUnitShift<Elem>;
}

// Copies rows [0, kRows) of K and V, key key0 + row of batch entry b (kv head offset
// kv_offset) from its own page (AttentionParams::page_table), into sK and sV laid out as
// Layout, zero-filling rows >= valid_rows: load_tile's copies (thread tid's chunk column, every
// kRowStep-th row), for pages shorter than a tile. Pages hold kMinPageSize keys or more, so
// each aligned run of kMinPageSize rows lies in one page: the table is read once per run (not
// per row) and only for runs that start below valid_rows (<= the entry's length <= S), never
// past the entry's max_pages; the run's rows are fixed steps from its first.
template <typename Traits, int kRows, typename Layout, typename Elem>
__device__ __forceinline__ void load_paged_tile_rows(Elem* sK, Elem* sV, const AttentionParams& p,
                                                     int b, int64_t kv_offset, int key0,
                                                     int valid_rows, int tid) {
  constexpr int kChunks = Traits::kChunks, kThreads = Traits::kThreads;
  static_assert(kThreads % kChunks == 0, "a thread copies one chunk column");
  constexpr int kRowStep = kThreads / kChunks;
  constexpr int kRun = kMinPageSize;
  static_assert(kRows % kRun == 0 && (kRun % kRowStep == 0 || kRowStep % kRun == 0),
                "a thread's rows step through whole runs");
  // A thread's copies per run, and the runs it copies into (every run, or every
  // kRowStep / kRun-th one).
  constexpr int kPerRun = kRowStep < kRun ? kRun / kRowStep : 1;
  constexpr int kRunStep = kRowStep < kRun ? 1 : kRowStep / kRun;
  constexpr int kRuns = kRows / kRun / kRunStep;
  const int row0 = tid / kChunks, chunk = tid % kChunks;
  const int head_chunks =
      int((kv_units<Elem>(p.head_dim) < kChunks * 8 ? kv_units<Elem>(p.head_dim) : kChunks * 8) +
          7) /
      8;
  const bool chunk_valid = chunk < head_chunks;
  const int64_t step = int64_t(kRowStep) * kv_units<Elem>(p.kv_row_stride);
  const Elem* k = static_cast<const Elem*>(p.k);
  const Elem* v = static_cast<const Elem*>(p.v);
#pragma unroll
  for (int r = 0; r < kRuns; ++r) {
    // This thread's first row in run r (kRowStep >= kRun: row0 lies in a later run of its own).
    const int first = r * kRunStep * kRun + row0;
    const int run0 = first - first % kRun;
    const int64_t at = run0 < valid_rows ? kv_units<Elem>(kv_offset) +
                                               kv_units<Elem>(p.kv_row_offset(b, key0 + run0)) +
                                               (first - run0) * kv_units<Elem>(p.kv_row_stride) +
                                               chunk * 8
                                         : 0;
#pragma unroll
    for (int i = 0; i < kPerRun; ++i) {
      const int row = first + i * kRowStep;
      const bool valid = chunk_valid && row < valid_rows;
      const int64_t src = valid ? at + i * step : 0;
      ptx::cp_async_16(ptx::smem_address(sK + Layout::offset(row, chunk)), k + src, valid);
      ptx::cp_async_16(ptx::smem_address(sV + Layout::offset(row, chunk)), v + src, valid);
    }
  }
}

// Issues the cp.async copies of key tile `tile` of split `sp`'s K and V into sK and sV (kBlockN
// rows each, laid out as Layout). Keys past the batch entry's length are zero-filled, not read:
// a padded cache may hold anything there. A paged call (AttentionParams::page_table) reads a
// tile from one page where pages hold whole tiles (both powers of two, so a tile never
// straddles two), else each row from its own (load_paged_tile_rows).
template <typename Traits, typename Layout, typename Elem>
__device__ __forceinline__ void load_split_tile(Elem* sK, Elem* sV, const AttentionParams& p,
                                                const DecodeSplit& sp, int tile, int tid) {
  constexpr int kBlockN = Traits::kBlockN;
  const int valid_keys = sp.vis.kv_len - tile * kBlockN;
  int64_t offset = sp.kv_offset + int64_t(tile) * kBlockN * p.kv_row_stride;
  if (p.page_table != nullptr) {
    if (kBlockN > (1 << p.page_size_log2)) {
      load_paged_tile_rows<Traits, kBlockN, Layout>(sK, sV, p, sp.b, sp.kv_offset,
                                                    tile * kBlockN, valid_keys, tid);
      return;
    }
    // The tile's first key is below the entry's length, so inside its table row.
    offset = sp.kv_offset + p.kv_row_offset(sp.b, tile * kBlockN);
  }
  load_tile<Traits, kBlockN, Layout>(sK, static_cast<const Elem*>(p.k) + kv_units<Elem>(offset),
                                     kv_units<Elem>(p.kv_row_stride), valid_keys,
                                     kv_units<Elem>(p.head_dim), tid);
  load_tile<Traits, kBlockN, Layout>(sV, static_cast<const Elem*>(p.v) + kv_units<Elem>(offset),
                                     kv_units<Elem>(p.kv_row_stride), valid_keys,
                                     kv_units<Elem>(p.head_dim), tid);
}

// Widens an e4m3 tile of the ring (kBlockN rows of Traits::kSmemDim byte pairs, laid out as
// From) into rows of Traits::kWidenedDim Elem (laid out as To: a 2-byte config's stage), thread
// tid's share of its 16-byte chunks: per chunk one 16-byte load, 8 widened pairs, two 16-byte
// stores. Chunks past the head dim were zero-filled, so the widened rows are zero there too.
template <typename Traits, typename Elem, typename From = SwizzledRows<Traits::kSmemDim>,
          typename To = SwizzledRows<Traits::kWidenedDim>>
__device__ __forceinline__ void widen_e4m3_tile(const cuda::E4m3Pair* src, Elem* dst, int tid) {
  constexpr int kChunks = Traits::kChunks, kTotal = Traits::kBlockN * kChunks;
  static_assert(kTotal % Traits::kThreads == 0,
                "every thread widens as many chunks (the NaN check votes over whole warps)");
  static_assert(2 * kChunks * 8 == Traits::kWidenedDim, "the widened rows are whole");
  // Traits::kWidenUnroll chunks at a time: the mma.sync kernel's one (beside its accumulators
  // an unrolled loop's registers spilled 140 bytes at head dim 256); the wgmma kernel's every
  // chunk of the tile at once, whose loads and conversions then overlap.
#pragma unroll(Traits::kWidenUnroll)
  for (int n = 0; n < kTotal / Traits::kThreads; ++n) {
    const int i = tid + n * Traits::kThreads, row = i / kChunks, chunk = i % kChunks;
    const uint4 raw = *reinterpret_cast<const uint4*>(src + From::offset(row, chunk));
    const uint32_t bytes[4] = {raw.x, raw.y, raw.z, raw.w};
    uint32_t pairs[4][2];
    cuda::widen_e4m3_x4<Elem, 0, 1, 2, 3>(bytes, pairs);
    const uint4 even = make_uint4(pairs[0][0], pairs[0][1], pairs[1][0], pairs[1][1]);
    const uint4 odd = make_uint4(pairs[2][0], pairs[2][1], pairs[3][0], pairs[3][1]);
    // The 8 threads of a 16-byte store's phase: where they widen chunks c and c + 4 of one row
    // (8 or more chunks a row), widened chunks 2c and 2c + 8 share their banks (128 bytes
    // apart, the same XOR), so threads of chunks 4-7 mod 8 store their odd chunk first: each
    // store's phase then covers all 32 banks once.
    const bool odd_first = (chunk >> 2) & 1;
    *reinterpret_cast<uint4*>(dst + To::offset(row, 2 * chunk + odd_first)) =
        odd_first ? odd : even;
    *reinterpret_cast<uint4*>(dst + To::offset(row, 2 * chunk + !odd_first)) =
        odd_first ? even : odd;
  }
}

// Where one split's partial result goes: row r's normalised O (plan.head_dim floats) at
// o + r * o_stride, its natural-log lse at lse[r].
struct PartialRows {
  float* o;
  int64_t o_stride;
  float* lse;
};

// Split `split` of work unit `unit` in the workspace, for the combine kernel.
__device__ __forceinline__ PartialRows workspace_partial(const DecodePlan& plan, int64_t unit,
                                                         int64_t split) {
  const int64_t row0 = plan.partial_row(unit, split, 0);
  return {plan.o_partial + row0 * plan.head_dim, plan.head_dim, plan.lse_partial + row0};
}

// Writes a slab's normalised O (accumulator fragments, kDTiles 8-column tiles) and its rows'
// lse to `dst`. kE4m3Order: the tiles of O += P V with e4m3 V (decode/mma_sync_kernel.cuh),
// where tiles 2 j and 2 j + 1 hold the even and the odd columns of columns [16 j, 16 j + 16):
// a lane's four of them, 16 j + 4 (lane % 4) + {0, 1, 2, 3}, one float4.
template <int kDTiles, bool kE4m3Order = false>
__device__ __forceinline__ void store_split_partial(const PartialRows& dst, const DecodePlan& plan,
                                                    const DecodeRows& rows,
                                                    const float (&o)[kDTiles][4],
                                                    const float (&lse)[2], int lane) {
  const int quad_col = 2 * (lane % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = rows.row[h];
    if (r >= plan.rows) continue;
    float* o_row = dst.o + r * dst.o_stride;
    if constexpr (kE4m3Order) {
#pragma unroll
      for (int j = 0; j < kDTiles / 2; ++j) {
        const int col = j * 16 + 2 * quad_col;
        if (col < plan.head_dim)
          *reinterpret_cast<float4*>(o_row + col) =
              make_float4(o[2 * j][2 * h], o[2 * j + 1][2 * h], o[2 * j][2 * h + 1],
                          o[2 * j + 1][2 * h + 1]);
      }
    } else {
#pragma unroll
      for (int d = 0; d < kDTiles; ++d) {
        const int col = d * 8 + quad_col;
        if (col < plan.head_dim)
          *reinterpret_cast<float2*>(o_row + col) = make_float2(o[d][2 * h], o[d][2 * h + 1]);
      }
    }
    if (lane % 4 == 0) dst.lse[r] = lse[h];
  }
}

// A split with no key: its lse rows are -inf, which either merge reads as weight 0, never
// adding its O (which the cluster merge may have loaded).
__device__ __forceinline__ void store_empty_split(const PartialRows& dst, const DecodePlan& plan,
                                                  int tid, int threads) {
  for (int64_t r = tid; r < plan.rows; r += threads) dst.lse[r] = -INFINITY;
}

}  // namespace jax_flashattn::mma_sync
