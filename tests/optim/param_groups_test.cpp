// Tests for memopt/optim/param_groups.hpp: no weight decay on norms, biases and
// embeddings.
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include <memopt/memopt.hpp>

#include "policies/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::policies;  // NOLINT: the fixtures of the policy tests

TEST_CASE("AdamW groups: no weight decay on norms, biases and embeddings", "[optim]") {
  memopt::models::Llama model(tiny_llama(0.0));
  auto groups = memopt::optim::param_groups(model->named_parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  REQUIRE(groups.size() == 2);
  auto& decay = static_cast<torch::optim::AdamWOptions&>(groups[0].options());
  auto& no_decay = static_cast<torch::optim::AdamWOptions&>(groups[1].options());
  CHECK(decay.weight_decay() == 0.1);
  CHECK(no_decay.weight_decay() == 0.0);
  auto named = model->named_parameters();
  auto holds = [](const torch::optim::OptimizerParamGroup& g, const torch::Tensor& t) {
    for (const auto& p : g.params())
      if (p.is_same(t)) return true;
    return false;
  };
  CHECK(holds(groups[1], named["model.embed_tokens.weight"]));
  CHECK(holds(groups[1], named["model.norm.weight"]));
  CHECK(holds(groups[1], named["model.layers.0.input_layernorm.weight"]));
  CHECK(holds(groups[0], named["model.layers.0.self_attn.q_proj.weight"]));
  CHECK(holds(groups[0], named["lm_head.weight"]));
  CHECK(groups[0].params().size() + groups[1].params().size() == named.size());
}

TEST_CASE("AdamW groups: a tied Llama's shared weight once, a tensor registered twice once", "[optim]") {
  memopt::models::Llama model(tiny_llama(0.0).tie_word_embeddings(true));
  const auto named = model->named_parameters();
  CHECK_FALSE(named.contains("lm_head.weight"));  // the head registers no weight of its own
  auto groups = memopt::optim::param_groups(named, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  REQUIRE(groups.size() == 2);
  int64_t shared = 0;
  for (const auto& group : groups)
    for (const auto& p : group.params()) shared += p.is_same(model->lm_head->weight) ? 1 : 0;
  CHECK(shared == 1);
  CHECK(groups[0].params().size() + groups[1].params().size() == named.size());

  // A module that registers one tensor under two names: LibTorch lists it twice, the groups once.
  struct Twice : torch::nn::Module {
    Twice() {
      auto w = register_parameter("a", torch::ones({2, 2}));
      register_parameter("b", w);
    }
  };
  Twice twice;
  REQUIRE(twice.named_parameters().size() == 2);
  auto twice_groups = memopt::optim::param_groups(twice.named_parameters(), torch::optim::AdamWOptions(1e-3));
  REQUIRE(twice_groups.size() == 1);
  CHECK(twice_groups[0].params().size() == 1);
}
