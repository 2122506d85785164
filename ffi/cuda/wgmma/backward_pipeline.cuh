// The Hopper backward's pipeline state, shared by its producer (backward_producer.cuh) and its
// consumers (backward_consumer.cuh): the mbarriers, the block's work, and the shared memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ffi/cuda/common/mask.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/wgmma/backward_traits.h"  // kBackwardConsumers
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

template <typename Traits>
struct BackwardBarriers {
  uint64_t kv_full;
  uint64_t q_full[Traits::kStages], q_empty[Traits::kStages];
};

// Between the consumers and the dQ writer of the deterministic mode (BackwardDeterministic),
// per consumer c: dq_done[c], one arrival per warp: its dQ of the step is staged (or, not
// staged, added into dq_accum); dq_free[c], the writer's one arrival: the staging tile has been
// read by the reductions (or, not staged, the tile's turn has come and the warps may add).
// Both sides address them by 32-bit shared address from the struct's own (`self`).
struct DqWriterBarriers {
  uint64_t dq_done[kBackwardConsumers], dq_free[kBackwardConsumers];

  __device__ static uint32_t done_at(uint32_t self, int consumer) {
    return self + uint32_t(offsetof(DqWriterBarriers, dq_done)) + 8 * consumer;
  }
  __device__ static uint32_t free_at(uint32_t self, int consumer) {
    return self + uint32_t(offsetof(DqWriterBarriers, dq_free)) + 8 * consumer;
  }
};

// Lengths and window of batch entry b, the same for every head (no elementwise mask on this
// kernel, the dispatcher's rule: saying so drops its tests). Rebuilt where needed rather than
// kept: its 64-bit fields would hold eight of the consumers' registers through the tile loop
// (docs/decisions/hopper-kernels-without-spills.md).
__device__ __forceinline__ cuda::Visibility block_visibility(const AttentionParams& p, int b) {
  cuda::Visibility vis = cuda::Visibility::make(p, b, 0);
  vis.mask.keep = nullptr;
  return vis;
}

// Deterministic mode: the key blocks that see a query tile add their dQ of it one at a time, in
// descending key order where the right side of the window is bounded (causal): block kb adds
// first to the tiles on its diagonal, which no block above it sees, and meets each later tile
// after block kb + 1, which met it a step or two earlier, so a block waits for one that is
// ahead of it. Without that bound every block starts on the same tiles and the order is
// ascending. BackwardBlock launches the blocks in that order within each (batch, kv head), so
// that a block only waits for blocks launched before it, which hold an SM or are done, never
// for one that cannot start while the waiting blocks hold every SM: this rests on the hardware
// dispatching a grid's blocks in blockIdx order, which CUDA does not promise but every
// architecture so far does (FlashAttention-3's deterministic mode rests on it too).
// The call's side decides for every batch entry: align_window_to_lengths moves a bounded side
// per entry (dq_turn counts with the entry's) and leaves an open one open.
__device__ __forceinline__ bool dq_order_descending(const AttentionParams& p) {
  return p.window_right != kUnboundedWindow;
}

// How many key blocks add their dQ of query tile `tile` before the block whose keys start at
// key0. The blocks that see the tile are exactly those holding keys of its key_range: a block
// visits tile m iff its query_range meets m's rows, and query_range (BackwardBlock) and
// key_range decide the same test on (rows, keys), one transposed, so the order counts no block
// that never arrives. Anything that narrows one side only (segment ids' spans) would break
// that: BackwardDeterministic excludes them. `window`: batch entry b's in 32 bits (the launch
// checks indices_fit_32_bits), fewer of the dQ writer's 24 registers than the 64-bit one's.
template <typename Traits>
__device__ __forceinline__ int dq_turn(const AttentionParams& p,
                                       const variant::KeyWindow<int>& window, int key0, int tile) {
  int lo, hi;
  window.key_range(tile * Traits::kBlockM, (tile + 1) * Traits::kBlockM, lo, hi);
  const int key_block = key0 / Traits::kBlockN;
  return dq_order_descending(p) ? (hi + Traits::kBlockN - 1) / Traits::kBlockN - 1 - key_block
                                : key_block - lo / Traits::kBlockN;
}

// The work of one block: its keys and the (query head, Q tile) steps that can see them (with
// segment ids or a mask, only the tiles their spans allow), heads outermost (head0 + step /
// tiles, tile_begin + step % tiles), the same for producer and consumers. 32-bit indices: the
// dispatcher checks indices_fit_32_bits.
template <typename Traits>
struct BackwardBlock {
  int b, kv_head, key0;
  int head0, tile_begin, tiles, steps;

  __device__ static BackwardBlock make(const AttentionParams& p) {
    // The key blocks of one (batch, kv head) are consecutive, so the blocks running together
    // stream the same Q and dO tiles through L2. Under a causal mask or a window the blocks'
    // work differs (the lowest key block sees the most queries), and in a grid of a few waves
    // (at most 4 blocks per SM) the last (batch, kv head)'s longest blocks would start late and
    // run alone at the end: there the key block is outermost, so every (batch, kv head)'s
    // longest blocks run first and the grid ends on short ones. With more waves that tail is
    // small and the L2 reuse worth more, unless the pairs are few (at most a quarter of the
    // SMs: GQA groups, long sequences): then the blocks running together with the key block
    // outermost are still several consecutive key blocks of each pair (measured in
    // docs/decisions/backward-kernels.md). In deterministic mode under a bounded right window
    // the key blocks run in reverse (dq_order_descending), shortest first. With segment ids
    // they run in the call's block order where it has one (tile_order.cuh: the long blocks in
    // this index order, then the short ones by length).
    const int key_blocks = int((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN);
    const int groups = int(p.batch * p.num_kv_heads);
    int index = int(blockIdx.x);
    const int sms = int(ptx::sm_id_count());
    bool key_block_outer = !p.unwindowed() && (int(gridDim.x) <= 4 * sms || 4 * groups <= sms);
    if constexpr (Traits::kSegments)
      if (p.block_order != nullptr) {
        index = p.block_order[index];
        key_block_outer = false;
      }
    const int bh = key_block_outer ? index % groups : index / key_blocks;
    int key_block = key_block_outer ? index / groups : index % key_blocks;
    if constexpr (Traits::kDeterministic)  // the order of the dQ additions (dq_turn)
      if (dq_order_descending(p)) key_block = key_blocks - 1 - key_block;
    return at(p, bh, key_block);
  }
  // Key block key_block of (batch entry, kv head) pair bh.
  __device__ static BackwardBlock at(const AttentionParams& p, int bh, int key_block) {
    BackwardBlock w;
    w.key0 = key_block * Traits::kBlockN;
    w.b = bh / int(p.num_kv_heads);
    w.kv_head = bh % int(p.num_kv_heads);
    w.head0 = w.kv_head * int(p.group_size());
    int64_t t_lo, t_hi;
    block_visibility(p, w.b).query_range(w.key0, int64_t(w.key0) + Traits::kBlockN, t_lo, t_hi);
    // Only the rows the spans allow (the documents of the block's keys, the rows the mask lets
    // see them); not in ordered-dQ mode, whose dq_turn counts unnarrowed tile ranges.
    if constexpr (Traits::kSegments || (Traits::kBiasAndMask && !Traits::kDeterministic)) {
      int lo = int(t_lo), hi = int(t_hi);  // 32-bit: fewer registers than the 64-bit loop
      const int key_end = w.key0 + Traits::kBlockN;
      variant::VisibleSpans::rows_of_keys(p, w.b).narrow(w.key0, key_end, lo, hi);
      t_lo = lo;
      t_hi = hi;
    }
    w.tile_begin = int(t_lo / Traits::kBlockM);
    w.tiles = t_hi > t_lo ? int((t_hi + Traits::kBlockM - 1) / Traits::kBlockM) - w.tile_begin : 0;
    w.steps = w.tiles * int(p.group_size());
    return w;
  }
  // Row (b, n, q0) of lse and D: int32, as backward_tma_compatible checks.
  __device__ int stats_row(const AttentionParams& p, int n, int q0) const {
    return (b * int(p.num_heads) + n) * int(p.seqlen_q) + q0;
  }
};

// The backward's blocks as tile_order.cuh orders them: key blocks, their query tiles.
template <typename Traits>
struct BackwardBlockWork {
  __host__ __device__ static int units(const AttentionParams& p) {
    return int((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN);
  }
  __host__ __device__ static int heads(const AttentionParams& p) { return int(p.num_kv_heads); }
  __device__ static int tiles(const AttentionParams& p, int b, int r) {
    return BackwardBlock<Traits>::at(p, b * heads(p), r).tiles;
  }
};

// The n-th step of a block uses stage n % kStages; its full barrier completes phase
// (n / kStages) & 1, and the producer refilling it waits for the empty barrier's phase of step
// n - kStages.
template <int kStages>
__device__ __forceinline__ uint32_t step_phase(int step) {
  return uint32_t(step / kStages) & 1;
}

// The dynamic shared memory's layout, tiles at 1024-byte boundaries (the 128-byte swizzle's
// period) from the aligned start: K, V, Q stages, dO stages, dS^T buffers, the consumers' dQ
// staging tiles, then lse / D
// ([stage][0][row]: lse; [stage][1][row]: D, from the tile's first row rounded down to
// kFlatAlignElems: BackwardMaps), each stage's tile of a staged bias or mask
// (BackwardWithStagedTerm), the query ids of each stage (segment ids) and the barriers
// (BackwardBarriers, then the deterministic mode's DqWriterBarriers).
template <typename Traits>
struct BackwardSmemLayout {
  static constexpr uint32_t kQOffset = 2 * Traits::kKVBytes;
  static constexpr uint32_t kDoOffset = kQOffset + Traits::kStages * Traits::kQBytes;
  static constexpr uint32_t kDsOffset = kDoOffset + Traits::kStages * Traits::kQBytes;
  static constexpr uint32_t kDqOffset = kDsOffset + Traits::kDsBuffers * Traits::kDsBytes;
  static constexpr uint32_t kStatsOffset = kDqOffset + Traits::kConsumers * Traits::kDqBytes;
  static constexpr uint32_t kTermOffset = kStatsOffset + Traits::kStatsBytes;
  static constexpr uint32_t kQIdsOffset = kTermOffset + Traits::kStages * Traits::kTermStageBytes;
  static constexpr uint32_t kBarrierOffset =
      kQIdsOffset + Traits::kStages * Traits::QIdBox::kStageBytes;
  static constexpr uint32_t kWriterBarrierOffset = kBarrierOffset + Traits::kBarrierBytes;
};

// The shared memory by 32-bit address from its aligned start `base` (BackwardSmemLayout), and
// from `start`, the same place as a generic pointer, lse / D, which the consumers read with
// plain loads, and the barriers.
template <typename Traits>
struct BackwardSmem {
  using Layout = BackwardSmemLayout<Traits>;
  uint32_t base;
  unsigned char* start;

  __device__ uint32_t k() const { return base; }
  __device__ uint32_t v() const { return base + Traits::kKVBytes; }
  __device__ uint32_t q(int stage) const {
    return base + Layout::kQOffset + stage * Traits::kQBytes;
  }
  __device__ uint32_t d_out(int stage) const {
    return base + Layout::kDoOffset + stage * Traits::kQBytes;
  }
  __device__ uint32_t ds(int buffer) const {
    return base + Layout::kDsOffset + buffer * Traits::kDsBytes;
  }
  __device__ uint32_t dq(int consumer) const {
    return base + Layout::kDqOffset + consumer * Traits::kDqBytes;
  }
  // lse of the stage's tile ([0][row]), D kStatsStride floats after it ([1][row]).
  __device__ uint32_t stats(int stage) const {
    return base + Layout::kStatsOffset + stage * Traits::kStatsStageBytes;
  }
  __device__ const float* stats_ptr() const {
    return reinterpret_cast<const float*>(start + Layout::kStatsOffset);
  }
  // The stage's tile of a staged bias or mask (BackwardWithStagedTerm; 256-byte aligned).
  __device__ uint32_t term(int stage) const {
    return base + Layout::kTermOffset + stage * Traits::kTermStageBytes;
  }
  __device__ uint32_t q_ids(int stage) const {
    return base + Layout::kQIdsOffset + stage * Traits::QIdBox::kStageBytes;
  }
  // DqWriterBarriers, in deterministic mode only (BackwardDeterministic's kWriterBarrierBytes):
  // no bytes of it exist otherwise, and only code under Traits::kDeterministic touches it.
  __device__ uint32_t writer_barriers() const { return base + Layout::kWriterBarrierOffset; }
  __device__ uint32_t dq_done(int consumer) const {
    return DqWriterBarriers::done_at(writer_barriers(), consumer);
  }
  __device__ uint32_t dq_free(int consumer) const {
    return DqWriterBarriers::free_at(writer_barriers(), consumer);
  }
};

}  // namespace jax_flashattn::wgmma
