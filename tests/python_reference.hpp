// tests/python_reference.hpp — the tests that compare with a Python package (bitsandbytes, PEFT):
// whether the tests' Python (MEMOPT_TEST_PYTHON) imports it, and a reference script of
// tests/baselines run on tensors exchanged through safetensors files.
#pragma once

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <sys/wait.h>

#include <cstdlib>
#include <memory>
#include <string>

#include <memopt/io/safetensors.hpp>

#include "support.hpp"

namespace memopt::test {

/// Whether MEMOPT_TEST_PYTHON imports `modules` ("peft, safetensors").
inline bool python_imports(const std::string& modules) {
  const std::string command = fmt::format("'{}' -c 'import {}' > /dev/null 2>&1", MEMOPT_TEST_PYTHON, modules);
  return std::system(command.c_str()) == 0;
}

/// Runs tests/baselines/SCRIPT DIR/in.safetensors DIR/out.safetensors with MEMOPT_TEST_PYTHON
/// (its output in DIR/reference.log, shown on failure) and opens what it wrote; fails the case,
/// naming `package` (which scripts/deps installs), unless the script exits 0.
inline std::shared_ptr<const memopt::io::SafetensorsFile> run_reference_script(const TempDir& dir,
                                                                               const std::string& script,
                                                                       const std::string& package) {
  const std::string path = std::string(MEMOPT_TEST_BASELINES) + "/" + script;
  const std::string log = dir.file("reference.log");
  const int status = std::system(("'" + std::string(MEMOPT_TEST_PYTHON) + "' '" + path + "' '" +
                                  dir.file("in.safetensors") + "' '" + dir.file("out.safetensors") + "' > '" + log +
                                  "' 2>&1").c_str());
  INFO(read_text(log));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    FAIL(MEMOPT_TEST_PYTHON << " could not run tests/baselines/" << script << ". HINT: run scripts/deps "
                            << "(requirements.txt installs " << package << " into .venv)");
  return memopt::io::SafetensorsFile::open(dir.file("out.safetensors"));
}

}  // namespace memopt::test
