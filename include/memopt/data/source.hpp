// memopt/data/source.hpp — where a stream's documents come from: files, directories and
// globs of plain text, JSONL, Parquet and token shards (or a memopt-pretokenize index),
// read one document at a time from a position (epoch, file, byte offset) that a checkpoint
// can store, with a fixed-size read buffer: memory does not grow with the corpus.
//
// Documents:
//   *.jsonl, *.ndjson   one JSON object a line; the document is its `text_field` string
//   *.parquet           a row; the document is its `text_field` column's string (null rows
//                       are no documents); read by pyarrow in a Python child process
//                       (memopt/data/parquet.hpp: $MEMOPT_PYTHON, else python3 on PATH)
//   *.bin               a token shard (memopt/data/shard.hpp): consecutive chunks of
//                       `shard_chunk_tokens` ids (the shard holds its own EOS ids)
//   *.json              a memopt-pretokenize index: its shards, in order
//   anything else       plain text: one document a line (Split::kLine), or a paragraph of
//                       lines ended by a blank line (Split::kParagraph); blank lines are no
//                       documents
// A directory stands for its files with these extensions (recursively, hidden ones left
// out; its index.json alone when it has one), a pattern with * ? [ for the files it matches
// (glob(3)); each sorted by path: data/source_files.hpp's resolve_sources.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/data/parquet.hpp>
#include <memopt/data/random.hpp>
#include <memopt/data/shard.hpp>
#include <memopt/data/source_files.hpp>

namespace memopt::data {

/// How a plain-text file is cut into documents.
enum class Split {
  kLine,       // every non-blank line is a document
  kParagraph,  // consecutive non-blank lines (joined by '\n') up to a blank line
};

/// Where a reader is: the next document it reads. Stored in training checkpoints.
struct SourcePosition {
  int64_t epoch = 0;     // passes over the sources completed
  int64_t file = 0;      // index into this epoch's file order
  int64_t offset = 0;    // bytes (text, JSONL), tokens (shards) or rows (Parquet) into that file
  int64_t line = 1;      // line number at `offset` (1-based; for error messages; Parquet: offset + 1)
  int64_t document = 0;  // documents read this epoch, every rank's counted (sharding, max_examples)

  nlohmann::json to_json() const {
    return {{"epoch", epoch}, {"file", file}, {"offset", offset}, {"line", line}, {"document", document}};
  }
  static SourcePosition from_json(const nlohmann::json& j) {
    TORCH_CHECK(j.is_object(), "memopt::data: a source position must be an object (got ", j.dump(),
                "). HINT: the checkpoint's state.json is damaged");
    SourcePosition p;
    for (auto [key, field] : {std::pair{"epoch", &p.epoch}, {"file", &p.file}, {"offset", &p.offset},
                              {"line", &p.line}, {"document", &p.document}}) {
      TORCH_CHECK(j.contains(key) && j[key].is_number_integer() && j[key].get<int64_t>() >= 0,
                  "memopt::data: source position field \"", key, "\" is ", j.contains(key) ? j[key].dump() : "missing",
                  " (expected an integer >= 0). HINT: the checkpoint's state.json is damaged");
      *field = j[key].get<int64_t>();
    }
    return p;
  }
};

/// Which documents a reader hands out, and how it reads them.
///   auto opts = memopt::data::SourceOptions().text_field("content").rank(1).world_size(2);
struct SourceOptions {
  /// JSONL: the field holding each document's text; Parquet: the column (strings).
  TORCH_ARG(std::string, text_field) = "text";
  /// Plain text: a document a line, or a paragraph.
  TORCH_ARG(Split, split) = Split::kLine;
  /// Token shards: ids per document (chunk).
  TORCH_ARG(int64_t, shard_chunk_tokens) = 2048;
  /// Documents per epoch, every rank's counted, from the start of the (shuffled) file order;
  /// 0: all.
  TORCH_ARG(int64_t, max_examples) = 0;
  /// Passes over the sources; 0: without end.
  TORCH_ARG(int64_t, epochs) = 1;
  /// Data-parallel sharding: this rank reads documents d with d % world_size == rank.
  TORCH_ARG(int64_t, rank) = 0;
  TORCH_ARG(int64_t, world_size) = 1;
  /// Shuffle the file order each epoch (seeded); documents within a file keep their order.
  TORCH_ARG(bool, shuffle_files) = true;
  TORCH_ARG(uint64_t, seed) = 1234;
  /// A longer document (line, paragraph, JSONL record, Parquet row) is an error, not an allocation.
  TORCH_ARG(int64_t, max_document_bytes) = int64_t{64} << 20;
};

/// A document as read: text to tokenize, or ids from a shard.
struct RawDocument {
  std::string text;
  std::vector<int32_t> tokens;
  bool pretokenized = false;
};

/// The text of one JSONL record: `line` must be a JSON object whose `field` is a string.
/// Errors name the file, the line number and what was seen. A pure function (the fuzz
/// target fuzz/jsonl_record_fuzz.cpp).
///   std::string text = memopt::data::parse_jsonl_record(R"({"text": "hi"})", "text", "a.jsonl", 1);
inline std::string parse_jsonl_record(std::string_view line, const std::string& field, const std::string& file,
                                      int64_t line_no) {
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  const auto shown = [&] {
    std::string s(line.substr(0, 80));
    for (char& c : s) c = (static_cast<unsigned char>(c) < 0x20) ? ' ' : c;
    return s + (line.size() > 80 ? "..." : "");
  };
  TORCH_CHECK(!j.is_discarded(), "memopt::data: ", file, ":", line_no, ": not valid JSON: '", shown(),
              "'. HINT: a JSONL file holds one JSON object per line");
  TORCH_CHECK(j.is_object(), "memopt::data: ", file, ":", line_no, ": expected a JSON object, got a ", j.type_name(),
              ": '", shown(), "'. HINT: a JSONL file holds one JSON object per line");
  const auto it = j.find(field);
  TORCH_CHECK(it != j.end(), "memopt::data: ", file, ":", line_no, ": the record has no field \"", field,
              "\": '", shown(), "'. HINT: name the text field with --text_field (SourceOptions::text_field)");
  TORCH_CHECK(it->is_string(), "memopt::data: ", file, ":", line_no, ": field \"", field, "\" is a ",
              it->type_name(), ", not a string. HINT: the text field must hold the document as one string");
  return it->get<std::string>();
}

namespace detail {

inline bool is_blank(std::string_view line) {
  return std::all_of(line.begin(), line.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; });
}

/// A file read forward from an offset through a fixed buffer, line by line.
class LineFile {
 public:
  LineFile(const std::string& path, int64_t offset) : path_(path), offset_(offset) {
    file_ = std::fopen(path.c_str(), "rb");
    TORCH_CHECK(file_ != nullptr, "memopt::data: cannot open '", path, "' (", std::strerror(errno),
                "). HINT: check that the file exists and is readable");
    TORCH_CHECK(::fseeko(file_, static_cast<off_t>(offset), SEEK_SET) == 0, "memopt::data: cannot seek to byte ",
                offset, " of '", path, "'. HINT: the file changed since the checkpoint; resume with the same data");
    buffer_.resize(1 << 20);
  }
  ~LineFile() {
    if (file_ != nullptr) std::fclose(file_);
  }
  LineFile(const LineFile&) = delete;
  LineFile& operator=(const LineFile&) = delete;

  /// The next line (without '\n') into `line`; false at the end of the file. A line longer
  /// than max_bytes is an error naming `line_no`.
  bool read_line(std::string& line, int64_t max_bytes, int64_t line_no) {
    line.clear();
    bool any = false;
    while (true) {
      if (pos_ == end_) {
        end_ = std::fread(buffer_.data(), 1, buffer_.size(), file_);
        pos_ = 0;
        TORCH_CHECK(!std::ferror(file_), "memopt::data: reading '", path_, "' failed near byte ", offset_,
                    ". HINT: check the disk and the file");
        if (end_ == 0) return any;
      }
      any = true;
      const char* start = buffer_.data() + pos_;
      const void* nl = std::memchr(start, '\n', end_ - pos_);
      const size_t take = nl ? static_cast<const char*>(nl) - start : end_ - pos_;
      TORCH_CHECK(static_cast<int64_t>(line.size() + take) <= max_bytes, "memopt::data: ", path_, ":", line_no,
                  ": a line longer than max_document_bytes (", max_bytes, " bytes). HINT: this reader takes one "
                  "document a line; split the text, or raise SourceOptions::max_document_bytes");
      line.append(start, take);
      pos_ += take;
      offset_ += static_cast<int64_t>(take);
      if (nl) {
        ++pos_;
        ++offset_;
        return true;
      }
    }
  }
  /// Bytes from the start of the file to the next unread byte.
  int64_t offset() const { return offset_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  std::vector<char> buffer_;
  size_t pos_ = 0, end_ = 0;
  int64_t offset_ = 0;
};

/// A token shard read forward by chunks with pread-like reads (no map: pages the run has
/// read are not kept resident).
class ShardFile {
 public:
  ShardFile(const std::string& path, int64_t token_offset) : path_(path), next_(token_offset) {
    file_ = std::fopen(path.c_str(), "rb");
    TORCH_CHECK(file_ != nullptr, "memopt::data: cannot open token shard '", path, "' (", std::strerror(errno),
                "). HINT: check that the file exists and is readable");
    unsigned char header[kShardHeaderBytes] = {};
    const size_t got = std::fread(header, 1, sizeof(header), file_);
    std::error_code ec;
    const auto size = static_cast<int64_t>(std::filesystem::file_size(path, ec));
    const int64_t known = static_cast<int64_t>(got) < kShardHeaderBytes ? static_cast<int64_t>(got) : size;
    header_ = parse_shard_header(header, ec ? 0 : known, path);
    TORCH_CHECK(next_ <= header_.tokens, "memopt::data: token shard '", path, "' holds ", header_.tokens,
                " tokens, the position is at token ", next_, ". HINT: the file changed since the checkpoint");
  }
  ~ShardFile() {
    if (file_ != nullptr) std::fclose(file_);
  }
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;

  /// The next up to `n` ids; false at the end of the shard.
  bool read_chunk(int64_t n, std::vector<int32_t>& out) {
    out.clear();
    const int64_t len = std::min(n, header_.tokens - next_);
    if (len <= 0) return false;
    const int64_t w = header_.bytes_per_token;
    bytes_.resize(static_cast<size_t>(len * w));
    const bool ok = ::fseeko(file_, static_cast<off_t>(kShardHeaderBytes + next_ * w), SEEK_SET) == 0 &&
                    std::fread(bytes_.data(), 1, bytes_.size(), file_) == bytes_.size();
    TORCH_CHECK(ok, "memopt::data: reading tokens ", next_, "..", next_ + len, " of shard '", path_,
                "' failed. HINT: the file is truncated or the disk failed; ", kRebuildShardHint);
    out.resize(static_cast<size_t>(len));
    for (int64_t i = 0; i < len; ++i) {
      const unsigned char* p = bytes_.data() + i * w;
      const int64_t id = w == 2 ? int64_t{load_le<uint16_t>(p)} : int64_t{load_le<uint32_t>(p)};
      TORCH_CHECK(id < header_.vocab_size, "memopt::data: token shard '", path_, "' holds token id ", id,
                  " at position ", next_ + i, ", >= its vocab_size ", header_.vocab_size, ". HINT: ", kRebuildShardHint);
      out[static_cast<size_t>(i)] = static_cast<int32_t>(id);
    }
    next_ += len;
    return true;
  }
  int64_t offset() const { return next_; }
  const ShardHeader& header() const { return header_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  ShardHeader header_;
  std::vector<unsigned char> bytes_;
  int64_t next_ = 0;
};

}  // namespace detail

/// Reads the documents of a list of files, one at a time, from a SourcePosition, for one
/// rank: the documents of other ranks are read past (JSONL records unparsed), never handed
/// out. Epochs restart at the first file of a new seeded order. Not thread-safe.
///   memopt::data::DocumentReader reader(memopt::data::resolve_sources({"corpus"}), {});
///   memopt::data::RawDocument doc;
///   while (reader.next(doc)) use(doc.text);
class DocumentReader {
 public:
  DocumentReader(std::vector<SourceFile> files, SourceOptions options, SourcePosition start = {})
      : files_(std::move(files)), options_(std::move(options)) {
    TORCH_CHECK(!files_.empty(), "memopt::data: DocumentReader has no file. HINT: resolve_sources() names them");
    TORCH_CHECK(options_.world_size() >= 1 && options_.rank() >= 0 && options_.rank() < options_.world_size(),
                "memopt::data: rank ", options_.rank(), " is outside world_size ", options_.world_size(),
                ". HINT: ranks are 0 .. world_size - 1");
    TORCH_CHECK(options_.epochs() >= 0, "memopt::data: epochs must be >= 0 (got ", options_.epochs(),
                "). HINT: 0 reads the sources again and again");
    TORCH_CHECK(options_.max_examples() >= 0, "memopt::data: max_examples must be >= 0 (got ",
                options_.max_examples(), "). HINT: 0 reads every document");
    TORCH_CHECK(options_.shard_chunk_tokens() >= 1, "memopt::data: shard_chunk_tokens must be >= 1 (got ",
                options_.shard_chunk_tokens(), "). HINT: 2048 ids a chunk suit most runs");
    TORCH_CHECK(options_.max_document_bytes() >= 1, "memopt::data: max_document_bytes must be >= 1 (got ",
                options_.max_document_bytes(), "). HINT: the default is 64 MiB");
    seek(start);
  }

  /// Moves to `position` (as position() returned it).
  void seek(const SourcePosition& position) {
    TORCH_CHECK(position.file <= static_cast<int64_t>(files_.size()), "memopt::data: the position names file ",
                position.file, " of ", files_.size(), ". HINT: resume with the data sources of the saving run");
    pos_ = position;
    order_ = order_for(pos_.epoch);
    close_file();
    mine_this_epoch_ = 0;
    counted_epoch_ = pos_.file == 0 && pos_.offset == 0 && pos_.document == 0;  // a whole pass ahead
  }

  /// The next document of this rank into `doc`; false when the last epoch is over.
  bool next(RawDocument& doc) {
    while (true) {
      if (finished()) return false;
      if (pos_.file == static_cast<int64_t>(files_.size()) || epoch_limit_reached()) {
        end_epoch();
        continue;
      }
      const SourceFile& f = files_[static_cast<size_t>(order_[static_cast<size_t>(pos_.file)])];
      const bool mine = pos_.document % options_.world_size() == options_.rank();
      if (!read_one(f, doc, mine)) {  // end of this file
        close_file();
        ++pos_.file;
        pos_.offset = 0;
        pos_.line = 1;
        continue;
      }
      ++pos_.document;
      if (mine) {
        ++mine_this_epoch_;
        return true;
      }
    }
  }

  /// The next document's position.
  const SourcePosition& position() const { return pos_; }
  /// Whether every epoch has been read.
  bool finished() const { return options_.epochs() > 0 && pos_.epoch >= options_.epochs(); }
  const std::vector<SourceFile>& files() const { return files_; }
  const SourceOptions& options() const { return options_; }
  /// Bytes of the position's file read so far, for progress: the offset of text and JSONL,
  /// the file's size times the share of its rows read for Parquet, the ids read for shards.
  int64_t file_bytes_read() const {
    if (!parquet_ || parquet_->rows() <= 0 || pos_.file >= static_cast<int64_t>(files_.size())) return pos_.offset;
    const SourceFile& f = files_[static_cast<size_t>(order_[static_cast<size_t>(pos_.file)])];
    return static_cast<int64_t>(static_cast<double>(f.bytes) * static_cast<double>(pos_.offset) /
                                static_cast<double>(parquet_->rows()));
  }

 private:
  void close_file() {
    text_.reset();
    shard_.reset();
    parquet_.reset();  // ends its Python child
  }

  bool epoch_limit_reached() const { return options_.max_examples() > 0 && pos_.document >= options_.max_examples(); }

  void end_epoch() {
    // A whole pass that gave this rank nothing would loop forever with epochs(0).
    TORCH_CHECK(!(counted_epoch_ && mine_this_epoch_ == 0), "memopt::data: a whole pass over ", files_.size(),
                " file(s) (first '", files_.front().path, "') gave rank ", options_.rank(), " of ",
                options_.world_size(), " no document (", pos_.document, " documents in all). HINT: ",
                pos_.document == 0 ? "the sources hold no non-blank document" : "use fewer ranks or more data");
    close_file();
    ++pos_.epoch;
    pos_.file = 0;
    pos_.offset = 0;
    pos_.line = 1;
    pos_.document = 0;
    order_ = order_for(pos_.epoch);
    mine_this_epoch_ = 0;
    counted_epoch_ = true;  // a pass read from its start: the next end_epoch() can judge it
  }

  std::vector<int64_t> order_for(int64_t epoch) const {
    std::vector<int64_t> order(files_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
    if (!options_.shuffle_files() || order.size() < 2) return order;
    Rng rng(options_.seed() ^ (0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(epoch + 1)));
    shuffle(rng, order);
    return order;
  }

  // One document of `f` (read past when not mine); false at the end of the file.
  bool read_one(const SourceFile& f, RawDocument& doc, bool mine) {
    doc.text.clear();
    doc.tokens.clear();
    doc.pretokenized = f.kind == SourceKind::kShard;
    if (f.kind == SourceKind::kShard) {
      if (!shard_) shard_ = std::make_unique<detail::ShardFile>(f.path, pos_.offset);
      const bool got = shard_->read_chunk(options_.shard_chunk_tokens(), doc.tokens);
      pos_.offset = shard_->offset();
      return got;
    }
    if (f.kind == SourceKind::kParquet) {  // offset: rows read past; null rows are no documents
      if (!parquet_) parquet_ = std::make_unique<detail::ParquetFile>(f.path, options_.text_field(), pos_.offset);
      while (true) {
        const auto row = parquet_->next(mine ? &doc.text : nullptr, options_.max_document_bytes());
        pos_.offset = parquet_->row();
        pos_.line = pos_.offset + 1;
        if (row != detail::ParquetFile::Row::kNull) return row == detail::ParquetFile::Row::kText;
      }
    }
    if (!text_) text_ = std::make_unique<detail::LineFile>(f.path, pos_.offset);
    const int64_t limit = options_.max_document_bytes();
    while (true) {
      const int64_t line_no = pos_.line;
      if (!text_->read_line(line_, limit, line_no)) {
        pos_.offset = text_->offset();
        return !doc.text.empty();  // a paragraph ended by the end of the file
      }
      pos_.offset = text_->offset();
      ++pos_.line;
      const bool blank = detail::is_blank(line_);
      if (f.kind == SourceKind::kJsonl) {
        if (blank) continue;
        if (mine) doc.text = parse_jsonl_record(line_, options_.text_field(), f.path, line_no);
        return true;
      }
      if (options_.split() == Split::kLine) {
        if (blank) continue;
        if (mine) doc.text = line_;
        return true;
      }
      if (blank) {  // Split::kParagraph
        if (!doc.text.empty()) return true;
        continue;
      }
      if (!mine) {
        doc.text = "x";  // a placeholder: the paragraph is counted, not kept
        continue;
      }
      TORCH_CHECK(static_cast<int64_t>(doc.text.size() + line_.size() + 1) <= limit, "memopt::data: ", f.path,
                  ":", line_no, ": a paragraph longer than max_document_bytes (", limit, " bytes). HINT: separate "
                  "paragraphs by blank lines, or raise SourceOptions::max_document_bytes");
      if (!doc.text.empty()) doc.text += '\n';
      doc.text += line_;
    }
  }

  std::vector<SourceFile> files_;
  SourceOptions options_;
  SourcePosition pos_;
  std::vector<int64_t> order_;
  std::unique_ptr<detail::LineFile> text_;
  std::unique_ptr<detail::ShardFile> shard_;
  std::unique_ptr<detail::ParquetFile> parquet_;
  std::string line_;
  int64_t mine_this_epoch_ = 0;
  bool counted_epoch_ = false;
};

}  // namespace memopt::data
