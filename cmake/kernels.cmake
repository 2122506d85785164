# The kernels build as a project of their own (cmake/kernels/CMakeLists.txt) in <build>/kernels,
# run by this build's jax_flashattn_kernels step. scikit-build-core deletes this build's
# CMakeFiles/, where CMake keeps object files, whenever pip builds in a new isolated environment,
# which every `pip install` does: kernels compiled here were all compiled again by a second
# install. The kernels' own tree lies beside CMakeFiles/ and survives, and their compile
# commands name nothing from pip's environment, so a second install recompiles only the
# handlers and the module.
include(ExternalProject)
set(_kernels_dir "${CMAKE_BINARY_DIR}/kernels")
set(_kernel_args
  -DCMAKE_BUILD_TYPE=Release
  -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}
  -DJAX_FLASHATTN_SOURCE_DIR=${PROJECT_SOURCE_DIR}
  -DJAX_FLASHATTN_WITH_CUDA=${JAX_FLASHATTN_WITH_CUDA})
set(_kernel_libs "${_kernels_dir}/libflashattn_cpu_kernels.a")
if(JAX_FLASHATTN_WITH_CUDA)
  # "|": ExternalProject's separator for a list inside one argument.
  string(REPLACE ";" "|" _archs "${CMAKE_CUDA_ARCHITECTURES}")
  list(APPEND _kernel_args -DCMAKE_CUDA_COMPILER=${CMAKE_CUDA_COMPILER}
                           -DCMAKE_CUDA_ARCHITECTURES=${_archs})
  list(APPEND _kernel_libs "${_kernels_dir}/libflashattn_cuda_kernels.a")
endif()
ExternalProject_Add(jax_flashattn_kernels
  SOURCE_DIR "${PROJECT_SOURCE_DIR}/cmake/kernels"
  BINARY_DIR "${_kernels_dir}"
  PREFIX "${CMAKE_BINARY_DIR}/kernels-prefix"
  LIST_SEPARATOR |
  CMAKE_ARGS ${_kernel_args}
  BUILD_ALWAYS ON  # its own ninja decides what is out of date
  INSTALL_COMMAND ""
  BUILD_BYPRODUCTS ${_kernel_libs})

find_package(Threads REQUIRED)
add_library(flashattn_cpu_kernels STATIC IMPORTED GLOBAL)
set_target_properties(flashattn_cpu_kernels PROPERTIES
  IMPORTED_LOCATION "${_kernels_dir}/libflashattn_cpu_kernels.a"
  INTERFACE_INCLUDE_DIRECTORIES "${PROJECT_SOURCE_DIR}"
  INTERFACE_LINK_LIBRARIES Threads::Threads)
if(JAX_FLASHATTN_WITH_CUDA)
  add_library(flashattn_cuda_kernels STATIC IMPORTED GLOBAL)
  set_target_properties(flashattn_cuda_kernels PROPERTIES
    IMPORTED_LOCATION "${_kernels_dir}/libflashattn_cuda_kernels.a"
    INTERFACE_LINK_LIBRARIES "flashattn_cpu_kernels;CUDA::cudart_static")
endif()
add_dependencies(_jax_flashattn jax_flashattn_kernels)
