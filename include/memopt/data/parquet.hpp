// memopt/data/parquet.hpp — the text column of a Parquet file, row by row, for the document
// reader of memopt/data/source.hpp. No C++ Parquet reader is packaged for Debian bookworm, so
// a small embedded Python program (kParquetScript) reads the file with PyPI's pyarrow, one
// record batch at a time (memory: one batch, whatever the file's size), and writes each row
// to a pipe as one line: a JSON string, or null. The interpreter is $MEMOPT_PYTHON when set,
// else python3 on PATH; it must import pyarrow (scripts/deps installs it into .venv).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace memopt::data::detail {

/// The reader's side of the pipe. argv: FILE COLUMN START_ROW BATCH_ROWS. Output, one line
/// each: the file's row count; then from row START_ROW on, each row of COLUMN as a JSON
/// string (UTF-8, newlines escaped) or `null`. A failure is one line "!KIND DETAIL" (KIND:
/// import, open, column, type, start, read) and exit status 1. SIGPIPE ends it silently when
/// the reader stops early.
inline constexpr const char* kParquetScript = R"py(
import sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # no module of the working folder
import json, signal
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
out = sys.stdout.buffer
def fail(kind, detail):
    out.write(("!" + kind + " " + " ".join(str(detail).split()) + "\n").encode("utf-8", "replace"))
    out.flush()
    sys.exit(1)
path, column, start, batch_rows = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except Exception as e:
    fail("import", "%s: %s (Python %s at %s)" % (type(e).__name__, e, sys.version.split()[0], sys.executable))
try:
    f = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)  # pages streamed, not whole chunks
    schema, meta = f.schema_arrow, f.metadata
except Exception as e:
    fail("open", "%s: %s" % (type(e).__name__, e))
if column not in schema.names:
    fail("column", ", ".join(schema.names) or "none")
kind = schema.field(column).type
if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or
        getattr(pa.types, "is_string_view", lambda t: False)(kind)):
    fail("type", kind)
if start > meta.num_rows:
    fail("start", meta.num_rows)
out.write(b"%d\n" % meta.num_rows)
skip, groups = start, []
for g in range(meta.num_row_groups):
    n = meta.row_group(g).num_rows
    if groups or skip < n:
        groups.append(g)
    else:
        skip -= n
try:
    batches = f.iter_batches(batch_size=batch_rows, row_groups=groups, columns=[column]) if groups else []
    for b in batches:
        texts = b.column(0).to_pylist()
        if skip:
            texts, skip = texts[skip:], max(0, skip - len(texts))
        out.write("".join("null\n" if t is None else json.dumps(t, ensure_ascii=False) + "\n"
                          for t in texts).encode("utf-8"))
except Exception as e:
    fail("read", "%s: %s" % (type(e).__name__, e))
out.flush()
)py";

/// The Python that reads Parquet: $MEMOPT_PYTHON when set, else "python3" from PATH.
inline std::string parquet_python() {
  const char* env = std::getenv("MEMOPT_PYTHON");
  return env != nullptr && *env != '\0' ? env : "python3";
}

inline constexpr const char* kParquetPythonHint =
    "MEMOPT_PYTHON must name a python3 that imports pyarrow: run scripts/deps (it installs pyarrow into "
    "the checkout's .venv) and set MEMOPT_PYTHON to that .venv/bin/python3";

/// One Parquet file's text column, read forward from a row by a child process (see the top
/// of this file). Each row is a document or a null; the end is checked (the child's exit
/// status and row count), so a crash is an error, never a silently shorter file.
class ParquetFile {
 public:
  enum class Row { kText, kNull, kEnd };

  ParquetFile(std::string path, const std::string& column, int64_t start_row)
      : path_(std::move(path)), column_(column), python_(parquet_python()), row_(start_row) {
    int fds[2];
    TORCH_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "memopt::data: cannot make a pipe to read Parquet file '", path_,
                "' (", std::strerror(errno), "). HINT: too many open files? raise `ulimit -n`");
    posix_spawn_file_actions_t actions;
    ::posix_spawn_file_actions_init(&actions);
    ::posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    ::posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    posix_spawnattr_t attr;
    ::posix_spawnattr_init(&attr);
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    sigaddset(&defaults, SIGPIPE);  // an ignored SIGPIPE would be inherited
    ::posix_spawnattr_setsigmask(&attr, &none);
    ::posix_spawnattr_setsigdefault(&attr, &defaults);
    ::posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    std::string dash_c = "-c", script = kParquetScript, start = std::to_string(start_row), batch = "512";
    std::vector<char*> argv = {python_.data(), dash_c.data(), script.data(), path_.data(), column_.data(),
                               start.data(), batch.data(), nullptr};
    const int rc = ::posix_spawnp(&pid_, python_.c_str(), &actions, &attr, argv.data(), environ);
    ::posix_spawn_file_actions_destroy(&actions);
    ::posix_spawnattr_destroy(&attr);
    ::close(fds[1]);
    if (rc != 0) {
      ::close(fds[0]);
      pid_ = -1;
      TORCH_CHECK(false, "memopt::data: cannot start the Python interpreter '", python_, "' to read Parquet file '",
                  path_, "' (", std::strerror(rc), "). HINT: ", kParquetPythonHint);
    }
    fd_ = fds[0];
    buffer_.resize(1 << 16);
    try {  // the first line: the file's row count (or the child's error)
      const bool got = read_line(0);
      if (got && !line_.empty() && line_[0] == '!') child_failed();
      if (!got) finish();  // names the exit status
      if (line_.empty() || line_.size() > 18 || line_.find_first_not_of("0123456789") != std::string::npos) {
        unexpected_line();
      }
      rows_ = std::stoll(line_);
    } catch (...) {
      stop();
      throw;
    }
  }

  ~ParquetFile() { stop(); }
  ParquetFile(const ParquetFile&) = delete;
  ParquetFile& operator=(const ParquetFile&) = delete;

  /// The next row: its text into `*text` (left alone when `text` is null: a row read past),
  /// a null row, or the end of the file. A document longer than `max_bytes` is an error.
  Row next(std::string* text, int64_t max_bytes) {
    if (done_) return Row::kEnd;
    TORCH_CHECK(fd_ >= 0, "memopt::data: Parquet file '", path_, "' is read on after an error of its Python reader. "
                "HINT: seek() the DocumentReader, or make a new one");
    if (!read_line(max_bytes)) {
      finish();
      return Row::kEnd;
    }
    if (line_[0] == '!') child_failed();
    if (line_ == "null") {
      ++row_;
      return Row::kNull;
    }
    if (line_[0] != '"') unexpected_line();
    if (text != nullptr) {
      const nlohmann::json j = nlohmann::json::parse(line_, nullptr, /*allow_exceptions=*/false);
      if (!j.is_string()) unexpected_line();
      *text = j.get<std::string>();
      too_long_unless(static_cast<int64_t>(text->size()) <= max_bytes, max_bytes);
    }
    ++row_;
    return Row::kText;
  }

  /// The next row's index (rows read past, nulls included).
  int64_t row() const { return row_; }
  /// Rows in the file.
  int64_t rows() const { return rows_; }

 private:
  // The next line (without '\n') into line_; false at the end of the output (a last line
  // without '\n' is left out: finish() then finds rows missing). JSON escapes make a row's
  // line at most 6 bytes a byte of text ("\u0001") plus the quotes; 1 MiB is always allowed
  // (the child's error lines).
  bool read_line(int64_t max_bytes) {
    const int64_t escaped = max_bytes > std::numeric_limits<int64_t>::max() / 8 ? max_bytes : 6 * max_bytes + 2;
    const int64_t cap = std::max<int64_t>(int64_t{1} << 20, escaped);
    line_.clear();
    while (true) {
      if (pos_ == end_) {
        ssize_t n;
        do {
          n = ::read(fd_, buffer_.data(), buffer_.size());
        } while (n < 0 && errno == EINTR);
        TORCH_CHECK(n >= 0, "memopt::data: reading the rows of Parquet file '", path_, "' from its Python reader "
                    "failed (", std::strerror(errno), "). HINT: ", kParquetPythonHint);
        if (n == 0) return false;
        pos_ = 0;
        end_ = static_cast<size_t>(n);
      }
      const char* start = buffer_.data() + pos_;
      const void* nl = std::memchr(start, '\n', end_ - pos_);
      const size_t take = nl ? static_cast<size_t>(static_cast<const char*>(nl) - start) : end_ - pos_;
      if (static_cast<int64_t>(line_.size() + take) > cap) {
        line_.append(start, std::min<size_t>(take, 81));
        if (rows_ < 0) unexpected_line();  // no row count: not our child speaking
        too_long_unless(false, max_bytes);
      }
      line_.append(start, take);
      pos_ += take;
      if (nl) {
        ++pos_;
        return true;
      }
    }
  }

  // Closes the pipe and ends the child (it may be blocked writing the next rows).
  void stop() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      reap();
    }
  }

  // The child's exit status (-1 when it cannot be learned).
  int reap() {
    int status = -1;
    pid_t got;
    do {
      got = ::waitpid(pid_, &status, 0);
    } while (got < 0 && errno == EINTR);
    pid_ = -1;
    return got < 0 ? -1 : status;
  }

  // The end of the output: the child must have exited with 0 after the file's last row.
  void finish() {
    ::close(fd_);
    fd_ = -1;
    const int status = reap();
    const std::string at = rows_ < 0 ? std::string("before writing anything")
                                     : "after " + std::to_string(row_) + " of " + std::to_string(rows_) + " rows";
    if (status != -1 && WIFSIGNALED(status)) {
      TORCH_CHECK(false, "memopt::data: the Python reader of Parquet file '", path_, "' ('", python_, "') was killed "
                  "by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ") ", at, ". HINT: out of "
                  "memory? a file with huge row groups needs memory for one batch of 512 rows");
    }
    TORCH_CHECK(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "memopt::data: the Python reader of "
                "Parquet file '", path_, "' ('", python_, "') exited with status ",
                status != -1 && WIFEXITED(status) ? std::to_string(WEXITSTATUS(status)) : std::string("unknown"), " ",
                at, ". HINT: its messages are on stderr above; ", kParquetPythonHint);
    TORCH_CHECK(row_ == rows_, "memopt::data: the Python reader of Parquet file '", path_, "' ('", python_,
                "') ended ", at, ". HINT: its output was cut short; ", kParquetPythonHint);
    done_ = true;
  }

  // A "!KIND DETAIL" line: the child's failure, as memopt's error.
  void child_failed() {
    const size_t space = line_.find(' ');
    const std::string kind = line_.substr(1, space == std::string::npos ? std::string::npos : space - 1);
    const std::string detail = space == std::string::npos ? "" : line_.substr(space + 1);
    ::close(fd_);
    fd_ = -1;
    reap();
    const std::string file = "'" + path_ + "'", col = "\"" + column_ + "\"";
    TORCH_CHECK(kind != "import", "memopt::data: reading Parquet file ", file, " needs pyarrow, which '", python_,
                "' cannot import (", detail, "). HINT: ", kParquetPythonHint);
    TORCH_CHECK(kind != "open", "memopt::data: ", file, " is not a readable Parquet file (", detail, "). HINT: check "
                "that the file is complete and is Parquet (magic 'PAR1' at both ends)");
    TORCH_CHECK(kind != "column", "memopt::data: Parquet file ", file, " has no column ", col, " (its columns: ",
                detail, "). HINT: name the text column with --text_field (SourceOptions::text_field)");
    TORCH_CHECK(kind != "type", "memopt::data: Parquet file ", file, ": column ", col, " holds ", detail, ", not "
                "strings. HINT: name the column holding each document's text with --text_field "
                "(SourceOptions::text_field)");
    TORCH_CHECK(kind != "start", "memopt::data: Parquet file ", file, " holds ", detail, " rows, the position is at "
                "row ", row_, ". HINT: the file changed since the checkpoint; resume with the same data");
    TORCH_CHECK(kind != "read", "memopt::data: reading the rows from ", row_, " on of Parquet file ", file,
                " failed (", detail, "). HINT: the file is damaged or cut short; pyarrow.parquet.read_table('", path_,
                "') shows it too");
    TORCH_CHECK(false, "memopt::data: the Python reader of Parquet file ", file, " failed (", line_.substr(1),
                "). HINT: ", kParquetPythonHint);
  }

  void unexpected_line() {
    const std::string shown = line_.substr(0, 80) + (line_.size() > 80 ? "..." : "");
    TORCH_CHECK(false, "memopt::data: the Python reader of Parquet file '", path_, "' ('", python_, "') wrote '",
                shown, "' at row ", row_, ", not a row. HINT: ", kParquetPythonHint);
  }

  void too_long_unless(bool ok, int64_t max_bytes) {
    TORCH_CHECK(ok, "memopt::data: Parquet file '", path_, "': row ", row_, " of column \"", column_, "\" is longer "
                "than max_document_bytes (", max_bytes, " bytes). HINT: raise SourceOptions::max_document_bytes, or "
                "split the documents");
  }

  std::string path_, column_, python_;
  pid_t pid_ = -1;
  int fd_ = -1;
  std::vector<char> buffer_;
  size_t pos_ = 0, end_ = 0;
  std::string line_;
  int64_t row_ = 0;    // the next row's index
  int64_t rows_ = -1;  // the file's, once the child has said
  bool done_ = false;  // the child ended well after the last row
};

}  // namespace memopt::data::detail
