// tests/data/grit_records_test.cpp — memopt/data/grit_records.hpp's JSONL readers: records of
// the fixtures in tests/data/fixtures, fatal errors naming file:line and field, bad lines skipped
// and counted.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <memopt/data/grit_records.hpp>

#include "data/fixtures.hpp"

using namespace memopt::test::data::grit;  // NOLINT: the fixtures of the GritLM tests

namespace fs = std::filesystem;
using memopt::data::GenRecord;

namespace {

std::string fixture(const std::string& name) {
  return (fs::path(MEMOPT_TEST_BASELINES).parent_path() / "data" / "fixtures" / name).string();
}

}  // namespace

TEST_CASE("read_embed_jsonl / read_gen_jsonl: records, fatal errors name file:line and field, skips counted",
          "[grit][jsonl]") {
  using memopt::data::OnBadLine;
  const std::string embed_path = fixture("grit_embed.jsonl");
  auto embed = memopt::data::read_embed_jsonl(embed_path, OnBadLine::kSkip);
  CHECK(embed.lines == 8);
  CHECK(embed.skipped == 5);
  REQUIRE(embed.records.size() == 3);
  CHECK(embed.records[0].query == "what keeps training memory low");
  CHECK(embed.records[0].neg == std::vector<std::string>{"a cat sat", "the dog ran"});
  CHECK(embed.records[0].instruction == "Retrieve the answer:");
  CHECK(embed.records[1].pos == "first positive");  // a list: the first
  CHECK(embed.records[1].neg.empty());               // optional
  CHECK(embed.records[2].instruction.empty());
  CHECK(embed.records[2].passage_instruction == "Represent the passage");
  CHECK(embed.records[0].passage_instruction.empty());
  REQUIRE(embed.messages.size() == 5);
  CHECK_THAT(embed.messages[0], Catch::Contains(embed_path + ":3: field 'neg' must be a list"));
  CHECK_THAT(embed.messages[1], Catch::Contains(embed_path + ":5: field 'pos' must be a string or a list"));
  CHECK_THAT(embed.messages[2], Catch::Contains(embed_path + ":6: not valid JSON"));
  CHECK_THAT(embed.messages[3], Catch::Contains(embed_path + ":7: field 'query' is missing"));
  CHECK_THAT(embed.messages[4], Catch::Contains(embed_path + ":8: field 'query' is empty"));
  require_error([&] { memopt::data::read_embed_jsonl(embed_path); }, {embed_path + ":3:", "'neg'", "OnBadLine::kSkip"},
                "memopt::data");

  const std::string gen_path = fixture("grit_gen.jsonl");
  auto gen = memopt::data::read_gen_jsonl(gen_path, OnBadLine::kSkip);
  CHECK(gen.lines == 5);
  CHECK(gen.skipped == 3);
  REQUIRE(gen.records.size() == 2);
  CHECK(gen.records[1].prompt == "Count to three");
  CHECK(gen.records[1].answer == "1 2 3");
  CHECK_THAT(gen.messages[0], Catch::Contains(gen_path + ":2: field 'answer' is missing"));
  CHECK_THAT(gen.messages[1], Catch::Contains(gen_path + ":3: expected a JSON object (got array)"));
  CHECK_THAT(gen.messages[2], Catch::Contains(gen_path + ":4: field 'answer' must be a string (got number)"));
  require_error([&] { memopt::data::read_gen_jsonl(gen_path, OnBadLine::kFatal); },
                {gen_path + ":2:", "'answer' is missing", "{\"prompt\": str, \"answer\": str}"}, "memopt::data");

  TempDir dir;
  require_error([&] { memopt::data::read_gen_jsonl(dir.file("absent.jsonl")); },
                {dir.file("absent.jsonl"), "does not exist"}, "memopt::data");
  // Many bad lines: all counted, the first few kept.
  {
    std::ofstream bad(dir.file("bad.jsonl"));
    for (int i = 0; i < 30; ++i) bad << "{\"prompt\": 1}\n";
  }
  auto many = memopt::data::read_gen_jsonl(dir.file("bad.jsonl"), OnBadLine::kSkip);
  CHECK(many.skipped == 30);
  CHECK(many.messages.size() == memopt::data::JsonlRecords<GenRecord>::kMaxMessages);
  CHECK(many.records.empty());
}
