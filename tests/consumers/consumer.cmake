# One step of memopt's consumer tests, run as `cmake -D... -P consumer.cmake` by ctest
# (tests/consumers/CMakeLists.txt registers the steps; `ctest -V` prints each command line):
#   STEP=install           configure memopt alone (no tests, examples, benchmarks) and install it into PREFIX
#   STEP=find_package      build tests/consumers/find_package against PREFIX and run it
#   STEP=add_subdirectory  build tests/consumers/add_subdirectory with memopt as a subproject and run it
# Inputs: STEP, MEMOPT_SOURCE_DIR, WORK_DIR (each step's build dir lies under it), PREFIX,
# GENERATOR, INITIAL_CACHE (a cmake -C file: compiler, build type, dependencies, ccache).
# Every step starts from an empty build directory.
cmake_minimum_required(VERSION 3.18)
include(${CMAKE_CURRENT_LIST_DIR}/nested_cmake.cmake)

foreach(input STEP MEMOPT_SOURCE_DIR WORK_DIR PREFIX GENERATOR INITIAL_CACHE)
  if(NOT DEFINED ${input})
    message(FATAL_ERROR "consumer.cmake: pass -D${input}=...")
  endif()
endforeach()
set(build_dir ${WORK_DIR}/${STEP})
string(TIMESTAMP start %s)

# configure_and_build(<source dir> <extra configure args>...)
function(configure_and_build source)
  file(REMOVE_RECURSE ${build_dir})
  nested_run("configure" ${CMAKE_COMMAND} -S ${source} -B ${build_dir} -G ${GENERATOR} -C ${INITIAL_CACHE} ${ARGN})
  nested_run("build" ${CMAKE_COMMAND} --build ${build_dir} --config Release)
endfunction()

# run_consumer(): runs the consumer just built; it must exit 0 and print "consumer OK".
function(run_consumer)
  set(exe ${build_dir}/consumer)
  if(NOT EXISTS ${exe})
    set(exe ${build_dir}/Release/consumer)  # multi-config generators
  endif()
  nested_run("run" ${exe})
  message(STATUS "${nested_output}")
  if(NOT nested_output MATCHES "consumer OK")
    message(FATAL_ERROR "${exe} did not print 'consumer OK'")
  endif()
endfunction()

if(STEP STREQUAL "install")
  file(REMOVE_RECURSE ${PREFIX})
  configure_and_build(${MEMOPT_SOURCE_DIR}
    -DMEMOPT_BUILD_TESTS=OFF -DMEMOPT_BUILD_EXAMPLES=OFF -DMEMOPT_BUILD_BENCHMARKS=OFF -DMEMOPT_INSTALL=ON)
  nested_run("install" ${CMAKE_COMMAND} --install ${build_dir} --config Release --prefix ${PREFIX})
  # The package is there, its headers with it, and it names no path of the source tree.
  file(GLOB_RECURSE config ${PREFIX}/*/memopt-config.cmake)
  file(GLOB_RECURSE targets ${PREFIX}/*/memoptTargets.cmake)
  if(NOT config OR NOT targets OR NOT EXISTS ${PREFIX}/include/memopt/memopt.hpp)
    message(FATAL_ERROR "install: memopt-config.cmake, memoptTargets.cmake or the headers are missing under ${PREFIX}")
  endif()
  file(READ ${targets} exported)
  string(FIND "${exported}" "${MEMOPT_SOURCE_DIR}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "install: ${targets} names the source tree ${MEMOPT_SOURCE_DIR}")
  endif()
  message(STATUS "installed ${config}")

elseif(STEP STREQUAL "find_package")
  if(NOT EXISTS ${PREFIX}/include/memopt/memopt.hpp)
    message(FATAL_ERROR "find_package: nothing installed in ${PREFIX}. HINT: run the consumer.install test first.")
  endif()
  # INITIAL_CACHE puts PREFIX first in CMAKE_PREFIX_PATH; the package registries stay out.
  configure_and_build(${CMAKE_CURRENT_LIST_DIR}/find_package
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
  file(STRINGS ${build_dir}/CMakeCache.txt found REGEX "^memopt_DIR:")
  string(FIND "${found}" "${PREFIX}/" at)
  if(NOT at GREATER -1)
    message(FATAL_ERROR "find_package found memopt elsewhere than ${PREFIX}: ${found}")
  endif()
  run_consumer()

elseif(STEP STREQUAL "add_subdirectory")
  configure_and_build(${CMAKE_CURRENT_LIST_DIR}/add_subdirectory -DMEMOPT_SOURCE_DIR=${MEMOPT_SOURCE_DIR})
  run_consumer()

else()
  message(FATAL_ERROR "consumer.cmake: unknown STEP '${STEP}' (install, find_package or add_subdirectory)")
endif()

string(TIMESTAMP end %s)
math(EXPR seconds "${end} - ${start}")
message(STATUS "consumer.${STEP}: passed in ${seconds} s")
