// memopt/dispatch.hpp — runtime → compile-time dispatch: a type list of Trainer
// instantiations is visited by index, so a policy combination chosen at run time (flags, a
// plan) runs as its own compiled loop, with no runtime branch on a policy. The flags are
// parsed against the list's own policies (their describe()), so the list is the only place
// that names them. StandardTrainers is every combination of memopt's
// --recompute/--precision/--optimizer_state flags that runs on any device.
//   memopt::dispatch<memopt::StandardTrainers>(policies, [&]<class T>(std::type_identity<T>) {
//     T trainer(*model, options.accum_steps(policies.accum));
//     trainer.fit(loader, loss_fn);                     // T::name() says which ran
//   });
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "memopt/memory/policy_desc.hpp"  // PolicyDesc, describe<Trainer>
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

template <class C, class P, class A, class States>
struct RowOf;
template <class C, class P, class A, class... O>
struct RowOf<C, P, A, TypeList<O...>> {
  using type = TypeList<Trainer<C, P, A, O>...>;
};
template <class C, class P, class Accums, class States>
struct LineOf;
template <class C, class P, class... A, class States>
struct LineOf<C, P, TypeList<A...>, States> {
  using type = typename Concat<TypeList<>, typename RowOf<C, P, A, States>::type...>::type;
};
template <class C, class Precisions, class Accums, class States>
struct PlaneOf;
template <class C, class... P, class Accums, class States>
struct PlaneOf<C, TypeList<P...>, Accums, States> {
  using type = typename Concat<TypeList<>, typename LineOf<C, P, Accums, States>::type...>::type;
};
}  // namespace detail

/// Every Trainer<C, P, A, O> for C, P, A, O in the four lists (by default accum::Runtime: a
/// run-time count, TrainerOptions::accum_steps).
template <class Recomputes, class Precisions, class States, class Accums = TypeList<accum::Runtime>>
struct TrainerProduct;
template <class... C, class Precisions, class States, class Accums>
struct TrainerProduct<TypeList<C...>, Precisions, States, Accums> {
  using type =
      typename detail::Concat<TypeList<>, typename detail::PlaneOf<C, Precisions, Accums, States>::type...>::type;
};
template <class Recomputes, class Precisions, class States, class Accums = TypeList<accum::Runtime>>
using TrainerProductT = typename TrainerProduct<Recomputes, Precisions, States, Accums>::type;

/// The combinations the --recompute/--precision/--optimizer_state flags name: 4 × 4 × 3 Trainers.
using StandardTrainers =
    TrainerProductT<TypeList<recompute::None, recompute::EveryBlock, recompute::EveryNth<2>, recompute::Selective>,
                    TypeList<precision::Fp32, precision::Bf16Autocast, precision::Bf16Pure, precision::Fp16Scaled>,
                    TypeList<state::Resident, state::Int8, state::Disk>>;

/// Recompute × bf16 autocast: the four combinations the examples with strategy flags
/// (moe_lm, llama_to_llada) compile, and plan over with --policies auto.
using RecomputePrecisionTrainers =
    TrainerProductT<TypeList<recompute::None, recompute::EveryBlock>,
                    TypeList<precision::Fp32, precision::Bf16Autocast>, TypeList<state::Resident>>;

/// The same × whole micro-batches or GradCache chunks: what the GritLM example compiles and
/// plan_gritlm() weighs.
using GradCacheTrainers =
    TrainerProductT<TypeList<recompute::None, recompute::EveryBlock>,
                    TypeList<precision::Fp32, precision::Bf16Autocast>, TypeList<state::Resident>,
                    TypeList<accum::Runtime, accum::GradCache>>;

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
/// not hold, or holds twice under the same flags, throws, naming it and what the list holds.
template <class List>
size_t index_of(const memory::PolicyDesc& want) {
  const auto all = candidates<List>();
  std::vector<size_t> found;
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i].same_types(want)) found.push_back(i);
  // The flags are the policies' identity here: two instantiations answering to the same ones
  // (recompute::EveryNth<1> is "every", as EveryBlock) would make the choice ambiguous.
  if (found.size() > 1) {
    const auto names = trainer_names<List>();
    TORCH_CHECK(false, "memopt::dispatch: ", found.size(), " compiled Trainers describe themselves as ", want.flags(),
                ": ", names[found[0]], " and ", names[found[1]], ". HINT: give each policy of a list its own flag in "
                "describe(), or keep one of them in the list.");
  }
  if (!found.empty()) return found.front();
  std::string held;
  for (const auto& d : all) held += "\n  " + d.flags();
  TORCH_CHECK(false, "memopt::dispatch: no compiled Trainer has ", want.flags(),
              ". HINT: this program was built with:", held);
  return 0;
}

/// The policies the flags name, looked up among the list's own descriptions (accum: the
/// run-time count; `split`: the accumulation flag, "" for the list's first). A value the list
/// does not hold throws, naming the flag, the value and the choices.
///   auto p = memopt::parse_policies<memopt::StandardTrainers>("every", "bf16", "resident", 4);
template <class List>
memory::PolicyDesc parse_policies(std::string_view recompute, std::string_view precision, std::string_view state,
                                  int64_t accum = 1, std::string_view split = "") {
  TORCH_CHECK(accum >= 1, "memopt: --accum must be >= 1 (got ", accum, "). HINT: 1 takes one micro-batch per step.");
  const auto all = candidates<List>(accum);
  memory::PolicyDesc out = all.front();
  auto pick = [&](std::string_view flag, std::string_view value, auto field) {
    std::vector<std::string> choices;
    for (const auto& d : all) {
      const auto& axis = d.*field;
      if (value == axis.flag || (value.empty() && &d == &all.front())) {
        out.*field = axis;
        return;
      }
      if (std::find(choices.begin(), choices.end(), axis.flag) == choices.end()) choices.push_back(axis.flag);
    }
    TORCH_CHECK(false, "memopt: ", flag, " must be ", fmt::format("{}", fmt::join(choices, ", ")), " (got '", value,
                "'). HINT: those are the ", flag, " values this program was built with.");
  };
  pick("--recompute", recompute, &memory::PolicyDesc::recompute);
  pick("--precision", precision, &memory::PolicyDesc::precision);
  pick("--optimizer_state", state, &memory::PolicyDesc::state);
  pick("accumulation", split, &memory::PolicyDesc::split);
  out.accum = out.split.fixed_steps > 0 ? out.split.fixed_steps : accum;
  return out;
}

/// Runs fn(std::type_identity<T>{}) with T the list's Trainer whose policies are `choice`'s.
template <class List, class Fn>
decltype(auto) dispatch(const memory::PolicyDesc& choice, Fn&& fn) {
  return visit_type<List>(index_of<List>(choice), std::forward<Fn>(fn));
}

}  // namespace memopt
