// memopt/error.hpp — how memopt reports bad input: TORCH_CHECK messages that name the
// file/option and the value seen and end with a HINT, and guarded_main() so that a
// program prints that message and exits non-zero instead of aborting with a trace.
#pragma once

#include <cstdio>
#include <exception>
#include <string>
#include <utility>

#include <c10/util/Exception.h>

namespace memopt {

/// The message of an error without LibTorch's C++ backtrace.
inline std::string error_message(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

/// Runs a program body; prints "error: ..." and returns 1 on a std::exception (c10::Error included).
///   int main(int argc, char** argv) { return memopt::guarded_main([&] { ...; return 0; }); }
template <class Fn>
int guarded_main(Fn&& body) {
  try {
    return std::forward<Fn>(body)();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", error_message(e).c_str());
    return 1;
  }
}

}  // namespace memopt
