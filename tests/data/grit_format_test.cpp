// Tests for memopt/data/grit_format.hpp: GritLM's formats and instruction prefixes (cached once
// per instruction), pooled tokens equal to the text's own, truncation. Tokenizers are small
// hand-written SentencePiece models (data/fixtures.hpp); no data/ is needed.
#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "data/fixtures.hpp"
#include "support.hpp"

#include <memopt/data/grit_format.hpp>
#include <memopt/data/grit_records.hpp>

using namespace memopt::test::data::grit;  // NOLINT: the fixtures of the GritLM tests

using memopt::data::GritFormat;

namespace {

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

// ---- formats and instruction prefixes --------------------------------------------------

TEST_CASE("GritLM formats, instruction prefixes cached once, pooled tokens are the text's",
          "[grit]") {
  using memopt::data::format_embed;
  using memopt::data::format_gen;
  CHECK(format_embed("Retrieve the answer", "The jury said.") ==
        "<s><|user|>\nRetrieve the answer\n<|embed|>\nThe jury said.");
  CHECK(format_embed("", "x") == "<s><|embed|>\nx");
  CHECK(format_embed(" \t: \n", "x") == "<s><|embed|>\nx");                      // strips to nothing
  CHECK(format_embed("\tRetrieve:\n", "x") == "<s><|user|>\nRetrieve\n<|embed|>\nx");  // strip("\t\n :")
  CHECK(format_gen("Say hi", "  Hello there \n") == "<s><|user|>\nSay hi\n<|assistant|>\nHello there</s>");

  auto tok = make_tokenizer(/*newline_is_space=*/true);
  const int64_t before = tok->vocab_size();
  auto format = std::make_shared<GritFormat>(tok);
  CHECK(format->vocab_size() == before + 3);
  CHECK(tok->vocab_size() == before + 3);
  CHECK(format->embed_id() == before + 1);
  CHECK(format->pad_id() == tok->eos_id());  // the model has no <pad>
  const int32_t bos = static_cast<int32_t>(tok->bos_id()), eos = static_cast<int32_t>(tok->eos_id());
  const int32_t ws = tok->piece_to_id(kWs);

  // Without an instruction: <s> ▁ <|embed|> (the dummy-prefix ▁ precedes the first symbol).
  CHECK(format->instruction_length("") == 3);
  CHECK(format->encode_embed("", "a cat").ids ==
        cat({bos, ws, format->embed_id()}, tok->encode("a cat")));
  const std::string instruction = "Find the passage";
  const int64_t length = format->instruction_length(instruction);
  CHECK(length == 1 + static_cast<int64_t>(tok->encode(memopt::data::embed_prefix(instruction)).size()));
  CHECK(length == 1 + 1 + 1 + static_cast<int64_t>(tok->encode(instruction).size()) + 1 + 1);  // <s> ▁ <|user|> .. ▁ <|embed|>
  CHECK(format->cached_instructions() == 2);
  format->instruction_length(":Find the passage:\n");  // the same instruction once stripped
  format->encode_embed(instruction, "more text");
  CHECK(format->cached_instructions() == 2);

  for (const std::string text : {"The cat sat.", "  the  other\tone", "x", "in the earth"}) {
    INFO("text: " << text);
    const auto seq = format->encode_embed(instruction, text);
    CHECK(seq.prefix_len == length);
    const std::vector<int32_t> pooled(seq.ids.begin() + seq.prefix_len, seq.ids.end());
    CHECK(pooled == tok->encode(text));
    // With "\n" normalized to a space, prefix + text tokenized apart == the whole string.
    const std::string whole = format_embed(instruction, text).substr(3);  // without "<s>"
    CHECK(seq.ids == cat({bos}, tok->encode(whole)));
  }

  // Generative: [<s>] + user part + answer + [</s>]; also equal to the whole string.
  const auto gen = format->encode_gen("Say the", " the answer ");
  CHECK(gen.ids == cat(cat(cat({bos}, tok->encode(memopt::data::gen_prefix("Say the"))), tok->encode("the answer")), {eos}));
  CHECK(gen.prompt_len == 1 + static_cast<int64_t>(tok->encode(memopt::data::gen_prefix("Say the")).size()));
  const std::string whole_gen = format_gen("Say the", " the answer ");
  CHECK(gen.ids == cat(cat({bos}, tok->encode(whole_gen.substr(3, whole_gen.size() - 3 - 4))), {eos}));
  CHECK(tok->decode(gen.ids) == "<|user|> Say the <|assistant|> the answer");

  // Truncation on the right.
  CHECK(format->encode_embed(instruction, "a long text here", length + 2).ids.size() == static_cast<size_t>(length + 2));
  CHECK(format->encode_gen("Say", "a long answer", 6).ids.size() == 6);
  require_error([&] { format->encode_embed(instruction, "text", length); }, {"no token of the text", "HINT"},
                "memopt::data");
  require_error([&] { format->encode_embed(instruction, "   "); }, {"no token of the text"}, "memopt::data");

  // An identity normalizer keeps "\n" as a character: the whole string would glue the text's
  // first word to it, while the split encoding keeps pooled tokens == encode(text).
  auto raw_tok = make_tokenizer(/*newline_is_space=*/false);
  GritFormat raw(raw_tok);
  const auto seq = raw.encode_embed(instruction, "cat");
  CHECK(std::vector<int32_t>(seq.ids.begin() + seq.prefix_len, seq.ids.end()) == raw_tok->encode("cat"));
  CHECK(seq.ids != cat({bos}, raw_tok->encode(format_embed(instruction, "cat").substr(3))));
}
