// FlashAttention forward for Hopper (sm_90a): TMA loads, wgmma, warp specialisation.
//
// Persistent: one block per SM walks the (kBlockM-row query block, head, batch) tiles of
// TileScheduler, claiming each next tile from a global counter when it is ready for one, so
// that blocks that drew short (causal) tiles take more of them. The kernel is the pipeline's
// setup and the split between its two roles:
//   warpgroup 0    the producer (forward_producer.cuh): one thread claims the tiles, hands
//                  them to the consumers through a shared-memory slot and issues every TMA
//                  load, Q into a ring of kQStages buffers and K_j, V_j into a ring of kStages
//   warpgroups 1.. the consumers (forward_consumer.cuh), 64 query rows each (two, or three at
//                  head dim 64): S = Q K^T and O += P V by wgmma with the online softmax
//                  between, taking turns to issue their products, and the epilogue
//                  (forward_epilogue.cuh)
// over the shared memory, mbarriers and named barriers of forward_pipeline.cuh. Every buffer
// has a full barrier (the load landed) and an empty barrier (every consumer warp is done with
// it). The consumers do not meet between tiles: the one that finishes first starts the next
// tile while the others finish theirs.
#pragma once

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/cuda/wgmma/forward_consumer.cuh"
#include "ffi/cuda/wgmma/forward_pipeline.cuh"
#include "ffi/cuda/wgmma/forward_producer.cuh"
#include "ffi/cuda/wgmma/traits.h"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

template <typename Elem, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    forward_kernel(const __grid_constant__ AttentionParams p,
                   const __grid_constant__ ForwardMapsFor<Traits::kSegments> maps) {
#ifdef JAX_FLASHATTN_SM90_BODY
  static_assert(register_budgets_fit<Traits>(), "setmaxnreg would wait forever");
  static_assert(sizeof(ForwardBarriers<Traits>) <= Traits::kBarrierBytes, "barriers fit");
  extern __shared__ unsigned char smem_raw[];
  const auto smem = ForwardSmem<Traits>::make(smem_raw);
  // Formed here from the layout's offset, as before the kernel was split into its pieces
  // (through a member function of ForwardSmem, ptxas then scheduled the consumer loop
  // differently); the pieces take it by reference.
  auto& bars = *reinterpret_cast<ForwardBarriers<Traits>*>(smem.start +
                                                           ForwardSmem<Traits>::kBarrierOffset);

  const int tid = threadIdx.x;

  if (tid == 0) {
    for (int s = 0; s < Traits::kQStages; ++s) {
      ptx::mbarrier_init(barrier_address(bars.q_full[s]), 1);
      ptx::mbarrier_init(barrier_address(bars.q_empty[s]), Traits::kConsumerWarps);
    }
    for (int s = 0; s < Traits::kStages; ++s) {
      ptx::mbarrier_init(barrier_address(bars.k_full[s]), 1);
      ptx::mbarrier_init(barrier_address(bars.v_full[s]), 1);
      ptx::mbarrier_init(barrier_address(bars.k_empty[s]), Traits::kConsumerWarps);
      ptx::mbarrier_init(barrier_address(bars.v_empty[s]), Traits::kConsumerWarps);
    }
    ptx::mbarrier_init(barrier_address(bars.tile_full), 1);
    ptx::mbarrier_init(barrier_address(bars.tile_empty), 128 * Traits::kConsumers);
    ptx::fence_barrier_init();
  }
  __syncthreads();

  const int warpgroup = tid / 128;
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<Traits::kProducerRegisters>();
    if (tid == 0) ForwardProducer<Traits>(p, maps, smem, bars).run();
    return;
  }
  ptx::setmaxnreg_inc<Traits::kConsumerRegisters>();
  // The consumer index through a warp reduction, whose result ptxas knows to be the same in
  // every lane: the tile loop's branches are then known uniform too, and ptxas keeps the tile
  // counter, the K/V ring and each tile's indices in uniform registers. From tid alone nothing
  // tells ptxas that the warp stays converged through the loop: those take general registers
  // and spill with three consumers (docs/decisions/hopper-forward-tile-hand-over.md).
  const int consumer = __reduce_max_sync(0xffffffff, warpgroup - 1);
  ForwardConsumer<Elem, Traits>(p, maps, smem, bars, tid, consumer).run();
#endif
}

}  // namespace jax_flashattn::wgmma
