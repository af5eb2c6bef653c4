// Tests for memopt/io: safetensors (bit-exact round trip of every dtype, metadata,
// zero-copy views that outlive the file object, one error per malformed header field,
// and a cross-check both ways with tests/io/safetensors_check.py, a json + numpy reader
// and writer) and HF-style LLaMA checkpoints (save_pretrained → load_pretrained gives the
// same logits; config.json round trip; missing fields, tied embeddings, wrong names, shapes).
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

#include "support.hpp"

#include <memopt/io/pretrained.hpp>
#include <memopt/io/safetensors.hpp>
#include <memopt/models/llama.hpp>

namespace fs = std::filesystem;
using memopt::io::SafetensorsFile;
using Named = std::vector<std::pair<std::string, torch::Tensor>>;

namespace {

struct TempDir : memopt::test::TempDir {
  TempDir() : memopt::test::TempDir("memopt_io_test") {}
};

using memopt::test::read_text;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

/// A safetensors file by hand: u64 length (`length` overrides it), `header`, `data_bytes` zeros.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes = 0, int64_t length = -1) {
  const uint64_t n = length >= 0 ? static_cast<uint64_t>(length) : header.size();
  std::string bytes(8, '\0');
  for (int b = 0; b < 8; ++b) bytes[b] = static_cast<char>(n >> (8 * b));
  write_text(path, bytes + header + std::string(data_bytes, '\0'));
}

void require_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  memopt::test::require_error(fn, "memopt::io:", parts);
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

// ---- HF-style checkpoints ---------------------------------------------------------------

namespace {

memopt::models::LlamaConfig tiny_config() {
  return memopt::models::LlamaConfig()
      .vocab_size(64)
      .hidden_size(32)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .num_key_value_heads(2)
      .intermediate_size(48)
      .max_position_embeddings(16)
      .rope_theta(500000.0)
      .rms_norm_eps(1e-6);
}

torch::Tensor logits_of(memopt::models::Llama& model) {
  torch::NoGradGuard no_grad;
  model->eval();
  return model->forward(torch::arange(16, torch::kLong).remainder(64).reshape({2, 8}));  // (2, 8, 64)
}

/// dir/config.json with `edit` applied to the tiny config's JSON.
void write_config(const TempDir& dir, const std::function<void(nlohmann::json&)>& edit) {
  auto json = memopt::io::to_json(tiny_config());
  edit(json);
  write_text(dir.file("config.json"), json.dump(2));
}

}  // namespace

TEST_CASE("save_pretrained then load_pretrained gives the same logits", "[io][pretrained]") {
  torch::manual_seed(0);
  TempDir dir;
  memopt::models::Llama model(tiny_config());
  memopt::io::save_pretrained(*model, model->config, dir.path.string());

  auto file = SafetensorsFile::open(dir.file("model.safetensors"));
  CHECK(file->metadata().at("format") == "pt");
  CHECK(file->contains("model.layers.1.self_attn.q_proj.weight"));
  CHECK(file->contains("lm_head.weight"));
  CHECK(file->names().size() == model->named_parameters().size());
  const auto json = nlohmann::json::parse(read_text(dir.file("config.json")));
  CHECK(json["architectures"][0] == "LlamaForCausalLM");
  CHECK(json["num_key_value_heads"] == 2);
  CHECK(json["torch_dtype"] == "float32");
  CHECK_FALSE(json.contains("causal"));

  memopt::models::Llama loaded = memopt::io::load_pretrained(dir.path.string());
  CHECK(loaded->is_training());
  CHECK(torch::equal(logits_of(loaded), logits_of(model)));

  // bf16 on disk: the loaded float32 weights are the bf16-rounded originals.
  memopt::io::save_pretrained(model, dir.file("bf16"), torch::kBFloat16);
  CHECK(SafetensorsFile::open(dir.file("bf16/model.safetensors"))->info("lm_head.weight").dtype == "BF16");
  CHECK(nlohmann::json::parse(read_text(dir.file("bf16/config.json")))["torch_dtype"] == "bfloat16");
  auto rounded = memopt::io::load_pretrained(dir.file("bf16"));
  CHECK(torch::equal(rounded->lm_head->weight, model->lm_head->weight.to(torch::kBFloat16).to(torch::kFloat32)));
}

TEST_CASE("config.json round-trips and takes HF defaults", "[io][pretrained]") {
  TempDir dir;
  const std::string path = dir.file("config.json");
  const auto config = tiny_config().causal(false).dropout(0.125).initializer_range(0.01);
  memopt::io::write_llama_config(config, path);
  CHECK(nlohmann::json::parse(read_text(path))["causal"] == false);
  const auto back = memopt::io::read_llama_config(path);
  CHECK(back.vocab_size() == 64);
  CHECK(back.hidden_size() == 32);
  CHECK(back.num_hidden_layers() == 2);
  CHECK(back.num_attention_heads() == 4);
  CHECK(back.num_key_value_heads() == 2);
  CHECK(back.intermediate_size() == 48);
  CHECK(back.max_position_embeddings() == 16);
  CHECK(back.rope_theta() == 500000.0);
  CHECK(back.rms_norm_eps() == 1e-6);
  CHECK(back.dropout() == 0.125);
  CHECK(back.initializer_range() == 0.01);
  CHECK_FALSE(back.causal());

  // The LLaMA rule's FFN width and implicit KV heads are written resolved.
  memopt::io::write_llama_config(memopt::models::LlamaConfig().hidden_size(256).num_attention_heads(4), path);
  const auto json = nlohmann::json::parse(read_text(path));
  CHECK(json["intermediate_size"] == 704);
  CHECK(json["num_key_value_heads"] == 4);

  // Only the four required fields: the rest are HF's defaults; null means unset.
  write_text(path, R"({"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "num_key_value_heads": null, "rope_scaling": null})");
  const auto defaults = memopt::io::read_llama_config(path);
  CHECK(defaults.kv_heads() == 2);
  CHECK(defaults.intermediate_size() == 11008);
  CHECK(defaults.max_position_embeddings() == 2048);
  CHECK(defaults.rms_norm_eps() == 1e-6);
  CHECK(defaults.rope_theta() == 10000.0);
  CHECK(defaults.causal());

  // transformers 5 writes theta inside rope_parameters (and head_dim); both are read.
  write_text(path, R"({"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "head_dim": 32, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}})");
  CHECK(memopt::io::read_llama_config(path).rope_theta() == 500000.0);
}

TEST_CASE("bad config.json files give errors naming the file and field", "[io][pretrained]") {
  TempDir dir;
  const std::string path = dir.file("config.json");
  auto rejects = [&](const std::function<void(nlohmann::json&)>& edit, const std::vector<std::string>& parts) {
    write_config(dir, edit);
    auto all = parts;
    all.push_back(path);
    require_error([&] { memopt::io::read_llama_config(path); }, all);
  };
  rejects([](auto& j) { j.erase("hidden_size"); }, {"field \"hidden_size\" is missing"});
  rejects([](auto& j) { j["hidden_size"] = "512"; }, {"field \"hidden_size\" must be an integer (got \"512\")"});
  rejects([](auto& j) { j["num_hidden_layers"] = 0; }, {"field \"num_hidden_layers\" must be >= 1 (got 0)"});
  rejects([](auto& j) { j["rms_norm_eps"] = "tiny"; }, {"\"rms_norm_eps\" must be a number (got \"tiny\")"});
  rejects([](auto& j) { j["causal"] = 1; }, {"\"causal\" must be true or false (got 1)"});
  rejects([](auto& j) { j["tie_word_embeddings"] = true; }, {"\"tie_word_embeddings\" is true", "untied lm_head"});
  rejects([](auto& j) { j["hidden_act"] = "gelu"; }, {"\"hidden_act\" is \"gelu\"", "silu"});
  rejects([](auto& j) { j["rope_scaling"] = {{"type", "linear"}}; }, {"\"rope_scaling\" is {\"type\":\"linear\"}"});
  rejects([](auto& j) { j["attention_bias"] = true; }, {"\"attention_bias\" is true"});
  rejects([](auto& j) { j["num_attention_heads"] = 5; }, {"hidden_size / num_attention_heads"});
  rejects([](auto& j) { j["rope_parameters"] = {{"rope_theta", 1e4}, {"rope_type", "llama3"}}; },
          {"\"rope_parameters\" is {", "llama3", "the default one"});
  rejects([](auto& j) { j["rope_theta"] = 1e4; j["rope_parameters"] = {{"rope_theta", 5e5}}; },
          {"\"rope_theta\" is 10000 but rope_parameters.rope_theta is 500000"});
  rejects([](auto& j) { j["rope_parameters"] = 5e5; }, {"\"rope_parameters\" must be an object (got 500000"});
  rejects([](auto& j) { j["head_dim"] = 7; }, {"\"head_dim\" is 7", "hidden_size / num_attention_heads wide"});
  write_text(path, "{\"vocab_size\": ");
  require_error([&] { memopt::io::read_llama_config(path); }, {path, "not valid JSON"});
  require_error([&] { memopt::io::read_llama_config(dir.file("none.json")); }, {"cannot open config", "none.json"});
}

TEST_CASE("load_pretrained rejects missing files, wrong names and wrong shapes", "[io][pretrained]") {
  torch::manual_seed(0);
  TempDir dir;
  const std::string root = dir.path.string();
  const std::string weights = dir.file("model.safetensors");
  memopt::models::Llama model(tiny_config());
  auto params = model->named_parameters();

  require_error([&] { memopt::io::load_pretrained(dir.file("nope")); }, {dir.file("nope"), "is not a directory"});
  require_error([&] { memopt::io::load_pretrained(root); }, {dir.file("config.json"), "does not exist"});
  memopt::io::write_llama_config(tiny_config(), dir.file("config.json"));
  require_error([&] { memopt::io::load_pretrained(root); }, {weights, "does not exist", "save_pretrained"});
  write_text(dir.file("model.safetensors.index.json"), "{}");
  require_error([&] { memopt::io::load_pretrained(root); }, {weights, "sharded checkpoint"});

  SECTION("names without the model. prefix (a base LlamaModel checkpoint)") {
    Named renamed;
    for (const auto& item : params) {
      const std::string& name = item.key();
      renamed.emplace_back(name.rfind("model.", 0) == 0 ? name.substr(6) : name, item.value());
    }
    memopt::io::save_safetensors(weights, renamed);
    require_error([&] { memopt::io::load_pretrained(root); },
                  {weights, "lacks 20 of the model's 21 tensors", "'model.embed_tokens.weight'", "(+15 more)",
                   "HF names"});
  }
  SECTION("an extra layer; inv_freq is ignored") {
    Named tensors;
    for (const auto& item : params) tensors.emplace_back(item.key(), item.value());
    tensors.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", torch::ones({4}));
    memopt::io::save_safetensors(weights, tensors);
    auto loaded = memopt::io::load_pretrained(root);
    CHECK(torch::equal(logits_of(loaded), logits_of(model)));
    tensors.emplace_back("model.layers.2.mlp.up_proj.weight", torch::ones({48, 32}));
    memopt::io::save_safetensors(weights, tensors);
    require_error([&] { memopt::io::load_pretrained(root); },
                  {"holds 1 tensors the model does not have", "'model.layers.2.mlp.up_proj.weight'",
                   "num_hidden_layers"});
  }
  SECTION("config.json does not match the weights") {
    memopt::io::save_pretrained(model, root);
    write_config(dir, [](auto& j) { j["intermediate_size"] = 64; });
    require_error([&] { memopt::io::load_pretrained(root); },
                  {"'model.layers.0.mlp.gate_proj.weight' has shape [48, 32] in the file but [64, 32] in the model",
                   "config.json"});
  }
  SECTION("load_state_dict with strict(false) loads a subset") {
    memopt::io::save_safetensors(weights, Named{{"lm_head.weight", torch::zeros({64, 32})}, {"extra", torch::ones({1})}});
    memopt::io::load_state_dict(*model, *SafetensorsFile::open(weights),
                                memopt::io::LoadStateDictOptions().strict(false));
    CHECK(model->lm_head->weight.abs().sum().item<double>() == 0.0);
    CHECK(model->model->embed_tokens->weight.abs().sum().item<double>() > 0.0);
  }
}

TEST_CASE("load_state_dict with grow_vocab loads into a model with added tokens", "[io][pretrained]") {
  torch::manual_seed(0);
  const auto grow = memopt::io::LoadStateDictOptions().grow_vocab(true);
  TempDir dir;
  memopt::models::Llama small(tiny_config());
  memopt::io::save_pretrained(small, dir.path.string());
  const auto file = SafetensorsFile::open(dir.file("model.safetensors"));
  memopt::models::Llama grown(tiny_config().vocab_size(67));  // 3 tokens added to the tokenizer

  require_error([&] { memopt::io::load_state_dict(*grown, *file); },
                {"'model.embed_tokens.weight' has shape [64, 32] in the file but [67, 32]", "grow_vocab(true)"});
  memopt::io::load_state_dict(*grown, *file, grow);
  const std::vector<std::pair<torch::Tensor, torch::Tensor>> rows = {
      {small->model->embed_tokens->weight, grown->model->embed_tokens->weight},
      {small->lm_head->weight, grown->lm_head->weight}};
  for (const auto& [old_rows, new_rows] : rows) {
    CHECK(torch::equal(new_rows.narrow(0, 0, 64), old_rows));
    for (int64_t i = 64; i < 67; ++i) CHECK(torch::allclose(new_rows[i], old_rows.mean(0), 0, 1e-6));
  }
  // The old tokens' logits are unchanged; the other tensors loaded as before.
  CHECK(torch::allclose(logits_of(grown).narrow(-1, 0, 64), logits_of(small), 1e-5, 1e-5));

  // Only the vocabulary may grow: a wider FFN still fails.
  memopt::models::Llama wider(tiny_config().vocab_size(67).intermediate_size(64));
  require_error([&] { memopt::io::load_state_dict(*wider, *file, grow); },
                {"'model.layers.0.mlp.gate_proj.weight' has shape [48, 32] in the file but [64, 32]"});
  // nor may it shrink
  memopt::models::Llama fewer(tiny_config().vocab_size(60));
  require_error([&] { memopt::io::load_state_dict(*fewer, *file, grow); },
                {"'model.embed_tokens.weight' has shape [64, 32] in the file but [60, 32]"});
}
