// Per-tile rules of the Hopper forward that its consumers apply outside the products: the rows
// of a query block that see no key, the key tiles a warpgroup multiplies under a window, and the
// V rows to zero past a batch entry's key length (and the zeroing).
#pragma once

#include <cmath>
#include <cstdint>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/id_box.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/wgmma/forward_pipeline.cuh"
#include "ffi/cuda/wgmma/tile_scheduler.cuh"
#include "ffi/params.h"
#include "ffi/variant.h"

namespace jax_flashattn::wgmma {

// Rows [row0 + first, row0 + first + rows) of a query block that no key is visible to: O = 0
// and lse = -inf, written with plain stores by `threads` threads.
template <typename Elem>
__device__ void write_unseen_rows(const AttentionParams& p, const ForwardTile& t, int first,
                                  int rows, int thread, int threads) {
  Elem* out = static_cast<Elem*>(p.out) + t.b * p.q_batch_stride + t.n * p.q_head_stride;
  float* lse = p.lse + (int64_t(t.b) * p.num_heads + t.n) * p.seqlen_q;
  const int64_t row_begin = int64_t(t.row0) + first;
  const int64_t valid = p.seqlen_q - row_begin < rows ? p.seqlen_q - row_begin : rows;
  for (int64_t i = thread; i < valid * p.head_dim; i += threads)
    out[(row_begin + i / p.head_dim) * p.q_row_stride + i % p.head_dim] = Elem(0.f);
  for (int64_t i = thread; i < valid; i += threads) lse[row_begin + i] = -INFINITY;
}

// The key tiles a computing warpgroup (rows [row0 + wg_row0, +64) of tile t) multiplies under
// a window: the block's, up to the one that holds the last key its rows see, or all of the
// block's where its rows see none (ForwardConsumer::begin_tile's wg_tiles, by the same rule).
template <int kBlockN>
__device__ __forceinline__ int windowed_warpgroup_tiles(const variant::KeyWindow<int>& vis,
                                                        const ForwardTile& t, int wg_row0) {
  int key_lo, key_hi;
  vis.key_range(t.row0 + wg_row0, t.row0 + wg_row0 + 64, key_lo, key_hi);
  if (key_hi <= key_lo) return t.num_kv_tiles;
  const int last = int(unsigned(key_hi - 1) / kBlockN) - t.tile_begin;
  return last + 1 < t.num_kv_tiles ? last + 1 : t.num_kv_tiles;
}

// kNarrowsToSpans: whether no row of a warpgroup (rows [row0 + wg_row0, +64) of tile t) sees a
// key through the window and the spans (of the segment ids or the mask). Such a warpgroup
// computes nothing (ForwardConsumer::idle_tile), so it neither reads V nor zeroes it.
__device__ __forceinline__ bool sees_no_keys_through_spans(const AttentionParams& p,
                                                           const variant::KeyWindow<int>& vis,
                                                           const ForwardTile& t, int wg_row0) {
  int key_lo, key_hi;
  vis.key_range(t.row0 + wg_row0, t.row0 + wg_row0 + 64, key_lo, key_hi);
  variant::VisibleSpans::keys_of_rows(p, t.b).narrow(t.row0 + wg_row0, t.row0 + wg_row0 + 64,
                                                     key_lo, key_hi);
  return key_hi <= key_lo;
}

// Segment ids: the ids of a key tile as its K stage holds them (cuda::id_box_start's box),
// indexed from the tile's first key.
template <typename Traits>
struct KeyIdsInSmem {
  uint32_t first;  // shared address of the tile's first key's id

  __device__ static KeyIdsInSmem make(const ForwardSmem<Traits>& smem, int stage,
                                      const AttentionParams& p, int b) {
    return {smem.key_ids(stage) + cuda::id_box_skip_bytes(b, int(p.seqlen_k))};
  }
  __device__ int32_t operator[](int key) const {
    return int32_t(ptx::ld_shared_b32(first + uint32_t(key) * 4));
  }
};

// The first row of the V tile that computing consumer `consumer` must zero before its last
// O += P V, or kBlockN for none. The tensor maps span S, so the key tile that holds a batch
// entry's key length brings the cache's rows past it, which may hold NaN or Inf, and a masked P
// of 0 times NaN is NaN. That tile is the last one of every warpgroup that reads it (WithAlibi:
// wherever its order puts it, ForwardConsumer::zero_v_past_length), and the first of them in
// turn order (the lowest computing consumer: below a computing one, a consumer is idle only
// through the spans, kSpans) zeroes it before its turn: the turns (named barriers, round
// robin) order its stores before every later reader's product, and no two
// warpgroups write the buffer. kTails false (no window, or WithAlibi): every computing
// warpgroup reads every tile, so the lowest computing one zeroes. Rebuilt from the parameters
// (one load of the length) rather than kept through the tile loop
// (docs/decisions/keys-past-the-length-never-read.md).
template <int kBlockN, bool kTails, bool kSpans = false>
__device__ __forceinline__ int first_v_row_to_zero(const AttentionParams& p, const ForwardTile& t,
                                                   int consumer, int wg_tiles) {
  if (p.kv_seqlens == nullptr) return kBlockN;  // rows past S load as zeros
  const auto vis = variant::KeyWindow<int>::make(p, int(ptx::opaque(uint32_t(t.b))));
  const int last_key0 = (t.tile_begin + wg_tiles - 1) * kBlockN;
  if (vis.kv_len >= p.seqlen_k || vis.kv_len - last_key0 >= kBlockN) return kBlockN;
  for (int below = 0; below < consumer; ++below) {
    if (kSpans && sees_no_keys_through_spans(p, vis, t, below * 64)) continue;
    if (!kTails || windowed_warpgroup_tiles<kBlockN>(vis, t, below * 64) >= wg_tiles)
      return kBlockN;
  }
  return vis.kv_len - last_key0;
}

// Rows [first_row, kBlockN) of every span of V stage `stage` set to zero by `threads` threads,
// 16 bytes a store (zero rows need no swizzle).
template <typename Traits>
__device__ __forceinline__ void zero_v_rows(const ForwardSmem<Traits>& smem, int stage,
                                            int first_row, int thread, int threads) {
  constexpr int kBlockN = Traits::kBlockN, kSpans = Traits::kSpans;
  constexpr int kRowChunks = kRowBytes / 16;
  const int chunks = (kBlockN - first_row) * kRowChunks;
  for (int i = thread; i < kSpans * chunks; i += threads) {
    const int span = i / chunks, row = first_row + (i % chunks) / kRowChunks;
    ptx::st_shared_v4_b32(smem.v(stage) + span * kBlockN * kRowBytes + row * kRowBytes +
                              (i % kRowChunks) * 16,
                          0, 0, 0, 0);
  }
}

}  // namespace jax_flashattn::wgmma
