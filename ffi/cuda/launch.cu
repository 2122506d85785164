// The lock behind once_per_device (launch.h).
#include "ffi/cuda/launch.h"

#include <mutex>

namespace jax_flashattn::cuda {
namespace {

std::recursive_mutex& once_mutex() {
  static std::recursive_mutex mutex;
  return mutex;
}

}  // namespace

OnceLock::OnceLock() { once_mutex().lock(); }
OnceLock::~OnceLock() { once_mutex().unlock(); }

}  // namespace jax_flashattn::cuda
