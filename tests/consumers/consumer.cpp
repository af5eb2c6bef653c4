// The consumer program of both consumer tests (find_package/ builds it against an
// installed memopt, add_subdirectory/ with memopt as a subproject): a user-defined
// classifier whose blocks run under activation checkpointing, trained for a few steps by
// memopt::Trainer with two accumulated micro-batches. Exits 0 only if the loss went down.
//   cmake -S find_package -B build -DCMAKE_PREFIX_PATH=<memopt prefix> && cmake --build build && build/consumer
#include <cstdio>

#include <torch/torch.h>

#ifdef MEMOPT_CONSUMER_UMBRELLA
#include <memopt/dist.hpp>    // memopt::dist: data parallel training (a world of one here)
#include <memopt/memopt.hpp>  // the umbrella header: proves every installed header is there
#else
#include <memopt/batch.hpp>  // the headers one by one: proves they stand on their own
#include <memopt/memory/tracker.hpp>
#include <memopt/policies/accum.hpp>
#include <memopt/policies/recompute.hpp>
#include <memopt/policies/precision.hpp>
#include <memopt/trainer.hpp>
#endif

// One residual block: x + gelu(linear(x)). A plain module with forward(Tensor), so it
// can sit in a torch::nn::Sequential.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t dim) : fc(register_module("fc", torch::nn::Linear(dim, dim))) {}
  torch::Tensor forward(torch::Tensor x) { return x + gelu(fc(x)); }  // (B, D) -> (B, D)
  torch::nn::Linear fc;
  torch::nn::GELU gelu;
};
TORCH_MODULE(Block);

// Token ids -> mean embedding -> blocks -> class logits.
struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl(int64_t vocab, int64_t dim, int64_t depth, int64_t classes)
      : embed(register_module("embed", torch::nn::Embedding(vocab, dim))),
        blocks(register_module("blocks", torch::nn::Sequential())),
        head(register_module("head", torch::nn::Linear(dim, classes))) {
    for (int64_t i = 0; i < depth; ++i) blocks->push_back(Block(dim));
  }
  template <memopt::RecomputePolicy Recompute>
  torch::Tensor forward(const torch::Tensor& ids, const Recompute& ckpt) {
    torch::Tensor x = embed(ids).mean(1);           // (B, T) -> (B, T, D) -> (B, D)
    x = memopt::run_sequential(ckpt, blocks, x);    // (B, D)
    return head(x);                                 // (B, C)
  }
  torch::nn::Embedding embed;
  torch::nn::Sequential blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(Classifier);

// Random sequences labelled 1 when most of their tokens lie in the lower half of the vocabulary.
struct MajorityLoader {
  int64_t batch = 16, seq = 9, vocab = 32;
  memopt::Batch next() {
    torch::Tensor ids = torch::randint(vocab, {batch, seq}, torch::kLong);        // (B, T)
    torch::Tensor labels = ids.lt(vocab / 2).sum(1).gt(seq / 2).to(torch::kLong);  // (B,)
    return {ids, labels};
  }
};

int main() {
  memopt::memory::Tracker::install();
  torch::manual_seed(0);
  MajorityLoader loader;
  Classifier model(loader.vocab, /*dim=*/32, /*depth=*/3, /*classes=*/2);
  // The SUM of the per-target losses: the Trainer divides by the targets of the whole step.
  auto loss_sum = [&](const memopt::Batch& b, const auto& ckpt) {
    return torch::nn::functional::cross_entropy(
        model->forward(b.inputs, ckpt), b.targets,
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  };
  const memopt::Batch held_out = MajorityLoader{256}.next();
  auto eval_loss = [&] {
    torch::NoGradGuard no_grad;
    return loss_sum(held_out, memopt::recompute::None{}).item<double>() / 256.0;
  };

  const double before = eval_loss();
  memopt::Trainer<memopt::recompute::EveryBlock, memopt::precision::Fp32, memopt::accum::Fixed<2>> trainer(
      *model, memopt::TrainerOptions().lr(1e-2).weight_decay(0).max_steps(30).log_interval(10));
  const memopt::FitResult result = trainer.fit(loader, loss_sum);
  const double after = eval_loss();

  std::printf(MEMOPT_CONSUMER " consumer: %lld steps, held-out loss %.4f -> %.4f\n",
              static_cast<long long>(result.steps), before, after);
  if (result.steps != 30 || !(after < before)) {
    std::printf("consumer FAILED: the loss did not decrease\n");
    return 1;
  }
  std::printf("consumer OK\n");
  return 0;
}
