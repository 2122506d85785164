// The Hopper forward consumer's per-key-tile softmax step (ForwardConsumer's member functions
// softmax_step, mask_and_exponentiate and stage_next, declared in forward_consumer.cuh): the
// landed scores of key tile j become its probabilities, by the settled maxima where they hold
// and by the full online-softmax update (with the tile's masking) where they do not. Included
// by forward_consumer.cuh after the class, whose members these definitions use.
#pragma once

namespace jax_flashattn::wgmma {

// The full update of key tile kt (the tile loop's j-th) over its first kUsed 8-column tiles:
// where a boundary crosses the tile for this warp's rows (not interior), the scores it hides
// set to -inf first; kSegments, unless one document holds the warp's rows and the tile's keys
// (one_doc), with the keys of other documents than the row's.
template <typename Elem, typename Traits>
template <int kUsed>
__device__ __forceinline__ void ForwardConsumer<Elem, Traits>::mask_and_exponentiate(
    ConsumerTile& w, int kt, int stage, bool interior, bool one_doc,
    float (&correction)[1][2]) {
  if (!interior) {
    // The bounds rebuilt from the parameters (the lengths one load away): t.vis, kept live
    // through the tile loop for this, spills with three consumers
    // (docs/decisions/int32-bounds-and-column-bits-masking.md).
    // The opaque batch index keeps the compiler from reusing the tile's first loads.
    const auto vis = variant::KeyWindow<int>::make(p, ptx::opaque(uint32_t(w.t.b)));
    const cuda::TileVisibility tile_vis = cuda::TileVisibility::make(
        vis, w.t.row0, (w.t.tile_begin + kt) * kBlockN, kBlockM + kBlockN);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t bits[(2 * kUsed + 31) / 32];  // this thread's visible elements of the row
      tile_vis.column_bits<kUsed>(warp_row0 + quad_row + 8 * h, quad_col, bits);
      // kSegments: the bits of keys whose id is not the row's cleared (their ids from the K
      // stage, whose box covers the tile: every read is in bounds). one_doc is the warp's
      // vote: the branch is uniform.
      if constexpr (Traits::kSegments)
        if (!one_doc) {
          const int32_t row_id = __shfl_sync(0xffffffff, w.lane_row_id, quad_row + 8 * h);
          KeyIdsInSmem<Traits> key_ids = KeyIdsInSmem<Traits>::make(smem, stage, p, w.t.b);
          key_ids.first += uint32_t(quad_col) * 4;
#pragma unroll
          for (int i = 0; i < 2 * kUsed; ++i)
            if (key_ids[8 * (i / 2) + i % 2] != row_id) bits[i / 32] &= ~(1u << (i % 32));
        }
#pragma unroll
      for (int c = 0; c < kUsed; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (!cuda::TileVisibility::column_visible(bits, 2 * c + e))
            s_acc[0][c][2 * h + e] = -INFINITY;
    }
  }
  w.softmax.template exponentiate_first<kUsed>(s_acc, scale_of(w), correction);
}

// Tile j's probabilities from its landed scores. On an interior tile (every row of the
// warp below the query length) after the first, once each of the warp's rows has a finite
// maximum, the tile is exponentiated against those maxima: no max reduction, no O rescale.
// Where a score outran them too far, the warp recomputes its 16 rows of S with mma.sync (a
// wgmma recompute would need the whole warpgroup, and its issue spills registers) and
// takes the full update, as every other tile does (with masking where a boundary crosses
// it). K_j is released once nothing reads it (docs/decisions/settled-row-maxima.md).
template <typename Elem, typename Traits>
__device__ __forceinline__ void ForwardConsumer<Elem, Traits>::softmax_step(
    ConsumerTile& w, int j, float (&correction)[1][2]) {
  cap_scores();
  // kE4m3: scores of a negative descale product change sign (the factor takes its magnitude:
  // the softmax takes each row's maximum before scaling).
  if constexpr (Traits::kE4m3)
    if (w.e4m3_negate) {
#pragma unroll
      for (int c = 0; c < kNTiles; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) s_acc[0][c][e] = -s_acc[0][c][e];
    }
  const int stage = kv_ring.stage();
  // The key tile: j itself but with kAlibi (key_tile; called in the other variants too, it
  // changed the form of their compares).
  int kt = j;
  if constexpr (Traits::kAlibi) kt = key_tile(w, j);
  // kSegments: whether one document holds the warp's rows and the tile's keys, asked of every
  // tile: on a tile that a boundary crosses it spares the per-element id test.
  bool one_doc = true;
  if constexpr (Traits::kSegments) one_doc = one_document(w, stage);
  bool interior = kt >= w.interior_lo && kt < w.interior_hi && one_doc;
  // kBiasAndMask: the lines of the next tile the warp reads brought into L2 (kStagedTerm: by
  // stage_next, of the one after the next).
  if constexpr (Traits::kBiasAndMask) {
    if (!Traits::kStagedTerm && j + 1 < w.wg_tiles) bias_and_mask().prefetch(w.t, j + 1);
    bias_and_mask().apply(s_acc, w.t, j, interior);
  }
  // ALiBi's logits grow tile after tile toward the diagonal, so with the key tiles in order a
  // settled maximum would be outrun (and the warp's scores recomputed) on most tiles: ALiBi
  // beside a bias or mask takes the full update (WithAlibi visits the diagonal first).
  const bool alibi = Traits::kBiasAndMask && p.alibi_slopes != nullptr;
  // kAlibi: the settled attempt takes the tiles on one side of the warp's diagonal keys (the
  // term in its exponent: alibi_exponent); the one or two that the diagonal crosses, the full
  // update.
  [[maybe_unused]] int side = 0;
  if constexpr (Traits::kAlibi) side = alibi_side(w, kt);
  // kE4m3: every tile takes the full update: against settled maxima a P could pass e4m3's
  // 448 (their headroom is 4096), and the recompute reads 2-byte tiles.
  const bool settled = !Traits::kE4m3 && j > 0 && interior && !alibi &&
                       (!Traits::kAlibi || side != 0) &&
                       __all_sync(0xffffffff, w.softmax.row_max[0][0] > -INFINITY &&
                                                  w.softmax.row_max[0][1] > -INFINITY);
  bool accepted = false;
  if (settled) {
    if constexpr (Traits::kAlibi)
      accepted = w.softmax.exponentiate_against_settled_max(s_acc, softmax_scale,
                                                            alibi_exponent(w, kt, side));
    else
      accepted = w.softmax.exponentiate_against_settled_max(s_acc, softmax_scale);
  }
  if (accepted) {
    correction[0][0] = correction[0][1] = 1.f;
  } else {
    // Beside this warpgroup's P_{j-1} V_{j-1} wgmma, whose registers it leaves alone (a
    // wgmma wait, taken by one warp, would break wait_group's warpgroup-wide rule).
    if (!Traits::kE4m3 && settled) {
      recompute_warp_scores<Elem, Traits>(s_acc, w.q_tile, smem, stage, lane, warp);
      cap_scores();
      if constexpr (Traits::kBiasAndMask) bias_and_mask().apply(s_acc, w.t, j, interior);
    }
    // kAlibi: the term on the landed scores or the recomputed ones, at one site (added again
    // after a recompute, its operands were hoisted over the recompute: ptxas spilled).
    add_alibi(w, kt);
    // kBiasAndMask: the bounds are applied already.
    if constexpr (Traits::kBiasAndMask) interior = true;
    // A half-seen last tile (half_last) is masked and exponentiated on its first half
    // alone: no row of this warpgroup sees the rest, and its O += P V reads only the first
    // half of P. On a causal diagonal with 128-key tiles and 128-row blocks, that is
    // warpgroup 0's last tile in every block (docs/decisions/half-seen-last-key-tile.md).
    if (w.half_last && j == w.wg_tiles - 1)
      mask_and_exponentiate<kNTiles / 2>(w, kt, stage, interior, one_doc, correction);
    else
      mask_and_exponentiate<kNTiles>(w, kt, stage, interior, one_doc, correction);
  }
  // One release site after both paths: releasing K_j before the full update where no
  // recompute can follow spills (docs/decisions/hopper-kernels-without-spills.md).
  release(bars.k_empty[stage]);
  stage_next(w, j + 1);
}

// kStagedTerm: the warp's rows of key tile j copied into its buffer, once both paths of the
// tile before are done reading it (the copies land under that tile's O += P V and the next
// tile's S = Q K^T), and those of tile j + 1 brought into L2.
template <typename Elem, typename Traits>
__device__ __forceinline__ void ForwardConsumer<Elem, Traits>::stage_next(const ConsumerTile& w,
                                                                         int j) const {
  if constexpr (Traits::kStagedTerm)
    if (j < w.wg_tiles)
      bias_and_mask().stage_tile(w.term_row, w.t, j, j + 1 < w.wg_tiles);
}

}  // namespace jax_flashattn::wgmma
