// Segment ids in shared memory as a flat TMA box puts them there (wgmma::ForwardMapsWithIds,
// wgmma::BackwardMapsWithIds view the [batch, L] ids as one row of batch x L): the box of a
// tile whose first position `first` (a multiple of kFlatAlignElems) lies in batch entry b
// starts at the 16-byte boundary at or below b L + first, so the tile's ids begin
// (b L) % kFlatAlignElems ids into the box.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/tensor_maps.h"  // kFlatAlignElems

namespace jax_flashattn::cuda {

// The box's TMA coordinate (int32: wgmma::segment_ids_tma_compatible).
__device__ __forceinline__ int id_box_start(int b, int length, int first) {
  return (b * length + first) & -wgmma::kFlatAlignElems;
}

// Bytes from the box's start to the tile's first id.
__device__ __forceinline__ uint32_t id_box_skip_bytes(int b, int length) {
  return uint32_t(b * length) % wgmma::kFlatAlignElems * 4;
}

}  // namespace jax_flashattn::cuda
