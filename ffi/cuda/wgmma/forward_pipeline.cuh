// The Hopper forward's pipeline state, shared by its producer (forward_producer.cuh) and its
// consumers (forward_consumer.cuh): the shared-memory layout, the mbarriers of the Q and K/V
// rings and of the tile slot, the named barriers of the consumers, and the position in a ring.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"

namespace jax_flashattn::wgmma {

template <typename Traits>
struct ForwardBarriers {
  uint64_t q_full[Traits::kQStages], q_empty[Traits::kQStages];
  uint64_t k_full[Traits::kStages], v_full[Traits::kStages];
  uint64_t k_empty[Traits::kStages], v_empty[Traits::kStages];
  // The block's k-th tile (TileSlot), handed from the producer to the consumers: written
  // before tile_full completes phase k, and read by every consumer thread before it arrives on
  // tile_empty, which the next write waits for. Each thread arrives after its own read, which
  // keeps racecheck clean (one arrival per warp after __syncwarp did not:
  // docs/decisions/hopper-forward-tile-hand-over.md).
  uint64_t tile_full, tile_empty;
  alignas(16) uint32_t tile[8];
};

using ptx::barrier_address;

// Named barriers (0 is __syncthreads): 1 + c synchronises consumer warpgroup c, and kTurn + c
// hands it the ping-pong turn.
template <int kConsumers>
struct NamedBarriers {
  static constexpr int kTurn = 1 + kConsumers;
  static_assert(kTurn + kConsumers <= 16, "16 named barriers per block");
};

// Where a barrier ring stands: the n-th use of a kStages ring is stage n % kStages, and its
// full barrier completes phase (n / kStages) for it; the producer refilling use n waits for the
// empty barrier's phase of use n - kStages.
template <int kStages>
struct RingPosition {
  // Unsigned: with a power-of-two kStages, % and / are a mask and a shift. It wraps after
  // 2^32 uses, which no call comes near (one block would run for over half an hour).
  uint32_t count = 0;
  __device__ int stage() const { return int(count % kStages); }
  __device__ uint32_t phase() const { return uint32_t(count / kStages) & 1; }
  __device__ bool refill() const { return count >= kStages; }
  __device__ uint32_t previous_phase() const { return uint32_t(count / kStages - 1) & 1; }
};

// The dynamic shared memory, with tiles at 1024-byte boundaries (the 128-byte swizzle's
// period): Q stages, O (unless staged in the K/V ring), K stages, V stages, the key ids of each
// K stage (segment ids; 128-byte aligned, as TMA writes them), each consumer warp's staging
// buffer for the bias or mask (WithStagedTerm), then the barriers
// (ForwardBarriers at start + kBarrierOffset). Addresses are 32-bit shared addresses.
template <typename Traits>
struct ForwardSmem {
  static constexpr uint32_t kOOffset = Traits::kQStages * Traits::kQBytes;
  static constexpr uint32_t kKVOffset = kOOffset + Traits::kOBytes;
  static constexpr uint32_t kKeyIdsOffset = kKVOffset + 2 * Traits::kStages * Traits::kKVBytes;
  static constexpr uint32_t kTermStagesOffset =
      kKeyIdsOffset + Traits::kStages * Traits::KeyIdBox::kStageBytes;
  static constexpr uint32_t kBarrierOffset =
      kTermStagesOffset + Traits::kConsumerWarps * Traits::kTermStageBytes;

  uint32_t base;          // the aligned start
  unsigned char* start;   // the same, as a generic pointer

  __device__ static ForwardSmem make(unsigned char* raw) {
    const uint32_t raw_address = ptx::smem_address(raw);
    ForwardSmem s;
    s.base = (raw_address + kGroupBytes - 1) & ~(kGroupBytes - 1);
    s.start = raw + (s.base - raw_address);
    return s;
  }
  __device__ uint32_t q(int stage) const { return base + stage * Traits::kQBytes; }
  __device__ uint32_t o() const { return base + kOOffset; }
  __device__ uint32_t k(int stage) const { return base + kKVOffset + stage * Traits::kKVBytes; }
  __device__ uint32_t v(int stage) const {
    return base + kKVOffset + (Traits::kStages + stage) * Traits::kKVBytes;
  }
  __device__ uint32_t key_ids(int stage) const {
    return base + kKeyIdsOffset + stage * Traits::KeyIdBox::kStageBytes;
  }
  // Consumer warp w's staging buffer for the bias or mask (WithStagedTerm; 16-byte aligned).
  __device__ uint32_t term_stage(int w) const {
    return base + kTermStagesOffset + w * Traits::kTermStageBytes;
  }
};

}  // namespace jax_flashattn::wgmma
