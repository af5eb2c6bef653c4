// tests/support.hpp — what several test files share: a temporary folder, reading and writing
// whole files, the check that a call fails with memopt's error style (the component's prefix,
// the parts named, a HINT), the largest difference of two tensors, the loader of the
// python3-torch reference files in tests/baselines/, and protobuf helpers to write small
// SentencePiece models by hand; MEMOPT_REQUIRE_CUDA, which skips a [cuda] test without a GPU;
// and Parquet files written by the tests' Python (pyarrow), with MEMOPT_PYTHON pointed at it.
#pragma once

#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>
#include <ATen/record_function.h>
#include <torch/torch.h>

namespace memopt::test {

/// A fresh folder under the system temp directory, removed with everything in it.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& prefix = "memopt_test") {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() /
           (prefix + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path / name).string(); }
};

/// Writes `text` to `path`, making its folder.
inline void write_text(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

/// The whole file at `path`, byte for byte ("" if it cannot be read).
inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Skips the running test case: under ctest (which sets MEMOPT_TEST_SKIP_CODE for every case it
/// registers, and counts that exit code as skipped) the process ends with that code; in a direct
/// run of the test binary, which runs many cases in one process, the case returns with a warning.
inline void skip_case(const std::string& reason) {
  if (const char* code = std::getenv("MEMOPT_TEST_SKIP_CODE"); code != nullptr && *code != '\0') {
    std::cout << "SKIPPED: " << reason << std::endl;
    std::fflush(nullptr);
    std::_Exit(std::atoi(code));
  }
  WARN("skipped: " << reason);
}

/// The first statement of a test case tagged [cuda]: without a CUDA device (a CPU build of
/// LibTorch, or no GPU), the case is skipped (skip_case) and counted as such.
#define MEMOPT_REQUIRE_CUDA()                                                                         \
  do {                                                                                                \
    if (!torch::cuda::is_available()) {                                                               \
      ::memopt::test::skip_case("needs a CUDA device (torch::cuda::is_available() is false)");        \
      return;                                                                                         \
    }                                                                                                 \
  } while (false)

/// Runs `fn`; requires a c10::Error whose message holds `prefix`, a HINT and every part.
inline void require_error(const std::function<void()>& fn, const std::string& prefix,
                          const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    INFO(message);
    CHECK_THAT(message, Catch::Contains(prefix));
    CHECK_THAT(message, Catch::Contains("HINT: "));
    for (const auto& part : parts) CHECK_THAT(message, Catch::Contains(part));
    return;
  }
  FAIL("expected a c10::Error mentioning " << (parts.empty() ? prefix : parts.front()));
}

/// max |a - b| over all elements, in double.
inline double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

/// max |got - want| relative to want's largest magnitude, in double.
inline double relative_diff(const torch::Tensor& got, const torch::Tensor& want) {
  return max_abs_diff(got, want) / std::max(want.abs().max().item<double>(), 1e-30);
}

using TensorMap = std::map<std::string, torch::Tensor>;

/// tests/baselines/NAME: a torch.save(dict) zip of tensors written by NAME's .py script.
inline TensorMap load_baseline(const std::string& name) {
  const std::string path = std::string(MEMOPT_TEST_BASELINES) + "/" + name;
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot open " + path + " (run its .py script in tests/baselines/)");
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  TensorMap out;
  for (const auto& entry : torch::pickle_load(bytes).toGenericDict())
    out.emplace(entry.key().toStringRef(), entry.value().toTensor());
  return out;
}

/// The tensor `key` of a loaded baseline, or an exception naming the missing key.
inline const torch::Tensor& baseline_at(const TensorMap& ref, const std::string& name, const std::string& key) {
  auto it = ref.find(key);
  if (it == ref.end()) throw std::runtime_error(name + " has no key " + key);
  return it->second;
}

// ---- protobuf wire format, to write small SentencePiece models by hand ----
inline std::string pb_varint(uint64_t v) {
  std::string out;
  do {
    out += static_cast<char>((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
    v >>= 7;
  } while (v != 0);
  return out;
}
inline std::string pb_bytes(int field, std::string_view bytes) {
  return pb_varint(static_cast<uint64_t>(field) << 3 | 2) + pb_varint(bytes.size()) + std::string(bytes);
}
inline std::string pb_int(int field, uint64_t v) { return pb_varint(static_cast<uint64_t>(field) << 3) + pb_varint(v); }
inline std::string pb_float(int field, float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  std::string out = pb_varint(static_cast<uint64_t>(field) << 3 | 5);
  for (int b = 0; b < 4; ++b) out += static_cast<char>(bits >> (8 * b));
  return out;
}

/// A BPE ModelProto with identity normalization; type 1 normal, 2 unknown, 3 control.
inline std::string make_model(const std::vector<std::tuple<std::string, float, int>>& pieces,
                       const std::string& extra_trainer_spec = "") {
  std::string model;
  for (const auto& [text, score, type] : pieces) {
    model += pb_bytes(1, pb_bytes(1, text) + pb_float(2, score) + pb_int(3, static_cast<uint64_t>(type)));
  }
  model += pb_bytes(2, pb_int(3, 2) + extra_trainer_spec);  // model_type BPE
  model += pb_bytes(3, pb_bytes(1, "identity"));
  return model;
}

#ifdef MEMOPT_TEST_PYTHON
// ---- Parquet files, written by the tests' Python (MEMOPT_TEST_PYTHON imports pyarrow) ----

/// MEMOPT_PYTHON, the interpreter memopt/data/parquet.hpp runs, set to `python` while in
/// scope (the tests' Python by default), then restored.
class ScopedPython {
 public:
  explicit ScopedPython(const std::string& python = MEMOPT_TEST_PYTHON) {
    if (const char* old = std::getenv("MEMOPT_PYTHON"); old != nullptr) old_ = old;
    ::setenv("MEMOPT_PYTHON", python.c_str(), 1);
  }
  ~ScopedPython() {
    if (old_) {
      ::setenv("MEMOPT_PYTHON", old_->c_str(), 1);
    } else {
      ::unsetenv("MEMOPT_PYTHON");
    }
  }
  ScopedPython(const ScopedPython&) = delete;
  ScopedPython& operator=(const ScopedPython&) = delete;

 private:
  std::optional<std::string> old_;
};

/// A Parquet file at `path` written by pyarrow: `columns` maps names to values (strings,
/// integers; null is a null row), in row groups of `row_group_size` rows; the columns named
/// in `large` are stored as large_string.
///   write_parquet(dir.file("a.parquet"), {{"id", {1, 2}}, {"text", {"x", nullptr}}}, 1);
inline void write_parquet(const std::string& path, const nlohmann::ordered_json& columns, int64_t row_group_size,
                          const std::vector<std::string>& large = {}) {
  const std::string spec = path + ".spec", script = path + ".py";
  write_text(spec, nlohmann::ordered_json{{"path", path}, {"columns", columns}, {"row_group_size", row_group_size},
                                          {"large", large}}.dump());
  write_text(script, R"py(import json, sys
import pyarrow as pa, pyarrow.parquet as pq
s = json.load(open(sys.argv[1], encoding="utf-8"))
columns = {k: pa.array(v, type=pa.large_string() if k in s["large"] else None) for k, v in s["columns"].items()}
pq.write_table(pa.table(columns), s["path"], row_group_size=s["row_group_size"])
)py");
  const std::string command = std::string("'") + MEMOPT_TEST_PYTHON + "' '" + script + "' '" + spec + "'";
  const int status = std::system(command.c_str());
  std::filesystem::remove(spec);
  std::filesystem::remove(script);
  if (status != 0) {
    throw std::runtime_error("writing the Parquet file " + path + " with " + MEMOPT_TEST_PYTHON +
                             " failed (HINT: scripts/deps installs pyarrow into .venv)");
  }
}
#endif  // MEMOPT_TEST_PYTHON

// Counts, while alive, the calls of one operator (by its RecordFunction name, e.g.
// "aten::mm") on every thread, except those made inside an operator named `except_inside`
// (empty: none). (A global RecordFunction callback; one counter at a time.)
//   { OpCalls mm("aten::mm");  step();  CHECK(mm.count() == 42); }
class OpCalls {
 public:
  explicit OpCalls(std::string name, std::string except_inside = "") {
    target() = std::move(name);
    excluded() = std::move(except_inside);
    counter() = 0;
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(&OpCalls::on_start, &OpCalls::on_end).scopes({at::RecordScope::FUNCTION}));
  }
  ~OpCalls() { at::removeCallback(handle_); }
  OpCalls(const OpCalls&) = delete;
  OpCalls& operator=(const OpCalls&) = delete;
  int64_t count() const { return counter().load(); }

 private:
  static std::string& target() {
    static std::string name;
    return name;
  }
  static std::string& excluded() {
    static std::string name;
    return name;
  }
  static std::atomic<int64_t>& counter() {
    static std::atomic<int64_t> n{0};
    return n;
  }
  static int& inside_excluded() {  // this thread's depth inside `excluded()` calls
    thread_local int depth = 0;
    return depth;
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    const std::string_view name(fn.name());
    if (!excluded().empty() && name == excluded()) ++inside_excluded();
    if (name == target() && inside_excluded() == 0) ++counter();
    return nullptr;
  }
  static void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
    if (!excluded().empty() && std::string_view(fn.name()) == excluded()) --inside_excluded();
  }
  at::CallbackHandle handle_ = 0;
};

// Counts the calls of aten::_local_scalar_dense: what item() and a tensor's bool conversion
// run, a host sync when the tensor is on a GPU. Not those inside ATen's fused AdamW, whose CPU
// kernel reads each parameter's step count from a CPU tensor (no sync; its CUDA kernel reads
// the count on the device): state::Resident steps with it (optim::FusedAdamW).
//   { HostReads reads;  step();  CHECK(reads.count() == 1); }
class HostReads : public OpCalls {
 public:
  HostReads() : OpCalls("aten::_local_scalar_dense", "aten::_fused_adamw_") {}
};

}  // namespace memopt::test
