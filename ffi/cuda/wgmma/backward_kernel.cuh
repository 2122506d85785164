// FlashAttention backward for Hopper (sm_90a), dK/dV/dQ in one pass: TMA loads, wgmma, warp
// specialisation (FlashAttention-3's structure).
//
// One block per (128-key block, kv head, batch); its steps are the (query head of the GQA
// group, query tile) pairs that can see the block's keys (BackwardBlock). The kernel is the
// pipeline's setup and the split between its roles:
//   warpgroup 0    the producer (backward_producer.cuh): one thread loads K and V of the block
//                  once, then each step's Q and dO tiles with the tile's lse and D into a ring
//                  of kStages buffers; in deterministic mode (BackwardDeterministic) a thread
//                  of its second warp is the dQ writer, which adds each step's dQ into dq_accum
//                  in the tile's turn (backward_dq_writer.cuh); with a staged bias or mask
//                  (BackwardWithStagedTerm) its third warp copies each step's tile of it
//   warpgroups 1.. the consumers (backward_consumer.cuh), 64 keys each (above head dim 128 the
//                  same 64 keys, some of the head-dim columns each; at 192 unevenly, each
//                  consumer on code of its own): per step S^T and dP^T by
//                  wgmma, P^T and dS^T in registers, dV and dK accumulated, and dQ added into
//                  its float32 accumulator; at the end dK and dV are stored
//                  (backward_epilogue.cuh)
// over the shared memory, mbarriers and block work of backward_pipeline.cuh. Every ring buffer
// has a full barrier (the loads landed) and an empty barrier (every consumer warp is done with
// it).
#pragma once

#include <cstdint>

#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/cuda/wgmma/backward_consumer.cuh"
#include "ffi/cuda/wgmma/backward_dq_writer.cuh"
#include "ffi/cuda/wgmma/backward_pipeline.cuh"
#include "ffi/cuda/wgmma/backward_producer.cuh"
#include "ffi/cuda/wgmma/backward_traits.h"
#include "ffi/cuda/wgmma/traits.h"  // register_budgets_fit
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

template <typename Elem, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    backward_kernel(const __grid_constant__ AttentionParams p,
                    const __grid_constant__ BackwardMapsFor<Traits::kSegments> maps) {
#ifdef JAX_FLASHATTN_SM90_BODY
  static_assert(register_budgets_fit<Traits>(), "setmaxnreg would wait forever");
  extern __shared__ unsigned char smem_raw[];
  using Layout = BackwardSmemLayout<Traits>;
  const uint32_t raw_address = ptx::smem_address(smem_raw);
  const uint32_t base = (raw_address + kGroupBytes - 1) & ~(kGroupBytes - 1);
  const BackwardSmem<Traits> smem{base, smem_raw + (base - raw_address)};
  // Formed here and in each piece from the layout's offset (BackwardProducer says why).
  auto& bars = *reinterpret_cast<BackwardBarriers<Traits>*>(smem.start + Layout::kBarrierOffset);

  const int tid = threadIdx.x;
  const BackwardBlock<Traits> block = BackwardBlock<Traits>::make(p);

  if (tid == 0) {
    ptx::mbarrier_init(ptx::barrier_address(bars.kv_full), 1);
    for (int s = 0; s < Traits::kStages; ++s) {
      ptx::mbarrier_init(ptx::barrier_address(bars.q_full[s]), Traits::kQFullArrivals);
      ptx::mbarrier_init(ptx::barrier_address(bars.q_empty[s]), Traits::kConsumerWarps);
    }
    if constexpr (Traits::kDeterministic) {
      static_assert(sizeof(DqWriterBarriers) <= Traits::kWriterBarrierBytes, "barriers fit");
      for (int c = 0; c < Traits::kConsumers; ++c) {
        ptx::mbarrier_init(smem.dq_done(c), 4);
        ptx::mbarrier_init(smem.dq_free(c), 1);
      }
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  const int warpgroup = tid / 128;
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<Traits::kProducerRegisters>();
    if (tid == 0) BackwardProducer<Traits>{p, maps, smem, block}.run();
    if constexpr (Traits::kStagedTerm)
      if (tid / 32 == 2) BackwardProducer<Traits>{p, maps, smem, block}.copy_terms(tid % 32);
    if constexpr (Traits::kDeterministic)
      if (tid == 32)
        write_dq_in_order<Traits>(p, maps, block, smem.writer_barriers(), smem.dq(0));
    return;
  }
  // The consumer index from the warpgroup index formed above: formed from tid in the consumer,
  // it changed the consumers' schedule (compare_sass).
  ptx::setmaxnreg_inc<Traits::kConsumerRegisters>();
  if constexpr (Traits::kUnevenSplit) {
    if (warpgroup == 1)
      BackwardConsumer<Elem, Traits, 0>{p, maps, smem, block}.run(tid, 0);
    else
      BackwardConsumer<Elem, Traits, 1>{p, maps, smem, block}.run(tid, 1);
  } else {
    BackwardConsumer<Elem, Traits>{p, maps, smem, block}.run(tid, warpgroup - 1);
  }
#endif
}

}  // namespace jax_flashattn::wgmma
