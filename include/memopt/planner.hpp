// memopt/planner.hpp — choose the policies at run time, run them compiled. A type list of
// Trainer instantiations is visited by index (runtime → compile-time dispatch): the policies
// stay template parameters, so the chosen loop has no runtime branch on a policy. plan()
// picks, among the compiled combinations, the fastest one whose estimated peak
// (memory/estimator.hpp) fits a memory budget, with the largest micro-batch that fits
// (accumulation adjusted to keep the effective batch).
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
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "memopt/memory/estimator.hpp"
#include "memopt/trainer.hpp"

namespace memopt {

template <class... Ts>
struct TypeList {
  static constexpr size_t size = sizeof...(Ts);
};

namespace detail {
template <class... Lists>
struct Concat;
template <class... A>
struct Concat<TypeList<A...>> {
  using type = TypeList<A...>;
};
template <class... A, class... B, class... Rest>
struct Concat<TypeList<A...>, TypeList<B...>, Rest...> {
  using type = typename Concat<TypeList<A..., B...>, Rest...>::type;
};

template <class C, class P, class Offloads>
struct RowOf;
template <class C, class P, class... O>
struct RowOf<C, P, TypeList<O...>> {
  using type = TypeList<Trainer<C, P, accum::Runtime, O>...>;
};
template <class C, class Precisions, class Offloads>
struct PlaneOf;
template <class C, class... P, class Offloads>
struct PlaneOf<C, TypeList<P...>, Offloads> {
  using type = typename Concat<TypeList<>, typename RowOf<C, P, Offloads>::type...>::type;
};
}  // namespace detail

/// Every Trainer<C, P, accum::Runtime, O> for C, P, O in the three lists (accumulation is a
/// run-time count: TrainerOptions::accum_steps).
template <class Checkpoints, class Precisions, class Offloads>
struct TrainerProduct;
template <class... C, class Precisions, class Offloads>
struct TrainerProduct<TypeList<C...>, Precisions, Offloads> {
  using type = typename detail::Concat<TypeList<>, typename detail::PlaneOf<C, Precisions, Offloads>::type...>::type;
};
template <class Checkpoints, class Precisions, class Offloads>
using TrainerProductT = typename TrainerProduct<Checkpoints, Precisions, Offloads>::type;

/// The combinations the --checkpoint/--precision/--offload flags name: 4 × 4 × 3 Trainers.
using StandardTrainers =
    TrainerProductT<TypeList<checkpoint::None, checkpoint::EveryBlock, checkpoint::EveryNth<2>, checkpoint::Selective>,
                    TypeList<precision::Fp32, precision::Bf16Autocast, precision::Bf16Pure, precision::Fp16Scaled>,
                    TypeList<offload::None, offload::Int8State, offload::Disk>>;

/// Checkpointing × bf16 autocast: the four combinations the examples with strategy flags
/// (moe_lm, llama_to_llada) compile, and plan over with --policies auto.
using CheckpointPrecisionTrainers =
    TrainerProductT<TypeList<checkpoint::None, checkpoint::EveryBlock>,
                    TypeList<precision::Fp32, precision::Bf16Autocast>, TypeList<offload::None>>;

/// Calls fn(std::type_identity<T>{}) with T the index-th type of the list; every call must
/// return the same type.
template <class List, class Fn>
decltype(auto) visit_type(size_t index, Fn&& fn);
template <class... Ts, class Fn>
decltype(auto) visit_type_in(TypeList<Ts...>, size_t index, Fn& fn) {
  static_assert(sizeof...(Ts) >= 1, "memopt::visit_type: the type list is empty");
  using First = std::tuple_element_t<0, std::tuple<Ts...>>;
  using R = decltype(fn(std::type_identity<First>{}));
  constexpr std::array<R (*)(Fn&), sizeof...(Ts)> table{+[](Fn& f) -> R { return f(std::type_identity<Ts>{}); }...};
  TORCH_CHECK(index < sizeof...(Ts), "memopt::visit_type: index ", index, " is outside the list of ", sizeof...(Ts),
              " types.");
  return table[index](fn);
}
template <class List, class Fn>
decltype(auto) visit_type(size_t index, Fn&& fn) {
  return visit_type_in(List{}, index, fn);
}

/// Each instantiation's policies, in list order (accum as given).
template <class List>
std::vector<memory::PolicyDesc> candidates(int64_t accum = 1) {
  std::vector<memory::PolicyDesc> out;
  [&]<class... Ts>(TypeList<Ts...>) { (out.push_back(memory::describe<Ts>(accum)), ...); }(List{});
  return out;
}

/// Each instantiation's name (Trainer::name()), in list order.
template <class List>
std::vector<std::string> trainer_names() {
  return []<class... Ts>(TypeList<Ts...>) { return std::vector<std::string>{Ts::name()...}; }(List{});
}

/// The index of the instantiation with `want`'s policy types; a combination the list does
/// not hold throws, naming it and what the list holds.
template <class List>
size_t index_of(const memory::PolicyDesc& want) {
  const auto all = candidates<List>();
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i].same_types(want)) return i;
  std::string held;
  for (const auto& d : all)
    held += fmt::format("\n  --checkpoint {} --precision {} --offload {}", d.checkpoint_flag(), d.precision_flag(),
                        d.offload_flag());
  TORCH_CHECK(false, "memopt::dispatch: no compiled Trainer has --checkpoint ", want.checkpoint_flag(),
              " --precision ", want.precision_flag(), " --offload ", want.offload_flag(),
              ". HINT: this program was built with:", held);
  return 0;
}

/// Runs fn(std::type_identity<T>{}) with T the list's Trainer whose policies are `choice`'s.
template <class List, class Fn>
decltype(auto) dispatch(const memory::PolicyDesc& choice, Fn&& fn) {
  return visit_type<List>(index_of<List>(choice), std::forward<Fn>(fn));
}

/// The cost model's machine: how fast it runs matmuls, streams memory and reads the disk.
/// from_device() fills it for the CPU this runs on (or a CUDA device); the figures only rank
/// candidates, so their ratios matter more than their absolute values.
struct MachineModel {
  TORCH_ARG(double, matmul_flops_per_s) = 2e11;  // fp32 matmuls (OpenBLAS on 2 cores: ~300 GFLOP/s peak)
  TORCH_ARG(double, bf16_speedup) = 0.5;         // bf16 matmul speed / fp32 (AMX: ~5×; avx512_bf16 alone: slower)
  TORCH_ARG(bool, fp16) = false;                 // fp16 autocast exists (CUDA only)
  TORCH_ARG(bool, disk_offload) = true;          // offload::Disk runs (CPU parameters only)
  TORCH_ARG(double, memory_bytes_per_s) = 1e10;  // elementwise work: the optimizer step
  TORCH_ARG(double, disk_bytes_per_s) = 1e9;     // offload::Disk's state streaming

 public:
  static MachineModel from_device(const c10::Device& device) {
    MachineModel m;
    if (device.is_cuda()) return m.matmul_flops_per_s(5e13).bf16_speedup(2.0).fp16(true).disk_offload(false)
                                  .memory_bytes_per_s(1e12);
    return m.bf16_speedup(cpu_has("amx_bf16") ? 3.0 : cpu_has("avx512_bf16") ? 0.5 : 0.2);
  }
};

/// What plan() weighs: a budget for the step's tensor peak and the effective batch to keep.
struct PlanOptions {
  TORCH_ARG(int64_t, budget_bytes) = 0;     // 0: no limit (the fastest candidate wins)
  TORCH_ARG(int64_t, effective_batch) = 1;  // sequences per optimizer step: micro-batch × accum
  TORCH_ARG(MachineModel, machine) = {};
  /// Measured / predicted peak of one real step, when one was measured (1: trust the estimate).
  TORCH_ARG(double, calibration) = 1.0;
};

/// One candidate as plan() judged it.
struct PlanRow {
  memory::PolicyDesc policies;  // accum = effective_batch / micro_batch
  int64_t micro_batch = 0;      // the largest that fits (0: none fits, or it cannot run here)
  memory::Estimate estimate;    // at micro_batch (at 1 when none fits)
  double seconds = 0;           // the cost model's step time
  std::string verdict;          // "fits", "over budget: needs 612 MiB at micro-batch 1", "needs CUDA"
  bool fits() const { return micro_batch > 0; }
};

/// plan()'s answer: the chosen row and every row considered.
struct Plan {
  PlanRow chosen;
  std::vector<PlanRow> rows;
  int64_t budget_bytes = 0;

  /// Why: the fastest `max_rows` fitting candidates (chosen first, marked *), the count of
  /// the others, then the choice.
  std::string explain(int64_t max_rows = 8) const {
    std::string out = fmt::format("plan: {} candidates, budget {}\n", rows.size(),
                                  budget_bytes > 0 ? fmt::format("{:.0f} MiB", memory::mib(budget_bytes)) : "none");
    int64_t shown = 0, more_fit = 0, over = 0, elsewhere = 0;
    for (const auto& r : rows) {
      if (r.fits() && shown < max_rows) {
        out += fmt::format("  {} {:<58} micro {:>3}  peak {:8.1f} MiB  {:7.3f} s/step\n",
                           &r == &rows.front() ? "*" : " ", r.policies.name(), r.micro_batch,
                           memory::mib(r.estimate.peak), r.seconds);
        ++shown;
      } else if (r.fits()) {
        ++more_fit;
      } else if (r.verdict.starts_with("over budget")) {
        ++over;
      } else {
        ++elsewhere;
      }
    }
    out += fmt::format("  ({} more fit, slower; {} over budget even at micro-batch 1; {} cannot run here)\n", more_fit,
                       over, elsewhere);
    out += fmt::format("chose {} (micro-batch {}): the fastest by the cost model of those that fit\n",
                       chosen.policies.name(), chosen.micro_batch);
    return out;
  }
};

/// The cost model: a step's time is its matmul FLOPs (forward, backward = 2 × forward, plus
/// what the checkpoint policy recomputes) at the precision's matmul speed, slowed by small
/// micro-batches (efficiency rows / (rows + 512): matmuls of few rows run below peak), plus the
/// optimizer step's memory traffic (AdamW 28 B/param, 8-bit AdamW 40 B/param with its
/// (de)quantisation, disk: AdamW plus 16 B/param read and written).
inline double step_seconds(const memory::ModelDesc& m, int64_t seq_len, int64_t micro_batch,
                           const memory::PolicyDesc& p, const MachineModel& machine) {
  using memory::CheckpointKind;
  const double T = static_cast<double>(seq_len), C = static_cast<double>(m.hidden_size);
  const double tokens = static_cast<double>(micro_batch * p.accum) * T;
  const double fwd = m.forward_flops_per_token(seq_len);
  const double head = 2 * C * static_cast<double>(m.vocab_size);
  const double blocks = fwd - head;
  double recompute = 0;
  switch (p.checkpoint) {
    case CheckpointKind::kEveryBlock: recompute = blocks; break;
    case CheckpointKind::kEveryNth:
      recompute = blocks * static_cast<double>((m.num_layers + p.every - 1) / p.every) /
                  static_cast<double>(m.num_layers);
      break;
    case CheckpointKind::kSelective: recompute = static_cast<double>(m.num_layers) * 4 * T * C; break;
    case CheckpointKind::kNone: break;
  }
  const bool bf16 = p.precision != memory::PrecisionKind::kFp32;
  const double speed = machine.matmul_flops_per_s() * (bf16 ? machine.bf16_speedup() : 1.0);
  const double rows = static_cast<double>(micro_batch) * T;
  const double efficiency = rows / (rows + 512);
  const double compute = tokens * (3 * fwd + recompute) / (speed * efficiency);
  const double P = static_cast<double>(m.num_parameters());
  double opt_bytes = 28 * P, disk_bytes = 0;
  if (p.offload == memory::OffloadKind::kInt8) opt_bytes = 40 * P;
  if (p.offload == memory::OffloadKind::kDisk) disk_bytes = 16 * P;
  return compute + opt_bytes / machine.memory_bytes_per_s() + disk_bytes / machine.disk_bytes_per_s();
}

/// Picks, among `candidates` (their policy types; accum is chosen here), the fastest
/// combination whose predicted peak fits options.budget_bytes(), each at the largest
/// micro-batch that divides the effective batch and fits (accum = effective / micro). Throws,
/// naming the budget and the smallest need, when none fits.
///   auto p = memopt::plan(desc, 256, candidates<memopt::StandardTrainers>(),
///                         memopt::PlanOptions().budget_bytes(4LL << 30).effective_batch(32));
inline Plan plan(const memory::ModelDesc& m, int64_t seq_len, const std::vector<memory::PolicyDesc>& candidates,
                 const PlanOptions& options) {
  TORCH_CHECK(!candidates.empty(), "memopt::plan: no candidate policy combinations. HINT: pass "
                                   "memopt::candidates<memopt::StandardTrainers>().");
  TORCH_CHECK(options.effective_batch() >= 1, "memopt::plan: effective_batch must be >= 1 (got ",
              options.effective_batch(), ").");
  TORCH_CHECK(options.budget_bytes() >= 0 && options.calibration() > 0, "memopt::plan: budget_bytes must be >= 0 and "
              "calibration > 0 (got ", options.budget_bytes(), " and ", options.calibration(), ").");
  const auto& machine = options.machine();
  const int64_t E = options.effective_batch();
  Plan result;
  result.budget_bytes = options.budget_bytes();
  int64_t smallest_need = std::numeric_limits<int64_t>::max();
  std::string smallest_name;
  for (auto policies : candidates) {
    PlanRow row;
    if (policies.precision == memory::PrecisionKind::kFp16Scaled && !machine.fp16()) {
      row.policies = policies;
      row.verdict = "needs CUDA (fp16 autocast)";
      result.rows.push_back(row);
      continue;
    }
    if (policies.offload == memory::OffloadKind::kDisk && !machine.disk_offload()) {
      row.policies = policies;
      row.verdict = "needs CPU parameters (disk offload)";
      result.rows.push_back(row);
      continue;
    }
    for (int64_t micro = E; micro >= 1; --micro) {  // the largest micro-batch dividing E that fits
      if (E % micro != 0) continue;
      policies.accum = E / micro;
      auto e = memory::estimate(m, {micro, seq_len}, policies);
      e.peak = static_cast<int64_t>(static_cast<double>(e.peak) * options.calibration());
      row.policies = policies;
      row.estimate = e;
      if (options.budget_bytes() == 0 || e.peak <= options.budget_bytes()) {
        row.micro_batch = micro;
        break;
      }
    }
    if (row.fits()) {
      row.seconds = step_seconds(m, seq_len, row.micro_batch, row.policies, machine);
      row.verdict = "fits";
    } else {
      row.verdict = fmt::format("over budget: needs {:.1f} MiB at micro-batch 1", memory::mib(row.estimate.peak));
      if (row.estimate.peak < smallest_need) smallest_need = row.estimate.peak, smallest_name = row.policies.name();
    }
    result.rows.push_back(row);
  }
  // Fitting rows first, fastest first; the rest after, smallest need first.
  std::stable_sort(result.rows.begin(), result.rows.end(), [](const PlanRow& a, const PlanRow& b) {
    if (a.fits() != b.fits()) return a.fits();
    if (a.fits()) return a.seconds < b.seconds;
    return a.estimate.peak < b.estimate.peak;
  });
  TORCH_CHECK(result.rows.front().fits(), "memopt::plan: no policy combination fits the memory budget of ",
              memory::mib(options.budget_bytes()), " MiB: the smallest need is ", memory::mib(smallest_need),
              " MiB (", smallest_name, ", micro-batch 1). HINT: raise --memory_budget, shorten --seq_len or use a "
              "smaller model.");
  result.chosen = result.rows.front();
  return result;
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
