# memopt's dependencies, found the same way by memopt's own build and by find_package(memopt)
# (memopt-config.cmake includes this file). Defines the INTERFACE target memopt_deps, which
# memopt::memopt links: LibTorch (with c10_cuda on CUDA builds), fmt, nlohmann_json, and PCRE2 and
# utf8proc when found.
#
# LibTorch: the supported range is MEMOPT_TORCH_MIN..MEMOPT_TORCH_MAX (2.11: the lent GPU
# machines; 2.15: the version pinned in requirements.txt). Found, in this order, through
# Torch_DIR, CMAKE_PREFIX_PATH, or the python3 that MEMOPT_PYTHON names (scripts/deps makes
# .venv/bin/python3), whose torch.utils.cmake_prefix_path holds TorchConfig.cmake.
include_guard(GLOBAL)

set(MEMOPT_TORCH_MIN 2.11)
set(MEMOPT_TORCH_MAX 2.15)
option(MEMOPT_ALLOW_UNTESTED_TORCH "Accept a LibTorch outside ${MEMOPT_TORCH_MIN}..${MEMOPT_TORCH_MAX}" OFF)

# 1. Where is TorchConfig.cmake? Ask the project's (or the given) python when nobody said.
if(NOT MEMOPT_PYTHON AND EXISTS "${CMAKE_CURRENT_LIST_DIR}/../.venv/bin/python3")
  get_filename_component(memopt_venv_python "${CMAKE_CURRENT_LIST_DIR}/../.venv/bin/python3" ABSOLUTE)
  set(MEMOPT_PYTHON "${memopt_venv_python}" CACHE FILEPATH "The project's Python (scripts/deps: .venv)")
endif()
if(NOT Torch_DIR)
  find_path(memopt_torch_config_dir TorchConfig.cmake PATH_SUFFIXES share/cmake/Torch NO_CACHE)
  if(NOT memopt_torch_config_dir)
    if(MEMOPT_PYTHON)
      execute_process(COMMAND "${MEMOPT_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
                      OUTPUT_VARIABLE memopt_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
                      RESULT_VARIABLE memopt_rc ERROR_QUIET)
      if(memopt_rc EQUAL 0 AND EXISTS "${memopt_torch_prefix}/Torch/TorchConfig.cmake")
        set(Torch_DIR "${memopt_torch_prefix}/Torch" CACHE PATH "LibTorch's CMake package (from ${MEMOPT_PYTHON})")
      endif()
    endif()
  endif()
endif()

# 2. Check the version before TorchConfig runs: a CUDA LibTorch fails inside it without a toolkit.
find_file(memopt_torch_version_file TorchConfigVersion.cmake
          HINTS "${Torch_DIR}" PATH_SUFFIXES share/cmake/Torch NO_CACHE)
if(NOT memopt_torch_version_file)
  message(FATAL_ERROR "memopt: LibTorch not found (no TorchConfig.cmake under Torch_DIR='${Torch_DIR}', "
          "CMAKE_PREFIX_PATH='${CMAKE_PREFIX_PATH}', MEMOPT_PYTHON='${MEMOPT_PYTHON}'). HINT: run scripts/deps "
          "(installs the pinned torch wheel into .venv), or pass -DTorch_DIR=<libtorch>/share/cmake/Torch "
          "or -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)').")
endif()
get_filename_component(memopt_torch_cmake_dir "${memopt_torch_version_file}" DIRECTORY)
set(PACKAGE_FIND_VERSION ${MEMOPT_TORCH_MIN})
include("${memopt_torch_version_file}")  # sets PACKAGE_VERSION
set(MEMOPT_TORCH_VERSION ${PACKAGE_VERSION})
string(REGEX MATCH "^[0-9]+\\.[0-9]+" memopt_torch_minor "${PACKAGE_VERSION}")
if((memopt_torch_minor VERSION_LESS MEMOPT_TORCH_MIN OR memopt_torch_minor VERSION_GREATER MEMOPT_TORCH_MAX)
   AND NOT MEMOPT_ALLOW_UNTESTED_TORCH)
  message(FATAL_ERROR "memopt: LibTorch ${PACKAGE_VERSION} at ${memopt_torch_cmake_dir} is outside the "
          "supported range ${MEMOPT_TORCH_MIN}..${MEMOPT_TORCH_MAX}. HINT: run scripts/deps for the pinned wheel, "
          "point Torch_DIR at a LibTorch in range, or pass -DMEMOPT_ALLOW_UNTESTED_TORCH=ON to try this one anyway.")
endif()

# 3. A CUDA build of LibTorch (libc10_cuda next to libtorch) needs the CUDA toolkit to configure.
get_filename_component(memopt_torch_root "${memopt_torch_cmake_dir}/../../.." ABSOLUTE)
file(GLOB memopt_c10_cuda "${memopt_torch_root}/lib/libc10_cuda.so" "${memopt_torch_root}/lib/c10_cuda.lib")
if(memopt_c10_cuda)
  find_package(CUDAToolkit QUIET)
  if(NOT CUDAToolkit_FOUND)
    message(FATAL_ERROR "memopt: LibTorch ${PACKAGE_VERSION} at ${memopt_torch_root} is a CUDA build "
            "(${memopt_c10_cuda}), but no CUDA toolkit was found (nvcc, cudart). HINT: install the CUDA toolkit "
            "and put its bin/ on PATH (or set CUDAToolkit_ROOT), or use a CPU build of LibTorch.")
  endif()
endif()

find_package(Torch REQUIRED PATHS "${memopt_torch_cmake_dir}" NO_DEFAULT_PATH)
find_package(nlohmann_json 3.9 REQUIRED)

add_library(memopt_deps INTERFACE)
# torch 2.11's libtorch.so and libtorch_cpu.so export unversioned copies of parts of libstdc++
# (std::filesystem among them). The linker resolves a program's std:: references against the
# first library on the line that defines them, and with LibTorch first it binds them to those
# copies; libtorch.so's remove_all then calls a weak symbol nothing defines (a jump to address 0,
# seen on an H200). So name the C++ runtime first among the libraries, right after the program's
# objects: a shared libstdc++ (Debian's GCC) then comes first in DT_NEEDED and wins at run time,
# and a static one (a GCC built without a shared libstdc++, as on the GPU machines' /opt/gcc)
# gets its members pulled into the program. A link option would sit before the objects, where
# an archive contributes nothing, which is why the earlier fix held for GCC 12 but not there.
set(memopt_cxx_runtime "")
if(CMAKE_SYSTEM_NAME STREQUAL "Linux" AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  set(memopt_cxx_runtime "-Wl,--push-state,--no-as-needed,-lstdc++,--pop-state")
endif()
target_link_libraries(memopt_deps INTERFACE ${memopt_cxx_runtime} ${TORCH_LIBRARIES} nlohmann_json::nlohmann_json)
if(memopt_c10_cuda)
  # c10_cuda (CUDACachingAllocator, streams) is in TORCH_LIBRARIES; tell the headers to use it.
  target_compile_definitions(memopt_deps INTERFACE MEMOPT_WITH_CUDA=1)
  set(MEMOPT_TORCH_CUDA "CUDA ${CUDAToolkit_VERSION} (toolkit at ${CUDAToolkit_BIN_DIR})")
  # A pip wheel brings the CUDA libraries it was built against (site-packages/nvidia/*/lib; 13.2
  # for torch 2.15, newer than a 13.0 toolkit, and with cuSPARSELt, NVSHMEM and cuFile, which the
  # toolkit lacks). Link and run against those first: the toolkit's older NCCL lacks symbols
  # libtorch_cuda needs, and one process must not mix two cudart versions.
  file(GLOB memopt_wheel_cuda_dirs LIST_DIRECTORIES true "${memopt_torch_root}/../nvidia/*/lib")
  if(memopt_wheel_cuda_dirs)
    list(JOIN memopt_wheel_cuda_dirs ":" memopt_wheel_cuda_path)
    target_link_options(memopt_deps INTERFACE "LINKER:-rpath-link,${memopt_wheel_cuda_path}"
                        "LINKER:-rpath,${memopt_wheel_cuda_path}")
    string(APPEND MEMOPT_TORCH_CUDA "; runtime libraries from the wheel's nvidia/ packages")
  endif()
else()
  set(MEMOPT_TORCH_CUDA "CPU only")
endif()

# fmt: LibTorch 2.x ships fmt's headers, which its include directory puts ahead of any other
# fmt: use them, header-only (libtorch exports no fmt symbols). Otherwise a system fmt.
# memopt_fmt carries that choice for targets that take LibTorch's headers without memopt_deps.
add_library(memopt_fmt INTERFACE)
if(EXISTS "${memopt_torch_root}/include/fmt/format-inl.h")
  target_compile_definitions(memopt_fmt INTERFACE FMT_HEADER_ONLY=1)
  set(MEMOPT_FMT "LibTorch's, header-only")
else()
  find_package(fmt REQUIRED)
  target_link_libraries(memopt_fmt INTERFACE fmt::fmt)
  set(MEMOPT_FMT "fmt ${fmt_VERSION}")
endif()
target_link_libraries(memopt_deps INTERFACE memopt_fmt)

# Tokenizers from tokenizer.json (memopt/data/hf_tokenizer.hpp): PCRE2 runs their pre-tokenizer
# regexes and utf8proc their Unicode normalizers (Debian: libpcre2-dev, libutf8proc-dev; scripts/deps
# installs both). Optional: without them a tokenizer.json that needs a regex or a normalizer fails
# to load with a HINT, and SentencePiece .model files work as before.
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(memopt_pcre2 QUIET IMPORTED_TARGET libpcre2-8)
  pkg_check_modules(memopt_utf8proc QUIET IMPORTED_TARGET libutf8proc)
endif()
set(MEMOPT_TEXT "")
if(memopt_pcre2_FOUND)
  target_link_libraries(memopt_deps INTERFACE PkgConfig::memopt_pcre2)
  target_compile_definitions(memopt_deps INTERFACE MEMOPT_WITH_PCRE2=1)
  string(APPEND MEMOPT_TEXT "PCRE2 ${memopt_pcre2_VERSION}")
else()
  string(APPEND MEMOPT_TEXT "no PCRE2")
endif()
if(memopt_utf8proc_FOUND)
  target_link_libraries(memopt_deps INTERFACE PkgConfig::memopt_utf8proc)
  target_compile_definitions(memopt_deps INTERFACE MEMOPT_WITH_UTF8PROC=1)
  string(APPEND MEMOPT_TEXT ", utf8proc ${memopt_utf8proc_VERSION}")
else()
  string(APPEND MEMOPT_TEXT ", no utf8proc")
endif()

if(NOT memopt_dependencies_reported)
  set(memopt_dependencies_reported ON)
  message(STATUS "memopt: LibTorch ${MEMOPT_TORCH_VERSION} (${MEMOPT_TORCH_CUDA}) at ${memopt_torch_root}; fmt: ${MEMOPT_FMT}; text: ${MEMOPT_TEXT}")
endif()
