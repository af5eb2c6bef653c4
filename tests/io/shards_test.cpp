// tests/io/shards_test.cpp — memopt/io/shards.hpp: save_sharded splits tensors as transformers
// does (in order, at most max_shard_bytes a shard, an oversized tensor alone) and writes the
// index; SafetensorsShards reads shards or one file back bit for bit; an earlier save's files
// do not mislead a reader; a broken index or a missing shard gets an error naming the index,
// the shard and the tensor, with a HINT; copy_tensor copies slice by slice into any dtype and
// layout. Against transformers' own shards: tests/models/llama_hf_test.cpp.
#include <catch2/catch.hpp>

#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/io/shards.hpp>

#include "support.hpp"

namespace fs = std::filesystem;
using memopt::io::SafetensorsShards;
using memopt::test::TempDir;

namespace {

using Named = std::vector<std::pair<std::string, torch::Tensor>>;

// 5 fp32 tensors of 400, 400, 1200, 40 and 400 bytes.
Named some_tensors() {
  torch::manual_seed(3);
  return {{"a", torch::randn({10, 10})}, {"b", torch::randn({100})}, {"big", torch::randn({300})},
          {"c", torch::arange(10, torch::kFloat)}, {"d", torch::randn({4, 25})}};
}

void check_same(const SafetensorsShards& read, const Named& written) {
  REQUIRE(read.names().size() == written.size());
  for (const auto& [name, tensor] : written) {
    INFO(name);
    REQUIRE(read.contains(name));
    CHECK(torch::equal(read.get(name), tensor));
    CHECK(read.info(name).shape == tensor.sizes().vec());
  }
}

void require_io_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  memopt::test::require_error(fn, "memopt::io:", parts);
}

}  // namespace

TEST_CASE("save_sharded fills shards in order up to max_shard_bytes and SafetensorsShards reads them back",
          "[io][shards]") {
  TempDir dir("memopt_shards");
  const Named tensors = some_tensors();
  const auto files = memopt::io::save_sharded(dir.path.string(), tensors, {{"format", "pt"}}, 1000);
  // a + b = 800; big (1200) is over the limit alone, so it gets a shard of its own; c + d = 440:
  // {a, b}, {big}, {c, d}.
  REQUIRE(files.size() == 4);
  CHECK(fs::path(files.back()).filename() == "model.safetensors.index.json");
  CHECK(fs::path(files[0]).filename() == "model-00001-of-00003.safetensors");
  const auto index = nlohmann::json::parse(memopt::test::read_text(files.back()));
  CHECK(index["metadata"]["total_size"] == 400 + 400 + 1200 + 40 + 400);
  CHECK(index["metadata"]["total_parameters"] == 100 + 100 + 300 + 10 + 100);
  CHECK(index["weight_map"]["a"] == "model-00001-of-00003.safetensors");
  CHECK(index["weight_map"]["b"] == "model-00001-of-00003.safetensors");
  CHECK(index["weight_map"]["big"] == "model-00002-of-00003.safetensors");
  CHECK(index["weight_map"]["c"] == "model-00003-of-00003.safetensors");
  CHECK(index["weight_map"]["d"] == "model-00003-of-00003.safetensors");
  CHECK(!fs::exists(dir.file("model.safetensors")));

  const auto read = SafetensorsShards::open_dir(dir.path.string());
  CHECK(read.num_files() == 3);
  CHECK(read.path() == files.back());
  CHECK(read.names() == std::vector<std::string>{"a", "b", "big", "c", "d"});
  check_same(read, tensors);
}

TEST_CASE("save_sharded writes one model.safetensors when the tensors fit, and removes an earlier layout",
          "[io][shards]") {
  TempDir dir("memopt_shards");
  const Named tensors = some_tensors();
  memopt::io::save_sharded(dir.path.string(), tensors, {}, 1000);  // 3 shards and the index
  const auto files = memopt::io::save_sharded(dir.path.string(), tensors, {}, 0);
  REQUIRE(files.size() == 1);
  CHECK(fs::path(files[0]).filename() == "model.safetensors");
  CHECK(!fs::exists(dir.file("model.safetensors.index.json")));  // would win over the new file
  CHECK(!fs::exists(dir.file("model-00001-of-00003.safetensors")));
  const auto read = SafetensorsShards::open_dir(dir.path.string());
  CHECK(read.num_files() == 1);
  check_same(read, tensors);
  // Back to shards, then shards of another count: the single file goes, the old shards too.
  memopt::io::save_sharded(dir.path.string(), tensors, {}, 1000);  // 3 shards
  memopt::io::save_sharded(dir.path.string(), tensors, {}, 500);   // {a}, {b}, {big}, {c, d}
  CHECK(!fs::exists(dir.file("model.safetensors")));
  CHECK(!fs::exists(dir.file("model-00001-of-00003.safetensors")));
  CHECK(fs::exists(dir.file("model-00004-of-00004.safetensors")));
  check_same(SafetensorsShards::open_dir(dir.path.string()), tensors);
}

TEST_CASE("a broken shard index names the index, the shard and the tensor, with a HINT", "[io][shards]") {
  TempDir dir("memopt_shards");
  const Named tensors = some_tensors();
  memopt::io::save_sharded(dir.path.string(), tensors, {}, 1000);
  const std::string index = dir.file("model.safetensors.index.json");
  const std::string good = memopt::test::read_text(index);
  auto with_map = [&](const nlohmann::json& map) {
    memopt::test::write_text(index, nlohmann::json{{"weight_map", map}}.dump());
  };
  const auto open = [&] { SafetensorsShards::open_dir(dir.path.string()); };

  SECTION("a missing shard") {
    fs::remove(dir.file("model-00002-of-00003.safetensors"));
    require_io_error(open, {index, "model-00002-of-00003.safetensors", "'big'", "does not exist", "HINT"});
  }
  SECTION("an index pointing at a tensor its shard lacks") {
    auto map = nlohmann::json::parse(good)["weight_map"];
    map["a"] = "model-00003-of-00003.safetensors";
    with_map(map);
    require_io_error(open, {index, "'a'", "model-00003-of-00003.safetensors", "no such tensor", "HINT"});
  }
  SECTION("a shard outside the index's folder") {
    with_map({{"a", "../model-00001-of-00003.safetensors"}});
    require_io_error(open, {index, "\"a\"", "../model-00001-of-00003.safetensors", "not a file name", "HINT"});
  }
  SECTION("not JSON, no weight_map, a non-string entry, an empty map") {
    memopt::test::write_text(index, "{\"weight_map\": ");
    require_io_error(open, {index, "not valid JSON", "HINT"});
    memopt::test::write_text(index, "{\"metadata\": {}}");
    require_io_error(open, {index, "weight_map", "HINT"});
    with_map({{"a", 3}});
    require_io_error(open, {index, "\"a\"", "shard file name", "HINT"});
    with_map(nlohmann::json::object());
    require_io_error(open, {index, "empty", "HINT"});
  }
  SECTION("a tensor the shards do not hold") {
    const auto read = SafetensorsShards::open_dir(dir.path.string());
    require_io_error([&] { read.get("e"); }, {index, "'e'", "HINT"});
  }
}

TEST_CASE("copy_tensor copies a tensor of several slices into any dtype and layout", "[io][shards]") {
  TempDir dir("memopt_shards");
  // 1000 x 750 fp32, 3 MB: more than one kCopySliceBytes slice, and a partial last slice.
  torch::manual_seed(7);
  const Named tensors = {{"small", torch::randn({3, 4})}, {"big", torch::randn({1000, 750})}};
  REQUIRE(tensors[1].second.nbytes() > static_cast<size_t>(memopt::io::kCopySliceBytes));
  REQUIRE(tensors[1].second.nbytes() % memopt::io::kCopySliceBytes != 0);
  memopt::io::save_sharded(dir.path.string(), tensors, {}, 1000);  // {small}, {big}
  const auto read = SafetensorsShards::open_dir(dir.path.string());
  REQUIRE(read.num_files() == 2);
  static_assert(memopt::io::TensorSource<SafetensorsShards> && memopt::io::TensorSource<memopt::io::SafetensorsFile>);
  torch::NoGradGuard no_grad;

  const torch::Tensor same = torch::empty({1000, 750});
  memopt::io::copy_tensor(read, "big", same);
  CHECK(torch::equal(same, tensors[1].second));
  const torch::Tensor bf16 = torch::empty({1000, 750}, torch::kBFloat16);
  memopt::io::copy_tensor(read, "big", bf16);
  CHECK(torch::equal(bf16, tensors[1].second.to(torch::kBFloat16)));
  const torch::Tensor transposed = torch::empty({750, 1000}).t();  // not contiguous: copied whole
  memopt::io::copy_tensor(read, "big", transposed);
  CHECK(torch::equal(transposed, tensors[1].second));
  const torch::Tensor small = torch::empty({3, 4}, torch::kFloat64);
  memopt::io::copy_tensor(read, "small", small);
  CHECK(torch::equal(small, tensors[0].second.to(torch::kFloat64)));
  check_same(read, tensors);  // released pages read back the same bytes
}
