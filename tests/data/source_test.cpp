// tests/data/source_test.cpp — memopt/data/source.hpp: documents by line, paragraph and JSONL
// record, read on from a position; bad sources and records named by file, line and value
// (resolving files, directories, globs and indexes: source_files_test.cpp). Parquet (memopt/data/parquet.hpp, through the
// tests' Python and pyarrow): the text column's strings, nulls skipped, resumed and sharded
// like JSONL; bad files, columns and interpreters named with a HINT.
#include <catch2/catch.hpp>

#include <sys/wait.h>

#include <cerrno>
#include <chrono>
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

// ---- Parquet ----------------------------------------------------------------------------

namespace {

using memopt::data::SourceKind;
using memopt::test::ScopedPython;
using memopt::test::write_parquet;

// The texts of the next `max_documents` documents (-1: all).
std::vector<std::string> read_docs(DocumentReader& reader, int64_t max_documents = -1) {
  std::vector<std::string> out;
  RawDocument doc;
  while (static_cast<int64_t>(out.size()) != max_documents && reader.next(doc)) out.push_back(doc.text);
  return out;
}
std::vector<std::string> read_docs(DocumentReader&& reader, int64_t max_documents = -1) {
  return read_docs(reader, max_documents);
}

// a.parquet's text column: Unicode, an empty string, a newline and a tab, quotes, a control
// character, nulls; 11 rows in row groups of 3.
const nlohmann::json kRowsA = {"In the beginning", "über naïve café", "emoji 🙂👍 and 中文字符", "",
                               "two\nlines\tand a tab", nullptr, "quote \" and backslash \\", "\x01 control",
                               nullptr, nullptr, "last of a"};

std::vector<std::string> strings_of(const nlohmann::json& rows) {
  std::vector<std::string> out;
  for (const auto& r : rows) {
    if (!r.is_null()) out.push_back(r.get<std::string>());
  }
  return out;
}

}  // namespace

TEST_CASE("Parquet: each string of the text column is a document, in order, across row groups and files, "
          "null rows are none", "[data][stream][parquet]") {
  TempDir dir;
  ScopedPython python;
  nlohmann::json ids = nlohmann::json::array(), b_rows = nlohmann::json::array();
  for (int i = 0; i < static_cast<int>(kRowsA.size()); ++i) ids.push_back(i);
  for (int i = 0; i < 25; ++i) b_rows.push_back("document " + std::to_string(i));
  write_parquet(dir.file("c/a.parquet"), {{"id", ids}, {"text", kRowsA}}, 3);
  write_parquet(dir.file("c/b.parquet"), {{"text", b_rows}}, 10, {"text"});  // large_string
  write_text(dir.file("c/z.jsonl"), "{\"text\": \"from jsonl\"}\n");

  const auto files = memopt::data::resolve_sources({dir.file("c")});
  REQUIRE(files.size() == 3);
  CHECK(files[0].kind == SourceKind::kParquet);
  CHECK(files[1].kind == SourceKind::kParquet);
  CHECK(files[2].kind == SourceKind::kJsonl);
  CHECK(memopt::data::resolve_sources({dir.file("c/*.parquet")}).size() == 2);
  std::vector<std::string> want = strings_of(kRowsA);  // 8 documents: the 3 nulls are none, "" is one
  for (const auto& s : strings_of(b_rows)) want.push_back(s);
  want.push_back("from jsonl");
  const auto in_order = SourceOptions().shuffle_files(false);
  CHECK(read_docs(DocumentReader(files, in_order)) == want);

  SECTION("positions count rows (nulls too); a reader started at any of them reads the rest") {
    for (const int64_t cut : {0, 3, 5, 7, 8, 20, 34}) {
      INFO("cut after " << cut << " documents");
      DocumentReader first(files, in_order);
      REQUIRE(read_docs(first, cut).size() == static_cast<size_t>(cut));
      const auto at = memopt::data::SourcePosition::from_json(first.position().to_json());
      if (cut == 5) CHECK((at.file == 0 && at.offset == 5 && at.line == 6 && at.document == 5));  // a null next
      if (cut == 8) CHECK((at.file == 0 && at.offset == 11));  // a.parquet's last row read, its end not yet
      const auto rest = read_docs(DocumentReader(files, in_order, at));
      CHECK(rest == std::vector<std::string>(want.begin() + cut, want.end()));
    }
  }
  SECTION("rank sharding and max_examples count documents, not rows") {
    for (int64_t rank = 0; rank < 3; ++rank) {
      std::vector<std::string> mine;
      for (size_t d = static_cast<size_t>(rank); d < want.size(); d += 3) mine.push_back(want[d]);
      CHECK(read_docs(DocumentReader(files, SourceOptions(in_order).rank(rank).world_size(3))) == mine);
    }
    std::vector<std::string> twice(want.begin(), want.begin() + 6);
    twice.insert(twice.end(), want.begin(), want.begin() + 6);
    CHECK(read_docs(DocumentReader(files, SourceOptions(in_order).max_examples(6).epochs(2))) == twice);
  }
  SECTION("text_field names the column") {
    write_parquet(dir.file("d.parquet"), {{"body", {"x", nullptr, "y"}}, {"text", {1, 2, 3}}}, 2);
    CHECK(read_docs(DocumentReader(memopt::data::resolve_sources({dir.file("d.parquet")}),
                                   SourceOptions().text_field("body"))) == std::vector<std::string>{"x", "y"});
  }
}

TEST_CASE("Parquet: a reader dropped in the middle of a large file ends its Python child at once",
          "[data][stream][parquet]") {
  TempDir dir;
  ScopedPython python;
  nlohmann::json rows = nlohmann::json::array();
  for (int i = 0; i < 40000; ++i) rows.push_back("row " + std::to_string(i) + " of a file larger than the pipe");
  write_parquet(dir.file("big.parquet"), {{"text", rows}}, 5000);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) {
    DocumentReader reader(memopt::data::resolve_sources({dir.file("big.parquet")}), SourceOptions());
    const std::vector<std::string> first_two = {rows[0].get<std::string>(), rows[1].get<std::string>()};
    CHECK(read_docs(std::move(reader), 2) == first_two);
  }  // the child, blocked writing into a full pipe, is killed and reaped with its reader
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
  CHECK((::waitpid(-1, nullptr, WNOHANG) == -1 && errno == ECHILD));  // no child left, not even a zombie
}

TEST_CASE("Parquet: bad files, columns, positions and interpreters get errors naming them, with a HINT",
          "[data][stream][parquet]") {
  TempDir dir;
  ScopedPython python;
  const std::string a = dir.file("a.parquet");
  write_parquet(a, {{"id", {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}}, {"text", kRowsA}}, 3);
  auto read_all = [](const std::string& path, SourceOptions options = SourceOptions(),
                     memopt::data::SourcePosition at = {}) {
    return read_docs(DocumentReader(memopt::data::resolve_sources({path}), options, at));
  };
  require_error([&] { read_all(a, SourceOptions().text_field("body")); },
                {a, "has no column \"body\"", "its columns: id, text", "--text_field"});
  require_error([&] { read_all(a, SourceOptions().text_field("id")); },
                {a, "column \"id\" holds int64, not strings", "--text_field"});
  require_error([&] { read_all(a, SourceOptions(), {0, 0, 99, 100, 0}); },
                {a, "holds 11 rows, the position is at row 99", "changed since the checkpoint"});
  require_error([&] { read_all(a, SourceOptions().max_document_bytes(10)); },
                {a, "row 0 of column \"text\" is longer than max_document_bytes (10 bytes)"});

  write_text(dir.file("csv.parquet"), "text,id\nhello,1\n");
  require_error([&] { read_all(dir.file("csv.parquet")); },
                {"csv.parquet", "is not a readable Parquet file", "magic", "PAR1"});
  const std::string bytes = memopt::test::read_text(a);
  write_text(dir.file("cut.parquet"), bytes.substr(0, bytes.size() / 2));
  require_error([&] { read_all(dir.file("cut.parquet")); }, {"cut.parquet", "is not a readable Parquet file"});
  // Pages damaged in the middle of the file: the error names the first row not handed out
  // (rows go out in batches of 512; here the first batch reaches the damage).
  nlohmann::json many = nlohmann::json::array();
  for (int i = 0; i < 2000; ++i) many.push_back("document number " + std::to_string(i) + " of a damaged file");
  write_parquet(dir.file("damaged.parquet"), {{"text", many}}, 500);
  std::string damaged = memopt::test::read_text(dir.file("damaged.parquet"));
  for (size_t i = damaged.size() * 4 / 10; i < damaged.size() * 6 / 10; ++i) damaged[i] = '\xab';
  write_text(dir.file("damaged.parquet"), damaged);
  require_error([&] { read_all(dir.file("damaged.parquet")); },
                {"reading the rows from 0 on of Parquet file '" + dir.file("damaged.parquet") + "' failed",
                 "damaged or cut short"});

  // The interpreter: one without pyarrow, a missing one, and children that fail mid-way.
  const auto script = [&](const std::string& name, const std::string& body) {
    write_text(dir.file(name), "#!/bin/sh\n" + body + "\n");
    fs::permissions(dir.file(name), fs::perms::owner_all);
    return dir.file(name);
  };
  {
    ScopedPython no_site(script("python-S", std::string("exec '") + MEMOPT_TEST_PYTHON + "' -S \"$@\""));
    require_error([&] { read_all(a); }, {a, "needs pyarrow", "python-S' cannot import", "No module named 'pyarrow'",
                                         "scripts/deps", "MEMOPT_PYTHON"});
  }
  {
    ScopedPython missing(dir.file("no-such-python"));
    require_error([&] { read_all(a); }, {"cannot start the Python interpreter", "no-such-python", "No such file",
                                         "MEMOPT_PYTHON"});
  }
  const std::vector<std::pair<std::string, std::vector<std::string>>> children = {
      {"echo 11; echo '\"x\"'; exit 3", {"exited with status 3 after 1 of 11 rows", "stderr"}},
      {"echo 11; echo '\"x\"'; exit 0", {"ended after 1 of 11 rows", "cut short"}},
      {"echo 11; echo '\"x\"'; kill -9 $$", {"killed by signal 9", "after 1 of 11 rows"}},
      {"exit 2", {"exited with status 2 before writing anything"}},
      {"echo hello", {"wrote 'hello' at row 0, not a row", "MEMOPT_PYTHON"}},
  };
  for (size_t i = 0; i < children.size(); ++i) {
    INFO(children[i].first);
    ScopedPython fake(script("fake" + std::to_string(i), children[i].first));
    auto parts = children[i].second;
    parts.push_back(a);
    require_error([&] { read_all(a); }, parts);
  }
}
