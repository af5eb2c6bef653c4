// Tests for examples/03_gritlm/corpus_pairs.hpp: the GritLM example's contrastive and
// generative records cut from Brown- and King James-format corpora — positives follow their
// query, negatives come from the same group and split, held out by document, deterministic in
// the seed; bad options name themselves.
#include <catch2/catch.hpp>

#include <set>
#include <string>
#include <vector>

#include "03_gritlm/corpus_pairs.hpp"
#include "data/fake_corpora.hpp"
#include "support.hpp"

namespace {

using memopt::data::EmbedRecord;
using memopt::data::GenRecord;
using memopt::test::book_of;
using memopt::test::sentences_of;
using memopt::test::verses_of;
using memopt::test::write_fake_brown;
using memopt::test::write_fake_kjv;

struct TempDir : memopt::test::TempDir {
  TempDir() : memopt::test::TempDir("memopt_gritlm_pairs_test") {}
};

}  // namespace

TEST_CASE("brown_grit_data: positives follow their query, negatives from the same genre, split by document",
          "[grit][brown]") {
  TempDir dir;
  write_fake_brown(dir);
  // heldout_every 2 on the sorted names ca01..ca04 cb01..cb04 holds out ca02 ca04 cb02 cb04.
  const auto options = gritlm::CorpusGritOptions()
                           .heldout_every(2).group_size(3).max_passage_chars(80).max_prompt_chars(80)
                           .max_answer_chars(40).seed(11);
  const auto data = gritlm::brown_grit_data(dir.path.string(), options);
  const std::set<std::string> heldout_docs = {"ca02", "ca04", "cb02", "cb04"};
  CHECK(data.heldout.documents == std::vector<std::string>{dir.file("ca02"), dir.file("ca04"), dir.file("cb02"),
                                                           dir.file("cb04")});
  CHECK(data.train.documents.size() == 4);
  CHECK(data.train.embed.size() >= 16);
  CHECK(data.heldout.embed.size() >= 16);
  CHECK(data.train.gen.size() > 10);

  for (const bool heldout : {false, true}) {
    const auto& split = heldout ? data.heldout : data.train;
    for (const EmbedRecord& r : split.embed) {
      INFO("query: " << r.query << " | pos: " << r.pos);
      CHECK(r.instruction == options.instruction());
      CHECK(r.passage_instruction.empty());
      const auto q = sentences_of(r.query);
      const auto p = sentences_of(r.pos);
      REQUIRE(q.size() == 1);
      REQUIRE(!p.empty());
      CHECK(heldout_docs.count(q[0].first) == (heldout ? 1u : 0u));
      for (size_t j = 0; j < p.size(); ++j) {
        CHECK(p[j].first == q[0].first);              // the same document
        CHECK(p[j].second == q[0].second + 1 + static_cast<int>(j));  // the sentences that follow
      }
      CHECK(r.pos.size() <= 80);
      REQUIRE(r.neg.size() == 2);
      for (const auto& n : r.neg) {
        const auto s = sentences_of(n);
        REQUIRE(!s.empty());
        CHECK(s[0].first != q[0].first);              // another document ...
        CHECK(s[0].first[1] == q[0].first[1]);        // ... of the same genre
        CHECK(heldout_docs.count(s[0].first) == (heldout ? 1u : 0u));  // ... of the same split
      }
    }
    for (const GenRecord& g : split.gen) {
      INFO("prompt: " << g.prompt << " | answer: " << g.answer);
      CHECK(g.prompt.rfind("Continue the text: ", 0) == 0);
      const auto p = sentences_of(g.prompt);
      const auto a = sentences_of(g.answer);
      REQUIRE(!p.empty());
      REQUIRE(!a.empty());
      CHECK(heldout_docs.count(p[0].first) == (heldout ? 1u : 0u));
      CHECK(a[0].first == p.back().first);
      CHECK(a[0].second == p.back().second + 1);
    }
  }
  // Queries do not overlap their own positives, and every document contributes.
  std::set<std::string> docs;
  for (const auto& r : data.train.embed) docs.insert(sentences_of(r.query)[0].first);
  CHECK(docs == std::set<std::string>{"ca01", "ca03", "cb01", "cb03"});

  // Deterministic given the seed; another seed draws other negatives.
  const auto again = gritlm::brown_grit_data(dir.path.string(), options);
  const auto other = gritlm::brown_grit_data(dir.path.string(), gritlm::CorpusGritOptions(options).seed(12));
  bool same_negs = true, other_negs = true;
  for (size_t i = 0; i < data.train.embed.size(); ++i) {
    same_negs = same_negs && again.train.embed[i].neg == data.train.embed[i].neg;
    other_negs = other_negs && other.train.embed[i].neg == data.train.embed[i].neg;
  }
  CHECK(same_negs);
  CHECK_FALSE(other_negs);

  memopt::test::require_error(
      [&] { gritlm::brown_grit_data(dir.path.string(), gritlm::CorpusGritOptions().heldout_every(1)); }, "gritlm",
      {"heldout_every must be >= 2"});
  memopt::test::require_error(
      [&] { gritlm::brown_grit_data(dir.path.string(), gritlm::CorpusGritOptions().heldout_every(8)); }, "gritlm",
      {"only one in its split", "group_size(1)"});
}

TEST_CASE("grit_data on brown::read_corpus's documents is brown_grit_data", "[grit][brown]") {
  TempDir dir;
  write_fake_brown(dir);
  const auto options = gritlm::CorpusGritOptions().heldout_every(2).group_size(3).max_passage_chars(80);
  const auto a = gritlm::brown_grit_data(dir.path.string(), options);
  const auto b = gritlm::grit_data(memopt::data::brown::read_corpus(dir.path.string()), options);
  CHECK(a.train.documents == b.train.documents);
  REQUIRE(a.train.embed.size() == b.train.embed.size());
  for (size_t i = 0; i < a.train.embed.size(); ++i) {
    CHECK(a.train.embed[i].query == b.train.embed[i].query);
    CHECK(a.train.embed[i].pos == b.train.embed[i].pos);
    CHECK(a.train.embed[i].neg == b.train.embed[i].neg);
  }
  REQUIRE(a.heldout.gen.size() == b.heldout.gen.size());
  for (size_t i = 0; i < a.heldout.gen.size(); ++i) CHECK(a.heldout.gen[i].answer == b.heldout.gen[i].answer);
}

// ---- King James pairs --------------------------------------------------------------------


TEST_CASE("kjv_grit_data: positives follow their query verse, negatives from other chapters of the same book",
          "[grit][kjv]") {
  TempDir dir;
  write_fake_kjv(dir);
  // heldout_every 2 on Ge1..Ge4 Exo1..Exo4 holds out Ge2 Ge4 Exo2 Exo4.
  const auto options = gritlm::CorpusGritOptions().heldout_every(2).group_size(3).max_passage_chars(120).seed(5);
  const auto data = gritlm::kjv_grit_data(dir.path.string(), options);
  const std::set<std::string> heldout = {"Ge2", "Ge4", "Exo2", "Exo4"};
  CHECK(data.heldout.documents == std::vector<std::string>{"Ge2", "Ge4", "Exo2", "Exo4"});
  CHECK(data.train.documents == std::vector<std::string>{"Ge1", "Ge3", "Exo1", "Exo3"});
  CHECK(data.train.embed.size() >= 8);
  CHECK(data.heldout.embed.size() >= 8);
  CHECK_FALSE(data.train.gen.empty());
  for (const bool is_heldout : {false, true}) {
    const auto& split = is_heldout ? data.heldout : data.train;
    std::set<std::string> chapters;
    for (const EmbedRecord& r : split.embed) {
      INFO("query: " << r.query << " | pos: " << r.pos);
      const auto q = verses_of(r.query);
      const auto p = verses_of(r.pos);
      REQUIRE(q.size() == 1);
      REQUIRE(!p.empty());
      chapters.insert(q[0].first);
      CHECK(heldout.count(q[0].first) == (is_heldout ? 1u : 0u));
      for (size_t j = 0; j < p.size(); ++j) {
        CHECK(p[j].first == q[0].first);                              // the same chapter
        CHECK(p[j].second == q[0].second + 1 + static_cast<int>(j));  // the verses that follow
      }
      REQUIRE(r.neg.size() == 2);
      for (const auto& n : r.neg) {
        const auto v = verses_of(n);
        REQUIRE(!v.empty());
        CHECK(v[0].first != q[0].first);                        // another chapter ...
        CHECK(book_of(v[0].first) == book_of(q[0].first));      // ... of the same book ...
        CHECK(heldout.count(v[0].first) == (is_heldout ? 1u : 0u));  // ... in the same split
      }
    }
    CHECK(chapters.size() == 4);  // every chapter of the split gives queries
    for (const GenRecord& g : split.gen) {
      const auto p = verses_of(g.prompt);
      const auto a = verses_of(g.answer);
      REQUIRE(!p.empty());
      REQUIRE(!a.empty());
      CHECK(a[0].first == p.back().first);
      CHECK(a[0].second == p.back().second + 1);
    }
  }
  memopt::test::require_error([&] { gritlm::kjv_grit_data(dir.file("absent.txt"), options); }, "memopt::data",
                              {"King James text", "absent.txt", "scripts/fetch_corpus"});
  memopt::test::require_error(
      [&] { gritlm::kjv_grit_data(dir.path.string(), gritlm::CorpusGritOptions().heldout_every(9)); }, "gritlm",
      {"kjv_grit_data: heldout_every 9 holds out no document of the 8 in"});
}
