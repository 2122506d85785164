// The device's copy bandwidth, the yardstick the benchmark sets beside its decode rows.
#pragma once

#include <cstddef>

namespace jax_flashattn::cuda {

struct CopyBandwidth {
  double median_bytes_per_s;  // bytes read plus bytes written, per second
  double best_bytes_per_s;
};

// Times `runs` (at least 1) cudaMemcpyAsync device-to-device copies of `bytes` on CUDA device
// `device` after one untimed copy. Allocates and frees its own buffers (2 x `bytes`) and
// stream; leaves the current device alone. Throws std::runtime_error when CUDA fails.
CopyBandwidth measure_copy_bandwidth(int device, size_t bytes, int runs);

}  // namespace jax_flashattn::cuda
