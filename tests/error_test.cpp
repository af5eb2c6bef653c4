// tests/error_test.cpp — memopt/error.hpp: error_message gives a c10::Error's message (a
// TORCH_CHECK's, its ValueError and IndexError too, caught as std::exception) without
// LibTorch's "Exception raised from ..." line and C++ frames, and any other exception's what()
// unchanged; guarded_main returns the body's exit code and prints nothing when it succeeds,
// and prints "error: <that message>" to stderr and returns 1 when it throws.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>
#include <c10/util/Lazy.h>

#include <memopt/error.hpp>

#include "support.hpp"

namespace {

// The exception `fn` throws (it must throw a std::exception).
template <class Fn>
std::exception_ptr thrown(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception&) {
    return std::current_exception();
  }
  return nullptr;
}

// error_message() and what() of the exception in `error`, seen as a std::exception.
struct Messages {
  std::string message, what;
};
Messages messages(const std::exception_ptr& error) {
  REQUIRE(error != nullptr);
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return {memopt::error_message(e), e.what()};
  }
  FAIL("not a std::exception");
  return {};
}

// Everything written to file descriptor 2 (stderr) while it lives.
class StderrCapture {
 public:
  StderrCapture() : path_(dir_.file("stderr.txt")) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    REQUIRE(saved_ >= 0);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(::dup2(fd, 2) == 2);
    ::close(fd);
  }
  ~StderrCapture() { restore(); }
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;

  /// Ends the capture; returns what was written.
  std::string text() {
    restore();
    return memopt::test::read_text(path_);
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }
  memopt::test::TempDir dir_{"memopt_error_test"};
  std::string path_;
  int saved_ = -1;
};

const std::string kMessage = "memopt::test: file 'x.bin' has 3 bytes, expected 8. HINT: write it again";

}  // namespace

TEST_CASE("error_message gives a TORCH_CHECK's message without the C++ frames", "[error]") {
  const auto [message, what] = messages(thrown([] {
    TORCH_CHECK(false, "memopt::test: file '", "x.bin", "' has ", 3, " bytes, expected ", 8, ". HINT: write it again");
  }));
  CHECK(message == kMessage);
  // what() is the same message followed by LibTorch's source location and backtrace.
  CHECK_THAT(what, Catch::StartsWith(kMessage));
  CHECK_THAT(what, Catch::Contains("Exception raised from"));
  CHECK(what.size() > message.size());
  CHECK_THAT(message, !Catch::Contains("Exception raised from"));
  CHECK_THAT(message, !Catch::Contains("most recent call first"));
  CHECK(message.find('\n') == std::string::npos);
}

TEST_CASE("error_message drops the backtrace of every c10::Error, subclasses included", "[error]") {
  SECTION("a c10::Error with a known backtrace") {
    const std::string frames = "frame #0: memopt::fake_function() + 0x10\nframe #1: main + 0x20";
    const auto [message, what] = messages(std::make_exception_ptr(
        c10::Error(kMessage, std::make_shared<c10::PrecomputedLazyValue<std::string>>(frames))));
    CHECK(message == kMessage);
    CHECK_THAT(what, Catch::Contains("frame #0: memopt::fake_function()"));
    CHECK_THAT(message, !Catch::Contains("frame #"));
  }
  SECTION("TORCH_CHECK_VALUE: c10::ValueError") {
    const auto [message, what] = messages(thrown([] { TORCH_CHECK_VALUE(false, "memopt::test: bad value 7"); }));
    CHECK(message == "memopt::test: bad value 7");
    CHECK_THAT(what, Catch::Contains("Exception raised from"));
  }
  SECTION("TORCH_CHECK_INDEX: c10::IndexError") {
    const auto [message, what] = messages(thrown([] { TORCH_CHECK_INDEX(false, "memopt::test: index 9 of 4"); }));
    CHECK(message == "memopt::test: index 9 of 4");
    CHECK_THAT(what, Catch::Contains("Exception raised from"));
  }
}

TEST_CASE("error_message gives any other exception's what() as it is", "[error]") {
  const std::string text = "memopt::test: plain\nsecond line";
  CHECK(messages(std::make_exception_ptr(std::runtime_error(text))).message == text);
  CHECK(messages(std::make_exception_ptr(std::invalid_argument("bad --flag"))).message == "bad --flag");
  CHECK(messages(std::make_exception_ptr(std::out_of_range(""))).message.empty());
}

TEST_CASE("guarded_main returns the body's exit code and prints nothing when it succeeds", "[error]") {
  int calls = 0;
  StderrCapture capture;
  const int zero = memopt::guarded_main([&] {
    ++calls;
    return 0;
  });
  const int three = memopt::guarded_main([&] {
    ++calls;
    return 3;
  });
  const std::string err = capture.text();
  CHECK(zero == 0);
  CHECK(three == 3);
  CHECK(calls == 2);  // each body runs once
  CHECK(err.empty());
}

TEST_CASE("guarded_main prints the message without frames to stderr and returns 1 when the body throws", "[error]") {
  SECTION("a TORCH_CHECK") {
    StderrCapture capture;
    const int code = memopt::guarded_main([]() -> int {
      TORCH_CHECK(false, "memopt::test: file 'x.bin' has ", 3, " bytes, expected 8. HINT: write it again");
      return 0;
    });
    const std::string err = capture.text();
    CHECK(code == 1);
    CHECK(err == "error: " + kMessage + "\n");
  }
  SECTION("a std::runtime_error") {
    StderrCapture capture;
    const int code = memopt::guarded_main([]() -> int { throw std::runtime_error("memopt::test: plain"); });
    const std::string err = capture.text();
    CHECK(code == 1);
    CHECK(err == "error: memopt::test: plain\n");
  }
}
