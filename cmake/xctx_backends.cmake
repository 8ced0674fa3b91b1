# Backend helpers. The CPU backend is always built (it is part of xctx_core); the CUDA backend is
# one more static library added by xctx_add_cuda_backend().

function(xctx_resolve_cuda)
  set(use OFF)
  if(XCTX_CUDA STREQUAL "AUTO" OR XCTX_CUDA STREQUAL "ON")
    if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
      set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc CACHE FILEPATH "" FORCE)
    endif()
    include(CheckLanguage)
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      set(use ON)
    elseif(XCTX_CUDA STREQUAL "ON")
      message(FATAL_ERROR "XCTX_CUDA=ON but no nvcc was found (looked on PATH and /usr/local/cuda)")
    endif()
  endif()
  set(XCTX_USE_CUDA ${use} PARENT_SCOPE)
  message(STATUS "xctx: CUDA backend ${use}")
endfunction()

# Adds the CUDA backend library (kernels/cuda/*.cu) and links it into `core`.
# A macro, not a function: enable_language() must run in the directory scope, or the CUDA
# rule variables it defines (CMAKE_CUDA_COMPILE_OBJECT, ...) vanish with the function scope.
# The default architectures are set before enable_language(), which would otherwise fill in
# the compiler's own default.
macro(xctx_add_cuda_backend core)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
    set(CMAKE_CUDA_ARCHITECTURES 80 90 CACHE STRING "CUDA architectures of the xctx kernels" FORCE)
  endif()
  # Shared cudart for every target from here on (tests link the CUDA objects with the C++
  # linker), matching CUDA::cudart below; otherwise cudart_static is linked alongside it.
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  file(GLOB xctx_cu_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/kernels/cuda/*.cu ${PROJECT_SOURCE_DIR}/comm/*.cu)
  # CMake < 3.26 knows no C++20 flag for nvcc (CUDA_STANDARD 20 then fails to generate); nvcc
  # >= 12 accepts -std=c++20, so teach it.
  if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION OR CMAKE_CUDA20_STANDARD_COMPILE_OPTION STREQUAL "")
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  add_library(xctx_cuda STATIC ${xctx_cu_sources})
  set_target_properties(xctx_cuda PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF
    CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}" POSITION_INDEPENDENT_CODE ON CUDA_SEPARABLE_COMPILATION OFF)
  target_include_directories(xctx_cuda PUBLIC ${PROJECT_SOURCE_DIR})
  target_compile_options(xctx_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
  target_link_libraries(xctx_cuda PUBLIC CUDA::cudart CUDA::cublas)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64 REQUIRED)
  target_link_libraries(xctx_cuda PUBLIC ${NCCL_LIBRARY} MPI::MPI_CXX glog::glog)
  target_link_libraries(${core} PUBLIC xctx_cuda)
endmacro()
