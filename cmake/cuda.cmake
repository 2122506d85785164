# The CUDA part: found or skipped per JAX_FLASHATTN_CUDA, architectures per
# JAX_FLASHATTN_CUDA_ARCHS, linked statically against cudart so the module needs only the driver.
include(CheckLanguage)

if(JAX_FLASHATTN_CUDA STREQUAL "OFF")
  message(STATUS "jax_flashattn: CUDA kernels disabled (JAX_FLASHATTN_CUDA=OFF)")
  return()
endif()

# Pick the architectures before enable_language(CUDA), which would otherwise probe its own.
if(JAX_FLASHATTN_CUDA_ARCHS)
  set(_archs "${JAX_FLASHATTN_CUDA_ARCHS}")
elseif(DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(_archs "${CMAKE_CUDA_ARCHITECTURES}")
else()
  execute_process(COMMAND nvidia-smi --query-gpu=compute_cap --format=csv,noheader
                  OUTPUT_VARIABLE _caps RESULT_VARIABLE _smi_failed ERROR_QUIET
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(_archs "")
  if(NOT _smi_failed AND _caps)
    string(REPLACE "\n" ";" _caps "${_caps}")
    foreach(_cap IN LISTS _caps)
      string(REPLACE "." "" _arch "${_cap}")
      # Hopper's wgmma/setmaxnreg exist only in the arch-specific sm_90a target.
      if(_arch STREQUAL "90")
        set(_arch "90a")
      endif()
      list(APPEND _archs "${_arch}")
    endforeach()
    list(REMOVE_DUPLICATES _archs)
  endif()
  if(NOT _archs)
    set(_archs "80;90a")
  endif()
endif()
set(CMAKE_CUDA_ARCHITECTURES "${_archs}")

check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(JAX_FLASHATTN_CUDA STREQUAL "ON")
    message(FATAL_ERROR "jax_flashattn: JAX_FLASHATTN_CUDA=ON but no CUDA compiler was found")
  endif()
  message(STATUS "jax_flashattn: no CUDA compiler found, building the CPU kernels only")
  return()
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
message(STATUS "jax_flashattn: CUDA kernels for architectures ${CMAKE_CUDA_ARCHITECTURES}")

# The kernels themselves build in the kernels project (cmake/kernels/); here the handlers, which
# decode XLA's call frames.
set(JAX_FLASHATTN_WITH_CUDA ON)
add_library(flashattn_cuda STATIC ffi/handlers_cuda.cu)
target_link_libraries(flashattn_cuda PUBLIC flashattn_cpu flashattn_cuda_kernels)
target_compile_options(flashattn_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Xptxas=-warn-spills>)

target_link_libraries(_jax_flashattn PRIVATE flashattn_cuda)
# Commas, not CMake's semicolons, which a compiler command line would split on.
string(REPLACE ";" "," _archs_csv "${CMAKE_CUDA_ARCHITECTURES}")
target_compile_definitions(_jax_flashattn PRIVATE
  JAX_FLASHATTN_WITH_CUDA JAX_FLASHATTN_CUDA_ARCHS="${_archs_csv}")
