// fuzz/safetensors_header_fuzz.cpp — libFuzzer target for memopt/io/safetensors.hpp: arbitrary
// bytes go through SafetensorsFile::parse_header(), the validation open() runs on the mapped
// file. An input it accepts is then opened for real (from a memfd) and every tensor is read
// with get(), as a view and as a copy, and compared with the input's bytes. A c10::Error is
// the expected rejection; any other exception, a sanitizer report, a trap or a hang is a bug.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

// clang 14 in C++20 rejects LibTorch 1.13's <torch/torch.h> (a std::vector<c10::IValue> used
// while IValue is still incomplete) unless IValue's header comes first.
#include <ATen/core/ivalue.h>
#include <memopt/io/safetensors.hpp>

namespace {

/// Stops the run with a message: libFuzzer records the input as a crash.
[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "safetensors_header_fuzz: %s\n", what.c_str());
  std::abort();
}

/// The input as a file: a memfd, reachable by path through /proc/self/fd (closed on return).
struct MemFile {
  int fd = -1;
  MemFile(const uint8_t* data, size_t size) {
    fd = ::memfd_create("safetensors_header_fuzz", MFD_CLOEXEC);
    if (fd < 0) fail("memfd_create failed");
    for (size_t done = 0; done < size;) {
      const ssize_t n = ::write(fd, data + done, size - done);
      if (n <= 0) fail("writing the memfd failed");
      done += static_cast<size_t>(n);
    }
  }
  ~MemFile() { ::close(fd); }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd); }
};

/// open() and get() on bytes that parse_header() accepted: they must agree with it.
void read_back(const uint8_t* data, size_t size, const memopt::io::SafetensorsHeader& header) {
  MemFile mem(data, size);
  std::shared_ptr<const memopt::io::SafetensorsFile> file;
  try {
    file = memopt::io::SafetensorsFile::open(mem.path());
  } catch (const c10::Error& e) {
    fail(std::string("parse_header accepted bytes that open() rejects: ") + e.what_without_backtrace());
  }
  if (file->names() != header.names || file->metadata() != header.metadata) fail("open() and parse_header differ");
  const uint8_t* section = data + 8 + header.header_bytes;
  for (const auto& name : file->names()) {
    const memopt::io::TensorInfo& info = file->info(name);
    for (bool copy : {false, true}) {
      torch::Tensor t;
      try {
        t = file->get(name, copy);
      } catch (const c10::Error&) {
        continue;  // a refusal with a message (e.g. a shape LibTorch cannot lay out) is not a crash
      }
      if (static_cast<int64_t>(t.nbytes()) != info.nbytes()) fail("get('" + name + "') has the wrong byte count");
      if (info.nbytes() > 0 && std::memcmp(t.data_ptr(), section + info.begin, t.nbytes()) != 0)
        fail("get('" + name + "') differs from the file's bytes");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  memopt::io::SafetensorsHeader header;
  try {
    header = memopt::io::SafetensorsFile::parse_header(data, size, "fuzz.safetensors");
  } catch (const c10::Error&) {
    return 0;  // rejected, with a message naming the field: what bad bytes should get
  }
  read_back(data, size, header);
  return 0;
}
