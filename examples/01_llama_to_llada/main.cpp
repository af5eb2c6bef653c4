// examples/01_llama_to_llada — distils an autoregressive LLaMA teacher into a LLaDA student
// (same transformer, bidirectional, trained as a masked diffusion model) on the King James Bible (scripts/fetch_corpus).
// Two strategies of the original scripts are presets of this one program, plus the naive
// baseline they improve on; explicit policy flags override a preset:
//   none           fp32, no checkpointing, the teacher's forward records a graph (the naive script)
//   simple         + checkpointing, bf16 autocast (auto: where measured faster), an fp32 teacher
//                    under InferenceMode, cache release every 10 steps (train_simple_strat.py)
//   comprehensive  + pre-tokenized shards, gradient accumulation, clipping, AdamW with
//                    parameter-specific weight decay, linear warmup and decay, TF32 matmuls and
//                    cuDNN benchmarking on CUDA (train_all_strat.py's list, nothing more)
// Every preset distils densely from an fp32 teacher with math attention; memopt's levers the
// originals lack are opt-in: --kd_top_k (sparse KD), --teacher_precision bf16|auto, --attention,
// --optimizer_state pinned-host (a CUDA student's AdamW state in pinned host memory).
// It trains the teacher first with --train_teacher (saved to --teacher_model with the tokenizer
// it was trained with), or loads a Hugging Face Llama checkpoint
// (--teacher_model DIR: config.json + model.safetensors or shards, e.g. a published LLaMA) with
// its own tokenizer (DIR/tokenizer.json or tokenizer.model, unless --tokenizer names another);
// the student's vocabulary is the teacher's (its config.json's vocab_size, padding rows
// included) plus the mask token. DATA's .bin shards hold DATA/tokenizer.model's ids, so with
// another tokenizer the text (DATA/{train,val}.txt) is tokenized at start. It distils,
// evaluates masked-token cross-entropy at mask ratios 0.15/0.5/0.85 on the held-out split,
// prints samples from LLaDA's low-confidence remasking sampler, and saves the student
// (model.safetensors + config.json) and a metrics JSONL. Both trainings write
// checkpoints (OUT/teacher/checkpoints, OUT/checkpoints; --save_every, and on SIGTERM/SIGINT,
// which then exit 0); --resume latest continues where they stopped.
//   Run: scripts/demo   (or build-release/examples/01_llama_to_llada/llama_to_llada --help)
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>

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
#include "common/cli.hpp"
#include "common/policy_flags.hpp"
#include "common/precision.hpp"
#include "common/tokenizer.hpp"
#include "common/distributed.hpp"
#include "common/memory_flags.hpp"
#include <memopt/models/distill.hpp>
#include <memopt/models/llada.hpp>

namespace {

namespace fs = std::filesystem;
using memopt::models::Llama;
using memopt::models::LlamaConfig;

// ---- command line: the original scripts' flags, the presets and their overrides ----
struct Args {
  std::string teacher_model = "out/teacher";
  std::string tokenizer;  // empty: the teacher folder's own (not with --train_teacher), else DATA/tokenizer.model
  bool train_teacher = false;
  bool estimate_only = false;
  std::string policies = "fixed";  // auto: the planner picks recompute, precision, micro-batch, accum
  std::string memory_budget;
  int64_t teacher_steps = 80;
  double teacher_lr = 2e-3;
  std::string student_model;  // empty: the teacher's shape, bidirectional, + mask token
  std::string data_path = "data/kjv";
  std::string output_dir = "out/llada";
  std::string strategy = "comprehensive";
  int64_t batch_size = 4;
  int64_t gradient_accumulation_steps = 4;
  double weight_decay = 0.1;
  int64_t warmup_steps = 8;
  int64_t max_steps = 80;
  double lr = 2e-3;
  int64_t seq_len = 128;
  // teacher shape (with --train_teacher)
  int64_t layers = 4, dim = 256, heads = 8, kv_heads = 0, max_seq_len = 512;
  // distillation
  double alpha = 0.5;
  double kd_temperature = 2.0;
  int64_t kd_top_k = 0;
  // policy overrides (empty / negative: the preset decides)
  std::string recompute, precision, teacher_precision, data_format;
  std::string optimizer_state = "resident";  // override: resident | pinned-host (a CUDA student)
  std::string device = "cpu", teacher_device;  // cpu | cuda[:N]; teacher_device empty: --device
  bool teacher_autograd = false;
  double grad_clip = 1.0;
  bool tf32 = false, cudnn_benchmark = false;  // CUDA only
  examples::MemoryFlags memory;  // --attention, --release_cache_every (default 10: simple and comprehensive)
  // evaluation and samples
  int64_t eval_batches = 8;
  int64_t memory_trace = 0;  // distillation steps traced into OUT/memory.trace.json (0: off)
  examples::CheckpointFlags checkpoints;
  examples::DistributedFlags distributed;
  int64_t samples = 3, prompt_tokens = 16, gen_length = 32, sample_steps = 32, block_length = 16;
  double temperature = 0.8, cfg_scale = 0.0;
  int64_t log_interval = 10;
  int threads = 0;
  uint64_t seed = 1234;
};

// What a strategy turns on, after the explicit flags are applied.
struct Plan {
  std::string strategy;
  std::string recompute = "every_block";  // none | every_block
  std::string precision = "auto";          // fp32 | bf16 | auto (measured: memopt/machine.hpp)
  std::string data_format = "shards";      // shards | text (text whenever the tokenizer is not DATA's)
  std::string tokenizer;                   // the tokenizer file or folder (tokenizer_path)
  bool data_tokenizer = true;              // whether it made DATA's .bin shards (DATA/tokenizer.model)
  std::string teacher_precision = "fp32";  // fp32 | bf16 | auto (as precision); every preset: fp32
  std::string optimizer_state = "resident";  // the student's AdamW state: resident | pinned-host (CUDA)
  torch::Device device = torch::kCPU;      // the student (and, by default, the teacher)
  torch::Device teacher_device = torch::kCPU;
  bool teacher_autograd = false;
  int64_t accum = 1;
  double grad_clip = 0.0;
  bool param_specific_decay = false;
  bool schedule = false;  // linear warmup and decay; constant lr otherwise
  int64_t release_cache_every = 0;  // examples::MemoryFlags::attach (0: never)
  int64_t kd_top_k = 0;             // 0: dense KD (every preset)
  bool tf32 = false;                // TF32 in cuBLAS and cuDNN (CUDA only)
  bool cudnn_benchmark = false;     // cuDNN autotuning (CUDA only)
};

// The preset, then every flag the user gave explicitly.
Plan make_plan(const Args& a, const CLI::App& app) {
  Plan p;
  p.strategy = a.strategy;
  if (a.strategy == "none") {
    p.recompute = "none";
    p.precision = "fp32";
    p.data_format = "text";
    p.teacher_autograd = true;
  } else if (a.strategy == "simple") {
    p.data_format = "text";
    p.release_cache_every = a.memory.release_cache_every;  // 10 unless given
  } else {  // comprehensive: the original's list (dense KD and an fp32 teacher, as in simple)
    p.accum = a.gradient_accumulation_steps;
    p.grad_clip = a.grad_clip;
    p.param_specific_decay = true;
    p.schedule = true;
    p.release_cache_every = a.memory.release_cache_every;
    p.tf32 = true;
    p.cudnn_benchmark = true;
  }
  auto given = [&](const char* flag) { return app.get_option(flag)->count() > 0; };
  if (examples::given(app, {"--recompute", "--checkpoint", "--gradient_checkpointing"})) p.recompute = a.recompute;
  if (examples::given(app, {"--precision", "--mixed_precision"})) p.precision = a.precision;
  p.tokenizer = examples::tokenizer_path(a.tokenizer, a.train_teacher ? "" : a.teacher_model, a.data_path);
  p.data_tokenizer = examples::is_data_tokenizer(p.tokenizer, a.data_path);
  if (!p.data_tokenizer) p.data_format = "text";  // DATA's shards hold another tokenizer's ids
  if (!fs::is_directory(a.data_path)) p.data_format = "text";  // a file's documents, tokenized now
  if (given("--data_format")) {
    TORCH_CHECK(a.data_format == "text" || p.data_tokenizer, "llama_to_llada: --data_format shards reads ",
                a.data_path, "/{train,val}.bin, which hold the ids of '", a.data_path, "/tokenizer.model', but this "
                "run's tokenizer is '", p.tokenizer, "' (", a.tokenizer.empty() ? "the teacher's own" : "--tokenizer",
                "): read with it they would be the wrong tokens. HINT: drop --data_format (with another tokenizer "
                "the text, DATA/{train,val}.txt, is tokenized now), or pass --tokenizer ", a.data_path,
                "/tokenizer.model");
    p.data_format = a.data_format;
  }
  if (given("--teacher_precision")) p.teacher_precision = a.teacher_precision;  // or its alias --teacher_dtype
  if (given("--teacher_autograd")) p.teacher_autograd = a.teacher_autograd;
  if (given("--gradient_accumulation_steps")) p.accum = a.gradient_accumulation_steps;
  if (given("--grad_clip")) p.grad_clip = a.grad_clip;
  p.device = examples::parse_device(a.device, "llama_to_llada");
  p.teacher_device = examples::parse_device(a.teacher_device.empty() ? a.device : a.teacher_device, "llama_to_llada",
                                            "--teacher_device");
  if (examples::given(app, {"--optimizer_state", "--offload"})) p.optimizer_state = a.optimizer_state;
  examples::check_state(p.optimizer_state, "llama_to_llada", p.device);  // pinned-host: a CUDA student only
  // auto: bf16 where this device's bf16 matmul measured faster than fp32 (or a GPU), fp32 elsewhere.
  std::string why = "as given";
  if (p.precision == "auto") {  // with --resume: the student checkpoint's (common/precision.hpp)
    const auto choice = examples::resolve_choice("auto", p.device, a.checkpoints.saved_precision(a.output_dir));
    p.precision = choice.precision;
    why = "auto: " + choice.reason;
  }
  if (p.teacher_precision == "auto") {
    const auto choice = memopt::machine::choose_precision(p.teacher_device);
    p.teacher_precision = choice.precision;
    if (why == "as given") why = "auto: " + choice.reason;
  }
  fmt::print("precision: student {} on {}, teacher {} on {} ({})\n", p.precision, p.device.str(),
             p.teacher_precision, p.teacher_device.str(), why);
  examples::enable_cpu_gemms(p.precision, p.device);
  examples::enable_cpu_gemms(p.teacher_precision, p.teacher_device);
  if (given("--release_cache_every")) p.release_cache_every = a.memory.release_cache_every;
  if (given("--kd_top_k")) p.kd_top_k = a.kd_top_k;
  if (given("--tf32")) p.tf32 = a.tf32;
  if (given("--cudnn_benchmark")) p.cudnn_benchmark = a.cudnn_benchmark;
  TORCH_CHECK(p.accum >= 1, "llama_to_llada: --gradient_accumulation_steps must be >= 1 (got ", p.accum,
              "). HINT: 1 takes one micro-batch per step; the effective batch is batch_size x this.");
  TORCH_CHECK(p.kd_top_k >= 0, "llama_to_llada: --kd_top_k must be >= 0 (got ", p.kd_top_k,
              "). HINT: 0 distils from every logit (dense, the presets' choice); 64 keeps the teacher's top 64.");
  a.memory.check("llama_to_llada");  // --attention, --release_cache_every: now, before any data is read
  return p;
}

// TF32 and cuDNN benchmarking, as train_all_strat.py sets them (torch.backends.cuda.matmul.allow_tf32,
// torch.backends.cudnn.benchmark): process-wide LibTorch settings that only CUDA kernels read,
// so they are applied when the student or the teacher runs on a GPU, and on the CPU only said.
void apply_cuda_settings(const Plan& p) {
  if (p.device.is_cuda() || p.teacher_device.is_cuda()) {
    at::globalContext().setAllowTF32CuBLAS(p.tf32);
    at::globalContext().setAllowTF32CuDNN(p.tf32);
    at::globalContext().setBenchmarkCuDNN(p.cudnn_benchmark);
    fmt::print("cuda: tf32 {}, cudnn benchmark {}\n", p.tf32, p.cudnn_benchmark);
  } else if (p.tf32 || p.cudnn_benchmark) {
    fmt::print("cuda: tf32 {}, cudnn benchmark {}: CUDA only, not applied (no CUDA device in this run)\n", p.tf32,
               p.cudnn_benchmark);
  }
}

// ---- data ----
struct Data {
  memopt::data::Tokenizer tokenizer;
  std::shared_ptr<const memopt::data::TokenShard> train, val;
};

// Pre-tokenized shards (memory-mapped), or the text tokenized now and held in memory.
std::shared_ptr<const memopt::data::TokenShard> load_split(const Args& a, const Plan& p,
                                                           const memopt::data::Tokenizer& tok,
                                                           const std::string& split) {
  if (p.data_format == "shards") return memopt::data::TokenShard::open(a.data_path + "/" + split + ".bin");
  const std::string path = a.data_path + "/" + split + ".txt";
  std::ifstream in(path);
  TORCH_CHECK(in, "llama_to_llada: cannot read '", path, "'. HINT: --data_format text reads one document per "
              "line from DATA_PATH/{train,val}.txt; scripts/demo prepares data/kjv.");
  TORCH_CHECK(tok.eos_id() >= 0, "llama_to_llada: the tokenizer '", tok.path(), "' has no end-of-text token "
              "(eos_id -1), so the documents of '", path, "' could not be separated. HINT: name it in "
              "tokenizer_config.json beside tokenizer.json (\"eos_token\": \"</s>\"), or use a tokenizer that has one");
  std::vector<int32_t> ids;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto encoded = tok.encode(line);
    ids.insert(ids.end(), encoded.begin(), encoded.end());
    ids.push_back(static_cast<int32_t>(tok.eos_id()));
  }
  return memopt::data::TokenShard::from_tokens(path, ids, tok.vocab_size());
}

// --data_path FILE (or a glob): the original's data.parquet. Its documents (Parquet or JSONL
// `text`, or a text file's lines: whatever memopt::data reads) tokenized now; the last 5% of
// the tokens are the held-out set.
std::pair<std::shared_ptr<const memopt::data::TokenShard>, std::shared_ptr<const memopt::data::TokenShard>>
load_file(const Args& a, const memopt::data::Tokenizer& tok) {
  TORCH_CHECK(tok.eos_id() >= 0, "llama_to_llada: the tokenizer '", tok.path(), "' has no end-of-text token "
              "(eos_id -1), so the documents of '", a.data_path, "' could not be separated. HINT: name it in "
              "tokenizer_config.json beside tokenizer.json (\"eos_token\": \"</s>\"), or use a tokenizer that has one");
  const auto ids = memopt::data::load_tokens(memopt::data::resolve_sources({a.data_path}), &tok, {});
  const auto cut = static_cast<std::ptrdiff_t>(ids.size() - ids.size() / 20);
  return {memopt::data::TokenShard::from_tokens(a.data_path + " (first 95%)",
                                                std::vector<int32_t>(ids.begin(), ids.begin() + cut), tok.vocab_size()),
          memopt::data::TokenShard::from_tokens(a.data_path + " (last 5%)",
                                                std::vector<int32_t>(ids.begin() + cut, ids.end()), tok.vocab_size())};
}

Data load_data(const Args& a, const Plan& p) {
  memopt::data::Tokenizer tok(p.tokenizer);
  const bool file = !fs::is_directory(a.data_path);
  fmt::print("tokenizer: '{}' ({}, {} ids); data: {}\n", tok.path(), tok.kind(), tok.vocab_size(),
             file                      ? "the file's documents, tokenized now (the last 5% held out)"
             : p.data_format == "shards" ? "DATA's .bin shards"
             : p.data_tokenizer          ? "text, tokenized now"
                                         : "text, tokenized now (the tokenizer is not DATA's)");
  std::shared_ptr<const memopt::data::TokenShard> train, val;
  if (file) {
    std::tie(train, val) = load_file(a, tok);
  } else {
    train = load_split(a, p, tok, "train");  // first: a missing corpus is named by its train split
    val = load_split(a, p, tok, "val");
  }
  for (const auto& shard : {train, val}) {
    TORCH_CHECK(shard->size() >= a.seq_len + 1, "llama_to_llada: the corpus '", shard->path(), "' holds ",
                shard->size(), " tokens, shorter than one sequence of --seq_len ", a.seq_len,
                " (+1). HINT: use a larger corpus or a smaller --seq_len.");
  }
  return {std::move(tok), std::move(train), std::move(val)};
}

// ---- policies: the plan's strings select the Trainer's types (one instantiation each of
// LladaTrainers, through memopt::dispatch): memopt::RecomputePrecisionTrainers (AdamW's state
// resident) and the same with the state in pinned host memory (--optimizer_state pinned-host) ----
using LladaTrainers =
    typename memopt::detail::Concat<memopt::TypeList<>, memopt::RecomputePrecisionTrainers,
                                    examples::PinnedHostTrainers<>>::type;
memopt::memory::PolicyDesc policies_of(const Plan& p) {
  return memopt::parse_policies<LladaTrainers>(p.recompute == "every_block" ? "every" : "none", p.precision,
                                               p.optimizer_state, p.accum);
}
template <class F>
int with_policies(const Plan& p, F&& f) {
  return memopt::dispatch<LladaTrainers>(policies_of(p), [&]<class T>(std::type_identity<T>) {
    return f(typename T::recompute_type{}, typename T::precision_type{}, typename T::state_type{});
  });
}

memopt::TrainerOptions trainer_options(const Args& a, const Plan& p, double lr, int64_t steps) {
  return a.memory.options(a.distributed.apply(memopt::TrainerOptions()))  // --preserve_rng_state
      .lr(lr)
      .weight_decay(a.weight_decay)
      .param_specific_decay(p.param_specific_decay)
      .warmup_steps(p.schedule ? a.warmup_steps : 0)
      .decay(p.schedule ? memopt::optim::Decay::kLinear : memopt::optim::Decay::kConstant)
      .min_lr_ratio(0.0)
      .grad_clip(p.grad_clip)
      .max_steps(steps)
      .accum_steps(p.accum)
      .log_interval(a.log_interval);
}

// Writes one JSON object per log line (and the evaluation and summary lines) to metrics.jsonl.
class MetricsJsonl : public memopt::Callback {
 public:
  MetricsJsonl(const std::string& path, memopt::models::Distiller* distiller) : distiller_(distiller) {
    if (memopt::dist::world().rank() != 0) return;  // data parallel: rank 0 writes the log
    out_.open(path, std::ios::app);
    TORCH_CHECK(out_, "llama_to_llada: cannot write '", path, "'. HINT: check --output_dir is writable.");
  }
  bool main_rank_only() const override { return true; }
  void on_log(const memopt::LogLine& l) override {
    nlohmann::json j = {{"event", distiller_ ? "distill" : "teacher"},
                        {"step", l.step},
                        {"loss", l.loss},
                        {"lr", l.lr},
                        {"grad_norm", l.grad_norm},
                        {"tokens_per_s", l.tokens_per_s},
                        {"tracked_mib", memopt::memory::mib(l.memory.tensors.live_bytes)},
                        {"peak_tracked_mib", memopt::memory::mib(l.memory.tensors.peak_bytes)},
                        {"rss_mib", memopt::memory::mib(l.memory.rss_bytes)}};
    if (distiller_) {
      const auto terms = distiller_->take_terms();
      const double tokens = std::max(terms.tokens.item<double>(), 1.0);
      j["diffusion_loss"] = terms.diffusion_sum.item<double>() / tokens;
      j["kd_loss"] = terms.kd_sum.item<double>() / tokens;
    }
    write(j);
  }
  void write(const nlohmann::json& j) {
    out_ << j.dump() << '\n';
    out_.flush();
  }

 private:
  std::ofstream out_;
  memopt::models::Distiller* distiller_;
};

// The naive strategy's teacher receives gradients nobody uses: drop them after each step.
struct ClearTeacherGrads : memopt::Callback {
  explicit ClearTeacherGrads(memopt::models::Distiller& d) : distill(d) {}
  void on_step_end(const memopt::StepStats&) override { distill.clear_teacher_grads(); }
  memopt::models::Distiller& distill;
};

// ---- teacher: trained here (causal LM) or loaded from a HuggingFace-style checkpoint ----
// Its shape: the --layers/--dim/... flags (--train_teacher) or the checkpoint's config.json;
// its attention: --attention (a runtime choice, not part of config.json).
LlamaConfig teacher_config(const Args& a, const Data& d) {
  if (a.train_teacher)
    return a.memory.apply(LlamaConfig()
                              .vocab_size(d.tokenizer.vocab_size())
                              .hidden_size(a.dim)
                              .num_hidden_layers(a.layers)
                              .num_attention_heads(a.heads)
                              .num_key_value_heads(a.kv_heads)
                              .max_position_embeddings(a.max_seq_len),
                          "llama_to_llada");
  TORCH_CHECK(fs::exists(a.teacher_model + "/config.json"), "llama_to_llada: no teacher at '", a.teacher_model,
              "' (config.json is missing). HINT: pass --train_teacher to train one there first, or point "
              "--teacher_model at a folder with config.json and model.safetensors.");
  const LlamaConfig config = memopt::io::read_llama_config(a.teacher_model + "/config.json");
  // A published config may pad vocab_size beyond the tokenizer: those rows are never a data id.
  TORCH_CHECK(d.tokenizer.vocab_size() <= config.vocab_size(), "llama_to_llada: the teacher's config.json (",
              a.teacher_model, ") has vocab_size ", config.vocab_size(), " but the tokenizer '", d.tokenizer.path(),
              "' has ", d.tokenizer.vocab_size(), " ids: its larger ids have no embedding row. HINT: use the "
              "teacher's own tokenizer (drop --tokenizer; the teacher folder's tokenizer.json or tokenizer.model "
              "is the default), or train a teacher with this tokenizer (--train_teacher).");
  TORCH_CHECK(a.seq_len <= config.max_position_embeddings(), "llama_to_llada: --seq_len ", a.seq_len, " exceeds the "
              "teacher's max_position_embeddings ", config.max_position_embeddings(), " (", a.teacher_model,
              "/config.json). HINT: lower --seq_len.");
  TORCH_CHECK(config.causal(), "llama_to_llada: the teacher at '", a.teacher_model,
              "' is bidirectional (\"causal\": false in config.json). HINT: the teacher is an autoregressive LLaMA.");
  return a.memory.apply(config, "llama_to_llada");
}

// Trains the teacher (checkpoints in OUT/teacher/checkpoints; --resume latest continues them).
// Returns false when a signal stopped it (its checkpoint is written).
bool train_teacher(const Args& a, const Plan& p, const Data& d, MetricsJsonl& metrics, Llama& teacher) {
  torch::manual_seed(static_cast<int64_t>(a.seed));
  teacher = Llama(teacher_config(a, d));
  teacher->to(p.teacher_device);  // the Trainer follows the parameters: batches go where they are
  fmt::print("teacher: training a causal LLaMA ({} layers, d{}) for {} steps (fp32, recompute {})\n", a.layers, a.dim,
             a.teacher_steps, p.recompute);
  std::fflush(stdout);
  if (a.teacher_steps > 0) {
    // fp32 whatever the strategy: the teacher is not what is measured, and its quality bounds
    // the student's. --teacher_precision bf16 (or auto's measured choice) casts it after training.
    Plan fp32 = p;
    fp32.precision = "fp32";
    fp32.optimizer_state = "resident";  // the teacher may train on the CPU (--teacher_device)
    const int stopped = with_policies(fp32, [&](auto ckpt, auto prec, auto /*resident*/) {
      memopt::Trainer<decltype(ckpt), decltype(prec), memopt::accum::Runtime> trainer(
          *teacher, a.checkpoints.apply(trainer_options(a, p, a.teacher_lr, a.teacher_steps), a.output_dir + "/teacher"));
      trainer.set_run_config({{"role", "teacher"}, {"config", memopt::io::to_json(teacher_config(a, d))}, {"seed", a.seed},
                              {"batch_size", a.batch_size}, {"seq_len", a.seq_len}});
      auto& world = memopt::dist::world();  // data parallel: each rank trains on its rows of every batch
      memopt::data::RandomWindowLoader global(d.train,
                                              memopt::data::LoaderOptions(a.batch_size * world.size(), a.seq_len).seed(a.seed));
      memopt::dist::RankSlice loader(global, world.rank(), world.size());
      if (a.checkpoints.resume == "latest") a.checkpoints.resume_if_asked(trainer, loader, "teacher");
      trainer.add_callback(std::make_shared<memopt::callbacks::ProgressBar>())
          .add_callback(std::make_shared<MetricsJsonl>(a.output_dir + "/metrics.jsonl", nullptr));
      const auto r = trainer.fit(loader, [&](const memopt::Batch& b, const auto& c) { return teacher->loss_sum(b, c); });
      if (examples::stopped_by_signal(r, trainer.steps_taken(), "llama_to_llada (teacher)")) return 1;
      metrics.write({{"event", "teacher_done"}, {"steps", r.steps}, {"seconds", r.seconds}, {"loss", r.final_loss}});
      return 0;
    });
    if (stopped) return false;
  }
  if (memopt::dist::world().rank() == 0) {
    memopt::io::save_pretrained(*teacher, teacher->config, a.teacher_model);
    d.tokenizer.save(a.teacher_model);  // a later --teacher_model run defaults to it
  }
  memopt::dist::world().barrier("teacher saved");
  fmt::print("teacher: saved to {}/ with its tokenizer\n", a.teacher_model);
  return true;
}

// As memopt::io::load_pretrained reads it (model.safetensors or shards, tied or not), but built
// from teacher_config, so that --attention applies to it.
Llama load_teacher(const Args& a, const Data& d) {
  LlamaConfig config = teacher_config(a, d);  // the checks, naming the file
  fmt::print("teacher: loading {} ({} layers, d{}, vocab {} for the tokenizer's {} ids)\n", a.teacher_model,
             config.num_hidden_layers(), config.hidden_size(), config.vocab_size(), d.tokenizer.vocab_size());
  const auto weights = memopt::io::SafetensorsShards::open_dir(a.teacher_model);
  const auto load = memopt::io::tied_checkpoint_options(weights, config,
                                                        "llama_to_llada: --teacher_model '" + a.teacher_model + "'");
  Llama teacher(config);
  memopt::io::load_state_dict(*teacher, weights, load);
  return teacher;
}

// The student: the teacher's shape (or --student_model's config.json), bidirectional, V + 1 ids,
// with --attention.
// `weights` gets --student_model's model.safetensors when there is one.
LlamaConfig student_config(const Args& a, const LlamaConfig& teacher, std::string* weights = nullptr) {
  const int64_t vocab = teacher.vocab_size() + 1;
  LlamaConfig config = teacher;
  if (!a.student_model.empty()) {
    const bool dir = fs::is_directory(a.student_model);
    config = memopt::io::read_llama_config(dir ? a.student_model + "/config.json" : a.student_model);
    TORCH_CHECK(config.vocab_size() == vocab, "llama_to_llada: --student_model '", a.student_model,
                "' has vocab_size ", config.vocab_size(), " but the student needs the teacher's ",
                vocab - 1, " + 1 mask token = ", vocab, ". HINT: set \"vocab_size\": ", vocab, " in its config.json.");
    if (weights && dir && fs::exists(a.student_model + "/model.safetensors"))
      *weights = a.student_model + "/model.safetensors";
  }
  return a.memory.apply(config.vocab_size(vocab).causal(false).dropout(0.0), "llama_to_llada");
}

Llama make_student(const Args& a, const Llama& teacher) {
  std::string weights;
  const LlamaConfig config = student_config(a, teacher->config, &weights);
  torch::manual_seed(static_cast<int64_t>(a.seed) + 1);
  Llama student(config);
  if (!weights.empty()) {
    memopt::io::load_state_dict(*student, *memopt::io::SafetensorsFile::open(weights));
    fmt::print("student: initialised from {}\n", weights);
  }
  return student;
}

// ---- evaluation ----
torch::Device device_of(const Llama& model) { return model->lm_head->weight.device(); }  // where its weights are

struct Eval {
  std::map<double, double> masked_ce;  // mask ratio -> mean CE over masked tokens
  double teacher_loss = 0;             // next-token CE of the teacher
};

Eval evaluate(const Args& a, memopt::models::Distiller& distill, const Data& d) {
  Eval e;
  if (a.eval_batches <= 0) return e;
  c10::InferenceMode no_graph;
  auto& student = distill.student();
  student->eval();
  const int64_t mask_id = distill.options().mask_id();
  for (double ratio : {0.15, 0.5, 0.85}) {
    torch::manual_seed(static_cast<int64_t>(a.seed) + 7);  // the same masks for every model
    memopt::data::SequentialLoader loader(d.val, memopt::data::LoaderOptions(a.batch_size, a.seq_len));
    double ce = 0, count = 0;
    for (int64_t i = 0; i < a.eval_batches && loader.has_next(); ++i) {
      const torch::Tensor x0 = loader.next().inputs.to(device_of(student));             // (B, L)
      const auto masked = memopt::models::llada::mask_at_ratio(x0, mask_id, ratio);      // noisy (B, L)
      const torch::Tensor logits = student->forward(masked.noisy);                        // (B, L, V + 1)
      ce += torch::nn::functional::cross_entropy(logits.index({masked.mask}).to(torch::kFloat),
                                                  x0.index({masked.mask}),
                                                  torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                .item<double>();
      count += masked.mask.sum().item<double>();
    }
    e.masked_ce[ratio] = ce / std::max(count, 1.0);
  }
  if (distill.teacher()) {
    auto autocast = distill.teacher_autocast();
    memopt::data::SequentialLoader loader(d.val, memopt::data::LoaderOptions(a.batch_size, a.seq_len));
    double sum = 0, count = 0;
    for (int64_t i = 0; i < a.eval_batches && loader.has_next(); ++i) {
      const memopt::Batch b = loader.next().to(device_of(distill.teacher()));
      sum += distill.teacher()->loss_sum(b, memopt::recompute::None{}).item<double>();
      count += b.num_targets().item<double>();
    }
    e.teacher_loss = sum / std::max(count, 1.0);
  }
  student->train();
  return e;
}

// The text of `ids` (1-D), leaving out ids beyond the tokenizer: the mask id, and a published
// teacher's padding rows (its config.json's vocab_size rounded up), which a sample can land on.
std::string decode_known(const memopt::data::Tokenizer& tok, const torch::Tensor& ids) {
  const torch::Tensor flat = ids.reshape({-1}).to(torch::kCPU, torch::kLong);  // (n,)
  return tok.decode(flat.masked_select(flat.ge(0).logical_and(flat.lt(tok.vocab_size()))));
}

// LLaDA samples from prompts cut from the held-out split, next to the teacher's continuation
// (same temperature; the teacher also keeps its 50 most likely tokens). Seeded: reproducible.
void print_samples(const Args& a, memopt::models::Distiller& distill, const Data& d) {
  if (a.samples <= 0) return;
  c10::InferenceMode no_graph;
  auto& student = distill.student();
  student->eval();
  auto options = memopt::models::llada::SamplerOptions(distill.options().mask_id())
                     .steps(a.sample_steps)
                     .gen_length(a.gen_length)
                     .block_length(a.block_length)
                     .temperature(a.temperature)
                     .cfg_scale(a.cfg_scale);
  const int64_t stride = std::max<int64_t>(1, (d.val->size() - a.prompt_tokens) / a.samples);
  for (int64_t s = 0; s < a.samples; ++s) {
    const torch::Tensor prompt = d.val->window(s * stride, a.prompt_tokens);  // (Lp)
    const uint64_t seed = a.seed + static_cast<uint64_t>(s);
    options.seed(seed);
    // The mask id is never a target, but an undertrained student may still rank it first.
    // A large finite logit, not -inf: guidance subtracts logits (-inf - -inf is NaN).
    auto never_mask = [&](const torch::Tensor& x) {
      auto logits = student->forward(x);                                    // (1, L, V + 1)
      logits.narrow(-1, options.mask_id(), 1).fill_(-1e9);
      return logits;
    };
    const torch::Tensor out =
        memopt::models::llada::generate(never_mask, prompt.unsqueeze(0).to(device_of(student)), options).cpu();  // (1, Lp + G)
    const torch::Tensor continuation = out[0].slice(0, a.prompt_tokens);
    fmt::print("\nprompt:  {}\nstudent: {}\n", decode_known(d.tokenizer, prompt), decode_known(d.tokenizer, continuation));
    if (distill.teacher()) {
      auto autocast = distill.teacher_autocast();
      const torch::Tensor ar = distill.teacher()->generate(prompt, memopt::models::SampleOptions()
                                                                     .max_new_tokens(a.gen_length)
                                                                     .temperature(a.temperature)
                                                                     .top_k(50)
                                                                     .seed(seed));
      fmt::print("teacher: {}\n", decode_known(d.tokenizer, ar.slice(0, a.prompt_tokens)));
    }
  }
  student->train();
}

int run(const Args& a, const CLI::App& app) {
  // ---- options first: a bad flag fails before any data is read ----
  Plan plan = make_plan(a, app);  // --policies auto may change its recompute, precision and accum
  TORCH_CHECK(a.policies == "fixed" || a.policies == "auto", "llama_to_llada: --policies must be fixed or auto (got '",
              a.policies, "'). HINT: auto picks checkpointing, precision and micro-batch for --memory_budget.");
  const int64_t budget = a.memory_budget.empty() ? 0 : memopt::parse_bytes(a.memory_budget);
  TORCH_CHECK(a.batch_size >= 1, "llama_to_llada: --batch_size must be >= 1 (got ", a.batch_size,
              "). HINT: 4 sequences per micro-batch fit in a few hundred MiB at the default size.");
  // The upper bound of a loaded teacher is its config.json's (teacher_config).
  TORCH_CHECK(a.seq_len >= 2 && (a.seq_len <= a.max_seq_len || !a.train_teacher), "llama_to_llada: --seq_len must "
              "lie in [2, --max_seq_len ", a.max_seq_len, "] (got ", a.seq_len, "). HINT: try 128.");
  TORCH_CHECK(a.max_steps >= 0 && a.teacher_steps >= 0, "llama_to_llada: --max_steps and --teacher_steps must be "
              ">= 0 (got ", a.max_steps, " and ", a.teacher_steps, "). HINT: 0 skips that training.");
  TORCH_CHECK(a.prompt_tokens >= 1, "llama_to_llada: --prompt_tokens must be >= 1 (got ", a.prompt_tokens,
              "). HINT: try 16.");
  trainer_options(a, plan, a.lr, std::max<int64_t>(a.max_steps, 1)).validate();
  trainer_options(a, plan, a.teacher_lr, std::max<int64_t>(a.teacher_steps, 1)).validate();
  apply_cuda_settings(plan);

  examples::join_world("llama_to_llada");  // torchrun: data parallel, rank 0 prints
  const Data data = load_data(a, plan);
  int64_t micro_batch = a.batch_size;  // of the distillation (the planner may lower it; the teacher keeps --batch_size)
  if (a.estimate_only || a.policies == "auto" || budget > 0) {
    // The distillation step's memory before any weight exists (memory/estimator.hpp) and,
    // for a budget, the plan (planner.hpp) over the four combinations this program compiles.
    TORCH_CHECK(!plan.teacher_autograd, "llama_to_llada: the memory estimate models the teacher under inference "
                "mode (got a teacher with autograd, strategy ", plan.strategy, "). HINT: use --strategy simple or "
                "comprehensive, or --teacher_autograd false.");
    const LlamaConfig teacher = teacher_config(a, data);
    const auto options = memopt::models::DistillOptions(teacher.vocab_size()).alpha(a.alpha).top_k(plan.kd_top_k);
    auto policies = policies_of(plan);
    const auto desc = memopt::models::describe_distill(student_config(a, teacher), teacher, options,
                                                                plan.teacher_precision == "bf16");
    if (a.policies == "auto" || budget > 0) {  // fixed + budget: the micro-batch finder only
      const auto chosen = memopt::choose_policies(
          desc, a.seq_len, policies, a.policies == "auto", memopt::candidates<LladaTrainers>(),
          memopt::PlanOptions().budget_bytes(budget).effective_batch(a.batch_size * plan.accum)
              .machine(memopt::MachineModel::from_device(plan.device)));
      policies = chosen.policies;
      micro_batch = chosen.micro_batch;
      plan.recompute = policies.recompute.flag == "every" ? "every_block" : "none";
      plan.precision = policies.precision.flag;
      plan.optimizer_state = policies.state.flag;
      plan.accum = policies.accum;
    }
    fmt::print("distillation step, {} ({} x {} tokens)\n{}", policies.name(), micro_batch, a.seq_len,
               memopt::memory::estimate(desc, {micro_batch, a.seq_len}, policies).table());
    if (a.estimate_only) return 0;
  }
  fs::create_directories(a.output_dir);
  if (memopt::dist::world().rank() == 0)
    std::ofstream(a.output_dir + "/metrics.jsonl",  // a new run's log starts empty; a resumed one appends
                  a.checkpoints.resume.empty() ? std::ios::trunc : std::ios::app);
  MetricsJsonl metrics(a.output_dir + "/metrics.jsonl", nullptr);
  metrics.write({{"event", "start"}, {"strategy", plan.strategy}, {"recompute", plan.recompute},
                 {"precision", plan.precision}, {"data_format", plan.data_format}, {"accum", plan.accum},
                 {"batch_size", micro_batch}, {"seq_len", a.seq_len}, {"teacher_precision", plan.teacher_precision},
                 {"teacher_autograd", plan.teacher_autograd}, {"kd_top_k", plan.kd_top_k}, {"alpha", a.alpha},
                 {"attention", a.memory.attention}, {"release_cache_every", plan.release_cache_every},
                 {"tf32", plan.tf32}, {"cudnn_benchmark", plan.cudnn_benchmark}});

  Llama teacher(nullptr);
  if (!a.train_teacher) {
    teacher = load_teacher(a, data);
  } else if (!train_teacher(a, plan, data, metrics, teacher)) {
    return 0;  // stopped by a signal, checkpointed
  }
  teacher->to(plan.teacher_device);
  if (plan.teacher_precision == "bf16") teacher->to(torch::kBFloat16);
  memopt::memory::Tracker::instance().reset_peaks();
  memopt::memory::reset_peak_rss();

  Llama student = make_student(a, teacher);
  student->to(plan.device);
  memopt::models::Distiller distill(teacher, student,
                                    memopt::models::DistillOptions(teacher->config.vocab_size())
                                        .alpha(a.alpha)
                                        .temperature(a.kd_temperature)
                                        .top_k(plan.kd_top_k)
                                        .teacher_autograd(plan.teacher_autograd)
                                        .teacher_bf16(plan.teacher_precision == "bf16"));
  auto distill_metrics = std::make_shared<MetricsJsonl>(a.output_dir + "/metrics.jsonl", &distill);

  int64_t params = 0;
  for (const auto& p : student->parameters()) params += p.numel();
  fmt::print("student: LLaDA {:.2f} M parameters, vocab {} (+ mask id {}); strategy {}: recompute {}, precision {}, "
             "data {}, accum {}, optimizer state {}, clip {}, teacher {}{}, KD top-k {} ({}), alpha {}, attention {}, cache release {}, "
             "tf32 {}, cudnn benchmark {}\n",
             params / 1e6, student->config.vocab_size(), teacher->config.vocab_size(), plan.strategy,
             plan.recompute, plan.precision, plan.data_format, plan.accum, plan.optimizer_state, plan.grad_clip, plan.teacher_precision,
             plan.teacher_autograd ? " with autograd" : " inference-mode", plan.kd_top_k,
             plan.kd_top_k == 0 ? "dense" : "sparse", a.alpha, a.memory.attention,
             plan.release_cache_every > 0 ? fmt::format("every {} steps", plan.release_cache_every) : "off",
             plan.tf32, plan.cudnn_benchmark);
  std::fflush(stdout);

  // ---- distillation ----
  memopt::FitResult result;
  if (a.max_steps > 0) {
    const int stopped = with_policies(plan, [&](auto ckpt, auto prec, auto state) {
      memopt::Trainer<decltype(ckpt), decltype(prec), memopt::accum::Runtime, decltype(state)> trainer(
          *student, a.checkpoints.apply(trainer_options(a, plan, a.lr, a.max_steps), a.output_dir));
      nlohmann::json run = {{"role", "student"}, {"strategy", plan.strategy}, {"data_format", plan.data_format},
                            {"teacher", memopt::io::to_json(teacher->config)}, {"alpha", a.alpha},
                            {"kd_top_k", plan.kd_top_k}, {"kd_temperature", a.kd_temperature},
                            {"teacher_precision", plan.teacher_precision}, {"attention", a.memory.attention},
                            {"seed", a.seed}, {"seq_len", a.seq_len}};
      if (!plan.data_tokenizer) run["tokenizer"] = data.tokenizer.path();
      trainer.set_run_config(std::move(run));
      trainer.add_callback(std::make_shared<memopt::callbacks::ProgressBar>()).add_callback(distill_metrics);
      if (plan.teacher_autograd) trainer.add_callback(std::make_shared<ClearTeacherGrads>(distill));
      examples::MemoryFlags memory = a.memory;  // with the plan's interval: the preset's, or the flag's when given
      memory.release_cache_every = plan.release_cache_every;
      memory.attach(trainer, "llama_to_llada");  // on every rank, after a barrier when data parallel
      if (a.memory_trace > 0)
        trainer.add_callback(std::make_shared<memopt::callbacks::MemoryTrace>(a.output_dir + "/memory.trace.json",
                                                                              a.memory_trace));
      auto& world = memopt::dist::world();
      memopt::data::RandomWindowLoader global(
          data.train, memopt::data::LoaderOptions(micro_batch * world.size(), a.seq_len).seed(a.seed + 1));
      memopt::dist::RankSlice loader(global, world.rank(), world.size());
      a.checkpoints.resume_if_asked(trainer, loader, "llama_to_llada");
      result = trainer.fit(loader, [&](const memopt::Batch& b, const auto& c) { return distill.loss_sum(b, c); });
      return examples::stopped_by_signal(result, trainer.steps_taken(), "llama_to_llada") ? 1 : 0;
    });
    if (stopped) return 0;  // checkpointed: --resume latest continues
    fmt::print("distilled {} steps in {:.0f} s, {:.0f} tokens/s\n{}", result.steps, result.seconds,
               result.tokens_per_s, result.memory.table());
  }
  const auto peak = memopt::memory::Report::now();
  if (memopt::dist::world().rank() == 0) memopt::io::save_pretrained(*student, student->config, a.output_dir + "/student");

  // ---- held-out quality and samples ----
  const Eval e = evaluate(a, distill, data);
  if (a.eval_batches > 0) {
    fmt::print("held-out masked-token CE (student): ratio 0.15 {:.3f} | 0.5 {:.3f} | 0.85 {:.3f}\n",
               e.masked_ce.at(0.15), e.masked_ce.at(0.5), e.masked_ce.at(0.85));
    fmt::print("held-out next-token CE (teacher): {:.3f} (perplexity {:.1f})\n", e.teacher_loss,
               std::exp(e.teacher_loss));
  }
  metrics.write({{"event", "summary"},
                 {"strategy", plan.strategy},
                 {"steps", result.steps},
                 {"tokens_per_s", result.tokens_per_s},
                 {"peak_tracked_mib", memopt::memory::mib(peak.tensors.peak_bytes)},
                 {"peak_rss_mib", memopt::memory::mib(peak.peak_rss_bytes)},
                 {"final_loss", result.final_loss},
                 {"masked_ce_0.15", a.eval_batches > 0 ? e.masked_ce.at(0.15) : 0.0},
                 {"masked_ce_0.5", a.eval_batches > 0 ? e.masked_ce.at(0.5) : 0.0},
                 {"masked_ce_0.85", a.eval_batches > 0 ? e.masked_ce.at(0.85) : 0.0},
                 {"teacher_loss", e.teacher_loss},
                 {"alpha", a.alpha},
                 {"kd_top_k", plan.kd_top_k},
                 {"teacher_precision", plan.teacher_precision}});
  print_samples(a, distill, data);
  fmt::print("\nsaved: {0}/student/model.safetensors, {0}/student/config.json, {0}/metrics.jsonl\n", a.output_dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Distil an autoregressive LLaMA teacher into a LLaDA (masked diffusion) student with memopt"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a later flag wins
  auto one_of = [](std::vector<std::string> v) { return CLI::IsMember(std::move(v)); };
  app.add_option("--teacher_model", a.teacher_model, "teacher folder: a Hugging Face Llama checkpoint (config.json + "
                 "model.safetensors or shards; its tokenizer.json or tokenizer.model is the default tokenizer), or "
                 "where --train_teacher saves one")
      ->capture_default_str();
  app.add_option("--tokenizer", a.tokenizer, "SentencePiece .model, tokenizer.json, or a folder holding one (default: "
                 "the teacher folder's own, unless --train_teacher; else DATA_PATH/tokenizer.model); with any but "
                 "DATA's, the text is tokenized now (--data_format text)");
  app.add_flag("--train_teacher", a.train_teacher, "train the teacher on the corpus first and save it there");
  app.add_flag("--estimate_only", a.estimate_only, "print the distillation step's estimated peak memory and stop");
  app.add_option("--policies", a.policies, "fixed: the strategy and flags; auto: the planner picks checkpointing, "
                 "precision and micro-batch for --memory_budget");
  app.add_option("--memory_budget", a.memory_budget, "peak tensor memory of a distillation step, e.g. 512MiB (fixed "
                 "policies: the largest micro-batch that fits; accumulation keeps the effective batch)");
  app.add_option("--teacher_steps", a.teacher_steps, "teacher training steps (0: random init)")->capture_default_str();
  app.add_option("--teacher_lr", a.teacher_lr, "teacher peak learning rate")->capture_default_str();
  app.add_option("--student_model", a.student_model,
                 "student config.json or folder (default: the teacher's shape, bidirectional, + mask token)");
  app.add_option("--data_path", a.data_path, "folder: tokenizer.model, {train,val}.bin and/or {train,val}.txt; or "
                 "a Parquet, JSONL or text file (or a glob) of documents, tokenized now, its last 5% held out")
      ->capture_default_str();
  app.add_option("--output_dir", a.output_dir, "where the student, metrics.jsonl and checkpoints/ go")
      ->capture_default_str();
  a.checkpoints.add_to(app);
  a.distributed.add_to(app);
  app.add_option("--strategy", a.strategy, "preset: none | simple | comprehensive")
      ->check(one_of({"none", "simple", "comprehensive"}))
      ->capture_default_str();
  app.add_option("--batch_size", a.batch_size, "sequences per micro-batch")->capture_default_str();
  app.add_option("--gradient_accumulation_steps,--grad_accum,--accum", a.gradient_accumulation_steps,
                 "micro-batches per step (comprehensive; 1 in the other presets unless given)")
      ->capture_default_str();
  app.add_option("--weight_decay", a.weight_decay, "AdamW weight decay")->capture_default_str();
  app.add_option("--warmup_steps", a.warmup_steps, "linear warmup steps (comprehensive)")->capture_default_str();
  app.add_option("--max_steps,--steps", a.max_steps, "distillation steps (0: none)")->capture_default_str();
  app.add_option("--lr", a.lr, "student peak learning rate")->capture_default_str();
  app.add_option("--seq_len", a.seq_len, "tokens per sequence")->capture_default_str();
  app.add_option("--layers", a.layers, "teacher decoder blocks (--train_teacher)")->capture_default_str();
  app.add_option("--dim", a.dim, "teacher hidden size (--train_teacher)")->capture_default_str();
  app.add_option("--heads", a.heads, "teacher attention heads (--train_teacher)")->capture_default_str();
  app.add_option("--kv_heads", a.kv_heads, "teacher KV heads, 0: --heads (--train_teacher)")->capture_default_str();
  app.add_option("--max_seq_len", a.max_seq_len, "teacher max positions (--train_teacher)")->capture_default_str();
  app.add_option("--alpha", a.alpha, "weight of the KD term (0: diffusion loss only, no teacher run)")
      ->capture_default_str();
  app.add_option("--kd_temperature", a.kd_temperature, "KD softmax temperature")->capture_default_str();
  app.add_option("--kd_top_k", a.kd_top_k, "memopt's lever, not in the original: sparse KD from the teacher's "
                 "top-k logits + a tail bin (0: dense, every preset's default)")
      ->capture_default_str();
  examples::add_recompute_option(app, a.recompute, "override: none | every (= every_block)", "every_block")
      ->check(one_of({"none", "every_block"}));
  examples::add_precision_option(app, a.precision, "override: fp32 | bf16 (autocast) | auto (measured on this CPU)")
      ->check(one_of({"fp32", "bf16", "auto"}));
  examples::add_state_option(app, a.optimizer_state, "override: resident | pinned-host (the student's AdamW state "
                             "in pinned host memory between steps; a CUDA student only)")
      ->check(one_of({"resident", "pinned-host"}));
  app.add_option("--data_format", a.data_format, "override: shards (pre-tokenized with DATA's tokenizer) | text "
                 "(tokenized now; the default when the tokenizer is not DATA's)")
      ->check(one_of({"shards", "text"}));
  app.add_option("--device", a.device, "cpu | cuda[:N]: where the student trains (and the teacher, unless "
                 "--teacher_device)")->capture_default_str();
  app.add_option("--teacher_device", a.teacher_device, "cpu | cuda[:N]: where the teacher runs (default: --device)");
  app.add_option("--teacher_precision,--teacher_dtype", a.teacher_precision, "memopt's lever, not in the original "
                 "(its teacher is fp32, every preset's default): fp32 | bf16 | auto (measured on --teacher_device) "
                 "teacher weights and compute; --teacher_dtype is the same setting")
      ->check(one_of({"fp32", "bf16", "auto"}));
  app.add_option("--teacher_autograd", a.teacher_autograd, "override: true runs the teacher with a graph (naive)");
  app.add_option("--grad_clip", a.grad_clip, "override: gradient-norm clip, 0 off (comprehensive: 1)");
  a.memory.add_to(app, 10);  // --attention, --release_cache_every (simple, comprehensive: 10; none: 0 unless given)
  auto* release = app.get_option("--release_cache_every");
  release->description(release->get_description() + "; the presets: simple and comprehensive 10, none 0");
  app.add_option("--tf32", a.tf32, "override: true lets cuBLAS and cuDNN use TF32 for fp32 matmuls and convolutions "
                 "(CUDA only; comprehensive: true, as the original; else false)");
  app.add_option("--cudnn_benchmark", a.cudnn_benchmark, "override: true lets cuDNN time its algorithms and keep the "
                 "fastest (CUDA only; comprehensive: true, as the original; else false)");
  app.add_option("--memory_trace", a.memory_trace, "trace the first N distillation steps' memory into "
                 "OUTPUT_DIR/memory.trace.json (Chrome trace; open in ui.perfetto.dev), 0: off")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--eval_batches", a.eval_batches, "held-out batches per evaluation (0: skip)")->capture_default_str();
  app.add_option("--samples", a.samples, "LLaDA samples to print")->capture_default_str();
  app.add_option("--prompt_tokens", a.prompt_tokens, "prompt length of the samples")->capture_default_str();
  app.add_option("--gen_length", a.gen_length, "tokens each sample generates")->capture_default_str();
  app.add_option("--sample_steps", a.sample_steps, "sampler steps")->capture_default_str();
  app.add_option("--block_length", a.block_length, "semi-autoregressive block length")->capture_default_str();
  app.add_option("--temperature", a.temperature, "sampling temperature; Gumbel-max for the student (0: greedy)")
      ->capture_default_str();
  app.add_option("--cfg_scale", a.cfg_scale, "classifier-free guidance scale (0: off)")->capture_default_str();
  app.add_option("--log_interval", a.log_interval, "steps between log lines")->capture_default_str();
  app.add_option("--threads", a.threads, "CPU threads (0: all available)")->capture_default_str();
  app.add_option("--seed", a.seed, "seed of init, data order, masks and sampling")->capture_default_str();
  examples::underscore_option_names(argc, argv);  // --seq-len is --seq_len
  CLI11_PARSE(app, argc, argv);
  return memopt::guarded_main([&] {
    memopt::init(memopt::RuntimeOptions().threads(a.threads));  // tracker + threads, before any tensor
    memopt::log_performance_info();
    return run(a, app);
  });
}
