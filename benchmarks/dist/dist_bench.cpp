// benchmarks/dist/dist_bench.cpp — data-parallel training (dist/data_parallel.hpp through the
// Trainer) on the reference LLaMA: one process per rank, launched torchrun-style (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT; none of them: a world of one). Every rank draws the
// same global micro-batches of --micro rows and trains on its rows of each (dist::RankSlice),
// so 1 and N ranks train on the same global batch and should follow the same loss curve.
// Rank 0 prints one JSON line: tokens/s of the global batch over the timed steps, the loss
// curve, the optimizer state each rank holds (ZeRO-1 shards it), the model state (parameters,
// gradients, optimizer state: tracked bytes at the optimizer phase's peak; ZeRO-3 shards all
// three), peak RSS (the largest rank's),
// where a step's time goes (forward + backward, gradient all-reduce, optimizer: from the memory
// tracker's timeline) and, timed apart after training, what each collective costs on its own.
//
//   memopt_bench_dist --precision bf16 --recompute every                      # 1 rank
//   RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 OMP_NUM_THREADS=1 \
//     memopt_bench_dist --sharded --param_gather allgather ...                 # per rank r
//     memopt_bench_dist --zero 3 ...                                           # ZeRO-3
//   scripts/bench dist                                                         # the suite
#include <sys/resource.h>  // getrusage
#include <unistd.h>        // sysconf

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench_main.hpp"
#include "memopt/data/loader.hpp"
#include "memopt/dist.hpp"
#include "memopt/memopt.hpp"
#include "memopt/memory/report.hpp"

namespace {

using memopt::data::RandomWindowLoader;
using memopt::dist::RankSlice;
using Clock = std::chrono::steady_clock;

/// What one run benchmarks (the command line; the same on every rank).
struct BenchConfig {
  int64_t layers = 4;
  int64_t dim = 256;
  int64_t heads = 8;
  int64_t seq = 256;
  int64_t micro = 8;  // rows of one global micro-batch, split over the ranks
  int64_t accum = 2;  // micro-batches per optimizer step
  int64_t vocab = 4096;
  int64_t steps = 4;
  int64_t warmup = 1;
  uint64_t seed = 1234;
  int threads = 1;
  std::string precision = "bf16";
  std::string recompute = "every";
  std::string data;  // a token shard (data/kjv/train.bin); empty: random tokens
  bool sharded = false;  // ZeRO-1 (--sharded or --zero 1)
  int zero = 0;          // 3: ZeRO-3 (TrainerOptions::shard_params)
  std::string offload_dir;  // ZeRO-3: the parameter shards in a file there (TrainerOptions::offload_params_dir)
  bool offload_host = false;  // ZeRO-3, --device cuda: the shards in pinned host memory (offload_params_host)
  bool keep_gathered = false;  // ZeRO-3: blocks whole from their first use to the step's end (keep_gathered)
  bool gather_half = false;    // ZeRO-3, bf16: blocks' matrices all-gathered in bf16 (gather_half)
  std::string device = "cpu";  // cpu | cuda (cuda:LOCAL_RANK)
  std::string param_gather = "broadcast";
  // The model's kernels: SDPA (what the PyTorch peers run; named, not `auto`, so that every rank
  // runs the same kernel) and the fused RMSNorm/RoPE/SwiGLU (nn/fused.hpp), as memopt_bench_trainer.
  std::string attention = "sdpa";
  bool fused_kernels = true;
  int64_t bucket_mib = 25;  // the gradient all-reduce's bucket size (TrainerOptions::bucket_mib)
  int64_t comm_reps = 5;    // repetitions of each collective timed after training

  int64_t tokens_per_step() const { return micro * accum * seq; }  // the global batch
  std::string name() const {
    return "l" + std::to_string(layers) + "-d" + std::to_string(dim) + "-s" + std::to_string(seq) + "-" + precision +
           (recompute == "every" ? "-ckpt" : "");
  }
};

/// Random tokens: a 64-bit LCG (Knuth's MMIX constants, trainer_bench's generator) as a shard.
std::shared_ptr<const memopt::data::TokenShard> random_tokens(int64_t count, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> ids(static_cast<size_t>(count));
  uint64_t state = seed;
  for (auto& id : ids) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;  // mod 2^64
    id = static_cast<int32_t>((state >> 33) % static_cast<uint64_t>(vocab));
  }
  return memopt::data::TokenShard::from_tokens("lcg", ids, vocab);
}

/// CPU seconds so far: the whole machine's busy time (/proc/stat: user, nice, system, irq,
/// softirq, steal) and this process's (every thread, Gloo's included). Their difference over the
/// timed steps, less the other ranks' own, is the work of other processes that competed.
struct CpuTimes {
  double machine = 0, self = 0;
  static CpuTimes now() {
    CpuTimes t;
    std::ifstream stat("/proc/stat");
    std::string cpu;
    double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    if (stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal)
      t.machine = (user + nice + system + irq + softirq + steal) / static_cast<double>(sysconf(_SC_CLK_TCK));
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    t.self = static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
             static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
    return t;
  }
};

/// What a run measured on this rank.
struct RankResult {
  std::vector<double> step_seconds;  // timed steps only
  std::vector<double> losses;        // every step's loss (the global batch's mean), warm-up included
  int64_t state_tracked_bytes = 0;   // tracker live bytes added by the first step (after a barrier)
  int64_t state_tensor_bytes = 0;    // nbytes of the AdamW state tensors this rank holds
  int64_t model_state_bytes = 0;     // tracker live bytes at the optimizer phase's peak, less those before the model
  int64_t peak_tracked_bytes = 0;    // the run's tracked peak, less the bytes live before the model
  int64_t cuda_between_steps = 0;    // --device cuda: bytes the caching allocator held after the first step
  int64_t cuda_peak = 0;             // --device cuda: its peak over all steps
  double grad_sync_ms = 0;           // one gradient all-reduce / reduce-scatter (GradientSync::sync) alone, median
  double count_sync_ms = 0;          // one 2-element all-reduce (the target count) alone, median
  double param_share_ms = 0;         // one ParamShare::share alone (sharded), median
  int64_t grad_buckets = 0;
  // Where the timed steps' time went (mean ms per step), from the tracker's timeline (its
  // phase changes and the gradient bucket's allocation): before the first forward (loader, the
  // target count all-reduce), forward + backward, the gradient all-reduce (first bucket's
  // allocation to the optimizer phase: copies in and out, the all-reduce, the stop-signal sync),
  // the optimizer phase (clipping, the finite check, AdamW, ZeRO-1's parameter share), after.
  std::map<std::string, double> phase_ms;
  double timed_seconds = 0;  // wall time of the timed steps
  CpuTimes cpu_timed;        // CPU seconds over the timed steps (end - start)
};

/// Adds one step's phases (ms) to `sum`, from its timeline; `bucket_bytes`: the bytes of the
/// gradient all-reduce's first fp32 bucket (0 on one rank). False when a mark is missing.
bool add_phases(const std::vector<memopt::memory::TimelineEvent>& events, int64_t start_ns, int64_t end_ns,
                int64_t bucket_bytes, std::map<std::string, double>& sum) {
  using memopt::memory::Phase;
  int64_t forward = -1, sync = -1, optimizer = -1, idle = -1;
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    if (e.time_ns < start_ns) continue;
    if (forward < 0 && e.phase == Phase::kForward) forward = e.time_ns;
    if (forward >= 0 && optimizer < 0 && bucket_bytes > 0 && i > 0 &&
        e.live_bytes - events[i - 1].live_bytes == bucket_bytes)
      sync = e.time_ns;  // the last such allocation before the optimizer phase
    if (optimizer < 0 && e.phase == Phase::kOptimizer) optimizer = e.time_ns;
    if (optimizer >= 0 && e.phase == Phase::kIdle) {
      idle = e.time_ns;
      break;
    }
  }
  if (forward < 0 || optimizer < 0 || idle < 0 || (bucket_bytes > 0 && sync < 0)) return false;
  if (sync < 0) sync = optimizer;
  sum["before_forward"] += (forward - start_ns) / 1e6;
  sum["forward_backward"] += (sync - forward) / 1e6;
  sum["grad_sync"] += (optimizer - sync) / 1e6;
  sum["optimizer"] += (idle - optimizer) / 1e6;
  sum["after"] += (end_ns - idle) / 1e6;
  return true;
}

/// The bytes of GradientSync's first fp32 bucket (its rule: parameters in order while they fit;
/// the last bucket also carries the 2 extras, the loss and the stop signal, once for an
/// all-reduce and once per rank for a reduce-scatter: `extra_copies`).
int64_t first_bucket_bytes(const std::vector<torch::Tensor>& params, int64_t bucket_bytes, int64_t extra_copies) {
  int64_t used = 0;
  size_t i = 0;
  for (; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    if (used > 0 && (used + n) * 4 > bucket_bytes) break;
    used += n;
  }
  return (used + (i == params.size() ? 2 * extra_copies : 0)) * 4;
}

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2] * 1e3;
}

/// Times each collective of a step on its own, `reps` times (the model's real gradients
/// and parameters, after training; the ranks start each together after a barrier).
void time_collectives(const BenchConfig& cfg, memopt::dist::World& world, torch::nn::Module& model,
                      const memopt::TrainerOptions& options, RankResult& r) {
  if (!world.distributed()) return;
  std::vector<torch::Tensor> params;
  for (const auto& p : model.parameters())
    if (p.requires_grad()) params.push_back(p);
  const auto owner = memopt::dist::owners(params, world.size());
  memopt::dist::GradientSync sync(world, params, options.bucket_mib() << 20,
                                  cfg.sharded ? owner : std::vector<int>{});  // as the Trainer makes it
  memopt::dist::ParamShare share(world, params, owner, options.param_gather());
  r.grad_buckets = sync.buckets();
  std::vector<double> grad_s, count_s, share_s;
  for (int64_t i = 0; i < cfg.comm_reps; ++i) {
    for (auto& p : params) p.mutable_grad() = torch::randn_like(p);  // (a reduce-scatter frees the others')
    world.barrier();
    auto start = Clock::now();
    torch::Tensor loss = torch::zeros({}), signal = torch::zeros({});
    sync.sync({loss, signal});
    grad_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());

    world.barrier();
    start = Clock::now();
    torch::Tensor counts = torch::ones({2}, torch::kDouble);
    world.all_reduce_sum({counts});
    (void)counts[1].item<double>();
    count_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());

    if (cfg.sharded) {
      world.barrier();
      start = Clock::now();
      share.share();
      share_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
  }
  for (auto& p : params) p.mutable_grad() = torch::Tensor();
  r.grad_sync_ms = median_ms(grad_s);
  r.count_sync_ms = median_ms(count_s);
  r.param_share_ms = median_ms(share_s);
}

/// The Trainer with the policy types picked in main(), on this rank's rows of each batch.
template <memopt::RecomputePolicy Recompute, memopt::PrecisionPolicy Precision>
RankResult run(const BenchConfig& cfg, memopt::dist::World& world, memopt::models::Llama& model,
               std::shared_ptr<const memopt::data::TokenShard> shard, int64_t before_model) {
  auto options = memopt::TrainerOptions()
                     .accum_steps(cfg.accum)
                     .decay(memopt::optim::Decay::kConstant)  // lr 3e-4 throughout, as trainer_bench
                     .max_steps(cfg.warmup + cfg.steps)
                     .shard_optimizer_state(cfg.sharded)
                     .shard_params(cfg.zero == 3)
                     .offload_params_dir(cfg.offload_dir)
                     .offload_params_host(cfg.offload_host)
                     .keep_gathered(cfg.keep_gathered)
                     .gather_half(cfg.gather_half)
                     .param_gather(cfg.param_gather == "allgather" ? memopt::dist::ParamGather::kAllgather
                                                                   : memopt::dist::ParamGather::kBroadcast)
                     .bucket_mib(cfg.bucket_mib)
                     .handle_signals(false)
                     .log_interval(1 << 30);
  memopt::Trainer<Recompute, Precision, memopt::accum::Runtime> trainer(*model, options);
  RandomWindowLoader global(std::move(shard), memopt::data::LoaderOptions(cfg.micro, cfg.seq).seed(cfg.seed));
  RankSlice<RandomWindowLoader> loader(global, world.rank(), world.size());  // world of one: every row
  auto loss_fn = [&model](const memopt::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); };
  auto& tracker = memopt::memory::Tracker::instance();

  std::vector<torch::Tensor> params;
  for (const auto& p : model->parameters())
    if (p.requires_grad()) params.push_back(p);
  const int64_t extra_copies = cfg.sharded ? world.size() : 1;
  const int64_t bucket_bytes =
      world.distributed() ? first_bucket_bytes(params, options.bucket_mib() << 20, extra_copies) : 0;

  RankResult r;
  world.barrier();
  const int64_t live_before = tracker.live_bytes();
  tracker.reset_peaks();
  memopt::memory::reset_cuda_peaks();
  size_t events_per_step = 0;  // the timeline's capacity for one timed step
  int64_t profiled = 0;
  CpuTimes cpu_start;
  auto timed_start = Clock::now();
  for (int64_t s = 0; s < cfg.warmup + cfg.steps; ++s) {
    if (s == cfg.warmup) {
      cpu_start = CpuTimes::now();
      timed_start = Clock::now();
    }
    const auto counts = tracker.snapshot();
    if (s >= cfg.warmup) tracker.start_timeline(events_per_step);  // a ring per step, sized to one
    const auto start = Clock::now();
    const double loss = trainer.step(loader, loss_fn).loss.template item<double>();
    const auto end = Clock::now();
    const double seconds = std::chrono::duration<double>(end - start).count();
    if (s >= cfg.warmup) {
      tracker.stop_timeline();
      uint64_t recorded = 0;
      const auto events = tracker.timeline(&recorded);
      const int64_t start_ns = start.time_since_epoch().count(), end_ns = end.time_since_epoch().count();
      if (recorded <= events.size() && add_phases(events, start_ns, end_ns, bucket_bytes, r.phase_ms))
        ++profiled;
    }
    if (s == 0) {
      const auto after = tracker.snapshot();
      events_per_step =
          static_cast<size_t>(2 * (after.allocations - counts.allocations + after.frees - counts.frees) + 4096);
      // The state the first step created. Gloo's worker threads drop their last work objects
      // (which hold the step's communication buffers) a moment after the collective completes:
      // a barrier, then 200 ms, before reading (outside every timed step).
      world.barrier();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      r.state_tracked_bytes = tracker.live_bytes() - live_before;
      if (const auto cuda = memopt::memory::CudaMemory::now(); !cuda.empty()) r.cuda_between_steps = cuda.front().allocated_bytes;
    }
    r.losses.push_back(loss);
    if (s >= cfg.warmup) r.step_seconds.push_back(seconds);
    if (world.rank() == 0)
      std::cerr << "  " << cfg.name() << " rank 0 of " << world.size() << " step " << s
                << (s < cfg.warmup ? " (warm-up)" : "") << ": loss " << loss << ", " << seconds * 1e3 << " ms\n";
  }
  for (const auto& [key, state] : trainer.optimizer().state()) {
    if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      r.state_tensor_bytes += static_cast<int64_t>(adamw->exp_avg().nbytes() + adamw->exp_avg_sq().nbytes());
      if (adamw->max_exp_avg_sq().defined())
        r.state_tensor_bytes += static_cast<int64_t>(adamw->max_exp_avg_sq().nbytes());
    }
  }
  const auto peaks = tracker.snapshot();
  r.model_state_bytes =
      peaks.phase_peak_bytes[static_cast<int>(memopt::memory::Phase::kOptimizer)] - before_model;
  r.peak_tracked_bytes = peaks.peak_bytes - before_model;
  if (const auto cuda = memopt::memory::CudaMemory::now(); !cuda.empty()) r.cuda_peak = cuda.front().peak_allocated_bytes;
  const CpuTimes cpu_end = CpuTimes::now();
  r.timed_seconds = std::chrono::duration<double>(Clock::now() - timed_start).count();
  r.cpu_timed = {cpu_end.machine - cpu_start.machine, cpu_end.self - cpu_start.self};
  for (auto& [phase, ms] : r.phase_ms) ms /= static_cast<double>(std::max<int64_t>(profiled, 1));
  if (profiled < cfg.steps) std::cerr << "  (phases from " << profiled << " of " << cfg.steps << " timed steps)\n";
  if (cfg.zero != 3) time_collectives(cfg, world, *model, options, r);  // ZeRO-3's are per block, in the step
  return r;
}

/// Each rank's value of `x`, in rank order (an all-gather; one rank: {x}).
std::vector<double> gather(memopt::dist::World& world, double x) {
  std::vector<double> out;
  for (const auto& t : world.all_gather(torch::full({1}, x, torch::kDouble), "bench: results"))
    out.push_back(t.item<double>());
  return out;
}

nlohmann::ordered_json measure(const BenchConfig& cfg) {
  auto& world = memopt::dist::world();
  TORCH_CHECK(cfg.micro % world.size() == 0, "memopt_bench_dist: --micro ", cfg.micro,
              " rows do not split evenly over ", world.size(), " ranks. HINT: use a multiple of WORLD_SIZE");
  auto shard =
      cfg.data.empty() ? random_tokens(1 << 20, cfg.vocab, cfg.seed) : memopt::data::TokenShard::open(cfg.data);
  TORCH_CHECK(shard->vocab_size() <= cfg.vocab, "memopt_bench_dist: the shard '", cfg.data, "' has vocab ",
              shard->vocab_size(), ", more than --vocab ", cfg.vocab, ". HINT: pass --vocab ", shard->vocab_size());
  torch::manual_seed(static_cast<int64_t>(cfg.seed));
  const int64_t before_model = memopt::memory::Tracker::instance().live_bytes();
  auto config = memopt::bench::llama_config(cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq);
  config.attention_kind(memopt::nn::parse_attention_kind(cfg.attention, "memopt_bench_dist: --attention"));
  config.fused_kernels(cfg.fused_kernels);
  memopt::models::Llama model(config);
  model->train();
  const torch::Device device(cfg.device == "cuda" ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(
                                                                     world.local_rank()))
                                                  : torch::Device(torch::kCPU));
  model->to(device);  // the Trainer follows the parameters: the batches go there

  const RankResult r = memopt::bench::with_policies(cfg.precision, cfg.recompute, [&]<class C, class P>() {
    return run<C, P>(cfg, world, model, shard, before_model);
  });

  double total = 0;
  for (double s : r.step_seconds) total += s;
  const double step_s = total / static_cast<double>(r.step_seconds.size());
  const double min_s = *std::min_element(r.step_seconds.begin(), r.step_seconds.end());
  std::vector<double> step_ms_all;
  for (double t : r.step_seconds) step_ms_all.push_back(t * 1e3);
  const auto tracked = gather(world, static_cast<double>(r.state_tracked_bytes));
  const auto tensors = gather(world, static_cast<double>(r.state_tensor_bytes));
  const auto rss = gather(world, static_cast<double>(memopt::memory::peak_rss_bytes()));
  const auto model_state = gather(world, static_cast<double>(r.model_state_bytes));
  const auto peak_tracked = gather(world, static_cast<double>(r.peak_tracked_bytes));
  const auto step_ms_ranks = gather(world, step_s * 1e3);
  double own_cpu = 0;  // every rank's CPU seconds over the timed steps (one machine: ranks on loopback)
  for (double c : gather(world, r.cpu_timed.self)) own_cpu += c;
  const auto compute_ms_ranks =
      gather(world, r.phase_ms.count("forward_backward") ? r.phase_ms.at("forward_backward") : 0.0);
  auto mib_each = [](const std::vector<double>& bytes) {
    std::vector<double> out;
    for (double b : bytes) out.push_back(b / (1 << 20));
    return out;
  };
  auto max_of = [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
  nlohmann::ordered_json phases = nlohmann::ordered_json::object();
  for (const char* key : {"before_forward", "forward_backward", "grad_sync", "optimizer", "after"})
    if (r.phase_ms.count(key)) phases[key] = r.phase_ms.at(key);
  nlohmann::ordered_json line{
      {"suite", "dist"},
      {"name", cfg.name()},
      {"impl", "memopt"},
      {"ranks", world.size()},
      {"threads_per_rank", at::get_num_threads()},
      {"sharded", cfg.sharded && world.distributed()},
      {"zero", cfg.zero == 3 ? 3 : cfg.sharded && world.distributed() ? 1 : 0},  // ZeRO-3 runs alone too (offload)
      {"offload_params", cfg.offload_host ? "host" : cfg.offload_dir.empty() ? "none" : "disk"},
      {"keep_gathered", cfg.keep_gathered},
      {"gather_half", cfg.gather_half},
      {"device", cfg.device},
      // the CUDA caching allocator (rank 0's GPU): tensors held after the first step, and the peak of all steps
      {"cuda_between_steps_mib", cfg.device == "cuda" ? nlohmann::json(r.cuda_between_steps / double(1 << 20)) : nullptr},
      {"cuda_peak_mib", cfg.device == "cuda" ? nlohmann::json(r.cuda_peak / double(1 << 20)) : nullptr},
      {"param_gather", cfg.sharded && world.distributed() ? nlohmann::json(cfg.param_gather) : nlohmann::json()},
      {"tokens_per_s", static_cast<double>(cfg.tokens_per_step()) / step_s},
      {"step_ms", step_s * 1e3},
      {"step_ms_min", min_s * 1e3},
      {"step_ms_median", median_ms(r.step_seconds)},
      {"step_ms_all", step_ms_all},  // each timed step, in order (scripts/bench pools repeated runs)
      {"step_ms_per_rank", step_ms_ranks},
      // the tracker's live bytes added by the first step, measured after a barrier: the largest rank's
      {"optimizer_state_mib_per_rank", max_of(tracked) / (1 << 20)},
      {"optimizer_state_mib_ranks", mib_each(tracked)},
      // the same from the AdamW state tensors' nbytes (exp_avg + exp_avg_sq), for cross-checking
      {"optimizer_state_tensor_mib_ranks", mib_each(tensors)},
      {"loss_first", r.losses.front()},
      {"loss_last", r.losses.back()},
      {"losses", r.losses},
      {"peak_rss_mib", max_of(rss) / (1 << 20)},
      {"model_state_mib_per_rank", max_of(model_state) / (1 << 20)},  // params, grads, state at the step
      {"model_state_mib_ranks", mib_each(model_state)},
      {"peak_tracked_mib", max_of(peak_tracked) / (1 << 20)},
      {"peak_tracked_mib_ranks", mib_each(peak_tracked)},
      // CPUs kept busy by other processes during the timed steps, on average (0: the machine was
      // ours; load_avg_1m counts the ranks themselves): the machine's busy CPU time less the ranks'
      {"other_cpus_busy", std::max(0.0, (r.cpu_timed.machine - own_cpu) / r.timed_seconds)},
      {"ranks_cpus_busy", own_cpu / r.timed_seconds},
      {"peak_rss_mib_ranks", mib_each(rss)},
      {"phase_ms", phases},  // rank 0's timed steps, mean
      {"forward_backward_ms_ranks", compute_ms_ranks},  // each rank's phase_ms.forward_backward
      {"grad_sync_ms", r.grad_sync_ms},
      {"grad_buckets", r.grad_buckets},
      {"bucket_mib", cfg.bucket_mib},
      {"count_sync_ms", r.count_sync_ms},
      {"param_share_ms", r.param_share_ms},
      {"params_m", memopt::bench::params_m(*model)},
      {"global_micro", cfg.micro},
      {"micro_per_rank", cfg.micro / world.size()},
      {"accum", cfg.accum},
      {"seq", cfg.seq},
      {"layers", cfg.layers},
      {"dim", cfg.dim},
      {"heads", cfg.heads},
      {"vocab", cfg.vocab},
      {"steps", cfg.steps},
      {"warmup", cfg.warmup},
      {"precision", cfg.precision},
      {"recompute", cfg.recompute},
      {"attention", cfg.attention},
      {"fused_kernels", cfg.fused_kernels},
      {"data", cfg.data.empty() ? std::string("lcg") : cfg.data},
  };
  memopt::dist::shutdown();  // a last barrier: no rank leaves while another still gathers
  return line;
}

}  // namespace

int main(int argc, char** argv) {
  BenchConfig cfg;
  CLI::App app{"memopt_bench_dist: data-parallel training on a LLaMA, one process per rank; rank 0 prints a JSON line"};
  memopt::bench::add_shape_options(app, cfg);
  app.add_option("--micro", cfg.micro, "rows per global micro-batch (each rank trains on micro / WORLD_SIZE)")
      ->check(CLI::PositiveNumber);
  app.add_option("--accum", cfg.accum, "micro-batches per optimizer step")->check(CLI::PositiveNumber);
  app.add_option("--vocab", cfg.vocab, "vocabulary size")->check(CLI::PositiveNumber);
  app.add_option("--steps", cfg.steps, "timed optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", cfg.warmup, "untimed optimizer steps first (>= 1: the first measures the state)")
      ->check(CLI::PositiveNumber);
  app.add_option("--seed", cfg.seed, "seed of the weights and of the batches");
  app.add_option("--threads", cfg.threads, "intra-op threads per rank")->check(CLI::PositiveNumber);
  memopt::bench::add_policy_options(app, cfg);
  app.add_option("--data", cfg.data, "token shard to train on (empty: random tokens)");
  app.add_flag("--sharded", cfg.sharded, "ZeRO-1: shard the optimizer state over the ranks");
  app.add_option("--zero", cfg.zero, "ZeRO stage: 0 (replicated), 1 (optimizer state), 3 (parameters too)")
      ->check(CLI::IsMember({0, 1, 3}));
  app.add_option("--offload_dir", cfg.offload_dir, "--zero 3: keep the parameter shards in a file in this folder");
  app.add_flag("--offload_host", cfg.offload_host, "--zero 3 --device cuda: keep the parameter shards, their state and "
               "the optimizer step in pinned host memory");
  app.add_flag("--keep_gathered", cfg.keep_gathered, "--zero 3: keep each block whole from its first use in a step "
               "to the step's end");
  app.add_flag("--gather_half", cfg.gather_half, "--zero 3 --precision bf16: all-gather the blocks' matrices in bf16");
  app.add_option("--device", cfg.device, "cpu, or cuda (rank r on cuda:LOCAL_RANK)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--param_gather", cfg.param_gather, "how a sharded step shares the parameters")
      ->check(CLI::IsMember({"broadcast", "allgather"}));
  app.add_option("--attention", cfg.attention, "math | blockwise | sdpa | auto (measured per rank: the ranks may "
                 "differ)")->capture_default_str();
  app.add_option("--fused_kernels", cfg.fused_kernels, "RMSNorm, RoPE and SwiGLU as nn/fused.hpp's kernels (false: "
                 "the ATen composites)")->capture_default_str();
  app.add_option("--bucket_mib", cfg.bucket_mib, "gradient all-reduce bucket size (MiB)")->check(CLI::PositiveNumber);
  app.add_option("--comm_reps", cfg.comm_reps, "times each collective is timed alone after training")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  cfg.sharded = cfg.sharded || cfg.zero == 1;
  memopt::init(memopt::RuntimeOptions().threads(cfg.threads));

  const char* rank = std::getenv("RANK");
  if (rank != nullptr && *rank != '\0' && std::string(rank) != "0") {  // the other ranks measure, rank 0 prints
    return memopt::guarded_main([&] {
      measure(cfg);
      return 0;
    });
  }
  return memopt::bench::print_line([&] { return measure(cfg); });
}
