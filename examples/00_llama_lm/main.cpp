// examples/00_llama_lm — trains a LLaMA-style language model on the King James corpus with the
// Trainer the flags name (--recompute, --precision, --accum, --optimizer_state; by default
// recompute::EveryBlock, precision::Bf16Autocast, 4 micro-batches per step), or the one the
// planner picks for a memory budget (--policies auto --memory_budget 1GiB): the fastest
// compiled combination whose estimated peak fits, at the largest micro-batch that fits;
// --calibrate corrects the estimate by measuring the choice's real step.
// Either way the choice runs as a compiled instantiation (memopt::dispatch over
// memopt::StandardTrainers, plus state::PinnedHost for CUDA runs). --estimate_only prints the
// memory estimate and stops. It
// evaluates held-out perplexity before and after, prints a memory report (with the estimate
// next to the measured peak) and a generated sample. Never loses a run: --save_every N
// checkpoints to OUTPUT_DIR/checkpoints, SIGTERM/SIGINT save and exit 0, --resume latest
// continues bit for bit (scripts/killtest proves it with kill -9).
// Other data: --dataset PATH|GLOB (text, JSONL, Parquet, token shards or a memopt-pretokenize
// index; --dataset-id is its TinyStories spelling, a local path only) is streamed in constant
// memory, as the TinyStories script does by default (--shuffle-buffer-size, --max-examples,
// --stride, --epochs; memopt/data/stream.hpp), or loaded whole with --use-streaming=false.
// --epochs without --steps trains the whole epochs, its schedule set by a counting pass over the
// stream. --target-params 25M sizes the
// model (layers, width, heads) to about that many parameters. --init_model DIR starts from a
// Hugging Face Llama checkpoint instead (config.json + model.safetensors or shards; its shape
// replaces the shape flags, which are then refused) and from its tokenizer (DIR/tokenizer.json or
// tokenizer.model) unless --tokenizer names another. DATA's shards hold DATA/tokenizer.model's ids,
// so with any other tokenizer the training text comes from --dataset and the held-out text from
// DATA/val.txt, both tokenized at start.
// --lora RANK fine-tunes low-rank adapters on --lora_targets (PEFT's q_proj,v_proj by default, or
// all-linear) with every other weight frozen, --qlora over NF4 base weights; the adapter is saved
// to OUTPUT_DIR/adapter in PEFT's format (examples/common/lora_flags.hpp); --finetune auto with
// --memory_budget takes the first of full fine-tuning, LoRA and QLoRA that fits (plan_finetune).
//   Run: scripts/demo   (or build/examples/00_llama_lm/llama_lm --help)
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <vector>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include <memopt/data/loader.hpp>
#include <memopt/data/shard.hpp>
#include <memopt/data/stream.hpp>
#include <memopt/data/tokenizer.hpp>
#include <memopt/io/pretrained.hpp>
#include <memopt/memopt.hpp>
#include <memopt/memory/estimator.hpp>
#include <memopt/planner.hpp>

#include "common/checkpoint_flags.hpp"
#include "common/device.hpp"
#include "common/eval.hpp"
#include "common/lora_flags.hpp"
#include "common/cli.hpp"
#include "common/policy_flags.hpp"
#include "common/precision.hpp"
#include "common/distributed.hpp"
#include "common/memory_flags.hpp"
#include "common/tokenizer.hpp"

namespace {

namespace fs = std::filesystem;

// What llama_lm compiles: memopt::StandardTrainers (4 recompute x 4 precision x resident, int8,
// disk), plus --optimizer_state pinned-host (the AdamW state in pinned host memory, copied in
// and out around each step: CUDA training only) with recompute none/every x fp32/bf16.
using LlamaLmTrainers =
    typename memopt::detail::Concat<memopt::TypeList<>, memopt::StandardTrainers, examples::PinnedHostTrainers<>>::type;

// The combinations the planner may choose on `device`: pinned-host only for a CUDA device.
std::vector<memopt::memory::PolicyDesc> plannable(const torch::Device& device) {
  auto all = memopt::candidates<LlamaLmTrainers>();
  if (!device.is_cuda())
    std::erase_if(all, [](const memopt::memory::PolicyDesc& d) { return d.state.flag == "pinned-host"; });
  return all;
}

struct Args {
  std::string data = "data/kjv";
  int64_t steps = 80;
  int64_t micro_batch = 4;
  int64_t seq_len = 128;
  int64_t max_seq_len = 512;
  int64_t layers = 4;
  int64_t dim = 256;
  int64_t heads = 8;
  int64_t kv_heads = 0;
  double dropout = 0.0;
  double lr = 2e-3;
  int64_t warmup = 8;
  int64_t eval_batches = 16;
  int64_t log_interval = 10;
  int threads = 0;
  uint64_t seed = 1234;
  std::string prompt = "The jury said";
  int64_t sample_tokens = 48;
  double temperature = 0.8;
  std::string device = "cpu";
  std::string recompute = "every", precision = "auto", optimizer_state = "resident", policies = "fixed", memory_budget;
  int64_t accum = 4;
  bool estimate_only = false;
  bool calibrate = false;
  std::string output_dir = "out/llama_lm";
  examples::CheckpointFlags checkpoints;
  examples::DistributedFlags distributed;
  examples::MemoryFlags memory;
  examples::LoraFlags lora;
  bool steps_given = false;      // --steps given: it bounds --epochs and sets the schedule
  bool streaming_given = false;  // --use_streaming given (true or false)
  // other data, streamed or loaded whole
  std::vector<std::string> dataset;
  std::vector<std::string> dataset_id;  // TinyStories' --dataset-id: local paths, added to dataset
  std::string tokenizer;  // empty: --init_model's own, else DATA/tokenizer.model
  std::string init_model;                // a Hugging Face Llama folder to start from
  std::vector<std::string> shape_flags;  // the model-shape flags given (refused with --init_model)
  bool use_streaming = true;  // with --dataset (TinyStories' train_optimized.py streams by default)
  int64_t shuffle_buffer = 1000, max_examples = 0, stride = 0, epochs = 0, data_workers = 1;
  std::string text_field = "text", split = "line";
  double target_params = 0;
};

// The --dataset documents' reading options.
memopt::data::SourceOptions source_options(const Args& a) {
  TORCH_CHECK(a.split == "line" || a.split == "paragraph", "llama_lm: --split must be line or paragraph (got '",
              a.split, "'). HINT: line: a document a line; paragraph: documents end at a blank line.");
  return memopt::data::SourceOptions()
      .text_field(a.text_field)
      .split(a.split == "line" ? memopt::data::Split::kLine : memopt::data::Split::kParagraph)
      .max_examples(a.max_examples)
      .epochs(a.epochs)
      .seed(a.seed);
}

// Mean next-token loss over the first --eval_batches sequential held-out batches: under bf16
// autocast, or in fp32 when the run's precision is fp32 (`autocast` false).
double heldout_loss(memopt::models::Llama& model, const std::shared_ptr<const memopt::data::TokenShard>& shard,
                    const Args& a, const torch::Device& device, bool autocast) {
  return examples::heldout_loss(*model, shard, memopt::data::LoaderOptions(a.micro_batch, a.seq_len), a.eval_batches,
                                device, [&](const memopt::Batch& batch) {
                                  if (!autocast) return model->loss_sum(batch, memopt::recompute::None{});
                                  auto guard = memopt::precision::Bf16Autocast{}.autocast(device.type());
                                  return model->loss_sum(batch, memopt::recompute::None{});
                                });
}

// ---- which tokenizer, and which data it may read ----

// Text is tokenized into documents that each end with EOS: a tokenizer without one cannot.
void check_eos(const memopt::data::Tokenizer& tok, const std::string& what) {
  TORCH_CHECK(tok.eos_id() >= 0, "llama_lm: the tokenizer '", tok.path(), "' has no end-of-text token (eos_id -1), "
              "so the documents of ", what, " could not be separated. HINT: name it in tokenizer_config.json beside "
              "tokenizer.json (\"eos_token\": \"</s>\"), or use a tokenizer that has one");
}

// The tokenizer checksum (tokenizer_xxh3) and path that a memopt-pretokenize index.json beside
// `shard` records for it; nullopt when no index there lists it. Indexes are read once.
struct Recorded {
  std::string index, tokenizer, xxh3;
};
std::optional<Recorded> recorded_tokenizer(const std::string& shard, std::map<std::string, nlohmann::json>& indexes) {
  const fs::path index = fs::path(shard).parent_path() / "index.json";
  if (!fs::is_regular_file(index)) return std::nullopt;
  auto [it, added] = indexes.try_emplace(index.string());
  if (added) {
    std::ifstream in(index);
    it->second = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  }
  const nlohmann::json& json = it->second;
  if (!json.is_object() || !json.contains("shards") || !json["shards"].is_array() ||
      !json.value("tokenizer_xxh3", nlohmann::json()).is_string())
    return std::nullopt;
  for (const auto& entry : json["shards"]) {
    if (!entry.is_object() || !entry.value("file", nlohmann::json()).is_string()) continue;
    if ((index.parent_path() / entry["file"].get<std::string>()).lexically_normal() == fs::path(shard).lexically_normal())
      return Recorded{index.string(), json.value("tokenizer", std::string("?")), json["tokenizer_xxh3"].get<std::string>()};
  }
  return std::nullopt;
}

// Token shards in --dataset hold ids, right only for the tokenizer that made them. A shard a
// memopt-pretokenize index lists was made by the tokenizer whose checksum the index records: it
// must be `tok`'s. A bare shard records its vocab_size only: it is taken with DATA's tokenizer
// (`data_tokenizer`), as DATA's own shards are, and refused with any other.
void check_shard_tokenizer(const std::vector<memopt::data::SourceFile>& files, const memopt::data::Tokenizer& tok,
                           bool data_tokenizer, const Args& a) {
  std::map<std::string, nlohmann::json> indexes;
  std::string digest;  // tok's, once needed
  for (const auto& f : files) {
    if (f.kind != memopt::data::SourceKind::kShard) continue;
    const auto recorded = recorded_tokenizer(f.path, indexes);
    if (!recorded) {
      TORCH_CHECK(data_tokenizer, "llama_lm: --dataset token shard '", f.path, "' records its vocab_size but not "
                  "the tokenizer that made it, and this run's tokenizer '", tok.path(), "' is not DATA's ('", a.data,
                  "/tokenizer.model'): its ids would be read as another tokenizer's. HINT: pass the text or JSONL "
                  "(tokenized now), or pre-tokenize it with memopt-pretokenize --tokenizer ", tok.path(),
                  " (its index.json records the tokenizer)");
      continue;
    }
    if (digest.empty()) digest = memopt::io::digest_file(tok.path()).xxh3;
    TORCH_CHECK(recorded->xxh3 == digest, "llama_lm: --dataset token shard '", f.path, "' was made by the tokenizer '",
                recorded->tokenizer, "' (tokenizer_xxh3 ", recorded->xxh3, " in ", recorded->index, "), but this "
                "run's tokenizer is '", tok.path(), "' (xxh3 ", digest, "). HINT: pass the text or JSONL (tokenized "
                "now), pre-tokenize it again with --tokenizer ", tok.path(), ", or pass --tokenizer ",
                recorded->tokenizer);
  }
}

// The text of `ids` (1-D), leaving out ids beyond the tokenizer: a checkpoint's embedding may
// have more rows than its tokenizer has ids (published configs round vocab_size up), and a
// sample can land on one.
std::string decode_known(const memopt::data::Tokenizer& tok, const torch::Tensor& ids) {
  const torch::Tensor flat = ids.reshape({-1}).to(torch::kCPU, torch::kLong);  // (n,)
  return tok.decode(flat.masked_select(flat.ge(0).logical_and(flat.lt(tok.vocab_size()))));
}

// --dataset-id: TinyStories' spelling of --dataset. memopt has no Hub client, so each value must
// be a local file, folder or glob; a Hub id is refused, saying how to get it.
void take_dataset_ids(Args& a) {
  for (const auto& id : a.dataset_id) {
    const bool glob = id.find_first_of("*?[") != std::string::npos;
    TORCH_CHECK(glob || fs::exists(id), "llama_lm: --dataset-id '", id, "' is not a local file, folder or glob, and "
                "memopt reads no Hugging Face Hub id. HINT: download it first (huggingface-cli download ", id,
                " --repo-type dataset --local-dir DIR), then pass the local path: --dataset-id DIR (text, JSONL, "
                "Parquet or token shards)");
    a.dataset.push_back(id);
  }
}

// --epochs without --steps: the run is those epochs, and the learning-rate schedule needs their
// step count. One counting pass over the stream (tokenized with the run's options, not trained
// on); data parallel: the fewest any rank has, so every rank keeps the same schedule.
int64_t count_stream_steps(const std::vector<memopt::data::SourceFile>& files,
                           const std::shared_ptr<const memopt::data::Tokenizer>& tokenizer,
                           const memopt::data::StreamOptions& stream, int64_t accum, memopt::dist::World& world) {
  memopt::data::StreamLoader counter(files, tokenizer, stream);
  int64_t batches = 0;
  while (counter.has_next(1)) {
    counter.next();
    ++batches;
  }
  auto steps = torch::tensor({batches / accum}, torch::kLong);
  if (world.distributed()) steps = torch::stack(world.all_gather(steps, "stream steps")).min();
  return steps.item<int64_t>();
}

int run(Args& a) {  // non-const: --finetune resolves a.lora
  // ---- options first: a bad flag fails before any data is read ----
  TORCH_CHECK(a.micro_batch >= 1, "llama_lm: --micro_batch must be >= 1 (got ", a.micro_batch,
              "). HINT: 8 fits in a few hundred MiB at the default size.");
  TORCH_CHECK(a.seq_len >= 1, "llama_lm: --seq_len must be >= 1 (got ", a.seq_len, "). HINT: try 256.");
  const torch::Device device = examples::parse_device(a.device, "llama_lm");
  a.memory.check("llama_lm");  // --attention, --release_cache_every
  a.lora.resolve("llama_lm", !a.memory_budget.empty());  // --lora, --qlora, --finetune
  // --init_model: the checkpoint's config.json is the model's shape (its weights load later).
  std::optional<memopt::models::LlamaConfig> pretrained;
  if (!a.init_model.empty()) {
    TORCH_CHECK(a.shape_flags.empty(), "llama_lm: ", fmt::format("{}", fmt::join(a.shape_flags, ", ")),
                " shape a model built here, but --init_model '", a.init_model, "' brings its own shape (",
                a.init_model, "/config.json). HINT: drop ", a.shape_flags.size() == 1 ? "it" : "them",
                "; to change the checkpoint's settings, edit a copy of its config.json");
    const fs::path dir(a.init_model);
    TORCH_CHECK(fs::is_regular_file(dir / "config.json"), "llama_lm: --init_model '", a.init_model,
                "' holds no config.json. HINT: pass a Hugging Face Llama folder (config.json + model.safetensors "
                "or shards), as transformers' or memopt's save_pretrained writes it");
    TORCH_CHECK(fs::exists(dir / "model.safetensors") || fs::exists(dir / "model.safetensors.index.json"),
                "llama_lm: --init_model '", a.init_model, "' holds no model.safetensors (nor a sharded "
                "model.safetensors.index.json). HINT: pass a folder written by save_pretrained; convert a "
                "pytorch_model.bin with safetensors.torch.save_file");
    pretrained = memopt::io::read_llama_config((dir / "config.json").string());
    TORCH_CHECK(pretrained->causal(), "llama_lm: --init_model '", a.init_model, "' is bidirectional (\"causal\": "
                "false in its config.json). HINT: llama_lm trains a causal LM: start from an autoregressive LLaMA");
  }
  const int64_t max_positions = pretrained ? pretrained->max_position_embeddings() : a.max_seq_len;
  TORCH_CHECK(a.seq_len <= max_positions, "llama_lm: --seq_len ", a.seq_len, " exceeds the model's maximum (",
              pretrained ? "max_position_embeddings in " + a.init_model + "/config.json: " : "--max_seq_len ",
              max_positions, "). HINT: lower --seq_len", pretrained ? "." : " or raise --max_seq_len.");
  examples::check_state(a.optimizer_state, "llama_lm", device, "resident, int8 or disk");
  auto policies = memopt::parse_policies<LlamaLmTrainers>(a.recompute, a.precision, a.optimizer_state, a.accum);
  const int64_t budget = a.memory_budget.empty() ? 0 : memopt::parse_bytes(a.memory_budget);
  TORCH_CHECK(a.policies == "fixed" || a.policies == "auto", "llama_lm: --policies must be fixed or auto (got '",
              a.policies, "'). HINT: auto picks the fastest combination that fits --memory_budget.");
  TORCH_CHECK(!a.calibrate || budget > 0, "llama_lm: --calibrate measures the plan for a budget (got no "
              "--memory_budget). HINT: add --memory_budget 1GiB (with --policies auto or your flags).");
  auto options = memopt::TrainerOptions()
                           .lr(a.lr)
                           .warmup_steps(a.warmup)
                           .max_steps(a.steps)
                           .log_interval(a.log_interval);
  options = a.checkpoints.apply(options, a.output_dir).memory_budget(budget);  // the run adapts if the plan misses
  options = a.memory.options(a.distributed.apply(options));  // --preserve_rng_state
  auto& world = examples::join_world("llama_lm");  // torchrun: each rank trains on its rows of every batch
  options.validate();  // --save_every, --keep_checkpoints, --max_skips too

  const bool streaming = a.use_streaming && !a.dataset.empty();  // the default with --dataset
  TORCH_CHECK(streaming || a.dataset.empty() || (a.epochs == 0 && a.stride == 0),
              "llama_lm: --epochs and --stride shape a stream (got --epochs ", a.epochs, ", --stride ", a.stride,
              " with --use-streaming=false). HINT: drop --use-streaming=false; a dataset loaded whole is sampled at "
              "random.");
  TORCH_CHECK(!(a.streaming_given && a.use_streaming) || !a.dataset.empty(), "llama_lm: --use-streaming streams "
              "--dataset (got none). HINT: --dataset 'corpus/*.jsonl' (or --dataset-id DIR) --use-streaming");
  TORCH_CHECK(a.epochs >= 0, "llama_lm: --epochs must be >= 0 (got ", a.epochs, "). HINT: 0 streams until --steps");

  // ---- tokenizer: --tokenizer, else --init_model's own, else DATA's (whose shards are opened first) ----
  const std::string tokenizer_file = examples::tokenizer_path(a.tokenizer, a.init_model, a.data);
  const bool data_default = tokenizer_file == a.data + "/tokenizer.model";
  std::shared_ptr<const memopt::data::TokenShard> train, val;  // train: null when streaming
  if (data_default && a.dataset.empty()) train = memopt::data::TokenShard::open(a.data + "/train.bin");
  if (data_default) val = memopt::data::TokenShard::open(a.data + "/val.bin");
  const auto tokenizer = memopt::data::load_tokenizer(tokenizer_file);
  // Whether it is the tokenizer DATA's shards were made with (DATA/tokenizer.model, or its bytes).
  const bool data_tokenizer = data_default || examples::is_data_tokenizer(tokenizer->path(), a.data);
  fmt::print("llama_lm: tokenizer '{}' ({}, {} ids){}\n", tokenizer->path(), tokenizer->kind(), tokenizer->vocab_size(),
             data_tokenizer ? "" : fmt::format(": not DATA's, so the text is tokenized now"));
  TORCH_CHECK(!pretrained || tokenizer->vocab_size() <= pretrained->vocab_size(), "llama_lm: the tokenizer '",
              tokenizer->path(), "' has ", tokenizer->vocab_size(), " ids but --init_model '", a.init_model,
              "' embeds only ", pretrained->vocab_size(), " (vocab_size in its config.json): its larger ids have no "
              "embedding row. HINT: use the checkpoint's own tokenizer (drop --tokenizer; the folder's tokenizer.json "
              "or tokenizer.model is the default), or one with at most ", pretrained->vocab_size(), " ids");
  TORCH_CHECK(data_tokenizer || !a.dataset.empty(), "llama_lm: ", a.data, "/train.bin and val.bin hold the ids of '",
              a.data, "/tokenizer.model', but this run's tokenizer is '", tokenizer->path(), "' (",
              a.tokenizer.empty() ? "--init_model's own" : "--tokenizer", "): read with it they would be the wrong "
              "tokens. HINT: pass the training text with --dataset (text or JSONL, tokenized now; e.g. --dataset ",
              a.data, "/train.txt), or --tokenizer ", a.data, "/tokenizer.model");

  // ---- data: DATA's shards, or --dataset loaded whole, or --dataset streamed; held out: DATA/val.bin,
  // or with another tokenizer DATA/val.txt (a document a line) tokenized now ----
  const auto files = a.dataset.empty() ? std::vector<memopt::data::SourceFile>() : memopt::data::resolve_sources(a.dataset);
  check_shard_tokenizer(files, *tokenizer, data_tokenizer, a);
  if (!train && a.dataset.empty()) train = memopt::data::TokenShard::open(a.data + "/train.bin");
  if (!val && data_tokenizer) val = memopt::data::TokenShard::open(a.data + "/val.bin");
  if (!val) {  // another tokenizer's ids: DATA/val.txt, tokenized now
    const std::string text = a.data + "/val.txt";
    TORCH_CHECK(fs::is_regular_file(text), "llama_lm: the held-out set ", a.data, "/val.bin holds the ids of DATA's "
                "tokenizer, not of '", tokenizer->path(), "', and '", text, "', its text to tokenize now, does not "
                "exist. HINT: point --data at a folder holding val.txt (a document a line; memopt_prepare_corpus "
                "writes one), or use --tokenizer ", a.data, "/tokenizer.model");
    check_eos(*tokenizer, text);
    val = memopt::data::TokenShard::from_tokens(
        text, memopt::data::load_tokens(memopt::data::resolve_sources({text}), tokenizer.get(), {}),
        tokenizer->vocab_size());
    fmt::print("llama_lm: held-out set {} tokenized now: {} tokens\n", text, val->size());
  }
  if (!a.dataset.empty() && !streaming) {
    const bool text = std::any_of(files.begin(), files.end(),
                                  [](const auto& f) { return f.kind != memopt::data::SourceKind::kShard; });
    if (text) check_eos(*tokenizer, "--dataset");
    const auto ids = memopt::data::load_tokens(files, tokenizer.get(), source_options(a));
    fmt::print("llama_lm: --dataset loaded whole: {} tokens ({:.1f} MiB as int32; --use-streaming holds a few MiB)\n",
               ids.size(), static_cast<double>(ids.size()) * 4 / (1 << 20));
    train = memopt::data::TokenShard::from_tokens(a.dataset.front(), ids, tokenizer->vocab_size());
  }

  // ---- model: --init_model's config.json, or the shape flags ----
  torch::manual_seed(static_cast<int64_t>(a.seed));
  auto config = memopt::models::LlamaConfig()
                    .vocab_size(tokenizer->vocab_size())
                    .hidden_size(a.dim)
                    .num_hidden_layers(a.layers)
                    .num_attention_heads(a.heads)
                    .num_key_value_heads(a.kv_heads)
                    .max_position_embeddings(a.max_seq_len)
                    .dropout(a.dropout);
  config = a.memory.apply(config, "llama_lm");  // --attention
  if (pretrained) {
    config = a.memory.apply(*pretrained, "llama_lm");
  } else if (a.target_params > 0) {  // --target-params: the shape nearest that many parameters
    config = memopt::models::shape_for_params(static_cast<int64_t>(a.target_params), config);
    fmt::print("llama_lm: --target-params {:.3g} -> {} layers, d{}, {} heads: {:.2f} M parameters\n", a.target_params,
               config.num_hidden_layers(), config.hidden_size(), config.num_attention_heads(),
               static_cast<double>(memopt::models::describe(config).num_parameters()) / 1e6);
  }
  config.validate();

  // ---- policies: the flags, or the planner's choice for the budget; the estimate either way ----
  const auto plan_options = a.distributed.plan_options(  // on several ranks: the ZeRO stage(s) too
      memopt::PlanOptions().budget_bytes(budget).effective_batch(a.micro_batch * a.accum)
          .machine(memopt::MachineModel::from_device(device)), a.calibrate, "llama_lm");
  if (a.lora.automatic()) {  // --finetune auto: full, LoRA or QLoRA, the first that fits the budget
    const auto way = memopt::plan_finetune(a.lora.ways(memopt::models::describe(config)), a.seq_len,
                                           a.policies == "auto" ? plannable(device) : std::vector{policies},
                                           plan_options);
    fmt::print("{}", way.explain());
    a.lora.adopt(way.chosen);
  }
  const auto desc = a.lora.describe(memopt::models::describe(config));  // --lora / --qlora: the adapters train
  int64_t micro_batch = a.micro_batch;
  const auto measure = memopt::probe_steps<LlamaLmTrainers>(  // --calibrate's real steps
      options, [&] {
        memopt::models::Llama probe(config);
        a.lora.apply(*probe);
        return probe;
      },
      [&](int64_t micro) {  // the probe's data only needs the right shape: held-out windows when streaming
        return memopt::data::RandomWindowLoader(train ? train : val, memopt::data::LoaderOptions(micro, a.seq_len));
      },
      [](memopt::models::Llama& probe) { return memopt::LossSum<memopt::models::Llama>{&probe}; });
  if (a.policies == "auto" || budget > 0) {  // fixed + budget: the micro-batch finder for these policies
    const auto chosen = memopt::choose_policies(desc, a.seq_len, policies, a.policies == "auto", plannable(device),
                                                plan_options, a.calibrate ? measure : memopt::MeasureStep());
    policies = chosen.policies;
    micro_batch = chosen.micro_batch;
    if (a.distributed.automatic()) {  // --zero auto: the chosen stage
      a.distributed.adopt(chosen.zero);
      options = a.distributed.apply(options);
    }
    torch::manual_seed(static_cast<int64_t>(a.seed));   // the run starts as it would have without the probes
    memopt::memory::Tracker::instance().reset_peaks();  // and its measured peak is its own
  }
  const auto estimate = memopt::memory::estimate(desc, a.distributed.run({micro_batch, a.seq_len}), policies);
  fmt::print("{}", estimate.table());
  if (a.estimate_only) return 0;
  options.accum_steps(policies.accum);

  // --init_model: built from its config.json in fp32 and loaded (model.safetensors or shards, tied
  // or not); a tied checkpoint whose lm_head.weight differs from its embedding loads untied.
  memopt::models::Llama model = pretrained ? memopt::io::load_pretrained(a.init_model) : memopt::models::Llama(config);
  if (pretrained) {
    config = model->config;
    fmt::print("llama_lm: initialised from {} ({})\n", a.init_model,
               config.tie_word_embeddings() ? "tied embeddings" : "untied embeddings");
  }
  a.lora.apply(*model, "llama_lm");  // --lora / --qlora: adapters on a frozen (NF4) base
  model->to(device);  // the Trainer follows the parameters: batches go where they are
  if (train) train->check_vocab(config.vocab_size());
  val->check_vocab(config.vocab_size());

  const int64_t params = memopt::lora::count_parameters(*model).total;
  fmt::print("llama_lm: {:.2f} M parameters ({} layers, d{}, {} heads), vocab {}, {} held-out tokens, training on {}\n",
             params / 1e6, config.num_hidden_layers(), config.hidden_size(), config.num_attention_heads(),
             config.vocab_size(), val->size(),
             train ? fmt::format("{} tokens in memory", train->size()) : fmt::format("a stream of {}", fmt::join(a.dataset, " ")));
  const bool eval_autocast = policies.precision.flag != "fp32";  // evaluated in the run's precision
  const double before = heldout_loss(model, val, a, device, eval_autocast);
  fmt::print("held-out loss before training {:.5f} (perplexity {:.1f})\n", before, std::exp(before));

  // The run-time choice becomes a compiled Trainer: no runtime branch on a policy in the loop.
  const auto train_on = [&](auto& loader) {
    return memopt::dispatch<LlamaLmTrainers>(policies, [&]<class T>(std::type_identity<T>) {
      T trainer(*model, options);
      nlohmann::json run = {{"vocab", config.vocab_size()}, {"layers", config.num_hidden_layers()},
                            {"dim", config.hidden_size()}, {"heads", config.num_attention_heads()},
                            {"kv_heads", pretrained ? config.num_key_value_heads() : a.kv_heads},
                            {"max_seq_len", pretrained ? config.max_position_embeddings() : a.max_seq_len},
                            {"dropout", pretrained ? config.dropout() : a.dropout},
                            {"seed", a.seed}, {"dataset", a.dataset}, {"streaming", streaming},
                            {"global_micro_batch", micro_batch * world.size()}};
      if (pretrained) run["init_model"] = a.init_model;
      if (a.lora.enabled()) run["lora"] = a.lora.record();
      if (!data_tokenizer) run["tokenizer"] = tokenizer->path();
      trainer.set_run_config(std::move(run));
      a.checkpoints.resume_if_asked(trainer, loader, "llama_lm");
      trainer.add_callback(std::make_shared<memopt::callbacks::ProgressBar>());
      a.memory.attach(trainer, "llama_lm");  // --release_cache_every
      fmt::print("trainer: {} — effective batch {} x {} x {} tokens{}, {} threads\n", T::name(), micro_batch,
                 policies.accum, a.seq_len, world.distributed() ? fmt::format(" x {} ranks", world.size()) : "",
                 at::get_num_threads());
      std::fflush(stdout);  // the progress bar goes to stderr: keep the order when both go to a file
      auto fit = trainer.fit(loader, memopt::LossSum<memopt::models::Llama>{&model});
      fit.steps = trainer.steps_taken();  // the run's step, a resumed one's included
      return fit;
    });
  };
  memopt::FitResult result;
  if (streaming) {
    auto stream = memopt::data::StreamOptions(micro_batch, a.seq_len)
                      .stride(a.stride)
                      .shuffle_buffer(a.shuffle_buffer)
                      .seed(a.seed)
                      .workers(a.data_workers)
                      .vocab_size(config.vocab_size())
                      .source(source_options(a).rank(world.rank()).world_size(world.size()));  // disjoint documents
    memopt::data::StreamLoader loader(files, tokenizer, stream);
    int64_t bytes = 0;
    for (const auto& f : loader.files()) bytes += f.bytes;
    const auto data_memory = memopt::data::estimate_memory_usage(bytes / 4 / a.seq_len, a.seq_len, micro_batch,
                                                                 a.shuffle_buffer, stream.prefetch());
    fmt::print("llama_lm: streaming {} file(s), {:.1f} MiB: data held ~{:.1f} MiB, ~{:.1f} MiB to load it whole "
               "(estimate_memory_usage at ~4 bytes a token; the seed's count: {:.2f} MB against {:.2f} MB, "
               "savings {})\n", loader.files().size(), bytes / 1048576.0,
               memopt::memory::mib(data_memory.streaming_bytes), memopt::memory::mib(data_memory.full_load_bytes),
               data_memory.full_load_mb, data_memory.streaming_mb, data_memory.memory_savings);
    if (a.epochs > 0 && !a.steps_given) {  // the epochs are the run: the schedule spans them
      options.max_steps(count_stream_steps(files, tokenizer, stream, policies.accum, world));
      TORCH_CHECK(options.max_steps() >= 1, "llama_lm: --epochs ", a.epochs, " of --dataset make no whole optimizer "
                  "step (", micro_batch, " x ", policies.accum, " windows of ", a.seq_len + 1, " tokens). HINT: "
                  "lower --micro_batch, --grad_accum or --seq_len, or raise --epochs");
      fmt::print("llama_lm: --epochs {}: {} optimizer steps (counted over the stream); the learning-rate schedule "
                 "spans them\n", a.epochs, options.max_steps());
    }
    result = train_on(loader);
  } else {
    // Every rank draws the same global micro-batch (micro-batch x ranks rows) and trains on its rows.
    memopt::data::RandomWindowLoader global(train,
                                            memopt::data::LoaderOptions(micro_batch * world.size(), a.seq_len).seed(a.seed));
    memopt::dist::RankSlice loader(global, world.rank(), world.size());
    result = train_on(loader);
  }
  if (result.data_exhausted && result.steps < options.max_steps()) {
    fmt::print("llama_lm: the data ran out at step {} of --steps {} (--epochs {}); the learning-rate schedule "
               "assumed {} steps\n", result.steps, a.steps, a.epochs, a.steps);
  }
  if (examples::stopped_by_signal(result, result.steps, "llama_lm")) return 0;
  const double after = heldout_loss(model, val, a, device, eval_autocast);
  fmt::print("held-out loss after {} steps {:.5f} (perplexity {:.1f}); {:.0f} tokens/s over {:.0f} s\n",
             result.steps, after, std::exp(after), result.tokens_per_s, result.seconds);
  a.lora.save(*model, a.output_dir + "/adapter", a.init_model, "llama_lm");
  fmt::print("{}", result.memory.table());
  fmt::print("estimated peak {:.1f} MiB, measured {:.1f} MiB ({:+.1f}%)\n", memopt::memory::mib(estimate.peak),
             memopt::memory::mib(result.memory.tensors.peak_bytes),
             100.0 * (static_cast<double>(estimate.peak) / static_cast<double>(result.memory.tensors.peak_bytes) - 1));

  std::vector<int32_t> prompt_ids = tokenizer->encode(a.prompt);
  if (tokenizer->bos_id() >= 0) prompt_ids.insert(prompt_ids.begin(), static_cast<int32_t>(tokenizer->bos_id()));
  auto prompt = torch::tensor(std::vector<int64_t>(prompt_ids.begin(), prompt_ids.end()));
  auto sample = model->generate(prompt, memopt::models::SampleOptions()
                                            .max_new_tokens(a.sample_tokens)
                                            .temperature(a.temperature)
                                            .top_k(50)
                                            .seed(a.seed)
                                            .eos_id(tokenizer->eos_id()));
  fmt::print("sample: {}\n", decode_known(*tokenizer, sample));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Train a LLaMA-style LM on the King James corpus with memopt's Trainer"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a later flag overrides
  app.add_option("--data", a.data, "folder with train.bin, val.bin, tokenizer.model (and val.txt, the held-out "
                 "text tokenized now when the tokenizer is another)")->capture_default_str();
  app.add_option("--init_model", a.init_model, "start from this Hugging Face Llama folder (config.json + "
                 "model.safetensors or shards), with its tokenizer.json or tokenizer.model unless --tokenizer; "
                 "its config.json is the shape: --layers, --dim, --heads, --kv_heads, --max_seq_len, --dropout "
                 "and --target_params are refused with it");
  app.add_option(examples::kSteps, a.steps, "optimizer steps")->capture_default_str();
  app.add_option("--micro_batch,--batch_size", a.micro_batch, "sequences per micro-batch (--grad_accum per step; "
                 "--batch_size is TinyStories' spelling)")->capture_default_str();
  app.add_option("--seq_len", a.seq_len, "tokens per sequence")->capture_default_str();
  app.add_option("--max_seq_len", a.max_seq_len, "the model's maximum sequence length")->capture_default_str();
  app.add_option("--layers", a.layers, "decoder blocks")->capture_default_str();
  app.add_option("--dim", a.dim, "hidden size")->capture_default_str();
  app.add_option("--heads", a.heads, "attention heads")->capture_default_str();
  app.add_option("--kv_heads", a.kv_heads, "KV heads (0: same as --heads)")->capture_default_str();
  app.add_option("--dropout", a.dropout, "dropout probability")->capture_default_str();
  app.add_option("--lr", a.lr, "peak learning rate")->capture_default_str();
  app.add_option("--warmup", a.warmup, "warmup steps")->capture_default_str();
  app.add_option("--eval_batches", a.eval_batches, "held-out batches to evaluate")->capture_default_str();
  app.add_option("--log_interval", a.log_interval, "steps between log lines")->capture_default_str();
  app.add_option("--threads", a.threads, "CPU threads (0: all available)")->capture_default_str();
  app.add_option("--device", a.device, "cpu | cuda[:N]: where the model trains")->capture_default_str();
  app.add_option("--seed", a.seed, "seed of init, data order and sampling")->capture_default_str();
  app.add_option("--prompt", a.prompt, "prompt of the generated sample")->capture_default_str();
  app.add_option("--sample_tokens", a.sample_tokens, "tokens to generate")->capture_default_str();
  app.add_option("--temperature", a.temperature, "sampling temperature (0: greedy)")->capture_default_str();
  examples::add_recompute_option(app, a.recompute, "none | every | every-2 | selective")->capture_default_str();
  examples::add_precision_option(app, a.precision,
                                 "fp32 | bf16 | bf16-pure | fp16 (CUDA) | auto (bf16 where measured faster)")
      ->capture_default_str();
  app.add_option(examples::kAccum, a.accum, "micro-batches per optimizer step")->capture_default_str();
  examples::add_state_option(app, a.optimizer_state, "resident | int8 | disk | pinned-host (CUDA; with --recompute "
                             "none or every and --precision fp32 or bf16)")->capture_default_str();
  examples::add_8bit_optimizer_alias(app, a.optimizer_state);
  a.memory.add_to(app);
  a.lora.add_to(app);
  app.add_option("--policies", a.policies, "fixed: the flags above; auto: the planner picks for --memory_budget")
      ->capture_default_str();
  app.add_option("--memory_budget", a.memory_budget,
                 "peak tensor memory allowed, e.g. 1GiB (auto: the planner's budget; fixed: the micro-batch finder's)");
  app.add_flag("--calibrate", a.calibrate, "with --memory_budget: measure the planner's choice by a real step "
               "(on a throwaway model) and re-plan with measured / estimated peak until a choice measured to fit "
               "stays the choice");
  app.add_flag("--estimate_only", a.estimate_only, "print the memory estimate (and the plan) and stop");
  app.add_option("--output_dir", a.output_dir, "where checkpoints go (OUTPUT_DIR/checkpoints)")->capture_default_str();
  a.checkpoints.add_to(app);
  a.distributed.add_to(app, /*plans=*/true);
  auto* data = app.add_option_group("other data", "train on --dataset instead of DATA/train.bin");
  data->add_option("--dataset", a.dataset, "text, JSONL (--text_field), token shards, a memopt-pretokenize "
                   "index.json, a directory or a glob; repeatable")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  data->add_option("--tokenizer", a.tokenizer, "SentencePiece .model, tokenizer.json, or a folder holding one "
                   "(default: --init_model's own, else DATA/tokenizer.model); with any but DATA's, train on "
                   "--dataset text and evaluate on DATA/val.txt, tokenized now");
  data->add_option("--dataset_id", a.dataset_id, "= --dataset (TinyStories' spelling): a local path; a Hugging "
                   "Face Hub id is refused (download it first)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  data->add_flag("--use_streaming", a.use_streaming,
                 "stream --dataset in constant memory (the default; --use-streaming=false tokenizes it all into "
                 "memory first)");
  data->add_option("--shuffle_buffer_size", a.shuffle_buffer,
                   "streaming: sequences drawn from at random (1: reading order)")->capture_default_str();
  data->add_option("--max_examples", a.max_examples, "documents read per epoch (0: all)")
      ->capture_default_str();
  data->add_option("--stride", a.stride, "streaming: tokens between window starts (0: --seq_len)")->capture_default_str();
  data->add_option("--epochs", a.epochs, "streaming: passes over --dataset (0: until --steps). Without --steps the "
                   "run is the epochs (a counting pass sets the schedule); with it, training ends at whichever comes "
                   "first")->capture_default_str();
  data->add_option("--text_field", a.text_field, "JSONL: the field holding the text")->capture_default_str();
  data->add_option("--split", a.split, "plain text: a document a line | paragraph (blank-line separated)")
      ->capture_default_str();
  data->add_option("--data_workers", a.data_workers, "streaming: tokenizer threads (0: inline)")
      ->capture_default_str();
  app.add_option("--target_params", a.target_params,
                 "size the model to about N parameters (25M, 1.5e8, 300k): overrides --layers, --dim, --heads")
      ->transform(CLI::AsNumberWithUnit(std::map<std::string, double>{{"k", 1e3}, {"M", 1e6}, {"B", 1e9}},
                                        CLI::AsNumberWithUnit::CASE_SENSITIVE));
  examples::underscore_option_names(argc, argv);  // --seq-len is --seq_len
  CLI11_PARSE(app, argc, argv);
  for (const char* flag : {"--layers", "--dim", "--heads", "--kv_heads", "--max_seq_len", "--dropout", "--target_params"})
    if (app.count(flag) > 0) a.shape_flags.emplace_back(flag);
  a.steps_given = app.count("--steps") > 0;
  a.streaming_given = app.count("--use_streaming") > 0;
  return memopt::guarded_main([&] {
    memopt::init(memopt::RuntimeOptions().threads(a.threads));  // tracker + threads, before any tensor
    take_dataset_ids(a);
    memopt::log_performance_info();
    const auto device = examples::parse_device(a.device, "llama_lm");
    const auto precision = examples::resolve_choice(a.precision, device, a.checkpoints.saved_precision(a.output_dir));
    fmt::print("{:>13}: {} ({})\n", "precision", precision.precision, precision.reason);
    examples::enable_cpu_gemms(precision.precision, device);
    a.precision = precision.precision;
    std::fflush(stdout);
    return run(a);
  });
}
