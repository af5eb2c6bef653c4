// memopt/data/grit_records.hpp — the records of GritLM-style training (query / positive /
// hard negatives; prompt / answer), GritLM's prompt formats, and their JSONL readers (a bad
// line is an error naming the file, line and field, or is skipped and counted).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace memopt::data {

// ---- records -------------------------------------------------------------------------

/// One contrastive example: a query, its positive passage, hard negatives, the query's task
/// instruction (empty: none) and the passages' (empty by default: GritLM embeds retrieval
/// documents without an instruction; set it, e.g. to `instruction`, for symmetric tasks).
///   EmbedRecord{"a sentence", "the passage after it", {"another passage"}, "Retrieve ..."}
struct EmbedRecord {
  std::string query;
  std::string pos;
  std::vector<std::string> neg;
  std::string instruction;
  std::string passage_instruction;
};

/// The instruction a record's passages (positive and negatives) are embedded with:
/// r.passage_instruction, so "" by default, giving GritLM's plain "<s><|embed|>\n{text}".
///   format.encode_embed(passage_instruction(r), r.pos, max_len)
inline const std::string& passage_instruction(const EmbedRecord& r) { return r.passage_instruction; }

/// One generative example: the user's prompt and the assistant's answer (the only part
/// that carries loss).   GenRecord{"Continue the text: It rained.", "The streets flooded."}
struct GenRecord {
  std::string prompt;
  std::string answer;
};

// ---- formats -------------------------------------------------------------------------

/// GritLM's special symbols, added to the tokenizer as user symbols (see GritFormat).
inline constexpr std::string_view kUserSymbol = "<|user|>";
inline constexpr std::string_view kEmbedSymbol = "<|embed|>";
inline constexpr std::string_view kAssistantSymbol = "<|assistant|>";

namespace detail {

/// `s` without leading and trailing characters from `chars` (Python's str.strip(chars)).
inline std::string_view strip(std::string_view s, std::string_view chars) {
  const size_t begin = s.find_first_not_of(chars);
  if (begin == std::string_view::npos) return {};
  const size_t end = s.find_last_not_of(chars);
  return s.substr(begin, end - begin + 1);
}

/// GritLM strips "\t\n :" around instructions (MEDI's end in ':'); empty: no instruction.
inline std::string_view clean_instruction(std::string_view instruction) {
  return strip(instruction, "\t\n :");
}

/// The first `max_bytes` bytes of `s`, cut back to a UTF-8 character boundary.
inline std::string_view utf8_prefix(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return s;
  size_t n = max_bytes;
  while (n > 0 && (static_cast<uint8_t>(s[n]) & 0xC0) == 0x80) --n;  // s[n] continues a character
  return s.substr(0, n);
}

}  // namespace detail

/// The text before an embedded text: "<|user|>\n{instruction}\n<|embed|>\n", or
/// "<|embed|>\n" when the instruction is empty after stripping "\t\n :" (as GritLM).
///   embed_prefix("Retrieve the answer:") == "<|user|>\nRetrieve the answer\n<|embed|>\n"
inline std::string embed_prefix(std::string_view instruction) {
  const std::string_view clean = detail::clean_instruction(instruction);
  if (clean.empty()) return std::string(kEmbedSymbol) + "\n";
  return std::string(kUserSymbol) + "\n" + std::string(clean) + "\n" + std::string(kEmbedSymbol) + "\n";
}

/// The user part of a generative sequence: "<|user|>\n{prompt}\n<|assistant|>\n" (the
/// prompt is not stripped, as in GritLM).
///   gen_prefix("Hi") == "<|user|>\nHi\n<|assistant|>\n"
inline std::string gen_prefix(std::string_view prompt) {
  return std::string(kUserSymbol) + "\n" + std::string(prompt) + "\n" + std::string(kAssistantSymbol) + "\n";
}

/// GritLM's embedding format as text: "<s>" + embed_prefix(instruction) + text.
/// For display and checks; tokenization inserts <s> as the BOS id, not as text.
///   format_embed("Find it", "x") == "<s><|user|>\nFind it\n<|embed|>\nx"
///   format_embed("", "x")        == "<s><|embed|>\nx"
inline std::string format_embed(std::string_view instruction, std::string_view text) {
  return "<s>" + embed_prefix(instruction) + std::string(text);
}

/// GritLM's generative format as text: "<s>" + gen_prefix(prompt) + answer.strip() + "</s>".
///   format_gen("Hi", " Hello ") == "<s><|user|>\nHi\n<|assistant|>\nHello</s>"
inline std::string format_gen(std::string_view prompt, std::string_view answer) {
  return "<s>" + gen_prefix(prompt) + std::string(detail::strip(answer, " \t\n\r\f\v")) + "</s>";
}

// ---- JSONL ---------------------------------------------------------------------------

/// What read_*_jsonl does with a malformed line: skip it (counted, the first messages
/// kept) or stop with an error naming the file and line.
enum class OnBadLine { kSkip, kFatal };

/// Records read from a JSONL file, with what was skipped.
template <class Record>
struct JsonlRecords {
  static constexpr size_t kMaxMessages = 10;
  std::vector<Record> records;
  int64_t lines = 0;                  // non-blank lines read
  int64_t skipped = 0;                // malformed lines skipped (OnBadLine::kSkip)
  std::vector<std::string> messages;  // "path:line: what" of the first kMaxMessages skipped
};

namespace detail {

struct BadLine {
  std::string what;
};

inline const nlohmann::json& json_field(const nlohmann::json& object, const char* key) {
  const auto it = object.find(key);
  if (it == object.end()) throw BadLine{c10::str("field '", key, "' is missing")};
  return *it;
}

inline std::string json_string(const nlohmann::json& value, const std::string& name, bool allow_empty) {
  if (!value.is_string()) {
    throw BadLine{c10::str("field '", name, "' must be a string (got ", value.type_name(), ")")};
  }
  std::string s = value.get<std::string>();
  if (!allow_empty && strip(s, " \t\n\r\f\v").empty()) throw BadLine{c10::str("field '", name, "' is empty")};
  return s;
}

/// Reads `path` line by line; `parse` turns one JSON object into a record or throws BadLine.
template <class Record, class Parse>
JsonlRecords<Record> read_jsonl(const std::string& path, OnBadLine on_bad, const char* schema, Parse parse) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "memopt::data: JSONL file '", path,
              "' does not exist or cannot be read. HINT: check the path; each line is ", schema);
  JsonlRecords<Record> out;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (strip(line, " \t\r\n").empty()) continue;
    ++out.lines;
    std::string what;
    try {
      const nlohmann::json object = nlohmann::json::parse(line);
      if (!object.is_object()) throw BadLine{c10::str("expected a JSON object (got ", object.type_name(), ")")};
      out.records.push_back(parse(object));
      continue;
    } catch (const BadLine& bad) {
      what = bad.what;
    } catch (const nlohmann::json::exception& e) {
      what = c10::str("not valid JSON (", e.what(), ")");
    }
    const std::string message = c10::str(path, ":", number, ": ", what);
    TORCH_CHECK(on_bad == OnBadLine::kSkip, "memopt::data: ", message, ". HINT: each line is ", schema,
                "; fix the line, or pass OnBadLine::kSkip to skip malformed lines");
    ++out.skipped;
    if (out.messages.size() < JsonlRecords<Record>::kMaxMessages) out.messages.push_back(message);
  }
  return out;
}

}  // namespace detail

/// Contrastive records from JSONL, one object a line:
/// {"query": str, "pos": str or [str, ...] (the first is taken), "neg": [str, ...]
/// (optional, default none), "instruction": str (optional, the query's),
/// "passage_instruction": str (optional, the passages')}. A line with bad JSON, a
/// missing or mistyped field, or an empty query/pos/neg text is malformed: `on_bad` says
/// whether it stops the read (an error naming path:line and the field) or is skipped.
///   auto data = read_embed_jsonl("pairs.jsonl", OnBadLine::kSkip);   // data.records, data.skipped
inline JsonlRecords<EmbedRecord> read_embed_jsonl(const std::string& path, OnBadLine on_bad = OnBadLine::kFatal) {
  static constexpr const char* kSchema =
      "{\"query\": str, \"pos\": str or [str], \"neg\": [str] (optional), \"instruction\": str (optional), "
      "\"passage_instruction\": str (optional)}";
  return detail::read_jsonl<EmbedRecord>(path, on_bad, kSchema, [](const nlohmann::json& object) {
    EmbedRecord record;
    record.query = detail::json_string(detail::json_field(object, "query"), "query", false);
    const nlohmann::json& pos = detail::json_field(object, "pos");
    if (pos.is_array()) {
      if (pos.empty()) throw detail::BadLine{"field 'pos' is an empty list"};
      record.pos = detail::json_string(pos[0], "pos[0]", false);
    } else if (pos.is_string()) {
      record.pos = detail::json_string(pos, "pos", false);
    } else {
      throw detail::BadLine{c10::str("field 'pos' must be a string or a list of strings (got ", pos.type_name(), ")")};
    }
    if (const auto neg = object.find("neg"); neg != object.end()) {
      if (!neg->is_array()) {
        throw detail::BadLine{c10::str("field 'neg' must be a list of strings (got ", neg->type_name(), ")")};
      }
      for (size_t i = 0; i < neg->size(); ++i) {
        record.neg.push_back(detail::json_string((*neg)[i], c10::str("neg[", i, "]"), false));
      }
    }
    if (const auto instruction = object.find("instruction"); instruction != object.end()) {
      record.instruction = detail::json_string(*instruction, "instruction", true);
    }
    if (const auto instruction = object.find("passage_instruction"); instruction != object.end()) {
      record.passage_instruction = detail::json_string(*instruction, "passage_instruction", true);
    }
    return record;
  });
}

/// Generative records from JSONL, one object a line: {"prompt": str, "answer": str}, both
/// non-empty. Malformed lines as in read_embed_jsonl.
///   auto data = read_gen_jsonl("chat.jsonl");   // fails at the first malformed line
inline JsonlRecords<GenRecord> read_gen_jsonl(const std::string& path, OnBadLine on_bad = OnBadLine::kFatal) {
  static constexpr const char* kSchema = "{\"prompt\": str, \"answer\": str}";
  return detail::read_jsonl<GenRecord>(path, on_bad, kSchema, [](const nlohmann::json& object) {
    GenRecord record;
    record.prompt = detail::json_string(detail::json_field(object, "prompt"), "prompt", false);
    record.answer = detail::json_string(detail::json_field(object, "answer"), "answer", false);
    return record;
  });
}

}  // namespace memopt::data
