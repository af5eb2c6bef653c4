# One step of memopt's compile-fail tests, run as `cmake -D... -P compile_fail.cmake` by ctest
# (tests/compile_fail/CMakeLists.txt registers the steps; `ctest -V` prints each command line):
#   STEP=configure  configure project/ into PROJECT_DIR, which writes compile_commands.json, and
#                   build its precompiled header (LibTorch's) under Ninja
#   STEP=compile    compile cases.cpp with -fsyntax-only -DCASE_${CASE}. CASE=control must compile;
#                   any other case must FAIL to compile with an output that contains each of
#                   the texts EXPECT_1 .. EXPECT_${EXPECT_COUNT} (plain text, not regexes).
# Inputs: STEP, PROJECT_DIR; configure: MEMOPT_SOURCE_DIR, GENERATOR, INITIAL_CACHE;
# compile: CASE, EXPECT_COUNT, EXPECT_<i>.
cmake_minimum_required(VERSION 3.19)  # string(JSON)
include(${CMAKE_CURRENT_LIST_DIR}/../consumers/nested_cmake.cmake)

if(STEP STREQUAL "configure")
  file(REMOVE_RECURSE ${PROJECT_DIR})
  nested_run("configure" ${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR}/project -B ${PROJECT_DIR}
             -G ${GENERATOR} -C ${INITIAL_CACHE} -DMEMOPT_SOURCE_DIR=${MEMOPT_SOURCE_DIR})
  if(NOT EXISTS ${PROJECT_DIR}/compile_commands.json)
    message(FATAL_ERROR "configure: ${PROJECT_DIR}/compile_commands.json was not written. "
                        "HINT: the generator must support CMAKE_EXPORT_COMPILE_COMMANDS (Ninja, Makefiles).")
  endif()
  if(GENERATOR STREQUAL "Ninja")  # the precompiled header the cases' command includes
    nested_run("precompile" ${CMAKE_COMMAND} --build ${PROJECT_DIR}
               --target CMakeFiles/compile_fail_cases.dir/cmake_pch.hxx.gch)
  endif()
  return()
elseif(NOT STEP STREQUAL "compile")
  message(FATAL_ERROR "compile_fail.cmake: unknown STEP '${STEP}' (configure or compile)")
endif()

# ---- the compile command of cases.cpp, made a syntax-only check of one case ----
set(commands_file ${PROJECT_DIR}/compile_commands.json)
if(NOT EXISTS ${commands_file})
  message(FATAL_ERROR "no ${commands_file}. HINT: run the compile_fail.configure test first.")
endif()
file(READ ${commands_file} commands)
string(JSON count LENGTH "${commands}")
foreach(i RANGE 0 ${count})  # the last index is one past the end: not found
  if(i EQUAL count)
    message(FATAL_ERROR "${commands_file} has no entry for cases.cpp")
  endif()
  string(JSON file GET "${commands}" ${i} file)
  if(file MATCHES "/cases\\.cpp$")
    string(JSON command GET "${commands}" ${i} command)
    string(JSON directory GET "${commands}" ${i} directory)
    break()
  endif()
endforeach()
separate_arguments(command UNIX_COMMAND "${command}")
set(args)
set(skip_next FALSE)
foreach(arg IN LISTS command)  # drop "-o <object>" and "-c <source>": -fsyntax-only writes nothing
  if(skip_next)
    set(skip_next FALSE)
  elseif(arg STREQUAL "-o" OR arg STREQUAL "-c")
    set(skip_next TRUE)
  else()
    list(APPEND args "${arg}")
  endif()
endforeach()
list(APPEND args -fsyntax-only -fdiagnostics-color=never -DCASE_${CASE} ${file})  # GCC and Clang flags

# ---- compile; judge by the exit status and the text of the diagnostics ----
set(ENV{LC_ALL} C)  # plain ASCII quotes in GCC's messages
string(TIMESTAMP start %s)
execute_process(COMMAND ${args} WORKING_DIRECTORY ${directory}
                RESULT_VARIABLE rc OUTPUT_VARIABLE output ERROR_VARIABLE output)
string(TIMESTAMP end %s)
math(EXPR seconds "${end} - ${start}")
string(REPLACE ";" " " line "${args}")
message(STATUS "compile (${seconds} s, exit ${rc}): ${line}")

if(CASE STREQUAL "control")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the control case must compile, and did not: the harness is broken.\n${output}")
  endif()
  message(STATUS "control compiled, as it must")
  return()
endif()

if(rc EQUAL 0)
  message(FATAL_ERROR "CASE_${CASE} compiled, but memopt must reject it")
endif()
set(missing)
foreach(i RANGE 1 ${EXPECT_COUNT})
  string(FIND "${output}" "${EXPECT_${i}}" at)
  if(at EQUAL -1)
    list(APPEND missing "'${EXPECT_${i}}'")
  else()
    message(STATUS "found '${EXPECT_${i}}'")
  endif()
endforeach()
if(missing)
  message(FATAL_ERROR "CASE_${CASE} failed to compile, but the diagnostics lack ${missing}:\n${output}")
endif()
message(STATUS "CASE_${CASE} was rejected as it must be; the diagnostics:\n${output}")
