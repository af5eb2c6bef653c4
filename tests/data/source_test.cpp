// tests/data/source_test.cpp — memopt/data/source.hpp: resolving files, directories, globs and
// indexes; documents by line, paragraph and JSONL record, read on from a position; bad sources
// and records named by file, line and value.
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include <memopt/data/shard.hpp>
#include <memopt/data/source.hpp>

#include "data/fixtures.hpp"

using namespace memopt::test::data::stream;  // NOLINT: the fixtures of the source and stream tests

namespace fs = std::filesystem;
using memopt::data::DocumentReader;
using memopt::data::RawDocument;
using memopt::data::SourceOptions;
using memopt::data::Split;

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

TEST_CASE("DocumentReader: a document a line, a paragraph, a JSONL record, blank lines are no documents",
          "[data][stream]") {
  TempDir dir;
  write_text(dir.file("t.txt"), "one line\n\n  \nsecond one\nthird\n\nlast para");
  write_text(dir.file("r.jsonl"), "{\"text\": \"first\", \"id\": 1}\n\n{\"body\": 2, \"text\": \"second\\nline\"}\n");
  auto read_all = [](DocumentReader reader) {
    std::vector<std::string> out;
    RawDocument doc;
    while (reader.next(doc)) out.push_back(doc.text);
    return out;
  };
  using V = std::vector<std::string>;
  const auto txt = memopt::data::resolve_sources({dir.file("t.txt")});
  CHECK(read_all(DocumentReader(txt, SourceOptions())) == V{"one line", "second one", "third", "last para"});
  CHECK(read_all(DocumentReader(txt, SourceOptions().split(Split::kParagraph))) ==
        V{"one line", "second one\nthird", "last para"});
  CHECK(read_all(DocumentReader(memopt::data::resolve_sources({dir.file("r.jsonl")}), SourceOptions())) ==
        V{"first", "second\nline"});
  // epochs and max_examples: 2 passes over the first 3 documents.
  CHECK(read_all(DocumentReader(txt, SourceOptions().epochs(2).max_examples(3))) ==
        V{"one line", "second one", "third", "one line", "second one", "third"});
  // A position read mid-way continues there.
  DocumentReader reader(txt, SourceOptions());
  RawDocument doc;
  REQUIRE(reader.next(doc));
  REQUIRE(reader.next(doc));
  const auto pos = reader.position();
  CHECK(pos.line == 5);
  CHECK(pos.document == 2);
  CHECK(read_all(DocumentReader(txt, SourceOptions(), memopt::data::SourcePosition::from_json(pos.to_json()))) ==
        V{"third", "last para"});
}

TEST_CASE("Bad sources and records get errors naming the file, the line and the value", "[data][stream]") {
  TempDir dir;
  auto read_all = [](const std::string& path, SourceOptions options = SourceOptions()) {
    DocumentReader reader(memopt::data::resolve_sources({path}), options);
    RawDocument doc;
    while (reader.next(doc)) {
    }
  };
  write_text(dir.file("a.jsonl"), "{\"text\": \"ok\"}\n{\"text\": \"ok\"\n");
  require_error([&] { read_all(dir.file("a.jsonl")); }, {"a.jsonl:2", "not valid JSON", "one JSON object per line"},
                "memopt::data");
  write_text(dir.file("b.jsonl"), "[1, 2]\n");
  require_error([&] { read_all(dir.file("b.jsonl")); }, {"b.jsonl:1", "expected a JSON object, got a array"},
                "memopt::data");
  write_text(dir.file("c.jsonl"), "{\"content\": \"x\"}\n");
  require_error([&] { read_all(dir.file("c.jsonl")); }, {"c.jsonl:1", "no field \"text\"", "--text_field"},
                "memopt::data");
  CHECK_NOTHROW(read_all(dir.file("c.jsonl"), SourceOptions().text_field("content")));
  write_text(dir.file("d.jsonl"), "{\"text\": 7}\n");
  require_error([&] { read_all(dir.file("d.jsonl")); }, {"d.jsonl:1", "field \"text\" is a number"}, "memopt::data");
  write_text(dir.file("e.txt"), "short\n" + std::string(100, 'x') + "\n");
  require_error([&] { read_all(dir.file("e.txt"), SourceOptions().max_document_bytes(64)); },
                {"e.txt:2", "longer than max_document_bytes (64 bytes)"}, "memopt::data");
  write_text(dir.file("f.bin"), "MEMOPTTK but not really a shard, too short or wrong sized.........");
  require_error([&] { read_all(dir.file("f.bin")); }, {"f.bin", "format version"}, "memopt::data");
  write_text(dir.file("blank.txt"), "\n \n\n");
  require_error([&] { read_all(dir.file("blank.txt"), SourceOptions().epochs(0)); },
                {"blank.txt", "no document", "no non-blank document"}, "memopt::data");
  write_docs(dir.file("two.txt"), 0, 2);
  require_error([&] { read_all(dir.file("two.txt"), SourceOptions().epochs(0).rank(2).world_size(3)); },
                {"rank 2 of 3", "no document", "fewer ranks"}, "memopt::data");
  require_error([&] { read_all(dir.file("two.txt"), SourceOptions().rank(3).world_size(3)); },
                {"rank 3 is outside world_size 3"}, "memopt::data");
  // A JSONL record of another rank is not parsed, so it cannot fail there.
  write_text(dir.file("g.jsonl"), "{\"text\": \"w1\"}\nnot json\n");
  CHECK_NOTHROW(read_all(dir.file("g.jsonl"), SourceOptions().rank(0).world_size(2)));
  require_error([&] { read_all(dir.file("g.jsonl"), SourceOptions().rank(1).world_size(2)); }, {"g.jsonl:2"},
                "memopt::data");
}
