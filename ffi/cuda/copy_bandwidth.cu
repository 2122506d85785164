// The decode kernels are judged against 85% of the card's measured copy bandwidth, and H200s
// differ by a few percent in it, so the benchmark measures it in its own process with the copy
// that target means: cudaMemcpy device to device (XLA's own copy of a jax array ran ~4%
// slower on an H200, which would flatter the ratio; docs/decisions/decode-benchmark-yardstick.md).
// Never called from an FFI handler: it allocates and synchronises.
#include "ffi/cuda/copy_bandwidth.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace jax_flashattn::cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("copy bandwidth: ") + what + ": " +
                             cudaGetErrorString(e));
}

// Everything the measurement creates, released on every path out (a throw included), with
// the caller's device made current again last.
struct Resources {
  int caller = -1;
  void* src = nullptr;
  void* dst = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;

  ~Resources() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
    if (src) cudaFree(src);
    if (dst) cudaFree(dst);
    if (caller >= 0) cudaSetDevice(caller);
  }
};

}  // namespace

CopyBandwidth measure_copy_bandwidth(int device, size_t bytes, int runs) {
  if (bytes == 0 || runs < 1)
    throw std::invalid_argument("copy bandwidth: bytes and runs must be positive");
  Resources r;
  check(cudaGetDevice(&r.caller), "cudaGetDevice");
  check(cudaSetDevice(device), "cudaSetDevice");
  check(cudaMalloc(&r.src, bytes), "cudaMalloc");
  check(cudaMalloc(&r.dst, bytes), "cudaMalloc");
  check(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaEventCreate(&r.start), "cudaEventCreate");
  check(cudaEventCreate(&r.stop), "cudaEventCreate");
  // Written once so that every page is backed before the timed copies.
  check(cudaMemsetAsync(r.src, 1, bytes, r.stream), "cudaMemsetAsync");
  check(cudaMemsetAsync(r.dst, 0, bytes, r.stream), "cudaMemsetAsync");
  check(cudaMemcpyAsync(r.dst, r.src, bytes, cudaMemcpyDeviceToDevice, r.stream),
        "cudaMemcpyAsync");
  std::vector<float> ms(runs);
  for (float& t : ms) {
    check(cudaEventRecord(r.start, r.stream), "cudaEventRecord");
    check(cudaMemcpyAsync(r.dst, r.src, bytes, cudaMemcpyDeviceToDevice, r.stream),
          "cudaMemcpyAsync");
    check(cudaEventRecord(r.stop, r.stream), "cudaEventRecord");
    check(cudaEventSynchronize(r.stop), "cudaEventSynchronize");
    check(cudaEventElapsedTime(&t, r.start, r.stop), "cudaEventElapsedTime");
  }
  std::sort(ms.begin(), ms.end());
  const double moved = 2.0 * double(bytes);
  return {moved / (ms[ms.size() / 2] * 1e-3), moved / (ms.front() * 1e-3)};
}

}  // namespace jax_flashattn::cuda
