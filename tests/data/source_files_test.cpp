// tests/data/source_files_test.cpp — memopt/data/source_files.hpp: the files that files,
// directories (hidden ones and other extensions left out), globs and memopt-pretokenize
// indexes name, sorted, with their kinds and sizes; a spec that names nothing is an error
// naming it.
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include <memopt/data/shard.hpp>
#include <memopt/data/source_files.hpp>

#include "data/fixtures.hpp"

using namespace memopt::test::data::stream;  // NOLINT: the fixtures of the source and stream tests

namespace fs = std::filesystem;

TEST_CASE("resolve_sources: files, directories, globs and index.json, sorted, errors name the spec",
          "[data][stream]") {
  TempDir dir;
  write_docs(dir.file("c/b.txt"), 0, 2);
  write_docs(dir.file("c/a.txt"), 0, 2);
  write_text(dir.file("c/sub/x.jsonl"), "{\"text\": \"w1\"}\n");
  write_text(dir.file("c/.hidden/y.txt"), "w1\n");
  write_text(dir.file("c/notes.md"), "not data\n");
  fs::create_directories(dir.file("s"));
  memopt::data::write_shard(dir.file("s/shard-00000.bin"), {3, 26, 30, kEos}, 40);
  write_text(dir.file("s/index.json"), R"({"format": "memopt-token-shards", "shards": [{"file": "shard-00000.bin"}]})");

  auto names = [](const std::vector<memopt::data::SourceFile>& files) {
    std::vector<std::string> out;
    for (const auto& f : files) out.push_back(fs::path(f.path).lexically_relative(fs::path(files.front().path).parent_path().parent_path()).string());
    return out;
  };
  const auto in_dir = memopt::data::resolve_sources({dir.file("c")});
  REQUIRE(in_dir.size() == 3);  // a.txt, b.txt, sub/x.jsonl; hidden and .md left out
  CHECK(fs::path(in_dir[0].path).filename() == "a.txt");
  CHECK(fs::path(in_dir[1].path).filename() == "b.txt");
  CHECK(in_dir[2].kind == memopt::data::SourceKind::kJsonl);
  CHECK(in_dir[0].bytes == 6);
  CHECK(names(in_dir).size() == 3);

  const auto globbed = memopt::data::resolve_sources({dir.file("c/*.txt")});
  REQUIRE(globbed.size() == 2);
  CHECK(fs::path(globbed[0].path).filename() == "a.txt");

  const auto indexed = memopt::data::resolve_sources({dir.file("s")});  // the folder's index.json
  REQUIRE(indexed.size() == 1);
  CHECK(indexed[0].kind == memopt::data::SourceKind::kShard);
  CHECK(memopt::data::resolve_sources({dir.file("s/index.json")}).size() == 1);

  require_error([&] { memopt::data::resolve_sources({dir.file("missing.txt")}); }, {"missing.txt", "does not exist"},
                "memopt::data");
  require_error([&] { memopt::data::resolve_sources({dir.file("c/*.csv")}); }, {"*.csv", "matches no file"},
                "memopt::data");
  require_error([&] { memopt::data::resolve_sources({}); }, {"no data source"}, "memopt::data");
  write_text(dir.file("bad/index.json"), "{\"shards\": 3}");
  require_error([&] { memopt::data::resolve_sources({dir.file("bad/index.json")}); },
                {"bad/index.json", "memopt-pretokenize index"}, "memopt::data");
}
