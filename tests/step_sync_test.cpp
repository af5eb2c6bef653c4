// memopt/step_sync.hpp: a Trainer's link to the other ranks. This test binary does not include
// memopt/dist.hpp, so data parallel training is not compiled in: a Trainer started as one of
// several ranks must refuse to train alone (each rank would train its own model and write
// the same checkpoints) and say how to turn it on. tests/dist/*_test.cpp cover DataParallel.
#include <catch2/catch.hpp>

#include <csignal>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memopt/memopt.hpp>

#include "support.hpp"

namespace {

// Sets environment variables for a scope, restoring what was there.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<std::string, std::string>> vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name.c_str());
      saved_.emplace_back(name, old != nullptr ? std::optional<std::string>(old) : std::nullopt);
      ::setenv(name.c_str(), value.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, old] : saved_) {
      if (old) {
        ::setenv(name.c_str(), old->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

}  // namespace

TEST_CASE("LocalSync leaves counts, gradients and signals as they are", "[step_sync]") {
  memopt::LocalSync sync;
  CHECK(sync.rank() == 0);
  CHECK(sync.size() == 1);
  CHECK_FALSE(sync.distributed());
  torch::Tensor targets = torch::scalar_tensor(7.0F);
  int64_t tokens = 11;
  sync.sum_counts(targets, tokens);
  CHECK(targets.item<float>() == 7.0F);
  CHECK(tokens == 11);
  torch::Tensor loss = torch::scalar_tensor(1.5F);
  CHECK(sync.sync_gradients(loss, SIGTERM) == SIGTERM);  // fit() stops on its own signal
  CHECK(sync.any(true, "test"));
  CHECK_FALSE(sync.any(false, "test"));
  // The gradient norm is the plain one and clips as optim::clip_grad_norm_ does.
  torch::Tensor w = torch::zeros({2}, torch::requires_grad());
  w.mutable_grad() = torch::tensor({3.0F, 4.0F});
  CHECK(sync.clip_grad_norm_({w}, 1.0).item<float>() == Approx(5.0F));
  CHECK(w.grad().norm().item<float>() == Approx(1.0F).epsilon(1e-5));
}

TEST_CASE("A Trainer started as one of several ranks without memopt/dist.hpp stops with a HINT", "[step_sync]") {
  REQUIRE_FALSE(memopt::detail::data_parallel_factory());  // this binary does not include memopt/dist.hpp
  torch::nn::Linear model(4, 2);
  ScopedEnv env({{"WORLD_SIZE", "2"}, {"RANK", "1"}});
  memopt::test::require_error([&] { memopt::Trainer<> trainer(*model, memopt::TrainerOptions()); },
                              "memopt::Trainer", {"rank 1 of 2", "memopt/dist.hpp", "data_parallel(false)"});
  // A probe or reference run that trains on this process alone is allowed.
  memopt::Trainer<> alone(*model, memopt::TrainerOptions().data_parallel(false));
  CHECK(alone.steps_taken() == 0);
}
