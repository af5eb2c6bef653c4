// memopt/planner.hpp — choose the policies at run time, run them compiled (the chosen
// Trainer instantiation is reached through dispatch.hpp). plan()
// picks, among the compiled combinations, the fastest one whose estimated peak
// (memory/estimator.hpp) fits a memory budget, with the largest micro-batch that fits
// (accumulation adjusted to keep the effective batch). plan_gritlm() does the same for a
// GritLM step, whose lever is GradCache's chunk; plan_calibrated() corrects either by
// measuring the choice's real step (probe_steps()) until a choice measured to fit stays.
//
//   using Trainers = memopt::StandardTrainers;                      // 4 × 4 × 3 instantiations
//   auto p = memopt::plan(desc, seq_len, memopt::candidates<Trainers>(),
//                         memopt::PlanOptions().budget_bytes(4LL << 30).effective_batch(32));
//   memopt::dispatch<Trainers>(p.chosen.policies, [&]<class T>(std::type_identity<T>) {
//     T trainer(*model, options.accum_steps(p.chosen.policies.accum));   // micro-batch: p.chosen.micro_batch
//     trainer.fit(loader, loss_fn);                                      // T::name() says which ran
//   });
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "memopt/dispatch.hpp"
#include "memopt/machine.hpp"
#include "memopt/memory/estimator.hpp"
#include "memopt/trainer.hpp"

namespace memopt {

/// The cost model's machine: how fast a training step's matmuls run (elementwise work
/// included, as seen at the step level), how many rows a matmul needs to run at half that
/// speed, how fast it streams memory and reads the disk. from_device() fills it for the CPU
/// this runs on (or a CUDA device); the figures rank candidates, so their ratios matter more
/// than their absolute values. The CPU figures were fitted to `scripts/bench planner` on this
/// project's machine (2 cores, avx512_bf16 without AMX, memopt's default allocator settings):
/// bf16 steps ran 2.0× faster than fp32, micro-batch 1 (256 rows) 1.2× slower than 8.
struct MachineModel {
  TORCH_ARG(double, matmul_flops_per_s) = 1.2e11;  // fp32, at the step level (OpenBLAS peak on 2 cores: ~300 GFLOP/s)
  TORCH_ARG(double, bf16_speedup) = 2.0;           // bf16 step speed / fp32 (avx512_bf16: 2.0 measured; AMX: more)
  TORCH_ARG(double, half_speed_rows) = 64;         // rows (tokens) per matmul at which it runs at half speed
  TORCH_ARG(bool, cuda) = false;                   // the parameters live on a CUDA device
  TORCH_ARG(double, memory_bytes_per_s) = 1e10;    // elementwise work: the optimizer step
  TORCH_ARG(double, disk_bytes_per_s) = 1e9;       // state::Disk's state streaming
  TORCH_ARG(double, host_bytes_per_s) = 2e10;      // host ↔ device copies (state::PinnedHost)
  TORCH_ARG(double, network_bytes_per_s) = 1e9;    // bytes a rank receives per second in a collective (Gloo, loopback)

 public:
  static MachineModel from_device(const c10::Device& device) {
    MachineModel m;
    if (device.is_cuda()) return m.matmul_flops_per_s(5e13).bf16_speedup(2.0).half_speed_rows(2048).cuda(true)
                                  .memory_bytes_per_s(1e12).network_bytes_per_s(1e11);
    // Measured on this machine (machine::matmul_speed(), once per process), never assumed: bf16
    // matmuls run 0.03x (AVX2-only) to ~5x (AMX) fp32 on the CPUs seen so far. The step runs
    // at ~0.4 of the GEMM peak (the cost model's fit: 1.2e11 step-level vs ~300 GFLOP/s).
    const auto& speed = machine::matmul_speed();
    return m.matmul_flops_per_s(0.4 * speed.fp32_gflops * 1e9).bf16_speedup(speed.bf16_over_fp32());
  }
};

/// What plan() weighs: a budget for the step's tensor peak and the effective batch to keep.
struct PlanOptions {
  TORCH_ARG(int64_t, budget_bytes) = 0;     // 0: no limit (the fastest candidate wins)
  TORCH_ARG(int64_t, effective_batch) = 1;  // sequences per optimizer step: micro-batch × accum
  TORCH_ARG(MachineModel, machine) = {};
  /// The run's TrainerOptions::grad_clip: optimizer-state policies that step inside backward need 0.
  TORCH_ARG(double, grad_clip) = 1.0;
  /// Measured / predicted peak of one real step, when one was measured (1: trust the estimate).
  TORCH_ARG(double, calibration) = 1.0;
  /// Data-parallel ranks: with more than one, each candidate is also weighed at ZeRO-1 and
  /// ZeRO-3 (one rank's peak; the step's collectives in its time), and effective_batch is each
  /// rank's share of the step's sequences.
  TORCH_ARG(int64_t, ranks) = 1;
  /// With ranks > 1: the ZeRO stages weighed (0, 1, 3; empty: all three).
  TORCH_ARG(std::vector<int>, zero_stages) = {};
};

/// One candidate as plan() judged it.
struct PlanRow {
  memory::PolicyDesc policies;  // accum = effective_batch / micro_batch
  int64_t micro_batch = 0;      // the largest that fits (0: none fits, or it cannot run here)
  int zero = 0;                 // PlanOptions::ranks > 1: the ZeRO stage (0, 1: shard_optimizer_state, 3: shard_params)
  int64_t chunk = -1;           // plan_gritlm(): accum::GradCache rows per chunk (0: one graph); -1: not GritLM
  memory::Estimate estimate;    // at micro_batch (at 1 when none fits), as the estimator predicts it
  int64_t peak = 0;             // the peak plan() weighed: estimate.peak × PlanOptions::calibration
  double seconds = 0;           // the cost model's step time
  std::string verdict;          // "fits", "over budget: needs 612 MiB at micro-batch 1", "cannot run: needs CUDA …"
  bool fits() const { return micro_batch > 0; }
  /// "micro 8" or, for GritLM, "chunk 8" / "one graph".
  std::string shape() const {
    if (chunk < 0) return fmt::format("micro {:>3}", micro_batch);
    return chunk == 0 ? std::string("one graph") : fmt::format("chunk {:>3}", chunk);
  }
  bool same_choice(const PlanRow& o) const {
    return policies == o.policies && micro_batch == o.micro_batch && chunk == o.chunk && zero == o.zero;
  }
  /// The policies' name, with the ZeRO stage when there is one.
  std::string name() const { return policies.name() + (zero > 0 ? fmt::format(" + ZeRO-{}", zero) : ""); }
};

/// plan()'s answer: the chosen row and every row considered.
struct Plan {
  PlanRow chosen;
  std::vector<PlanRow> rows;
  int64_t budget_bytes = 0;
  double calibration = 1.0;   // measured / predicted peak the rows were weighed with
  int64_t measured_peak = 0;  // plan_calibrated(): the chosen row's measured step peak (0: not measured)
  int measured_steps = 0;     // plan_calibrated(): choices measured

  /// Why: the fastest `max_rows` fitting candidates (chosen first, marked *), the count of
  /// the others, then the choice.
  std::string explain(int64_t max_rows = 8) const {
    std::string out = fmt::format("plan: {} candidates, budget {}\n", rows.size(),
                                  budget_bytes > 0 ? fmt::format("{:.1f} MiB", memory::mib(budget_bytes)) : "none");
    int64_t shown = 0, more_fit = 0, over = 0, elsewhere = 0;
    for (const auto& r : rows) {
      if (r.fits() && shown < max_rows) {
        out += fmt::format("  {} {:<62} {:>9}  peak {:8.1f} MiB  {:7.3f} s/step\n", &r == &rows.front() ? "*" : " ",
                           r.name(), r.shape(), memory::mib(r.peak), r.seconds);
        ++shown;
      } else if (r.fits()) {
        ++more_fit;
      } else if (r.verdict.starts_with("over budget")) {
        ++over;
      } else {
        ++elsewhere;
      }
    }
    out += fmt::format("  ({} more fit, slower; {} over budget even at the smallest size; {} cannot run here)\n",
                       more_fit, over, elsewhere);
    if (measured_steps > 0)
      out += fmt::format("calibrated: {} choice(s) measured by a real step; the chosen one peaked at {:.1f} MiB "
                         "(estimate {:.1f} MiB, factor {:.3f})\n",
                         measured_steps, memory::mib(measured_peak), memory::mib(chosen.estimate.peak), calibration);
    out += fmt::format("chose {} ({}): the fastest by the cost model of those that fit\n", chosen.name(),
                       chosen.shape());
    return out;
  }
};

namespace detail {
// The matmul seconds of `tokens` tokens through graphs of `rows` sequences of `seq_len`:
// `passes` forward passes (the backward counts as two), what the recompute policy recomputes,
// the LM head only when `head`; matmuls of few rows run below peak (efficiency
// rows × T / (rows × T + machine.half_speed_rows())).
inline double matmul_seconds(const memory::ModelDesc& m, int64_t seq_len, int64_t rows, double tokens, double passes,
                             bool head, const memory::PolicyDesc& p, const MachineModel& machine) {
  const double T = static_cast<double>(seq_len), C = static_cast<double>(m.hidden_size);
  const double head_flops = 2 * C * static_cast<double>(m.vocab_size);
  const double blocks = m.forward_flops_per_token(seq_len) - head_flops;
  int64_t whole = 0;  // blocks recomputed whole
  for (int64_t i = 0; i < m.num_layers; ++i) whole += p.recompute.whole_block(i, m.num_layers) ? 1 : 0;
  double recompute = blocks * static_cast<double>(whole) / static_cast<double>(m.num_layers);
  if (p.recompute.cheap_parts) recompute += static_cast<double>(m.num_layers) * 4 * T * C;
  const double speed = machine.matmul_flops_per_s() * (p.precision.half_matmuls ? machine.bf16_speedup() : 1.0);
  const double graph_rows = static_cast<double>(rows) * T;
  const double efficiency = graph_rows / (graph_rows + machine.half_speed_rows());
  return tokens * (passes * (blocks + (head ? head_flops : 0)) + recompute) / (speed * efficiency);
}

// The optimizer step: the optimizer-state policy's memory traffic (AdamW 28 B/param, 8-bit AdamW 40
// with its (de)quantisation), plus what it moves to and from disk or over the host link.
inline double optimizer_seconds(const memory::ModelDesc& m, const memory::PolicyDesc& p, const MachineModel& machine) {
  double P = 0;  // what the optimizer steps (LoRA: the adapters)
  for (int64_t n : m.trainable_numels()) P += static_cast<double>(n);
  const auto& o = p.state;
  return P * (o.step_bytes_per_param / machine.memory_bytes_per_s() + o.disk_bytes_per_param / machine.disk_bytes_per_s() +
              o.host_bytes_per_param / machine.host_bytes_per_s());
}

// The collectives of a step, per rank (docs/distributed.md), for P trainable parameters of which
// R in the root (embedding, head, final norm), M micro-batches, N ranks, w bytes per weight:
// DDP all-reduces the fp32 gradients once, 2(N-1)/N 4P; ZeRO-1 sends each to its owner and
// shares the stepped weights, (N-1)/N (4 + w) P; ZeRO-3 gathers each block twice and
// reduce-scatters it per micro-batch and the root once each per step, (N-1)/N ((2w + 4) M (P - R)
// + (w + 4) R).
inline double comm_seconds(const memory::ModelDesc& m, const memory::PolicyDesc& p, int zero, int64_t ranks,
                           const MachineModel& machine) {
  if (ranks <= 1) return 0;
  double P = 0;
  for (int64_t n : m.trainable_numels()) P += static_cast<double>(n);
  const double C = static_cast<double>(m.hidden_size), V = static_cast<double>(m.vocab_size);
  const double R = m.lora() ? 0 : V * C * (m.tied_embeddings ? 1 : 2) + C;
  const double N = static_cast<double>(ranks), w = p.precision.half_weights ? 2 : 4;
  const double M = static_cast<double>(p.accum);
  const double bytes = zero == 3   ? (N - 1) / N * ((2 * w + 4) * M * (P - R) + (w + 4) * R)
                       : zero == 1 ? (N - 1) / N * (4 + w) * P
                                   : 2 * (N - 1) / N * 4 * P;
  return bytes / machine.network_bytes_per_s();
}

// Why a candidate cannot run on this machine with these options, or "" when it can.
inline std::string cannot_run(const memory::PolicyDesc& p, const PlanOptions& options) {
  const bool cuda = options.machine().cuda();
  if (p.precision.needs_cuda && !cuda) return fmt::format("cannot run: needs CUDA (precision {})", p.precision.flag);
  if (p.state.needs_cuda && !cuda) return fmt::format("cannot run: needs CUDA parameters (optimizer state {})", p.state.flag);
  if (p.state.needs_cpu && cuda) return fmt::format("cannot run: needs CPU parameters (optimizer state {})", p.state.flag);
  if (p.state.steps_in_backward && options.grad_clip() > 0)
    return fmt::format("cannot run: optimizer state {} steps inside backward, so it cannot clip (needs --grad_clip 0)",
                       p.state.flag);
  if (p.state.steps_in_backward && options.ranks() > 1)
    return fmt::format("cannot run: optimizer state {} steps inside backward, before the gradients are summed over "
                       "the ranks", p.state.flag);
  return "";
}

// Fitting rows first, fastest first; the rest after, smallest need first. The fastest fitting
// row is chosen; none fitting throws, naming the budget, the smallest need and its candidate.
inline Plan choose_fastest(std::vector<PlanRow> rows, const PlanOptions& options, std::string_view smallest) {
  std::stable_sort(rows.begin(), rows.end(), [](const PlanRow& a, const PlanRow& b) {
    if (a.fits() != b.fits()) return a.fits();
    if (a.fits()) return a.seconds < b.seconds;
    return a.peak < b.peak;
  });
  const PlanRow* need = nullptr;
  for (const auto& r : rows)
    if (!r.fits() && r.verdict.starts_with("over budget") && (need == nullptr || r.peak < need->peak)) need = &r;
  TORCH_CHECK(!rows.empty() && rows.front().fits(), "memopt::plan: no policy combination fits the memory budget of ",
              memory::mib(options.budget_bytes()), " MiB: the smallest need is ",
              need ? memory::mib(need->peak) : 0.0, " MiB (", need ? need->policies.name() : "none", ", ", smallest,
              "). HINT: raise --memory_budget, shorten the sequences or use a smaller model.");
  Plan result;
  result.budget_bytes = options.budget_bytes();
  result.calibration = options.calibration();
  result.chosen = rows.front();
  result.rows = std::move(rows);
  return result;
}

inline void check_plan_options(const std::vector<memory::PolicyDesc>& candidates, const PlanOptions& options) {
  TORCH_CHECK(!candidates.empty(), "memopt::plan: no candidate policy combinations. HINT: pass "
                                   "memopt::candidates<memopt::StandardTrainers>().");
  TORCH_CHECK(options.effective_batch() >= 1, "memopt::plan: effective_batch must be >= 1 (got ",
              options.effective_batch(), ").");
  TORCH_CHECK(options.budget_bytes() >= 0 && options.calibration() > 0, "memopt::plan: budget_bytes must be >= 0 and "
              "calibration > 0 (got ", options.budget_bytes(), " and ", options.calibration(), ").");
  TORCH_CHECK(options.ranks() >= 1, "memopt::plan: ranks must be >= 1 (got ", options.ranks(),
              "). HINT: pass dist::world().size()");
  for (const int zero : options.zero_stages())
    TORCH_CHECK(zero == 0 || zero == 1 || zero == 3, "memopt::plan: zero_stages holds ", zero, ", not a ZeRO stage. "
                "HINT: 0 (replicated), 1 (optimizer state sharded) or 3 (parameters too)");
}
}  // namespace detail

/// The cost model: a step's time is its matmul FLOPs (forward, backward = 2 × forward, plus
/// what the recompute policy recomputes) at the precision's matmul speed, slowed by small
/// micro-batches (efficiency rows / (rows + half_speed_rows): matmuls of few rows run below
/// peak), plus the
/// optimizer step's memory traffic (AdamW 28 B/param, 8-bit AdamW 40 B/param with its
/// (de)quantisation, disk: AdamW plus 16 B/param read and written). A LoRA model's frozen
/// weights take no weight gradient: its backward is one forward's FLOPs, not two.
inline double step_seconds(const memory::ModelDesc& m, int64_t seq_len, int64_t micro_batch,
                           const memory::PolicyDesc& p, const MachineModel& machine) {
  const double tokens = static_cast<double>(micro_batch * p.accum * seq_len);
  return detail::matmul_seconds(m, seq_len, micro_batch, tokens, m.lora() ? 2 : 3, true, p, machine) +
         detail::optimizer_seconds(m, p, machine);
}

namespace detail {
// One candidate at ZeRO stage `zero`, at the largest micro-batch that fits, or why not. ZeRO-3
// recomputes every block whatever the policy (dist::Zero3), which its step time counts.
inline PlanRow plan_row(const memory::ModelDesc& m, int64_t seq_len, const memory::PolicyDesc& policies, int zero,
                        const PlanOptions& options) {
  const int64_t E = options.effective_batch();
  PlanRow row;
  row.policies = policies;
  row.zero = zero;
  row.verdict = cannot_run(policies, options);
  if (!row.verdict.empty()) return row;
  // The largest micro-batch dividing E that fits (one of E when the type fixes the count or
  // the state steps in backward, which allows no accumulation).
  const int64_t fixed = policies.state.steps_in_backward ? 1 : policies.split.fixed_steps;
  for (int64_t micro = E; micro >= 1; --micro) {
    if (E % micro != 0 || (fixed > 0 && E / micro != fixed)) continue;
    row.policies.accum = E / micro;
    memory::RunDesc run{micro, seq_len};
    run.ranks = options.ranks();
    run.zero = zero;
    row.estimate = memory::estimate(m, run, row.policies);
    row.peak = static_cast<int64_t>(static_cast<double>(row.estimate.peak) * options.calibration());
    if (options.budget_bytes() == 0 || row.peak <= options.budget_bytes()) {
      row.micro_batch = micro;
      break;
    }
  }
  if (row.fits()) {
    auto timed = row.policies;
    if (zero == 3) timed.recompute.whole_block = [](int64_t, int64_t) { return true; };
    const double unsharded = zero >= 1 ? 1 - 1 / static_cast<double>(options.ranks()) : 0;  // of the optimizer's work
    row.seconds = step_seconds(m, seq_len, row.micro_batch, timed, options.machine()) -
                  unsharded * optimizer_seconds(m, timed, options.machine()) +
                  comm_seconds(m, timed, zero, options.ranks(), options.machine());
  }
  row.verdict = row.fits() ? "fits"
                : row.peak > 0 ? fmt::format("over budget: needs {:.1f} MiB at micro-batch {}", memory::mib(row.peak),
                                             E / row.policies.accum)
                               : fmt::format("cannot run: its {} micro-batch(es) per step do not divide the effective "
                                             "batch {}", fixed, E);
  return row;
}

// plan()'s rows, unsorted: each candidate at the largest micro-batch that fits, or why not.
inline std::vector<PlanRow> plan_rows(const memory::ModelDesc& m, int64_t seq_len,
                                      const std::vector<memory::PolicyDesc>& candidates, const PlanOptions& options) {
  check_plan_options(candidates, options);
  std::vector<PlanRow> rows;
  const std::vector<int> stages = options.ranks() <= 1             ? std::vector<int>{0}
                                  : options.zero_stages().empty() ? std::vector<int>{0, 1, 3}
                                                                  : options.zero_stages();
  for (const auto& candidate : candidates)
    for (const int zero : stages) rows.push_back(plan_row(m, seq_len, candidate, zero, options));
  return rows;
}
}  // namespace detail

/// Picks, among `candidates` (their policy types; accum is chosen here), the fastest
/// combination whose predicted peak (× options.calibration()) fits options.budget_bytes(),
/// each at the largest micro-batch that divides the effective batch and fits (accum =
/// effective / micro). Throws, naming the budget and the smallest need, when none fits.
///   auto p = memopt::plan(desc, 256, candidates<memopt::StandardTrainers>(),
///                         memopt::PlanOptions().budget_bytes(4LL << 30).effective_batch(32));
inline Plan plan(const memory::ModelDesc& m, int64_t seq_len, const std::vector<memory::PolicyDesc>& candidates,
                 const PlanOptions& options) {
  return detail::choose_fastest(detail::plan_rows(m, seq_len, candidates, options), options, "micro-batch 1");
}

/// The GradCache chunks (rows per chunk) plan_gritlm() tries by default.
inline const std::vector<int64_t> kGradCacheChunks = {1, 2, 4, 8, 16, 32, 64, 128};

/// GritLM's plan: the batch is the loss (in-batch negatives), so it is never split into
/// micro-batches; the lever is the chunk of a candidate that caches gradients
/// (SplitDesc::grad_cache: accum::GradCache), tried at each of `chunks` rows below the batch's
/// embedding rows; other candidates run one graph (chunk 0). The fastest that fits by the
/// cost model wins, where GradCache adds the embedding parts' first forward pass without a
/// graph and small chunks run matmuls below peak. `run.chunk` is ignored; `run.queries` etc.
/// are the step's (maximum) shape.
inline Plan plan_gritlm(const memory::ModelDesc& m, const memory::GritRunDesc& run,
                        const std::vector<memory::PolicyDesc>& candidates, const PlanOptions& options,
                        std::vector<int64_t> chunks = kGradCacheChunks);

namespace detail {
// plan_gritlm()'s rows, unsorted.
inline std::vector<PlanRow> plan_gritlm_rows(const memory::ModelDesc& m, const memory::GritRunDesc& run,
                                             const std::vector<memory::PolicyDesc>& candidates,
                                             const PlanOptions& options, std::vector<int64_t> chunks) {
  check_plan_options(candidates, options);
  const int64_t embed_rows = run.queries * run.group_size;
  chunks.erase(std::remove_if(chunks.begin(), chunks.end(), [&](int64_t c) { return c < 1 || c >= embed_rows; }),
               chunks.end());
  std::vector<PlanRow> rows;
  for (const auto& policies : candidates) {
    for (const int64_t chunk : policies.split.grad_cache ? chunks : std::vector<int64_t>{0}) {
      PlanRow row;
      row.policies = policies;
      row.chunk = chunk;
      row.verdict = cannot_run(policies, options);
      if (row.verdict.empty()) {
        auto r = run;
        r.chunk = chunk;
        row.estimate = memory::estimate_gritlm(m, r, policies);
        row.peak = static_cast<int64_t>(static_cast<double>(row.estimate.peak) * options.calibration());
        const bool fits = options.budget_bytes() == 0 || row.peak <= options.budget_bytes();
        row.micro_batch = fits ? run.queries : 0;
        row.verdict = fits ? "fits" : fmt::format("over budget: needs {:.1f} MiB", memory::mib(row.peak));
        const double passes = chunk > 0 ? 4 : 3;  // GradCache: a forward without a graph first
        auto part = [&](int64_t part_rows, int64_t len, double p, bool head) {
          const int64_t graph_rows = chunk > 0 ? std::min(chunk, part_rows) : part_rows;
          return matmul_seconds(m, len, graph_rows, static_cast<double>(part_rows * len), p, head, policies,
                                options.machine());
        };
        row.seconds = part(run.queries, run.query_len, passes, false) +
                      part(embed_rows, run.passage_len, passes, false) +
                      (run.gen_rows > 0 ? part(run.gen_rows, run.gen_len, 3, true) : 0);
        row.seconds = static_cast<double>(policies.accum) * row.seconds +
                      optimizer_seconds(m, policies, options.machine());
      }
      rows.push_back(row);
    }
  }
  return rows;
}
}  // namespace detail

inline Plan plan_gritlm(const memory::ModelDesc& m, const memory::GritRunDesc& run,
                        const std::vector<memory::PolicyDesc>& candidates, const PlanOptions& options,
                        std::vector<int64_t> chunks) {
  return detail::choose_fastest(detail::plan_gritlm_rows(m, run, candidates, options, std::move(chunks)), options,
                                "the smallest chunk");
}

/// Measures a candidate: runs the row's policies at its micro-batch (or chunk) for a real step
/// and returns the tracker's peak, e.g. through memopt::measure_peak().
using MeasureStep = std::function<int64_t(const PlanRow&)>;

/// The tracker's peak while fn() runs (the window starts at the bytes live now).
template <class Fn>
int64_t measure_peak(Fn&& fn) {
  auto& tracker = memory::Tracker::instance();
  tracker.reset_peaks();
  fn();
  return tracker.snapshot().peak_bytes;
}

/// The usual MeasureStep: a real step of the row's Trainer (from `List`) on a throwaway model
/// of the run's shape (its weights do not change the memory). make_model() builds it,
/// make_loader(micro_batch) its batches, make_loss(model) the loss function (the run's own
/// loss type, so each Trainer's step is compiled once); one warm-up step creates the
/// optimizer state, the next one is measured.
template <class List, class MakeModel, class MakeLoader, class MakeLoss>
MeasureStep probe_steps(const TrainerOptions& options, MakeModel make_model, MakeLoader make_loader,
                        MakeLoss make_loss) {
  return [=](const PlanRow& row) {
    return dispatch<List>(row.policies, [&]<class T>(std::type_identity<T>) {
      auto model = make_model();
      T trainer(*model, TrainerOptions(options).accum_steps(row.policies.accum).data_parallel(false));  // this rank alone
      auto loader = make_loader(row.micro_batch);
      auto loss = make_loss(model);
      trainer.step(loader, loss);
      return measure_peak([&] { trainer.step(loader, loss); });
    });
  };
}

/// A plan corrected by measurement: `plan_with(options)` plans (plan() or plan_gritlm() bound
/// to the model); the choice is measured by a real step, and the plan redone with
/// calibration = measured / estimated peak until a choice measured to fit stays the choice
/// (at most `rounds` measured steps). A measured overrun moves to a smaller choice; an
/// overestimate lets a larger one in. Throws when no measured choice fits.
template <class PlanWith>
Plan plan_calibrated(PlanWith&& plan_with, PlanOptions options, const MeasureStep& measure, int rounds = 3) {
  Plan current = plan_with(options);
  std::optional<Plan> fitting;  // the last plan whose choice was measured within the budget
  int64_t last_measured = 0;
  for (int round = 1; round <= rounds; ++round) {
    last_measured = measure(current.chosen);
    TORCH_CHECK(last_measured > 0, "memopt::plan_calibrated: the measured step peak must be > 0 (got ",
                last_measured, "). HINT: measure with memopt::measure_peak around a real Trainer step.");
    const double factor = static_cast<double>(last_measured) / static_cast<double>(current.chosen.estimate.peak);
    current.measured_peak = last_measured;
    current.measured_steps = round;
    current.calibration = factor;
    const bool fits = options.budget_bytes() == 0 || last_measured <= options.budget_bytes();
    if (fits) fitting = current;
    Plan next;
    try {
      next = plan_with(options.calibration(factor));
    } catch (const c10::Error&) {  // nothing fits once calibrated: keep a measured fit if there is one
      break;
    }
    if (fits && next.chosen.same_choice(current.chosen)) return current;
    next.measured_steps = round;
    current = std::move(next);
  }
  TORCH_CHECK(fitting.has_value(), "memopt::plan_calibrated: no measured choice fits the memory budget of ",
              memory::mib(options.budget_bytes()), " MiB: the last one (", current.chosen.policies.name(), ", ",
              current.chosen.shape(), ") measured ", memory::mib(last_measured), " MiB. HINT: raise --memory_budget "
              "or shorten the sequences.");
  return *fitting;
}

/// What the examples' --policies / --memory_budget / --calibrate flags ask for: with
/// `automatic`, the plan over `candidates`; otherwise the micro-batch finder for the `fixed`
/// policies alone. With a `measure`, calibrated by measured steps. Prints the explanation and
/// returns the chosen row.
inline PlanRow choose_policies(const memory::ModelDesc& m, int64_t seq_len, const memory::PolicyDesc& fixed,
                               bool automatic, const std::vector<memory::PolicyDesc>& candidates,
                               const PlanOptions& options, const MeasureStep& measure = {}) {
  const auto considered = automatic ? candidates : std::vector<memory::PolicyDesc>{fixed};
  auto plan_with = [&](const PlanOptions& o) { return plan(m, seq_len, considered, o); };
  const Plan p = measure ? plan_calibrated(plan_with, options, measure) : plan_with(options);
  fmt::print("{}", p.explain());
  return p.chosen;
}

/// "4GiB", "512MiB", "1.5G", "800M", "1048576" → bytes; a bad value throws naming it.
inline int64_t parse_bytes(std::string_view text, std::string_view what = "--memory_budget") {
  const std::string s(text);
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = s.substr(used);
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "K" || unit == "KiB" || unit == "k") scale = 1024.0;
  else if (unit == "M" || unit == "MiB") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "KB") scale = 1e3;
  else if (unit == "MB") scale = 1e6;
  else if (unit == "GB") scale = 1e9;
  TORCH_CHECK(used > 0 && scale > 0 && value > 0, "memopt: ", what, " must be a positive size such as 4GiB, 512MiB "
              "or 1048576 (got '", text, "'). HINT: units are B, KiB, MiB, GiB (K, M, G) or KB, MB, GB.");
  return static_cast<int64_t>(value * scale);
}

}  // namespace memopt
