// memopt/dispatch.hpp — runtime → compile-time dispatch: a type list of Trainer
// instantiations is visited by index, so a policy combination chosen at run time (flags, a
// plan) runs as its own compiled loop, with no runtime branch on a policy. StandardTrainers is
// every combination the --checkpoint/--precision/--offload flags name.
//   memopt::dispatch<memopt::StandardTrainers>(policies, [&]<class T>(std::type_identity<T>) {
//     T trainer(*model, options.accum_steps(policies.accum));
//     trainer.fit(loader, loss_fn);                     // T::name() says which ran
//   });
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "memopt/memory/estimator.hpp"  // PolicyDesc, describe<Trainer>
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

}  // namespace memopt
