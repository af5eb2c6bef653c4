// tests/data/fake_corpora.hpp — tiny Brown- and King James-format corpora written to a
// temporary folder, and the patterns that find their numbered sentences again: the fixtures of
// the corpus readers' tests and of the GritLM example's corpus pairs.
#pragma once

#include <fstream>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "support.hpp"

namespace memopt::test {

/// Fake Brown documents: genres a and b, 4 documents each, 3 paragraphs of 5 sentences;
/// sentence k of document cXNN reads "Doc cXNN sentence k has some words." (tagged).
inline void write_fake_brown(const TempDir& dir) {
  for (char genre : {'a', 'b'}) {
    for (int d = 1; d <= 4; ++d) {
      const std::string name = std::string("c") + genre + "0" + std::to_string(d);
      std::ofstream doc(dir.file(name));
      int k = 0;
      for (int p = 0; p < 3; ++p) {
        doc << "\n\n";
        for (int s = 0; s < 5; ++s, ++k) {
          doc << "\tDoc/np " << name << "/nn sentence/nn " << k << "/cd has/hvz some/dti words/nns ./.\n";
        }
      }
    }
  }
  std::ofstream(dir.file("README")) << "not a document\n";
}

/// {group 1, group 2 as a number} of each match of `pattern` in `text`, in order.
inline std::vector<std::pair<std::string, int>> numbered_matches(const std::string& text, const std::regex& pattern) {
  std::vector<std::pair<std::string, int>> out;
  for (std::sregex_iterator it(text.begin(), text.end(), pattern), end; it != end; ++it) {
    out.emplace_back((*it)[1].str(), std::stoi((*it)[2].str()));
  }
  return out;
}

/// {document, sentence number} of each "Doc cXNN sentence k" in `text`, in order.
inline std::vector<std::pair<std::string, int>> sentences_of(const std::string& text) {
  static const std::regex pattern("Doc (c[a-r][0-9][0-9]) sentence ([0-9]+) has some words\\.");
  return numbered_matches(text, pattern);
}

/// A fake King James text: books Ge and Exo, 4 chapters each of 12 verses; verse k of
/// chapter BkC reads "Chapter BkC verse k has some words." ("Ge1:3 Chapter Ge1 verse 3 ...").
inline void write_fake_kjv(const TempDir& dir) {
  std::ofstream out(dir.file("kjv.txt"));
  for (const char* book : {"Ge", "Exo"}) {
    for (int c = 1; c <= 4; ++c) {
      for (int v = 1; v <= 12; ++v) {
        out << book << c << ":" << v << " Chapter " << book << c << " verse " << v << " has some words.\n";
      }
    }
  }
}

/// {chapter, verse} of each "Chapter BkC verse k" in `text`, in order.
inline std::vector<std::pair<std::string, int>> verses_of(const std::string& text) {
  static const std::regex pattern("Chapter ([A-Za-z]+[0-9]+) verse ([0-9]+) has some words\\.");
  return numbered_matches(text, pattern);
}

inline std::string book_of(const std::string& chapter) { return chapter.substr(0, chapter.find_first_of("0123456789")); }

}  // namespace memopt::test
