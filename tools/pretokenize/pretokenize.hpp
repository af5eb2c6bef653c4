// tools/pretokenize/pretokenize.hpp — what memopt-pretokenize does: the documents of text, JSONL
// and Parquet sources (memopt/data/source.hpp), tokenized in parallel and kept in order, EOS after
// each (the ids StreamLoader makes on the fly), written as token shards of at most
// shard_tokens ids (OUT/shard-00000.bin, ...) and, last, OUT/index.json. main.cpp is the
// command line; tests/tools/pretokenize_test.cpp calls pretokenize() directly.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/callbacks.hpp>  // callbacks::format_duration
#include <memopt/data/prefetch.hpp>
#include <memopt/data/shard.hpp>
#include <memopt/data/source.hpp>
#include <memopt/data/tokenizer.hpp>
#include <memopt/io/manifest.hpp>  // io::digest_file (XXH3-64)

namespace memopt::tools {

/// index.json's "format" and "version" (what detail::index_shards in source_files.hpp checks).
inline constexpr const char* kIndexFormat = "memopt-token-shards";
inline constexpr int kIndexVersion = 1;

/// Threads that tokenize by default: one per hardware thread.
inline int64_t default_workers() { return std::max<int64_t>(1, std::thread::hardware_concurrency()); }

/// What to pre-tokenize, where to, and how.
///   auto opts = memopt::tools::PretokenizeOptions().sources({"corpus/*.jsonl"})
///                   .tokenizer("data/kjv/tokenizer.model").out("corpus-tokens");
struct PretokenizeOptions {
  using Stream = std::FILE*;  // TORCH_ARG writes `const T&`: spelled `const std::FILE*&` it would not bind
  /// Files, directories and globs of text, JSONL and Parquet (resolve_sources()).
  TORCH_ARG(std::vector<std::string>, sources);
  /// The tokenizer: a SentencePiece .model, a tokenizer.json, or a folder holding one
  /// (memopt::data::Tokenizer).
  TORCH_ARG(std::string, tokenizer);
  /// Text bytes that are not UTF-8: replaced by U+FFFD, or an error (data::InvalidUtf8).
  TORCH_ARG(data::InvalidUtf8, invalid_utf8) = data::InvalidUtf8::kReplace;
  /// The folder that receives shard-NNNNN.bin and index.json.
  TORCH_ARG(std::string, out);
  /// JSONL: the field holding each document's text; Parquet: the column.
  TORCH_ARG(std::string, text_field) = "text";
  /// Plain text: a document a line or a paragraph.
  TORCH_ARG(data::Split, split) = data::Split::kLine;
  /// Documents to take from the start of the sources; 0: all.
  TORCH_ARG(int64_t, max_examples) = 0;
  /// Ids per shard at most (a document may continue in the next shard).
  TORCH_ARG(int64_t, shard_tokens) = 100'000'000;
  /// Tokenizer threads.
  TORCH_ARG(int64_t, workers) = default_workers();
  /// Documents a worker tokenizes at once (a block also ends after 1 MiB of text).
  TORCH_ARG(int64_t, block_documents) = 256;
  /// Replace the index.json and shard-*.bin files of a non-empty `out`.
  TORCH_ARG(bool, force) = false;
  /// Where the progress bar goes (stderr in the tool); nullptr: nowhere.
  TORCH_ARG(Stream, progress) = nullptr;
};

/// What pretokenize() wrote.
struct PretokenizeSummary {
  int64_t documents = 0;
  int64_t tokens = 0;  // EOS ids included
  int64_t shards = 0;
  int64_t bytes = 0;   // of the sources read (up to the last document taken)
  double seconds = 0;
  std::string index;   // OUT/index.json
};

/// The progress bar: bytes read / total, documents, tokens, MB/s, ETA. On a terminal it is
/// redrawn in place (at most 10 times a second); otherwise one line every 5 seconds.
class Progress {
 public:
  Progress(std::FILE* out, int64_t total_bytes, int64_t max_documents)
      : out_(out), tty_(out != nullptr && ::isatty(::fileno(out)) != 0), total_(total_bytes), max_documents_(max_documents) {}

  void update(int64_t bytes, int64_t documents, int64_t tokens, bool final = false) {
    if (out_ == nullptr) return;
    const double now = seconds();
    if (!final && now - last_ < (tty_ ? 0.1 : 5.0)) return;
    last_ = now;
    double fraction = total_ > 0 ? static_cast<double>(bytes) / static_cast<double>(total_) : 1.0;
    if (max_documents_ > 0) fraction = std::max(fraction, static_cast<double>(documents) / static_cast<double>(max_documents_));
    fraction = final ? 1.0 : std::clamp(fraction, 0.0, 1.0);
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * fraction);
    const double mb = 1e6, rate = static_cast<double>(bytes) / std::max(now, 1e-9);
    const double eta = final ? 0.0 : (fraction > 0 ? now * (1 - fraction) / fraction : -1.0);
    const std::string line = fmt::format(
        "[{}{}] {:5.1f}% | {:.1f}/{:.1f} MB | {} documents | {} tokens | {:.1f} MB/s | ETA {}",
        std::string(filled, '#'), std::string(kWidth - filled, '.'), 100 * fraction, static_cast<double>(bytes) / mb,
        static_cast<double>(total_) / mb, documents, tokens, rate / mb, callbacks::format_duration(eta));
    if (tty_) {
      fmt::print(out_, "\r{}\x1b[K{}", line, final ? "\n" : "");  // \x1b[K: erase what a longer line left
    } else {
      fmt::print(out_, "{}\n", line);
    }
    std::fflush(out_);
  }

  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  std::FILE* out_;
  bool tty_;
  int64_t total_, max_documents_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  double last_ = 0;
};

namespace detail {

namespace fs = std::filesystem;

/// "shard-00012.bin"
inline std::string shard_name(int64_t index) { return fmt::format("shard-{:05d}.bin", index); }

/// What a previous run may have left in `out`: its index.json and shards (and their .tmp).
inline bool is_output_file(const std::string& name) {
  const auto ends_with = [&](std::string_view suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return name == "index.json" || name == "index.json.tmp" ||
         (name.rfind("shard-", 0) == 0 && (ends_with(".bin") || ends_with(".bin.tmp")));
}

/// Makes `out` an empty or a writable folder: refuses a non-empty one unless `force`, which
/// removes index.json first (a half-replaced folder is never read as complete), then the shards.
inline void prepare_out(const fs::path& out, bool force) {
  std::error_code ec;
  if (fs::exists(out, ec)) {
    TORCH_CHECK(fs::is_directory(out), "memopt-pretokenize: --out '", out.string(), "' is a file, not a folder. "
                "HINT: pass a new or an empty folder");
    if (!fs::is_empty(out, ec)) {
      TORCH_CHECK(force, "memopt-pretokenize: --out '", out.string(), "' exists and is not empty. HINT: pass --force to "
                  "replace its index.json and shard-*.bin files, or choose a new folder");
      fs::remove(out / "index.json", ec);
      TORCH_CHECK(!ec, "memopt-pretokenize: cannot remove '", (out / "index.json").string(), "' (", ec.message(),
                  "). HINT: check that --out is writable");
      for (const auto& entry : fs::directory_iterator(out, ec)) {
        if (!entry.is_regular_file() || !is_output_file(entry.path().filename().string())) continue;
        fs::remove(entry.path(), ec);
        TORCH_CHECK(!ec, "memopt-pretokenize: cannot remove '", entry.path().string(), "' (", ec.message(),
                    "). HINT: check that --out is writable");
      }
      TORCH_CHECK(!ec, "memopt-pretokenize: cannot list --out '", out.string(), "' (", ec.message(),
                  "). HINT: check that it is a readable folder");
    }
  } else {
    fs::create_directories(out, ec);
    TORCH_CHECK(!ec, "memopt-pretokenize: cannot create --out '", out.string(), "' (", ec.message(),
                "). HINT: pass a folder whose parent exists and is writable");
  }
  TORCH_CHECK(::access(out.c_str(), W_OK | X_OK) == 0, "memopt-pretokenize: cannot write to --out '", out.string(),
              "' (", std::strerror(errno), "). HINT: pass a folder you can write to");
}

/// Writes `text` to `path` via `path.tmp`, synced, then renamed (atomic).
inline void write_atomically(const fs::path& path, const std::string& text) {
  const std::string tmp = path.string() + ".tmp";
  std::FILE* file = std::fopen(tmp.c_str(), "wb");
  TORCH_CHECK(file != nullptr, "memopt-pretokenize: cannot create '", tmp, "' (", std::strerror(errno),
              "). HINT: check that --out is writable");
  const bool ok = std::fwrite(text.data(), 1, text.size(), file) == text.size() && std::fflush(file) == 0 &&
                  ::fsync(::fileno(file)) == 0;
  const int write_errno = errno;
  const bool closed = std::fclose(file) == 0;
  if (!ok || !closed) {
    std::remove(tmp.c_str());
    TORCH_CHECK(false, "memopt-pretokenize: writing '", tmp, "' failed (", std::strerror(write_errno),
                "). HINT: check free disk space");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) std::remove(tmp.c_str());
  TORCH_CHECK(!ec, "memopt-pretokenize: cannot rename '", tmp, "' to '", path.string(), "' (", ec.message(),
              "). HINT: check that --out is writable");
}

/// Documents read together and tokenized by one worker.
struct Block {
  std::vector<int32_t> ids;       // the documents' ids, EOS after each
  std::vector<int64_t> lengths;   // ids of each document (EOS included)
  int64_t source_bytes = 0;       // bytes of the sources read up to the end of this block
  bool last = false;              // no document after these
  std::exception_ptr error;       // reading or tokenizing failed: rethrown in order
};

}  // namespace detail

/// Pre-tokenizes `options.sources()` into `options.out()` (see the top of this file).
/// Errors name the flag, file or line and end with a HINT; on an error the shards written
/// so far are removed and no index.json is written.
///   auto summary = memopt::tools::pretokenize(opts);   // summary.tokens, summary.shards, ...
inline PretokenizeSummary pretokenize(const PretokenizeOptions& options) {
  namespace fs = std::filesystem;
  using data::SourceKind;
  TORCH_CHECK(options.workers() >= 1, "memopt-pretokenize: --workers must be >= 1 (got ", options.workers(),
              "). HINT: the default is one per hardware thread");
  TORCH_CHECK(options.shard_tokens() >= 1, "memopt-pretokenize: --shard_tokens must be >= 1 (got ",
              options.shard_tokens(), "). HINT: the default, 100000000 ids, makes shards of 200 MB (uint16 ids)");
  TORCH_CHECK(options.block_documents() >= 1, "memopt-pretokenize: --block_documents must be >= 1 (got ",
              options.block_documents(), "). HINT: the default is 256");
  TORCH_CHECK(options.max_examples() >= 0, "memopt-pretokenize: --max_examples must be >= 0 (got ",
              options.max_examples(), "). HINT: 0 takes every document");
  TORCH_CHECK(!options.out().empty(), "memopt-pretokenize: no output folder. HINT: pass --out FOLDER");

  // ---- the tokenizer, the sources, the output folder: every check before any work ----
  TORCH_CHECK(!options.tokenizer().empty(), "memopt-pretokenize: no tokenizer. HINT: pass --tokenizer "
              "PATH/tokenizer.model (a SentencePiece BPE model, e.g. data/kjv/tokenizer.model from scripts/demo), a "
              "tokenizer.json or a checkpoint folder holding one");
  TORCH_CHECK(fs::exists(options.tokenizer()), "memopt-pretokenize: --tokenizer '", options.tokenizer(),
              "' does not exist. HINT: pass a SentencePiece BPE model such as data/kjv/tokenizer.model (scripts/demo "
              "makes it), a tokenizer.json, or a folder holding one");
  const auto tokenizer = std::make_shared<const data::Tokenizer>(
      options.tokenizer(), data::TokenizerOptions().invalid_utf8(options.invalid_utf8()));
  const int32_t eos = static_cast<int32_t>(tokenizer->eos_id());
  TORCH_CHECK(eos >= 0, "memopt-pretokenize: tokenizer '", options.tokenizer(), "' has no EOS piece: documents could "
              "not be separated. HINT: train it with eos_id >= 0 (spm_train --eos_id=2)");
  TORCH_CHECK(!options.sources().empty(), "memopt-pretokenize: no sources. HINT: pass text, JSONL or Parquet files, "
              "folders or globs such as 'corpus/*.jsonl'");
  std::vector<data::SourceFile> files = data::resolve_sources(options.sources());
  int64_t total_bytes = 0;
  for (const auto& f : files) {
    TORCH_CHECK(f.kind != SourceKind::kShard, "memopt-pretokenize: '", f.path, "' is already a token shard. HINT: pass "
                "text, JSONL or Parquet sources; shards and index.json files stream as they are");
    total_bytes += f.bytes;
  }
  const fs::path out = options.out();
  detail::prepare_out(out, options.force());
  const std::string model_digest = io::digest_file(tokenizer->path()).xxh3;

  // ---- reading (in block order, one worker at a time) and tokenizing (in parallel) ----
  struct Shared {
    Shared(std::vector<data::SourceFile> files, data::SourceOptions options)
        : reader(std::move(files), std::move(options)) {}
    data::DocumentReader reader;
    std::vector<int64_t> bytes_before;  // bytes of the files before file i
    std::mutex mutex;
    std::condition_variable turn_cv;
    int64_t turn = 0;
    bool failed = false;
    int64_t bytes_read = 0;  // up to the end of the last document read
  };
  const auto source_options = data::SourceOptions()
                                  .text_field(options.text_field())
                                  .split(options.split())
                                  .max_examples(options.max_examples())
                                  .epochs(1)
                                  .shuffle_files(false);  // the index keeps the sources' order
  Shared shared(files, source_options);
  shared.bytes_before.push_back(0);
  for (const auto& f : files) shared.bytes_before.push_back(shared.bytes_before.back() + f.bytes);

  const int64_t block_documents = options.block_documents();
  const bool limited = options.max_examples() > 0;
  auto produce = [&shared, &tokenizer, &files, block_documents, eos, total_bytes, limited](int64_t index) {
    detail::Block block;
    std::vector<std::string> texts;
    std::vector<int64_t> text_files;  // the source of each text (an index into files)
    {
      std::unique_lock<std::mutex> lock(shared.mutex);
      shared.turn_cv.wait(lock, [&] { return shared.turn == index; });
      struct NextTurn {  // the next block may read, whatever happens to this one
        Shared& s;
        ~NextTurn() {
          ++s.turn;
          s.turn_cv.notify_all();
        }
      } next_turn{shared};
      if (shared.failed) {
        block.last = true;
        return block;
      }
      try {
        int64_t bytes = 0;
        data::RawDocument doc;
        while (static_cast<int64_t>(texts.size()) < block_documents && bytes < (int64_t{1} << 20) &&
               shared.reader.next(doc)) {
          bytes += static_cast<int64_t>(doc.text.size());
          texts.push_back(std::move(doc.text));
          const data::SourcePosition& at = shared.reader.position();  // the file and offset after it
          text_files.push_back(at.file);
          shared.bytes_read = shared.bytes_before[static_cast<size_t>(at.file)] + shared.reader.file_bytes_read();
        }
        block.last = shared.reader.finished();
        if (block.last && !limited) shared.bytes_read = total_bytes;  // the blank lines after the last document
        block.source_bytes = shared.bytes_read;
      } catch (...) {
        shared.failed = true;
        block.error = std::current_exception();
        block.last = true;
        return block;
      }
    }
    try {
      block.lengths.reserve(texts.size());
      for (size_t i = 0; i < texts.size(); ++i) {
        std::vector<int32_t> ids;
        try {
          ids = tokenizer->encode(texts[i]);
        } catch (const c10::Error& e) {  // malformed UTF-8 under --invalid_utf8 reject: name the file
          TORCH_CHECK(false, "memopt-pretokenize: a document of '", files[static_cast<size_t>(text_files[i])].path,
                      "': ", e.what_without_backtrace());
        }
        block.ids.insert(block.ids.end(), ids.begin(), ids.end());
        block.ids.push_back(eos);
        block.lengths.push_back(static_cast<int64_t>(ids.size()) + 1);
      }
    } catch (...) {
      block.error = std::current_exception();
    }
    return block;
  };

  // ---- writing, in order: shards filled to shard_tokens ids, then the index ----
  PretokenizeSummary summary;
  nlohmann::ordered_json shards = nlohmann::ordered_json::array();
  std::vector<fs::path> written;  // removed again if anything fails
  struct RemoveOnError {
    std::vector<fs::path>& paths;
    bool done = false;
    ~RemoveOnError() {
      if (done) return;
      std::error_code ec;
      for (const auto& p : paths) fs::remove(p, ec);
    }
  } cleanup{written};
  std::unique_ptr<data::ShardWriter> writer;
  int64_t shard_documents = 0;
  const auto close_shard = [&] {
    writer->close();
    const std::string name = fs::path(writer->path()).filename().string();
    shards.push_back({{"file", name}, {"tokens", writer->size()}, {"documents", shard_documents}});
    writer.reset();
    shard_documents = 0;
  };

  Progress progress(options.progress(), total_bytes, options.max_examples());
  {
    data::Prefetcher<detail::Block> prefetch(
        produce, data::PrefetchOptions().workers(options.workers()).depth(2 * options.workers() + 2));
    while (true) {
      detail::Block block = prefetch.next();
      if (block.error) std::rethrow_exception(block.error);
      int64_t offset = 0;
      for (const int64_t length : block.lengths) {
        for (int64_t at = 0; at < length;) {
          if (!writer) {
            const fs::path path = out / detail::shard_name(static_cast<int64_t>(shards.size()));
            writer = std::make_unique<data::ShardWriter>(path.string(), tokenizer->vocab_size());
            written.push_back(path);
          }
          const int64_t take = std::min(length - at, options.shard_tokens() - writer->size());
          writer->append(std::span<const int32_t>(block.ids.data() + offset + at, static_cast<size_t>(take)));
          at += take;
          if (at == length) ++shard_documents;  // a document counts in the shard holding its EOS
          if (writer->size() == options.shard_tokens()) close_shard();
        }
        offset += length;
        summary.tokens += length;
      }
      summary.documents += static_cast<int64_t>(block.lengths.size());
      summary.bytes = block.source_bytes;
      progress.update(summary.bytes, summary.documents, summary.tokens);
      if (block.last) break;
    }
  }
  if (writer) close_shard();
  TORCH_CHECK(summary.documents > 0, "memopt-pretokenize: the sources hold no document. HINT: check --text_field and "
              "--split, and that the files are not empty");

  std::vector<std::string> source_paths;
  for (const auto& f : files) source_paths.push_back(fs::absolute(f.path).lexically_normal().string());
  const nlohmann::ordered_json index = {
      {"format", kIndexFormat},
      {"version", kIndexVersion},
      {"tokenizer", fs::absolute(tokenizer->path()).lexically_normal().string()},
      {"tokenizer_kind", tokenizer->kind()},
      {"invalid_utf8", options.invalid_utf8() == data::InvalidUtf8::kReplace ? "replace" : "reject"},
      {"tokenizer_xxh3", model_digest},
      {"vocab_size", tokenizer->vocab_size()},
      {"eos_id", eos},
      {"documents", summary.documents},
      {"tokens", summary.tokens},
      {"bytes_per_token", tokenizer->vocab_size() <= 65536 ? 2 : 4},
      {"shard_tokens", options.shard_tokens()},
      {"text_field", options.text_field()},
      {"split", options.split() == data::Split::kLine ? "line" : "paragraph"},
      {"max_examples", options.max_examples()},
      {"sources", source_paths},
      {"shards", shards},
  };
  summary.index = (out / "index.json").string();
  detail::write_atomically(summary.index, index.dump(2) + "\n");
  cleanup.done = true;
  summary.shards = static_cast<int64_t>(shards.size());
  summary.seconds = progress.seconds();
  progress.update(summary.bytes, summary.documents, summary.tokens, /*final=*/true);
  return summary;
}

}  // namespace memopt::tools
