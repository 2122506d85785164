// The order in which a WithAlibi block of the Hopper forward visits its key tiles: from the
// tile that holds its first row's key on ALiBi's diagonal (clamped into the block's tiles),
// upwards, then from the block's first tile up to it. ALiBi's term is largest on the diagonal
// and falls with the distance from it, so a row's maximum over the first tile visited bounds
// its logits on the later ones up to the spread of the scores, and the softmax exponentiates
// them against that maximum (docs/decisions/settled-row-maxima.md) instead of raising it tile
// after tile. On a causal diagonal the first tile visited is the block's last (or, where the
// diagonal crosses a tile boundary inside the block, the one before it). With a negative slope
// the term grows away from the diagonal instead: the order stays correct, and the settled
// attempts fail and are recomputed.
//
// The producer and the consumers each make the order from the tile: the tile slot has no room
// for it, and the producer's loads and the consumers' products must agree on it.
#pragma once

#include <cstdint>

#include "ffi/cuda/wgmma/tile_scheduler.cuh"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

template <int kBlockN>
struct AlibiTileOrder {
  int first;  // the first key tile visited, from the block's first (t.tile_begin)
  int count;  // the block's key tiles, t.num_kv_tiles

  // ALiBi's diagonal as variant::Alibi has it: query t at key t + alibi_shift, moved by the
  // entry's kv_len - q_len under align_window_to_lengths (the slot's lengths are the entry's).
  // In 64 bits: the shift is the caller's.
  __device__ __forceinline__ static AlibiTileOrder make(const AttentionParams& p,
                                                        const ForwardTile& t) {
    int64_t shift = p.alibi_shift;
    if (p.align_window_to_lengths) shift += int64_t(t.vis.kv_len) - int64_t(t.vis.q_len);
    const int64_t diagonal_key = int64_t(t.row0) + shift;
    // Floor division: the diagonal may lie left of key 0.
    const int64_t tile = (diagonal_key >= 0 ? diagonal_key : diagonal_key - (kBlockN - 1)) /
                             kBlockN -
                         t.tile_begin;
    const int64_t last = t.num_kv_tiles - 1;
    return {int(tile < 0 ? 0 : tile > last ? last : tile), t.num_kv_tiles};
  }

  // The key tile (from the block's first) visited j-th, for 0 <= j < count.
  __device__ __forceinline__ int key_tile(int j) const {
    const int k = j + first;
    return k < count ? k : k - count;
  }
  // When the block's last key tile is visited: the only one that may hold keys past a length.
  __device__ __forceinline__ int last_tile_visit() const { return count - 1 - first; }
};

}  // namespace jax_flashattn::wgmma
