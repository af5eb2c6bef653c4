// Tests for memopt/data/shard.hpp: token shards round-trip uint16 and uint32 ids, in
// files and in memory, and bad files and ids are refused with the path, the value and a HINT.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <unistd.h>

#include <torch/torch.h>

#include <memopt/data/brown.hpp>
#include <memopt/data/kjv.hpp>
#include <memopt/data/loader.hpp>
#include <memopt/data/shard.hpp>
#include <memopt/data/tokenizer.hpp>

#include "data/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::data;  // NOLINT: the fixtures of these tests
namespace fs = std::filesystem;
using memopt::data::LoaderOptions;
using memopt::data::RandomWindowLoader;
using memopt::data::TokenShard;

TEST_CASE("write_shard and TokenShard round-trip uint16 ids", "[data][shard]") {
  TempDir dir;
  const std::string path = dir.file("small.bin");
  std::vector<int32_t> tokens = {0, 1, 65535, 300, 4095, 7, 65535, 12345};
  memopt::data::write_shard(path, tokens, 65536);

  CHECK_FALSE(fs::exists(path + ".tmp"));
  CHECK(fs::file_size(path) == 64 + 2 * tokens.size());
  const auto bytes = read_bytes(path);
  CHECK(std::string(bytes.begin(), bytes.begin() + 8) == "MEMOPTTK");
  CHECK(bytes[12] == 2);  // bytes_per_token

  auto shard = TokenShard::open(path);
  CHECK(shard->path() == path);
  CHECK(shard->size() == static_cast<int64_t>(tokens.size()));
  CHECK(shard->vocab_size() == 65536);
  CHECK(shard->bytes_per_token() == 2);
  CHECK(shard->max_token_id() == 65535);
  for (size_t i = 0; i < tokens.size(); ++i) CHECK(shard->at(static_cast<int64_t>(i)) == tokens[i]);

  torch::Tensor w = shard->window(2, 4);
  CHECK(w.scalar_type() == torch::kLong);
  CHECK(w.sizes() == torch::IntArrayRef{4});
  CHECK(same(w, torch::tensor({65535, 300, 4095, 7}, torch::kLong)));
  require_error([&] { shard->window(6, 3); }, {path, "window [6"});
  require_error([&] { shard->at(8); }, {path, "index 8"});
}

TEST_CASE("write_shard picks uint32 above 65536 ids and round-trips them", "[data][shard]") {
  TempDir dir;
  const std::string path = dir.file("wide.bin");
  std::vector<int32_t> tokens = {99999, 0, 65536, 70000, 1};
  memopt::data::write_shard(path, tokens, 100000);
  CHECK(fs::file_size(path) == 64 + 4 * tokens.size());

  auto shard = TokenShard::open(path);
  CHECK(shard->bytes_per_token() == 4);
  CHECK(shard->vocab_size() == 100000);
  CHECK(same(shard->window(0, 5), torch::tensor({99999, 0, 65536, 70000, 1}, torch::kLong)));

  // An empty shard is valid too.
  memopt::data::write_shard(dir.file("empty.bin"), {}, 10);
  CHECK(TokenShard::open(dir.file("empty.bin"))->size() == 0);

  // Rewriting replaces the file (atomic rename over the old one).
  memopt::data::write_shard(path, {5, 6}, 100000);
  CHECK(TokenShard::open(path)->size() == 2);
}

TEST_CASE("TokenShard::from_tokens holds a shard in memory, same as the file", "[data][shard]") {
  TempDir dir;
  std::vector<int32_t> tokens = {3, 1, 4, 1, 5, 9, 2, 6};
  memopt::data::write_shard(dir.file("pi.bin"), tokens, 10);
  auto file = TokenShard::open(dir.file("pi.bin"));
  auto memory = TokenShard::from_tokens("pi.txt", tokens, 10);
  CHECK(memory->path() == "pi.txt");
  CHECK(memory->size() == file->size());
  CHECK(memory->max_token_id() == 9);
  CHECK(same(memory->window(0, 8), file->window(0, 8)));
  memopt::data::RandomWindowLoader a(memory, memopt::data::LoaderOptions(2, 3).seed(7));
  memopt::data::RandomWindowLoader b(file, memopt::data::LoaderOptions(2, 3).seed(7));
  CHECK(same(a.next().inputs, b.next().inputs));
  require_error([&] { TokenShard::from_tokens("bad.txt", {1, 12}, 10); }, {"bad.txt", "token id 12", "HINT"});
}

TEST_CASE("write_shard rejects ids outside the vocab", "[data][shard]") {
  TempDir dir;
  const std::string path = dir.file("bad.bin");
  require_error([&] { memopt::data::write_shard(path, {1, 2, 50}, 50); },
                {path, "token id 50", "vocab_size 50"});
  require_error([&] { memopt::data::write_shard(path, {1, -3}, 50); }, {path, "token id -3"});
  CHECK_FALSE(fs::exists(path));
  CHECK_FALSE(fs::exists(path + ".tmp"));
}

TEST_CASE("TokenShard rejects bad files with the path, the value and a hint", "[data][shard]") {
  TempDir dir;
  const std::string good = dir.file("good.bin");
  memopt::data::write_shard(good, {1, 2, 77, 3, 4}, 100);
  auto copy_of_good = [&](const std::string& name) {
    const std::string path = dir.file(name);
    fs::copy_file(good, path);
    return path;
  };

  SECTION("missing file") {
    const std::string path = dir.file("nope.bin");
    require_error([&] { TokenShard::open(path); }, {path, "No such file", "fetch_corpus"});
  }
  SECTION("shorter than the header") {
    const std::string path = dir.file("tiny.bin");
    write_bytes(path, std::vector<unsigned char>(10, 0));
    require_error([&] { TokenShard::open(path); }, {path, "holds 10 bytes", "64-byte header"});
  }
  SECTION("truncated") {
    const std::string path = copy_of_good("truncated.bin");
    fs::resize_file(path, 64 + 2 * 5 - 3);
    require_error([&] { TokenShard::open(path); },
                  {path, "is 71 bytes", "promises 5 tokens", "truncated"});
  }
  SECTION("wrong magic") {
    const std::string path = copy_of_good("magic.bin");
    auto bytes = read_bytes(path);
    std::copy_n("BADMAGIC", 8, bytes.begin());
    write_bytes(path, bytes);
    require_error([&] { TokenShard::open(path); }, {path, "magic 'BADMAGIC'", "MEMOPTTK"});
  }
  SECTION("unknown version") {
    const std::string path = copy_of_good("version.bin");
    patch_le(path, 8, 9, 4);
    require_error([&] { TokenShard::open(path); }, {path, "format version 9"});
  }
  SECTION("bad bytes_per_token") {
    const std::string path = copy_of_good("width.bin");
    patch_le(path, 12, 3, 4);
    require_error([&] { TokenShard::open(path); }, {path, "bytes_per_token 3"});
  }
  SECTION("token id >= the header's vocab_size") {
    const std::string path = copy_of_good("vocab.bin");
    patch_le(path, 24, 10, 8);  // vocab_size 100 -> 10; the first id >= 10 is 77 at 2
    require_error([&] { TokenShard::open(path); },
                  {path, "token id 77", "position 2", "vocab_size 10", "scripts/demo"});
  }
  SECTION("check_vocab against a smaller model") {
    auto shard = TokenShard::open(good);
    CHECK(shard->max_token_id() == 77);
    CHECK_NOTHROW(shard->check_vocab(100));
    CHECK_NOTHROW(shard->check_vocab(4096));
    require_error([&] { shard->check_vocab(50); },
                  {good, "token id 77 >= model vocab 50", "vocab_size 100"});
    require_error([&] { shard->check_vocab(90); }, {good, "model has vocab 90"});
  }
}
