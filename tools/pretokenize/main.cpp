// memopt-pretokenize — tokenizes a text / JSONL / Parquet corpus once, into token shards that
// training runs stream without a tokenizer in the loop:
//   OUT/shard-00000.bin, shard-00001.bin, ...   at most --shard_tokens ids each (memopt/data/shard.hpp)
//   OUT/index.json                              what was tokenized, with what, into which shards
// The ids are exactly those StreamLoader makes from the same sources on the fly (each document's
// ids, then EOS), so streaming OUT (or OUT/index.json) with StreamLoader gives the same batches
// as streaming the text, in packing mode and the same file order (shuffle_files off).
//
// Run (from the repository root, after scripts/demo):
//   build/tools/pretokenize/memopt-pretokenize data/kjv/train.txt --split paragraph \
//       --tokenizer data/kjv/tokenizer.model --out data/kjv-tokens
// See docs/data.md, section "Pre-tokenizing".
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <memopt/error.hpp>

#include "pretokenize.hpp"

int main(int argc, char** argv) {
  return memopt::guarded_main([&]() -> int {
    CLI::App app{"memopt-pretokenize: text / JSONL / Parquet documents -> token shards + index.json (EOS after each "
                 "document)"};
    app.footer("Parquet (*.parquet): each row of the --text_field column is a document (null rows are skipped),\n"
               "read with pyarrow by $MEMOPT_PYTHON (else python3 on PATH), e.g.\n"
               "  MEMOPT_PYTHON=.venv/bin/python3 memopt-pretokenize data/*.parquet --tokenizer T --out OUT\n"
               "See docs/data.md, sections \"Parquet\" and \"Pre-tokenizing\".");
    memopt::tools::PretokenizeOptions options;
    std::vector<std::string> sources;
    std::string tokenizer, out, text_field = options.text_field();
    int64_t max_examples = options.max_examples(), shard_tokens = options.shard_tokens();
    int64_t workers = options.workers(), block_documents = options.block_documents();
    bool force = false, quiet = false;
    app.add_option("sources", sources, "text, JSONL or Parquet files, folders, globs ('corpus/*.jsonl')")->required();
    app.add_option("--tokenizer", tokenizer, "SentencePiece .model, tokenizer.json, or a folder holding one")->required();
    app.add_option("--out", out, "output folder (new or empty, or any with --force)")->required();
    app.add_option("--text_field", text_field, "JSONL: the field holding each document; Parquet: the column")
        ->capture_default_str();
    std::string split = "line";
    app.add_option("--split", split, "plain text: a document a line, or a paragraph (lines up to a blank line)")
        ->check(CLI::IsMember({"line", "paragraph"}))
        ->capture_default_str();
    app.add_option("--max_examples", max_examples, "documents to take from the start; 0: all")->capture_default_str();
    app.add_option("--shard_tokens", shard_tokens, "ids per shard at most")->capture_default_str();
    app.add_option("--workers", workers, "tokenizer threads (default: hardware threads)")->capture_default_str();
    app.add_option("--block_documents", block_documents, "documents a worker tokenizes at once")->capture_default_str();
    app.add_flag("--force", force, "replace the index.json and shard-*.bin files of a non-empty --out");
    std::string invalid_utf8 = "replace";
    app.add_option("--invalid_utf8", invalid_utf8, "text bytes that are not UTF-8: replace (U+FFFD, as Python's "
                   "errors=\"replace\") or reject (an error naming the byte)")
        ->check(CLI::IsMember({"replace", "reject"}))
        ->capture_default_str();
    app.add_flag("--quiet", quiet, "no progress bar (the summary line is still printed)");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    options.sources(sources)
        .tokenizer(tokenizer)
        .out(out)
        .text_field(text_field)
        .split(split == "paragraph" ? memopt::data::Split::kParagraph : memopt::data::Split::kLine)
        .max_examples(max_examples)
        .shard_tokens(shard_tokens)
        .workers(workers)
        .block_documents(block_documents)
        .force(force)
        .invalid_utf8(invalid_utf8 == "reject" ? memopt::data::InvalidUtf8::kReject : memopt::data::InvalidUtf8::kReplace)
        .progress(quiet ? nullptr : stderr);
    const auto s = memopt::tools::pretokenize(options);
    fmt::print("memopt-pretokenize: {} documents, {} tokens, {} shard{} in {:.1f} s ({:.0f} tokens/s, {:.1f} MB/s) -> {}\n",
               s.documents, s.tokens, s.shards, s.shards == 1 ? "" : "s", s.seconds,
               static_cast<double>(s.tokens) / std::max(s.seconds, 1e-9),
               static_cast<double>(s.bytes) / 1e6 / std::max(s.seconds, 1e-9), s.index);
    return 0;
  });
}
