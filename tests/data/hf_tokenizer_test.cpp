// Tests for memopt/data/hf_tokenizer.hpp (through memopt::data::Tokenizer): tokenizer.json files
// trained at test time by Hugging Face `tokenizers` (tests/data/hf_tokenizer_check.py: GPT-2,
// Llama-3, Qwen, Llama-2 and Metaspace styles) encode to HF's ids token for token and decode to
// HF's text, on held-out text and on hard text (Unicode, emoji, CJK, whitespace runs, digits,
// contractions, special tokens); malformed UTF-8 and unsupported or broken files.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <memopt/data/shard.hpp>
#include <memopt/data/tokenizer.hpp>
#include <pretokenize/pretokenize.hpp>

#include "support.hpp"

using memopt::data::InvalidUtf8;
using memopt::tools::PretokenizeOptions;
using memopt::data::Tokenizer;
using memopt::data::TokenizerOptions;
using memopt::test::read_text;
using memopt::test::require_error;
using memopt::test::TempDir;
using memopt::test::write_text;

namespace {

const std::vector<std::string> kKinds = {"gpt2", "llama3", "qwen", "llama2", "metaspace"};

/// The reference folder: tokenizers trained once per test run by hf_tokenizer_check.py.
const std::string& reference_dir() {
  static TempDir dir;
  static const bool made = [] {
    const std::string script = std::string(MEMOPT_TEST_BASELINES) + "/../data/hf_tokenizer_check.py";
    const std::string log = dir.file("check.log");
    const int status = std::system((std::string(MEMOPT_TEST_PYTHON) + " '" + script + "' '" + dir.path.string() +
                                    "' > '" + log + "' 2>&1").c_str());
    INFO(read_text(log));
    REQUIRE(status == 0);  // HINT: scripts/deps installs `tokenizers` into .venv
    return true;
  }();
  (void)made;
  static const std::string path = dir.path.string();
  return path;
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_text(path)); }

/// The length-prefixed byte strings of invalid.bin.
std::vector<std::string> invalid_texts() {
  const std::string bytes = read_text(reference_dir() + "/invalid.bin");
  std::vector<std::string> out;
  for (size_t at = 0; at + 4 <= bytes.size();) {
    uint32_t n = 0;
    for (int b = 0; b < 4; ++b) n |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[at + b])) << (8 * b);
    out.push_back(bytes.substr(at + 4, n));
    at += 4 + n;
  }
  return out;
}

/// A copy of the gpt2 reference tokenizer.json with `edit` applied, saved in `dir`.
std::string edited(const TempDir& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json json = read_json(reference_dir() + "/gpt2/tokenizer.json");
  edit(json);
  const std::string path = dir.file("edited.json");
  write_text(path, json.dump());
  return path;
}

}  // namespace

TEST_CASE("tokenizer.json encodes and decodes exactly as Hugging Face tokenizers", "[data][tokenizer][hf]") {
  const auto texts = read_json(reference_dir() + "/texts.json");
  for (const std::string& kind : kKinds) {
    DYNAMIC_SECTION(kind) {
      const auto tok = memopt::data::load_tokenizer(reference_dir() + "/" + kind);  // the folder: its tokenizer.json
      const auto expected = read_json(reference_dir() + "/" + kind + "/expected.json");
      CHECK(std::string(tok->kind()) == "tokenizer.json");
      CHECK(tok->vocab_size() == expected["vocab_size"].get<int64_t>());
      if (expected["special"].contains("bos")) CHECK(tok->bos_id() == expected["special"]["bos"].get<int64_t>());
      if (expected["special"].contains("eos")) CHECK(tok->eos_id() == expected["special"]["eos"].get<int64_t>());
      size_t round_trips = 0;
      for (size_t i = 0; i < texts.size(); ++i) {
        const std::string text = texts[i].get<std::string>();
        const auto want = expected["texts"][i]["ids"].get<std::vector<int32_t>>();
        const std::string hf_decoded = expected["texts"][i]["decoded"].get<std::string>();
        INFO("text " << i << ": " << texts[i].dump());
        const auto ids = tok->encode(text);
        REQUIRE(ids == want);
        CHECK(tok->decode(ids) == hf_decoded);
        if (hf_decoded == text) {  // where HF round-trips, memopt does too
          CHECK(tok->decode(ids) == text);
          ++round_trips;
        }
      }
      CHECK(round_trips > texts.size() / 2);  // the byte-level kinds round-trip nearly everything
      const auto invalid = invalid_texts();
      for (size_t i = 0; i < invalid.size(); ++i) {
        INFO("invalid text " << i);
        CHECK(tok->encode(invalid[i]) == expected["invalid"][i].get<std::vector<int32_t>>());
      }
    }
  }
}

TEST_CASE("tokenizer.json: special tokens, added symbols, piece lookups", "[data][tokenizer][hf]") {
  Tokenizer tok(reference_dir() + "/llama3/tokenizer.json");
  const int32_t user = tok.piece_to_id("<|user|>");
  REQUIRE(user >= 0);
  CHECK(tok.piece(user) == "<|user|>");
  CHECK(tok.piece(tok.bos_id()) == "<|begin_of_text|>");
  CHECK(tok.piece(tok.eos_id()) == "<|end_of_text|>");
  CHECK(tok.unk_id() == -1);  // byte-level BPE has no <unk>
  // Special tokens are cut out whole and skipped by decode; added non-special ones decode to their text.
  const auto ids = tok.encode("<|begin_of_text|>Hi <|user|>x");
  CHECK(ids.front() == tok.bos_id());
  CHECK(std::count(ids.begin(), ids.end(), user) == 1);
  CHECK(tok.decode(ids) == "Hi x");
  // add_user_symbols: new ids after the vocab, matched whole, decoded back.
  const int64_t before = tok.vocab_size();
  const auto added = tok.add_user_symbols({"<|embed|>", "<|user|>"});
  CHECK(added == std::vector<int32_t>{static_cast<int32_t>(before), user});
  CHECK(tok.vocab_size() == before + 1);
  const auto with_marker = tok.encode("a<|embed|>b");
  CHECK(std::count(with_marker.begin(), with_marker.end(), added[0]) == 1);
  CHECK(tok.decode(with_marker) == "a<|embed|>b");
  // decode of a tensor row, and a bad id.
  CHECK(tok.decode(torch::tensor(std::vector<int64_t>(with_marker.begin(), with_marker.end()))) == "a<|embed|>b");
  require_error([&] { tok.decode(std::vector<int32_t>{static_cast<int32_t>(tok.vocab_size())}); },
                "memopt::data", {"cannot decode token id", "vocab_size"});
}

TEST_CASE("tokenizer.json: malformed UTF-8 is replaced or rejected, per TokenizerOptions", "[data][tokenizer][hf]") {
  const std::string cut = "caf\xc3";  // a cut two-byte character
  Tokenizer replace(reference_dir() + "/gpt2");
  CHECK(replace.decode(replace.encode(cut)) == "caf\xEF\xBF\xBD");
  Tokenizer reject(reference_dir() + "/gpt2", TokenizerOptions().invalid_utf8(InvalidUtf8::kReject));
  CHECK(reject.encode("caf\xc3\xa9").size() > 0);
  require_error([&] { reject.encode("ok so far, then " + cut); }, "memopt::data",
                {"not valid UTF-8 at byte 19", "0xC3", "--invalid_utf8 replace"});
  CHECK(memopt::data::valid_utf8("\xe2\x82 x \xff", InvalidUtf8::kReplace, "t") == "\xEF\xBF\xBD x \xEF\xBF\xBD");
}

TEST_CASE("tokenizer.json: unsupported or broken files fail naming the key and value", "[data][tokenizer][hf]") {
  TempDir dir;
  require_error([&] { Tokenizer t(edited(dir, [](auto& j) { j["model"]["type"] = "WordPiece"; })); },
                "memopt::data", {"edited.json", "model.type is \"WordPiece\"", "SentencePiece .model"});
  require_error([&] { Tokenizer t(edited(dir, [](auto& j) { j["pre_tokenizer"] = {{"type", "BertPreTokenizer"}}; })); },
                "memopt::data", {"pre_tokenizer.type is \"BertPreTokenizer\"", "ByteLevel"});
  require_error(
      [&] {
        Tokenizer t(edited(dir, [](auto& j) {
          j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "BertNormalizer"}}}}};
        }));
      },
      "memopt::data", {"normalizer.normalizers[1].type is \"BertNormalizer\""});
  require_error([&] { Tokenizer t(edited(dir, [](auto& j) { j["model"]["merges"][3] = {"Ġzzz", "q"}; })); },
                "memopt::data", {"merges[3]", "'Ġzzz', which is not in the vocab"});
  require_error([&] { Tokenizer t(edited(dir, [](auto& j) { j["model"]["merges"][0] = "a b c"; })); },
                "memopt::data", {"merges[0]", "not two tokens separated by one space"});
  require_error([&] { Tokenizer t(edited(dir, [](auto& j) { j["model"]["dropout"] = 0.1; })); },
                "memopt::data", {"model.dropout is 0.1"});
  require_error([&] { Tokenizer t(edited(dir, [](auto& j) { j["model"]["unk_token"] = "<nope>"; })); },
                "memopt::data", {"unk_token '<nope>' is not in the vocab"});
  require_error(
      [&] {
        Tokenizer t(edited(dir, [](auto& j) {
          j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
        }));
      },
      "memopt::data", {"pre_tokenizer.pattern", "'(unclosed' does not compile"});
  write_text(dir.file("broken.json"), "{\"model\": {\"type\": \"BPE\", \"vocab\": {");
  require_error([&] { Tokenizer t(dir.file("broken.json")); }, "memopt::data", {"broken.json", "not valid JSON"});
  require_error([&] { Tokenizer t(dir.path.string()); }, "memopt::data",
                {"holds neither tokenizer.json nor tokenizer.model"});
}

TEST_CASE("memopt-pretokenize takes a tokenizer.json folder, and --invalid_utf8 reject names the file",
          "[data][tokenizer][hf][pretokenize]") {
  TempDir dir;
  const std::string llama3 = reference_dir() + "/llama3";
  write_text(dir.file("docs.txt"), "Hello <|user|> world\nIt's 2026, caf\xc3\xa9 \xf0\x9f\xa4\x97\n");
  const auto options = PretokenizeOptions().sources({dir.file("docs.txt")}).tokenizer(llama3).workers(2);
  const auto summary = memopt::tools::pretokenize(PretokenizeOptions(options).out(dir.file("out")));
  CHECK(summary.documents == 2);
  const Tokenizer tok(llama3);
  REQUIRE(tok.eos_id() >= 0);
  std::vector<int32_t> want;
  for (const char* doc : {"Hello <|user|> world", "It's 2026, caf\xc3\xa9 \xf0\x9f\xa4\x97"}) {
    for (int32_t id : tok.encode(doc)) want.push_back(id);
    want.push_back(static_cast<int32_t>(tok.eos_id()));
  }
  const auto shard = memopt::data::TokenShard::open(dir.file("out/shard-00000.bin"));
  std::vector<int32_t> got;
  for (int64_t i = 0; i < shard->size(); ++i) got.push_back(static_cast<int32_t>(shard->at(i)));
  CHECK(got == want);
  const auto index = nlohmann::json::parse(read_text(dir.file("out/index.json")));
  CHECK(index["tokenizer_kind"] == "tokenizer.json");
  CHECK(index["invalid_utf8"] == "replace");
  // A Latin-1 byte in the second document: replaced by default, an error naming the file under reject.
  write_text(dir.file("latin1.txt"), "fine\ncaf\xe9\n");
  const auto latin1 = PretokenizeOptions(options).sources({dir.file("latin1.txt")});
  CHECK(memopt::tools::pretokenize(PretokenizeOptions(latin1).out(dir.file("replaced"))).documents == 2);
  require_error([&] { memopt::tools::pretokenize(PretokenizeOptions(latin1).out(dir.file("rejected"))
                                                     .invalid_utf8(InvalidUtf8::kReject)); },
                "memopt-pretokenize", {"a document of '" + dir.file("latin1.txt"), "not valid UTF-8 at byte 3 (0xE9)"});
}
