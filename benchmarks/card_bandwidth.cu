// The GPU's own memory bandwidth, the yardstick of the decode rows (the decode kernels aim to
// read K/V at no less than 85% of the card's measured copy bandwidth:
// docs/decisions/decode-benchmark-yardstick.md): cudaMemcpy device to device of 2 GiB (bytes
// read plus bytes written per second) and a streaming read of 4 GiB (16-byte loads,
// grid-stride, folded into a value the kernel keeps), median and best of 10 runs.
//
//     nvcc -O3 -arch=native -o card_bandwidth benchmarks/card_bandwidth.cu && ./card_bandwidth
//
// The benchmark measures the same copy in its own process (ffi/cuda/copy_bandwidth.cu); this
// program keeps its own copy loop because its read rows follow copies from the buffer they
// read: built on that function (copies of other buffers first), its 4-block read row read ~12%
// lower on an H200, the 8- and 16-block rows the same.
//
// H200s differ by a few percent in both (4.24-4.27 against 4.22-4.25 TB/s copy, 4.41-4.47
// against 4.48-4.56 read, on 2026-11-25), so compare a decode row with the number of the card it
// ran on.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

// Reads n 16-byte words once (streaming: no reuse to keep in L2) and stores their fold only if
// it equals a value it practically never does, so the loads are not dead code.
__global__ void read_kernel(const uint4* x, size_t n, unsigned* sink) {
  unsigned fold = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(x + i);
    fold ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (fold == 0x9e3779b9u) sink[0] = fold;
}

// Runs f once untimed, then 10 times between events; prints bytes / time as TB/s.
template <typename F>
void report(const char* name, double bytes, F f) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  f();
  check(cudaDeviceSynchronize(), name);
  std::vector<float> ms(10);
  for (float& t : ms) {
    check(cudaEventRecord(start), "cudaEventRecord");
    f();
    check(cudaEventRecord(stop), "cudaEventRecord");
    check(cudaEventSynchronize(stop), name);
    check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
  }
  std::sort(ms.begin(), ms.end());
  std::printf("%-40s median %.3f TB/s, best %.3f TB/s\n", name, bytes / (ms[5] * 1e9),
              bytes / (ms[0] * 1e9));
}

}  // namespace

int main() {
  constexpr size_t kCopyBytes = size_t(2) << 30, kReadBytes = size_t(4) << 30;
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  char *src = nullptr, *dst = nullptr;
  unsigned* sink = nullptr;
  check(cudaMalloc(&src, kReadBytes), "cudaMalloc");
  check(cudaMalloc(&dst, kCopyBytes), "cudaMalloc");
  check(cudaMalloc(&sink, sizeof(unsigned)), "cudaMalloc");
  check(cudaMemset(src, 1, kReadBytes), "cudaMemset");
  check(cudaMemset(dst, 0, kCopyBytes), "cudaMemset");

  report("memcpy device to device (read + write)", 2.0 * kCopyBytes, [&] {
    check(cudaMemcpyAsync(dst, src, kCopyBytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
  });
  for (int blocks_per_sm : {4, 8, 16}) {
    char name[64];
    std::snprintf(name, sizeof(name), "read, %d blocks of 512 per SM", blocks_per_sm);
    report(name, double(kReadBytes), [&] {
      read_kernel<<<prop.multiProcessorCount * blocks_per_sm, 512>>>(
          reinterpret_cast<const uint4*>(src), kReadBytes / sizeof(uint4), sink);
      check(cudaGetLastError(), "read_kernel");
    });
  }
  check(cudaFree(src), "cudaFree");
  check(cudaFree(dst), "cudaFree");
  check(cudaFree(sink), "cudaFree");
  return 0;
}
