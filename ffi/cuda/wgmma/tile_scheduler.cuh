// Work tiles of the persistent Hopper forward: one per (query block, head, batch). A block
// starts with tile blockIdx.x and then claims gridDim.x + (a global counter's next value), so
// the tiles are handed out in index order to whichever block is ready first. Consecutive tiles
// of one block share no state but the pipeline, and the producer can load the next tile's Q
// while the consumers finish the current one.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/mask.cuh"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// 32-bit indices (indices_fit_32_bits in traits.h, checked by the dispatcher and the launch):
// registers are what the consumers are short of.
struct ForwardTile {
  int b, n, kv_head;
  int row0;          // first query row of the block
  int tile_begin;    // first K/V tile the block visits
  int num_kv_tiles;  // 0 when no row of the block sees a key
  variant::KeyWindow<int> vis;
};

// A claimed tile as the producer hands it to the consumers: 32 bytes of shared memory (16-byte
// aligned), decoded once by the producer, whose thread mostly waits on barriers. Decoded by each
// consumer from the tile index, its divisions and 64-bit bounds would sit on the consumers'
// critical path (docs/decisions/hopper-forward-tile-hand-over.md).
// b = -1 says that the block has no more tiles.
struct TileSlot {
  __device__ static void store(uint32_t address, const ForwardTile& t) {
    ptx::st_shared_v4_b32(address, uint32_t(t.b), uint32_t(t.n), uint32_t(t.kv_head),
                          uint32_t(t.row0));
    ptx::st_shared_v4_b32(address + 16, uint32_t(t.tile_begin), uint32_t(t.num_kv_tiles),
                          uint32_t(t.vis.q_len), uint32_t(t.vis.kv_len));
  }
  __device__ static void store_end(uint32_t address) {
    ptx::st_shared_v4_b32(address, uint32_t(-1), 0, 0, 0);
  }
  // The tile in the slot, with the windows of `call` (KeyWindow<int>::make(p), made once; the
  // consumers move them to the entry's under AttentionParams::align_window_to_lengths:
  // ForwardConsumer::tile_window); false when the slot says there is none. Every lane loads
  // the same words; a warp reduction of each says so to ptxas, which then keeps the tile in
  // uniform registers and its loop bounds' branches uniform (loaded plainly, the eight words
  // take vector registers; docs/decisions/hopper-forward-tile-hand-over.md).
  __device__ static bool load(uint32_t address, const variant::KeyWindow<int>& call,
                              ForwardTile& t) {
    uint32_t w[4], x[4];
    ptx::ld_shared_v4_b32(address, w);
    ptx::ld_shared_v4_b32(address + 16, x);
    const auto uniform = [](uint32_t v) { return __reduce_max_sync(0xffffffff, int(v)); };
    t.b = uniform(w[0]);
    t.n = uniform(w[1]);
    t.kv_head = uniform(w[2]);
    t.row0 = uniform(w[3]);
    t.tile_begin = uniform(x[0]);
    t.num_kv_tiles = uniform(x[1]);
    t.vis = call;
    t.vis.q_len = uniform(x[2]);
    t.vis.kv_len = uniform(x[3]);
    return t.b >= 0;
  }
};

// kSpans: each block's key tiles narrowed to the spans of its rows (the segment ids' documents,
// the mask's kept keys; kNarrowsToSpans). kOrdered: the tiles handed out in the call's tile
// order where it has one (AttentionParams::tile_order, written by tile_order.cuh).
template <int kBlockM, int kBlockN, bool kSpans = false, bool kOrdered = false>
struct TileScheduler {
  int m_blocks, heads_times_batch, num_tiles;
  // Query heads per K/V head, divided once here: divided per tile, the 64-bit division would
  // be a subroutine call in the producer's tile loop, around which ptxas would spill the
  // producer's tile counter within its 24 registers
  // (docs/decisions/hopper-forward-tile-hand-over.md).
  int group_size;

  __device__ static TileScheduler make(const AttentionParams& p) {
    TileScheduler s;
    s.m_blocks = int((p.seqlen_q + kBlockM - 1) / kBlockM);
    s.heads_times_batch = int(p.batch * p.num_heads);
    s.num_tiles = s.m_blocks * s.heads_times_batch;
    s.group_size = int(p.group_size());
    return s;
  }

  // The query blocks of one (batch, head) are consecutive, highest first, so the blocks
  // running at the same time share their K/V in L2 (ordered over every head first, each K/V
  // is read from HBM once per query block). Highest first is longest first under causal
  // masking, and with tiles claimed on demand the short ones fill in the ends (handed out
  // round-robin instead, some blocks draw mostly long tiles). Why, with measurements:
  // docs/decisions/hopper-forward-persistent-tile-schedule.md.
  __device__ ForwardTile tile(const AttentionParams& p, int index) const {
    if constexpr (kOrdered)
      if (p.tile_order != nullptr) index = p.tile_order[index];
    ForwardTile t;
    const int bh = index / m_blocks, heads = int(p.num_heads);
    t.b = bh / heads;
    t.n = bh % heads;
    t.kv_head = t.n / group_size;
    t.row0 = (m_blocks - 1 - index % m_blocks) * kBlockM;
    t.vis = variant::KeyWindow<int>::make(p, t.b);
    int key_lo, key_hi;
    t.vis.key_range(t.row0, t.row0 + kBlockM, key_lo, key_hi);
    if constexpr (kSpans)
      variant::VisibleSpans::keys_of_rows(p, t.b).narrow(t.row0, t.row0 + kBlockM, key_lo, key_hi);
    t.tile_begin = key_hi > key_lo ? key_lo / kBlockN : 0;
    t.num_kv_tiles = key_hi > key_lo ? (key_hi + kBlockN - 1) / kBlockN - t.tile_begin : 0;
    return t;
  }
};

}  // namespace jax_flashattn::wgmma
