// memopt/data/kjv.hpp — reading the King James Bible (public domain) as Debian's bible-kjv
// package prints it: `bible -f "Gen1:1-Rev22:21"`, saved by scripts/fetch_corpus as
// data/raw/kjv/kjv.txt, one verse a line ("Ge1:1 In the beginning God created ..."). The
// reader returns the corpus as a CorpusDocument list (memopt/data/brown.hpp): one document
// per chapter (1189), grouped by book (66), one paragraph per verse. Used by
// examples/prepare_corpus and memopt/data/grit.hpp.
#pragma once

#include <charconv>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <c10/util/Exception.h>

#include <memopt/data/brown.hpp>  // CorpusDocument

namespace memopt::data::kjv {

/// The file scripts/fetch_corpus writes into data/raw/kjv/.
inline constexpr std::string_view kFileName = "kjv.txt";

/// One line of the text: "Ge1:1 In the beginning ..." -> {"Ge", 1, 1, "In the beginning ..."}.
struct Verse {
  std::string book;  // the abbreviation `bible` prints: Ge, Exo, 1Sm, SSol, Mat, Rev, ...
  int64_t chapter = 0;
  int64_t verse = 0;
  std::string text;
};

namespace detail {

inline bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f' || c == '\v'; }
inline bool is_letter(char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); }
inline bool is_digit(char c) { return c >= '0' && c <= '9'; }

/// A number of 1..6 digits >= 1 at the start of `s` (advances it); nullopt otherwise.
inline std::optional<int64_t> take_number(std::string_view& s) {
  size_t n = 0;
  while (n < s.size() && is_digit(s[n])) ++n;
  if (n == 0 || n > 6) return std::nullopt;
  int64_t value = 0;
  std::from_chars(s.data(), s.data() + n, value);
  s.remove_prefix(n);
  if (value < 1) return std::nullopt;
  return value;
}

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

/// `s` cut to 80 bytes for an error message.
inline std::string shown(std::string_view s) {
  return s.size() <= 80 ? std::string(s) : std::string(s.substr(0, 80)) + "...";
}

}  // namespace detail

/// A verse line: a reference (book = an optional digit and letters, then chapter:verse, both
/// >= 1), whitespace, the text (not empty; surrounding whitespace and a '\r' dropped).
/// nullopt when the line is not one.
///   parse_verse("1Sm3:10 And the LORD came").value().book == "1Sm"
inline std::optional<Verse> parse_verse(std::string_view line) {
  std::string_view s = detail::trim(line);
  Verse v;
  size_t n = 0;
  if (n < s.size() && detail::is_digit(s[n])) ++n;
  const size_t letters = n;
  while (n < s.size() && detail::is_letter(s[n])) ++n;
  if (n == letters) return std::nullopt;
  v.book.assign(s.substr(0, n));
  s.remove_prefix(n);
  const auto chapter = detail::take_number(s);
  if (!chapter || s.empty() || s.front() != ':') return std::nullopt;
  s.remove_prefix(1);
  const auto verse = detail::take_number(s);
  if (!verse || s.empty() || !detail::is_space(s.front())) return std::nullopt;
  const std::string_view text = detail::trim(s);
  if (text.empty()) return std::nullopt;
  v.chapter = *chapter;
  v.verse = *verse;
  v.text.assign(text);
  return v;
}

/// The text file of a KJV path: the path itself when it is a file, DIR/kjv.txt when it is a
/// folder. Fails with a HINT when there is none.
///   corpus_file("data/raw/kjv") == "data/raw/kjv/kjv.txt"
inline std::string corpus_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string file = fs::is_directory(path, ec) ? (fs::path(path) / kFileName).string() : path;
  TORCH_CHECK(fs::is_regular_file(file, ec), "memopt::data: the King James text '", file,
              "' does not exist. HINT: run scripts/fetch_corpus (it writes data/raw/kjv/kjv.txt with the `bible` "
              "program of Debian's bible-kjv package); a Brown corpus is a folder of files ca01 .. cr09 "
              "(scripts/fetch_corpus brown)");
  return file;
}

/// The King James text at `path` (a kjv.txt, or the folder holding it) as documents in file
/// order: one per chapter, named book + chapter ("Ge1"), grouped by book ("Ge"), one
/// paragraph per verse, each a single sentence (the verse's text without its reference).
/// Blank lines are skipped. A line that is not a verse, or a verse that does not come after
/// the previous one of its book (a repeated or reordered verse, a book that appears twice),
/// is an error naming file:line and the line; gaps are allowed (a dump of some verses).
///   auto chapters = memopt::data::kjv::read_corpus("data/raw/kjv");   // 1189 documents
///   chapters[0].name == "Ge1"; chapters[0].paragraphs[0][0] == "In the beginning God created ..."
inline std::vector<CorpusDocument> read_corpus(const std::string& path) {
  const std::string file = corpus_file(path);
  std::ifstream in(file, std::ios::binary);
  TORCH_CHECK(in.good(), "memopt::data: cannot read the King James text '", file,
              "'. HINT: check its permissions, or re-run scripts/fetch_corpus");
  std::vector<CorpusDocument> docs;
  std::set<std::string> books_done;  // books before the current one
  Verse last;                        // the previous verse (book empty: none yet)
  int64_t line_no = 0;
  std::string line;
  while (std::getline(in, line)) {
    ++line_no;
    if (detail::trim(line).empty()) continue;
    std::optional<Verse> v = parse_verse(line);
    TORCH_CHECK(v.has_value(), "memopt::data: ", file, ":", line_no, ": not a verse line (got '", detail::shown(line),
                "'; expected a reference, a space and the text, as `bible -f` prints them: 'Ge1:1 In the beginning "
                "...'). HINT: rewrite the file with scripts/fetch_corpus (remove data/raw/kjv first)");
    const bool same_book = v->book == last.book;
    if (!same_book) {
      TORCH_CHECK(books_done.count(v->book) == 0, "memopt::data: ", file, ":", line_no, ": book '", v->book,
                  "' appears again after other books (got '", detail::shown(line), "'). HINT: keep each book's "
                  "verses together, in order, as `bible -f \"Gen1:1-Rev22:21\"` prints them");
      if (!last.book.empty()) books_done.insert(last.book);
    } else {
      const bool after = v->chapter > last.chapter || (v->chapter == last.chapter && v->verse > last.verse);
      TORCH_CHECK(after, "memopt::data: ", file, ":", line_no, ": verse ", v->book, v->chapter, ":", v->verse,
                  " does not come after ", last.book, last.chapter, ":", last.verse, " (got '", detail::shown(line),
                  "'). HINT: the verses of a book must be in order and appear once; rewrite the file with "
                  "scripts/fetch_corpus");
    }
    if (!same_book || v->chapter != last.chapter) {
      docs.push_back({v->book + std::to_string(v->chapter), v->book, {}});
    }
    docs.back().paragraphs.push_back({v->text});
    last = std::move(*v);
  }
  TORCH_CHECK(!docs.empty(), "memopt::data: the King James text '", file, "' holds no verses (", line_no,
              " lines). HINT: run scripts/fetch_corpus (remove data/raw/kjv first), or check that the file is "
              "`bible -f` output");
  return docs;
}

}  // namespace memopt::data::kjv
