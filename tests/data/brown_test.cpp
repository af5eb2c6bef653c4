// Tests for memopt/data/brown.hpp: tag stripping, detokenisation, documents grouped by
// genre with a sentence per line, paragraph by paragraph (read_sentences on a fake corpus).
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

#include "data/fake_corpora.hpp"
#include "data/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::data;  // NOLINT: the fixtures of these tests
using memopt::test::write_fake_brown;

TEST_CASE("brown::strip_tags removes POS tags and detokenises", "[data][brown]") {
  using memopt::data::brown::strip_tags;
  CHECK(strip_tags("\tThe/at Fulton/np-tl County/nn-tl Grand/jj-tl Jury/nn-tl said/vbd "
                   "Friday/nr an/at investigation/nn of/in Atlanta's/np$ recent/jj "
                   "primary/nn election/nn produced/vbd ``/`` no/at evidence/nn ''/'' "
                   "that/cs any/dti irregularities/nns took/vbd place/nn ./.") ==
        "The Fulton County Grand Jury said Friday an investigation of Atlanta's recent "
        "primary election produced \"no evidence\" that any irregularities took place.");
  CHECK(strip_tags("``/`` Only/rb a/at handful/nn ''/'' ,/, he/pps said/vbd ;/. "
                   "it/pps is/bez odd/jj !/. ?/.") == "\"Only a handful\", he said; it is odd!?");
  // The tag is after the LAST '/'; words may hold slashes.
  CHECK(strip_tags("and/or/cc 1-1/2/cd mg/l/nn //in x/") == "and/or 1-1/2 mg/l / x");
  CHECK(strip_tags("(/( see/vb below/rb )/) :/: a/at --/-- b/nn") == "(see below): a -- b");
  CHECK(strip_tags("He/pps said/vbd :/: '/' You/ppss stunk/vbd '/' ''/'' ./.") ==
        "He said: 'You stunk'\".");
  CHECK(strip_tags("Sammy/np Davis/np Jr./np ./.") == "Sammy Davis Jr.");
  CHECK(strip_tags("they/ppss do/do n't/* know/vb it/pps 's/bez 10/cd %/nn") ==
        "they don't know it's 10%");
  CHECK(strip_tags("get/vb 'em/ppo") == "get 'em");
  CHECK(strip_tags("being/beg 1/8''/nn ''/'' brass/nn ,/, 4'/nns 10''/nns ''/'' tall/jj") ==
        "being 1/8\" brass, 4' 10\" tall");
  CHECK(strip_tags("  \t\n ") == "");
}

TEST_CASE("brown::read_document and list_documents", "[data][brown]") {
  TempDir dir;
  {
    std::ofstream doc(dir.file("ca01"));
    doc << "\n\n\tThe/at jury/nn said/vbd ./.\nIt/pps was/bedz ``/`` late/jj ./.\n"
           "''/'' ,/, he/pps added/vbd ./.\n\n\n\tSecond/od paragraph/nn ./.\n\n";
  }
  std::ofstream(dir.file("cb02")) << "\tOne/cd ./.\n";
  std::ofstream(dir.file("README")) << "not a document\n";
  std::ofstream(dir.file("cz01")) << "not a genre\n";

  const auto paragraphs = memopt::data::brown::read_document(dir.file("ca01"));
  CHECK(paragraphs == std::vector<std::string>{"The jury said. It was \"late.\", he added.",
                                               "Second paragraph."});
  const auto files = memopt::data::brown::list_documents(dir.path.string());
  CHECK(files == std::vector<std::string>{dir.file("ca01"), dir.file("cb02")});
  CHECK(memopt::data::brown::genre_of(files[1]) == 'b');

  require_error([&] { memopt::data::brown::read_document(dir.file("ca02")); },
                {dir.file("ca02"), "fetch_corpus"});
  TempDir empty;
  require_error([&] { memopt::data::brown::list_documents(empty.path.string()); },
                {empty.path.string(), "found 0", "scripts/fetch_corpus"});
  require_error([&] { memopt::data::brown::list_documents(empty.file("absent")); },
                {empty.file("absent"), "does not exist", "scripts/fetch_corpus"});
}

TEST_CASE("brown::read_corpus: documents named by path, grouped by genre, sentences per paragraph", "[data][brown]") {
  TempDir dir;
  memopt::test::write_text(dir.file("cb02"), "\tOne/cd ./.\n\tTwo/cd ./.\n\n\tThree/cd ./.\n");
  memopt::test::write_text(dir.file("ca01"), "\tThe/at jury/nn said/vbd ./.\n");
  CHECK(memopt::data::brown::holds_documents(dir.path.string()));
  const auto docs = memopt::data::brown::read_corpus(dir.path.string());
  REQUIRE(docs.size() == 2);
  CHECK(docs[0].name == dir.file("ca01"));
  CHECK(docs[0].group == "a");
  CHECK(docs[1].group == "b");
  CHECK(docs[1].paragraphs == std::vector<std::vector<std::string>>{{"One.", "Two."}, {"Three."}});
  TempDir other;
  memopt::test::write_text(other.file("kjv.txt"), "Ge1:1 In the beginning.\n");
  CHECK_FALSE(memopt::data::brown::holds_documents(other.path.string()));
  CHECK_FALSE(memopt::data::brown::holds_documents(other.file("absent")));
}

TEST_CASE("brown::read_sentences keeps one sentence a line, paragraph by paragraph", "[grit][brown]") {
  TempDir dir;
  write_fake_brown(dir);
  const auto paragraphs = memopt::data::brown::read_sentences(dir.file("ca01"));
  REQUIRE(paragraphs.size() == 3);
  CHECK(paragraphs[0].size() == 5);
  CHECK(paragraphs[1][0] == "Doc ca01 sentence 5 has some words.");
  require_error([&] { memopt::data::brown::read_sentences(dir.file("ca09")); }, {dir.file("ca09"), "fetch_corpus"});
}
