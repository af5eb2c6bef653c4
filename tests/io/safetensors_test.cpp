// tests/io/safetensors_test.cpp — memopt/io/safetensors.hpp: bit-exact round trip of every
// dtype, metadata, zero-copy views that outlive the file object, release() dropping a tensor's
// pages from the resident set while its views stay valid, one error per malformed header
// field, and cross-checks both ways with tests/io/safetensors_check.py (a json + numpy reader and
// writer) and the safetensors package. HF-style checkpoints: tests/io/pretrained_test.cpp.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "io/fixtures.hpp"
#include "support.hpp"

#include <memopt/io/safetensors.hpp>
#include <memopt/memory/rss.hpp>

namespace fs = std::filesystem;
using memopt::io::SafetensorsFile;
using Named = std::vector<std::pair<std::string, torch::Tensor>>;

namespace {

using memopt::test::read_text;
using memopt::test::TempDir;
using memopt::test::write_text;
using memopt::test::io::require_error;

/// A safetensors file by hand: u64 length (`length` overrides it), `header`, `data_bytes` zeros.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes = 0, int64_t length = -1) {
  const uint64_t n = length >= 0 ? static_cast<uint64_t>(length) : header.size();
  std::string bytes(8, '\0');
  for (int b = 0; b < 8; ++b) bytes[b] = static_cast<char>(n >> (8 * b));
  write_text(path, bytes + header + std::string(data_bytes, '\0'));
}

/// Same dtype, shape and bytes (so NaN, -0.0 and bf16 bits count too).
bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto x = a.contiguous(), y = b.contiguous();
  // An empty tensor's data_ptr() may be null, and memcmp(null, …, 0) is undefined (UBSan).
  return x.nbytes() == 0 || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

/// The tensors of tests/io/safetensors_check.py's RECIPE, in its order (keep them equal).
Named recipe() {
  auto t = [](std::initializer_list<double> v, torch::Dtype d, std::vector<int64_t> shape) {
    return torch::tensor(std::vector<double>(v), torch::kFloat64).to(d).reshape(shape);
  };
  auto i = [](std::vector<int64_t> v, torch::Dtype d, std::vector<int64_t> shape) {
    return torch::tensor(v, torch::kInt64).to(d).reshape(shape);
  };
  return {
      {"f32", t({-1.25, 0.0, 0.1, 3.5, 1e30, -7.0}, torch::kFloat32, {2, 3})},
      {"f64", t({0.0, 1.0 / 3.0, -2.5e-300}, torch::kFloat64, {3})},
      {"f16", t({0.5, -2.0, 65504.0, 0.00006103515625}, torch::kFloat16, {2, 2})},
      {"bf16", t({1.0, -0.5, 256.0, 0.0078125, -3.0, 1.5}, torch::kBFloat16, {6})},
      {"i64", i({-(int64_t{1} << 40), 0, (int64_t{1} << 62) + 5}, torch::kInt64, {3})},
      {"i32", i({-(int64_t{1} << 31), -1, 0, (int64_t{1} << 31) - 1}, torch::kInt32, {2, 2})},
      {"i16", i({-32768, 7, 32767}, torch::kInt16, {3})},
      {"i8", i({-128, 0, 127}, torch::kInt8, {3})},
      {"u8", i({0, 1, 128, 200, 254, 255}, torch::kUInt8, {2, 3})},
      {"bool", i({1, 0, 0, 1}, torch::kBool, {4})},
      {"scalar", torch::tensor(3.5f)},
      {"empty", torch::zeros({0, 3})},
  };
}
const std::map<std::string, std::string> kRecipeMetadata = {{"format", "pt"}, {"recipe", "memopt-check-v1"}};

/// Runs tests/io/safetensors_check.py MODE FILE with the project's python (MEMOPT_TEST_PYTHON:
/// .venv/bin/python3 from scripts/deps); its exit code and output.
std::pair<int, std::string> run_check(const std::string& mode, const std::string& file) {
  const std::string script = std::string(MEMOPT_TEST_BASELINES) + "/../io/safetensors_check.py";
  const std::string log = file + ".log";
  const int status = std::system((std::string(MEMOPT_TEST_PYTHON) + " '" + script + "' " + mode + " '" + file + "' > '" + log +
                                  "' 2>&1").c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_text(log)};
}

void require_numpy() {
  const int status = std::system((std::string(MEMOPT_TEST_PYTHON) + " -c 'import numpy' > /dev/null 2>&1").c_str());
  if (status != 0)
    FAIL(MEMOPT_TEST_PYTHON << " cannot import numpy, which the safetensors cross-check needs. HINT: "
         "run scripts/deps (installs requirements.txt into .venv)");
}

}  // namespace

// ---- safetensors ----------------------------------------------------------------------

TEST_CASE("save_safetensors and SafetensorsFile round-trip every dtype bit for bit", "[io][safetensors]") {
  TempDir dir;
  const std::string path = dir.file("all.safetensors");
  Named tensors = recipe();
  tensors.emplace_back("special", torch::tensor({std::nanf(""), -0.0f, INFINITY, -INFINITY}));
  tensors.emplace_back("transposed", torch::arange(6, torch::kFloat32).reshape({2, 3}).t());  // not contiguous
  memopt::io::save_safetensors(path, tensors, kRecipeMetadata);
  CHECK_FALSE(fs::exists(path + ".tmp"));

  // Header: u64 N, N a multiple of 8, padded with spaces.
  const std::string bytes = read_text(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);
  CHECK(bytes[8] == '{');
  CHECK(nlohmann::json::parse(bytes.substr(8, n))["__metadata__"]["recipe"] == "memopt-check-v1");

  auto file = SafetensorsFile::open(path);
  CHECK(file->path() == path);
  CHECK(file->metadata() == kRecipeMetadata);
  REQUIRE(file->names().size() == tensors.size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    const auto& [name, expected] = tensors[k];
    INFO(name);
    CHECK(file->names()[k] == name);  // file order = the order given
    CHECK(file->contains(name));
    CHECK(same_bits(file->get(name), expected.contiguous()));
    CHECK(same_bits(file->get(name, /*copy=*/true), expected.contiguous()));
    CHECK(file->info(name).shape == expected.sizes().vec());
  }
  CHECK(file->info("bf16").dtype == "BF16");
  CHECK(file->info("bf16").nbytes() == 12);
  CHECK(file->get("scalar").dim() == 0);
  CHECK(file->get("empty").sizes() == torch::IntArrayRef{0, 3});
  CHECK_FALSE(file->contains("missing"));
  require_error([&] { file->get("missing"); }, {path, "no tensor named 'missing'", "'f32'"});

  // Views share the mapping; copies do not.
  CHECK(file->get("f32").data_ptr() == file->get("f32").data_ptr());
  CHECK(file->get("f32", true).data_ptr() != file->get("f32").data_ptr());

  // load_safetensors copies everything; the map overload writes name-sorted.
  auto loaded = memopt::io::load_safetensors(path);
  CHECK(loaded.size() == tensors.size());
  CHECK(same_bits(loaded.at("i64"), tensors[4].second));
  memopt::io::save_safetensors(dir.file("sorted.safetensors"), loaded);
  CHECK(SafetensorsFile::open(dir.file("sorted.safetensors"))->names().front() == "bf16");
  CHECK(SafetensorsFile::open(dir.file("sorted.safetensors"))->metadata().empty());
}

TEST_CASE("zero-copy views outlive the SafetensorsFile and the file's replacement", "[io][safetensors]") {
  TempDir dir;
  const std::string path = dir.file("view.safetensors");
  memopt::io::save_safetensors(path, Named{{"w", torch::arange(1000, torch::kFloat32)}});
  torch::Tensor view;
  {
    auto file = SafetensorsFile::open(path);
    view = file->get("w");
  }  // the last shared_ptr the caller held is gone; the view keeps the mapping
  memopt::io::save_safetensors(path, Named{{"w", torch::zeros({1000})}});  // atomic rename: new inode
  CHECK(torch::equal(view, torch::arange(1000, torch::kFloat32)));
  fs::remove(path);
  CHECK(view.sum().item<double>() == 499500.0);
  CHECK(torch::equal(view * 2, torch::arange(0, 2000, 2, torch::kFloat32)));
}

TEST_CASE("release() drops a tensor's pages from the resident set, its views read the file again",
          "[io][safetensors]") {
  constexpr int64_t kMiB = int64_t{1} << 20;
  TempDir dir;
  const std::string path = dir.file("big.safetensors");
  const torch::Tensor data = torch::arange(16 * kMiB, torch::kInt32);  // 64 MiB
  memopt::io::save_safetensors(path, Named{{"head", torch::ones({3})}, {"x", data}});
  auto file = SafetensorsFile::open(path);
  const torch::Tensor view = file->get("x");
  const int64_t before = memopt::memory::current_rss_bytes();
  CHECK(torch::equal(view, data));  // reads every page of the mapping
  const int64_t read = memopt::memory::current_rss_bytes();
  file->release("x");
  const int64_t released = memopt::memory::current_rss_bytes();
  INFO("RSS before reading " << before / kMiB << " MiB, after " << read / kMiB << " MiB, after release "
                             << released / kMiB << " MiB");
  CHECK(read - before > 48 * kMiB);  // loose: RSS counts whole pages of the whole process
  CHECK(read - released > 48 * kMiB);
  CHECK(torch::equal(view, data));  // the same bytes, read again from the file
  CHECK(torch::equal(file->get("head"), torch::ones({3})));
  file->release("x", 4 * kMiB, 8 * kMiB);  // a byte range, as load_state_dict releases its slices
  file->release("head", 0, 0);             // an empty range: nothing to do
  CHECK(torch::equal(view, data));
}

TEST_CASE("save_safetensors also takes named_parameters()", "[io][safetensors]") {
  TempDir dir;
  torch::nn::Linear linear(3, 2);
  memopt::io::save_safetensors(dir.file("linear.safetensors"), linear->named_parameters(), {{"format", "pt"}});
  auto file = SafetensorsFile::open(dir.file("linear.safetensors"));
  CHECK(file->names() == std::vector<std::string>{"weight", "bias"});
  CHECK(torch::equal(file->get("weight"), linear->weight));
}

TEST_CASE("save_safetensors rejects bad names and dtypes", "[io][safetensors]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  auto t = torch::ones({2});
  require_error([&] { memopt::io::save_safetensors(path, Named{{"a", t}, {"a", t}}); }, {path, "'a' appears twice"});
  require_error([&] { memopt::io::save_safetensors(path, Named{{"a", t}, {"", t}}); }, {"tensor 1 has an empty name"});
  require_error([&] { memopt::io::save_safetensors(path, Named{{"__metadata__", t}}); }, {"reserves"});
  require_error([&] { memopt::io::save_safetensors(path, Named{{"c", torch::ones({2}, torch::kComplexFloat)}}); },
                {"'c' has dtype ComplexFloat", "BF16", "torch::kFloat32"});
  require_error([&] { memopt::io::save_safetensors(path, Named{{"u", torch::Tensor()}}); }, {"'u' is undefined"});
  require_error([&] { memopt::io::save_safetensors(dir.file("no/such/dir.safetensors"), Named{{"a", t}}); },
                {"cannot create", "no/such/dir.safetensors.tmp"});
  CHECK_FALSE(fs::exists(path));
  CHECK_FALSE(fs::exists(path + ".tmp"));
}

TEST_CASE("SafetensorsFile rejects malformed files with the field and value seen", "[io][safetensors]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  auto rejects = [&](const std::vector<std::string>& parts) {
    require_error([&] { SafetensorsFile::open(path); }, parts);
  };
  const std::string f32x2 = R"("dtype": "F32", "shape": [2])";

  SECTION("missing file") {
    require_error([&] { SafetensorsFile::open(dir.file("nope.safetensors")); }, {"cannot open", "nope.safetensors"});
  }
  SECTION("shorter than 8 bytes") {
    write_text(path, "12345");
    rejects({path, "holds 5 bytes"});
  }
  SECTION("header length 0") {
    write_raw(path, "", 0, 0);
    rejects({path, "header length of 0"});
  }
  SECTION("header length absurd") {
    write_raw(path, "{}", 0, 200'000'000);
    rejects({path, "header of 200000000 bytes", "100000000-byte limit"});
  }
  SECTION("header length beyond the file") {
    write_raw(path, "{}", 0, 64);
    rejects({path, "header of 64 bytes but holds only 2"});
  }
  SECTION("header not JSON") {
    write_raw(path, "{\"a\": {nope");
    rejects({path, "not valid JSON", "parse error"});
  }
  SECTION("header not UTF-8") {
    write_raw(path, "{\"\xff\": 1}");
    rejects({path, "not valid JSON", "UTF-8"});
  }
  SECTION("header not an object") {
    write_raw(path, "[1, 2]");
    rejects({path, "must be a JSON object (got [1,2])"});
  }
  SECTION("entry not an object") {
    write_raw(path, R"({"a": 3})");
    rejects({"tensor 'a' must be an object", "(got 3)"});
  }
  SECTION("missing dtype / shape / data_offsets") {
    write_raw(path, R"({"a": {"shape": [2], "data_offsets": [0, 8]}})", 8);
    rejects({"tensor 'a' has no \"dtype\" field"});
    write_raw(path, R"({"a": {"dtype": "F32", "data_offsets": [0, 8]}})", 8);
    rejects({"tensor 'a' has no \"shape\" field"});
    write_raw(path, R"({"a": {"dtype": "F32", "shape": [2]}})", 8);
    rejects({"tensor 'a' has no \"data_offsets\" field"});
  }
  SECTION("wrong JSON types") {
    write_raw(path, R"({"a": {"dtype": 5, "shape": [2], "data_offsets": [0, 8]}})", 8);
    rejects({"tensor 'a'", "\"dtype\" must be a string (got 5)"});
    write_raw(path, R"({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}})", 8);
    rejects({"tensor 'a'", "\"shape\" must be an array of integers (got \"2\")"});
    write_raw(path, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}})", 8);
    rejects({"tensor 'a'", "\"data_offsets\" must be two non-negative integers", "[\"0\",\"8\"]"});
  }
  SECTION("unknown dtype") {
    write_raw(path, R"({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}})", 8);
    rejects({"tensor 'a' has dtype \"C64\"", "supported: F64, F32"});
  }
  SECTION("negative or non-integer shape") {
    write_raw(path, R"({"a": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}})", 8);
    rejects({"tensor 'a'", "has -1 at index 1", "non-negative integer"});
    write_raw(path, R"({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 8]}})", 8);
    rejects({"tensor 'a'", "has 1.5 at index 0"});
  }
  SECTION("shape too large, including overflow") {
    write_raw(path, R"({"a": {"dtype": "F32", "shape": [4611686018427387904, 8], "data_offsets": [0, 8]}})", 8);
    rejects({"tensor 'a' has shape [4611686018427387904,8] of more than 2^64 bytes"});
    write_raw(path, R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8);
    rejects({"tensor 'a' has shape [3] of 12 bytes, larger than the 8-byte data section"});
  }
  SECTION("data_offsets malformed") {
    write_raw(path, "{\"a\": {" + f32x2 + ", \"data_offsets\": [0]}}", 8);
    rejects({"tensor 'a'", "two non-negative integers", "(got [0])"});
    write_raw(path, "{\"a\": {" + f32x2 + ", \"data_offsets\": [8, 0]}}", 8);
    rejects({"tensor 'a' has data_offsets [8,0] with begin > end"});
    write_raw(path, "{\"a\": {" + f32x2 + ", \"data_offsets\": [4, 12]}}", 8);
    rejects({"tensor 'a' has data_offsets [4,12] reaching past the end of the 8-byte data section"});
    write_raw(path, "{\"a\": {" + f32x2 + ", \"data_offsets\": [0, 4]}}", 8);
    rejects({"tensor 'a' has data_offsets [0,4] spanning 4 bytes", "F32 and shape [2] need 8"});
  }
  SECTION("overlapping tensors") {
    write_raw(path, "{\"a\": {" + f32x2 + ", \"data_offsets\": [0, 8]}, \"b\": {" + f32x2 +
                        ", \"data_offsets\": [4, 12]}}", 12);
    rejects({path, "tensors 'a' and 'b' overlap (bytes 4..8"});
  }
  SECTION("holes and trailing bytes") {
    write_raw(path, "{\"a\": {" + f32x2 + ", \"data_offsets\": [0, 8]}, \"b\": {" + f32x2 +
                        ", \"data_offsets\": [12, 20]}}", 20);
    rejects({path, "bytes 8..12 of the data section belong to no tensor", "before 'b'"});
    write_raw(path, "{\"a\": {" + f32x2 + ", \"data_offsets\": [0, 8]}}", 12);
    rejects({path, "bytes 8..12", "trailing bytes"});
  }
  SECTION("bad metadata") {
    write_raw(path, R"({"__metadata__": [1]})");
    rejects({"\"__metadata__\" must be an object of strings (got [1])"});
    write_raw(path, R"({"__metadata__": {"step": 3}})");
    rejects({"\"__metadata__\" entry 'step' must be a string (got 3)"});
  }
  SECTION("valid edge cases still open") {
    write_raw(path, R"({"__metadata__": null, "z": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}      )");
    auto file = SafetensorsFile::open(path);
    CHECK(file->names() == std::vector<std::string>{"z"});
    CHECK(file->get("z").numel() == 0);
  }
}

TEST_CASE("SafetensorsFile refuses what fuzz/safetensors_header_fuzz found with a message, not a crash",
          "[io][safetensors]") {
  // A number beyond a double's range made nlohmann::json throw out_of_range, which escaped
  // open() as a non-c10 exception; a deeply nested header overflowed the stack while its
  // error message was written (snippet() dumped the whole value, one recursion per level).
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  auto rejects = [&](const std::vector<std::string>& parts) {
    require_error([&] { SafetensorsFile::open(path); }, parts);
  };
  SECTION("a number too large for a double") {
    write_raw(path, R"({"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}})", 4);
    rejects({path, "not valid JSON", "number overflow parsing '1e400'"});
  }
  SECTION("a header of arrays nested 10^6 deep") {
    const size_t depth = 1'000'000;
    write_raw(path, std::string(depth, '[') + std::string(depth, ']'));
    rejects({path, "must be a JSON object (got " + std::string(80, '[') + "…)"});
    write_raw(path, "{\"a\": " + std::string(depth, '[') + std::string(depth, ']') + "}");
    rejects({path, "tensor 'a' must be an object", "(got " + std::string(80, '[') + "…)"});
  }
  SECTION("snippet() writes what dump() writes, cut at max_chars") {
    using memopt::io::detail::snippet;
    const auto value = nlohmann::json::parse(R"({"b": [1, 2.5, "x\u00e9"], "a": {"k": null, "t": true}})");
    const std::string full = value.dump(-1, ' ', true, nlohmann::json::error_handler_t::replace);
    CHECK(snippet(value) == full);
    for (size_t n : {0, 1, 7, 20}) CHECK(snippet(value, n) == full.substr(0, n) + "…");
  }
}

TEST_CASE("safetensors files cross-check with an independent numpy reader and writer", "[io][safetensors]") {
  require_numpy();
  TempDir dir;

  SECTION("memopt writes, Python verifies") {
    const std::string path = dir.file("memopt.safetensors");
    memopt::io::save_safetensors(path, recipe(), kRecipeMetadata);
    const auto [code, output] = run_check("verify", path);
    INFO(output);
    CHECK(code == 0);
    CHECK_THAT(output, Catch::Contains("ok:"));
  }
  SECTION("Python writes (unpadded, unaligned), memopt reads") {
    const std::string path = dir.file("python.safetensors");
    const auto [code, output] = run_check("write", path);
    INFO(output);
    REQUIRE(code == 0);
    auto file = SafetensorsFile::open(path);
    CHECK(file->metadata() == kRecipeMetadata);
    CHECK(file->names().front() == "u8");
    CHECK(file->info("f32").begin == 13);  // unaligned: get() must copy
    for (const auto& [name, expected] : recipe()) {
      INFO(name);
      CHECK(same_bits(file->get(name), expected));
    }
  }
}

TEST_CASE("safetensors files cross-check with the safetensors package both ways", "[io][safetensors]") {
  TempDir dir;

  SECTION("memopt writes, safetensors.torch.load_file reads") {
    const std::string path = dir.file("memopt.safetensors");
    memopt::io::save_safetensors(path, recipe(), kRecipeMetadata);
    const auto [code, output] = run_check("verify-package", path);
    INFO(output);
    CHECK(code == 0);
    CHECK_THAT(output, Catch::Contains("ok:"));
  }
  SECTION("safetensors.torch.save_file writes, memopt reads") {
    const std::string path = dir.file("package.safetensors");
    const auto [code, output] = run_check("write-package", path);
    INFO(output);
    REQUIRE(code == 0);
    auto file = SafetensorsFile::open(path);
    CHECK(file->metadata() == kRecipeMetadata);
    CHECK(file->names().size() == recipe().size());
    for (const auto& [name, expected] : recipe()) {
      INFO(name);
      CHECK(same_bits(file->get(name), expected));
    }
  }
}
