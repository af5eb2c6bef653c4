// Tests for memopt/data/tokenizer.hpp: BPE merges, unknowns and decoding on a
// hand-written model, exact agreement with SentencePiece's own tools where installed, errors,
// and user symbols (add_user_symbols) on the GritLM tests' tokenizer.
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
using memopt::test::data::grit::make_tokenizer;

TEST_CASE("Tokenizer: BPE merges, unknowns and decoding on a hand-written model",
          "[data][tokenizer]") {
  TempDir dir;
  const std::vector<std::tuple<std::string, float, int>> pieces = {
      {"<unk>", 0.f, 2}, {"<s>", 0.f, 3},    {"</s>", 0.f, 3},     {kWs, 0.f, 1},
      {"a", 0.f, 1},     {"b", 0.f, 1},      {"c", 0.f, 1},        {"d", 0.f, 1},
      {"bc", -0.5f, 1},  {"ab", -1.f, 1},    {"dd", -1.f, 1},      {kWs + "ab", -1.5f, 1},
      {kWs + "a", -2.f, 1}, {"cd", -3.f, 1}};
  write_bytes(dir.file("hand.model"), [&] {
    const std::string m = make_model(pieces);
    return std::vector<unsigned char>(m.begin(), m.end());
  }());
  memopt::data::Tokenizer tok(dir.file("hand.model"));
  CHECK(tok.vocab_size() == 14);
  CHECK(tok.unk_id() == 0);
  CHECK(tok.bos_id() == 1);
  CHECK(tok.eos_id() == 2);
  CHECK(tok.pad_id() == -1);
  CHECK(tok.piece(9) == "ab");
  CHECK(tok.piece_to_id(kWs + "ab") == 11);
  CHECK(tok.piece_to_id("zz") == 0);

  auto pieces_of = [&](std::string_view text) {
    std::vector<std::string> out;
    for (int32_t id : tok.encode(text)) out.push_back(tok.piece(id));
    return out;
  };
  using V = std::vector<std::string>;
  // The best-scoring pair merges first: bc (-0.5) before ab (-1), then ▁a (-2).
  CHECK(pieces_of("abc") == V{kWs + "a", "bc"});
  // ab, then the new pair ▁ab (-1.5), then cd (-3); spaces become ▁, extra ones vanish.
  CHECK(pieces_of("ab cd") == V{kWs + "ab", kWs, "cd"});
  CHECK(pieces_of("  ab   cd  ") == V{kWs + "ab", kWs, "cd"});
  // Equal scores: the leftmost pair merges first.
  CHECK(pieces_of("ddd") == V{kWs, "dd", "d"});
  // A run of unknown characters is one <unk>.
  CHECK(tok.encode("axxb") == std::vector<int32_t>{12, 0, 5});
  CHECK(tok.encode("").empty());
  CHECK(tok.encode("   ").empty());

  CHECK(tok.decode(tok.encode("ab cd")) == "ab cd");
  CHECK(tok.decode(std::vector<int32_t>{1, 11, 3, 13, 2}) == "ab cd");  // <s>, </s> are silent
  CHECK(tok.decode(tok.encode("axxb")) == "a \xE2\x81\x87 b");
  CHECK(tok.decode(torch::tensor({11, 3, 13})) == "ab cd");
  CHECK(tok.decode(torch::tensor({11, 3, 13}, torch::kInt)) == "ab cd");
  require_error([&] { tok.decode(std::vector<int32_t>{14}); }, {dir.file("hand.model"), "token id 14"});
  require_error([&] { tok.decode(torch::tensor({3, -1})); }, {"token id -1", "position 1"});
  require_error([&] { tok.decode(torch::zeros({2, 3}, torch::kLong)); }, {"2-D"});

  // Models this implementation does not cover are refused by name.
  const std::string unigram = pb_bytes(1, pb_bytes(1, "<unk>") + pb_int(3, 2)) + pb_bytes(2, pb_int(3, 1));
  write_bytes(dir.file("unigram.model"), {unigram.begin(), unigram.end()});
  require_error([&] { memopt::data::Tokenizer t(dir.file("unigram.model")); },
                {dir.file("unigram.model"), "model_type 1 is not BPE"});
  const std::string bytes = make_model(pieces, pb_int(35, 1));
  write_bytes(dir.file("bytes.model"), {bytes.begin(), bytes.end()});
  require_error([&] { memopt::data::Tokenizer t(dir.file("bytes.model")); },
                {dir.file("bytes.model"), "byte_fallback"});
}

TEST_CASE("Tokenizer encodes exactly as SentencePiece (spm_train / spm_encode)",
          "[data][tokenizer]") {
  if (!have_program("spm_train") || !have_program("spm_encode")) {
    WARN("spm_train / spm_encode not found (apt-get install sentencepiece): cross-check skipped");
    return;
  }
  TempDir dir;
  // A few hundred lines of generated text from a small word list (an LCG picks words).
  const std::vector<std::string> words = {"the",    "quick", "brown", "fox",    "jumps", "over",
                                          "lazy",   "dog",   "memory", "train", "model", "token",
                                          "batch",  "shard", "window", "loss",  "42",    "(x)"};
  {
    std::ofstream text(dir.file("text.txt"));
    uint32_t state = 12345;
    for (int line = 0; line < 300; ++line) {
      for (int w = 0; w < 8; ++w) {
        state = state * 1664525u + 1013904223u;
        text << (w ? " " : "") << words[(state >> 16) % words.size()];
      }
      text << ".\n";
    }
  }
  const std::string model = dir.file("tiny.model");
  const std::string train = "spm_train --input='" + dir.file("text.txt") + "' --model_prefix='" +
                            dir.file("tiny") + "' --model_type=bpe --vocab_size=64 "
                            "--hard_vocab_limit=false --character_coverage=1.0 --num_threads=1 "
                            "--minloglevel=2 > /dev/null 2>&1";
  REQUIRE(std::system(train.c_str()) == 0);

  // Lines that exercise merges, unknown characters, NFKC rules and odd whitespace.
  const std::vector<std::string> lines = {
      "the lazy fox jumps over the memory window.",
      "  shard   batch\ttoken  loss (x) 42 ",
      "zebra quartz, the fox!",
      "caf\xc3\xa9 \xef\xbd\x86\xef\xbd\x8f\xef\xbd\x98 \xef\xac\x81ne \xe2\x91\xa0",  // café ｆｏｘ ﬁne ①
      "the\xc2\xa0" "dog \xe3\x80\x80 model",  // no-break and ideographic spaces
      "x"};
  {
    std::ofstream in(dir.file("lines.txt"));
    for (const auto& l : lines) in << l << '\n';
  }
  const std::string encode = "spm_encode --model='" + model + "' --output_format=id < '" +
                             dir.file("lines.txt") + "' > '" + dir.file("ids.txt") + "' 2> /dev/null";
  REQUIRE(std::system(encode.c_str()) == 0);

  memopt::data::Tokenizer tok(model);
  CHECK(tok.vocab_size() > 3);
  CHECK(tok.vocab_size() <= 64);
  CHECK(tok.unk_id() == 0);
  CHECK(tok.bos_id() == 1);
  CHECK(tok.eos_id() == 2);
  std::ifstream ids_file(dir.file("ids.txt"));
  for (const std::string& line : lines) {
    std::string spm_line;
    REQUIRE(std::getline(ids_file, spm_line));
    std::vector<int32_t> expected;
    std::istringstream fields(spm_line);
    for (int32_t id; fields >> id;) expected.push_back(id);
    INFO("line: " << line);
    CHECK(tok.encode(line) == expected);
  }
  const std::string sentence = lines[0];
  CHECK(tok.decode(tok.encode(sentence)) == sentence);
}

TEST_CASE("Tokenizer reports a missing or invalid model", "[data][tokenizer]") {
  TempDir dir;
  const std::string missing = dir.file("missing.model");
  require_error([&] { memopt::data::Tokenizer tok(missing); }, {missing, "does not exist", "fetch_corpus"});
  const std::string garbage = dir.file("garbage.model");
  write_bytes(garbage, std::vector<unsigned char>(100, 0xab));
  require_error([&] { memopt::data::Tokenizer tok(garbage); },
                {garbage, "not a SentencePiece model", "100 bytes"});
}

TEST_CASE("Tokenizer::add_user_symbols appends whole, unmerged symbols that decode back",
          "[grit][tokenizer]") {
  auto tok = make_tokenizer();
  const int64_t n = tok->vocab_size();
  // Before: '<', '|', '>' are not in the vocab.
  CHECK(tok->encode("<|user|>")[1] == tok->unk_id());
  CHECK(tok->piece_to_id("<|user|>") == tok->unk_id());

  const auto ids = tok->add_user_symbols({"<|user|>", "<|embed|>", "<|assistant|>"});
  CHECK(ids == std::vector<int32_t>{static_cast<int32_t>(n), static_cast<int32_t>(n + 1),
                                    static_cast<int32_t>(n + 2)});
  CHECK(tok->vocab_size() == n + 3);
  CHECK(tok->piece_to_id("<|embed|>") == n + 1);
  CHECK(tok->piece(n + 2) == "<|assistant|>");

  // Matched whole, never merged with neighbours (even without spaces), decoded to their text.
  const auto x = tok->piece_to_id("x"), y = tok->piece_to_id("y");
  CHECK(tok->encode("x<|user|>y") == std::vector<int32_t>{tok->piece_to_id(kWs), x, static_cast<int32_t>(n), y});
  CHECK(tok->encode("<|user|><|embed|>") ==
        std::vector<int32_t>{tok->piece_to_id(kWs), static_cast<int32_t>(n), static_cast<int32_t>(n + 1)});
  CHECK(tok->decode(tok->encode("the cat <|user|> said <|assistant|>hi")) == "the cat <|user|> said <|assistant|>hi");
  CHECK(tok->decode(std::vector<int32_t>{static_cast<int32_t>(n + 1)}) == "<|embed|>");
  CHECK(tok->decode(torch::tensor({n, n + 2})) == "<|user|><|assistant|>");

  // Adding again is a no-op returning the ids; so is a piece already in the model.
  CHECK(tok->add_user_symbols({"<|embed|>", "<|user|>"}) ==
        std::vector<int32_t>{static_cast<int32_t>(n + 1), static_cast<int32_t>(n)});
  CHECK(tok->add_user_symbols({"he", "</s>"}) == std::vector<int32_t>{tok->piece_to_id("he"), 2});
  CHECK(tok->vocab_size() == n + 3);

  require_error([&] { tok->add_user_symbols({"<|ok|>", ""}); }, {"empty user symbol", "symbol 1"}, "memopt::data");
  require_error([&] { tok->add_user_symbols({"<|a b|>"}); }, {"'<|a b|>'", "whitespace"}, "memopt::data");
}
