// Tests for memopt/nn/attention_choice.hpp: the decision rule (speed, then memory, then SDPA),
// the measurement (every kernel timed on the shape, the tracked peak and the global RNG left as
// they were), one measurement per shape per process, the paths taken without measuring
// (dropout, causal with padding), and the bad options' errors. Values and gradients of
// attention_auto against the math path are in attention_test.cpp.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include <memopt/memory/tracker.hpp>
#include <memopt/nn/attention_choice.hpp>

#include "support.hpp"

namespace {

using memopt::nn::AttentionKind;
using memopt::nn::AttentionShape;
using memopt::nn::AttentionTiming;

// A shape no other test uses, so the process-wide table has not seen it yet.
AttentionShape unseen_shape(int64_t q_len, bool causal) {
  auto q = torch::zeros({1, 2, q_len, 8});
  return AttentionShape::of(q, q, q, causal, false);
}

int64_t choices_for(const AttentionShape& shape) {
  int64_t n = 0;
  for (const auto& [s, c] : memopt::nn::attention_choices()) n += s.key() == shape.key();
  return n;
}

}  // namespace

TEST_CASE("pick_attention takes the faster kernel, on a tie the smaller, then SDPA", "[attention][choice]") {
  using memopt::nn::pick_attention;
  CHECK(pick_attention(AttentionTiming{10, 100}, AttentionTiming{20, 50}, 0.05) == AttentionKind::kSdpa);
  CHECK(pick_attention(AttentionTiming{20, 50}, AttentionTiming{10, 100}, 0.05) == AttentionKind::kBlockwise);
  // Within 5%: memory decides, whichever is faster.
  CHECK(pick_attention(AttentionTiming{10, 100}, AttentionTiming{10.4, 50}, 0.05) == AttentionKind::kBlockwise);
  CHECK(pick_attention(AttentionTiming{10.4, 50}, AttentionTiming{10, 100}, 0.05) == AttentionKind::kSdpa);
  // A full tie: SDPA. Outside the tie, memory does not count.
  CHECK(pick_attention(AttentionTiming{10, 50}, AttentionTiming{10, 50}, 0.05) == AttentionKind::kSdpa);
  CHECK(pick_attention(AttentionTiming{10, 100}, AttentionTiming{10.6, 50}, 0.05) == AttentionKind::kSdpa);
  CHECK(pick_attention(AttentionTiming{10, 100}, AttentionTiming{10.6, 50}, 0.1) == AttentionKind::kBlockwise);
}

TEST_CASE("pick_attention of three: the fastest, within the tie the smallest, then the first listed",
          "[attention][choice]") {
  using memopt::nn::pick_attention;
  const auto three = [](AttentionTiming sdpa, AttentionTiming blockwise, AttentionTiming flash) {
    return pick_attention({{AttentionKind::kSdpa, sdpa}, {AttentionKind::kBlockwise, blockwise},
                           {AttentionKind::kFlash, flash}}, 0.05);
  };
  CHECK(three({10, 100}, {20, 50}, {5, 100}) == AttentionKind::kFlash);
  CHECK(three({10, 100}, {20, 50}, {12, 100}) == AttentionKind::kSdpa);
  CHECK(three({10.3, 100}, {20, 50}, {10, 100}) == AttentionKind::kSdpa);     // a tie on time and bytes: SDPA
  CHECK(three({10.3, 100}, {10.4, 50}, {10, 100}) == AttentionKind::kBlockwise);  // within the tie, fewer bytes
  CHECK(three({10.3, 100}, {10.4, 50}, {10, 40}) == AttentionKind::kFlash);
  CHECK(three({11, 100}, {20, 50}, {10, 100}) == AttentionKind::kFlash);      // 10% slower is no tie
  memopt::test::require_error([&] { pick_attention({}, 0.05); }, "memopt::nn::pick_attention", {"no candidates"});
}

TEST_CASE("measure_attention times both kernels and leaves the tracked peak and the global RNG alone",
          "[attention][choice]") {
  const auto shape = unseen_shape(96, true);
  torch::manual_seed(3);
  const auto expected_draw = torch::randn({4});
  torch::manual_seed(3);
  auto& tracker = memopt::memory::Tracker::instance();
  REQUIRE(tracker.installed());
  tracker.reset_peaks();
  const int64_t peak_before = tracker.peak_bytes();

  const auto c = memopt::nn::measure_attention(shape, memopt::nn::AttentionChoiceOptions().reps(2));

  CHECK(tracker.peak_bytes() == peak_before);
  CHECK(torch::equal(torch::randn({4}), expected_draw));  // the probe drew from its own generator
  CHECK(c.sdpa.ms > 0);
  CHECK(c.blockwise.ms > 0);
  // The forward leaves at least its (B, H, T, D) fp32 output allocated.
  const int64_t output_bytes = shape.batch * shape.heads * shape.q_len * shape.head_dim * 4;
  CHECK(c.sdpa.saved_bytes >= output_bytes);
  CHECK(c.blockwise.saved_bytes >= output_bytes);
  // attention_flash is timed where its backward runs (a CPU build with the batch-reduce GEMM, fp32).
  std::vector<std::pair<AttentionKind, AttentionTiming>> timed{{AttentionKind::kSdpa, c.sdpa},
                                                               {AttentionKind::kBlockwise, c.blockwise}};
  CHECK(c.flash.has_value() == memopt::nn::flash_supported(c10::kCPU, torch::kFloat, 8, false, false));
  if (c.flash) {
    CHECK(c.flash->ms > 0);
    CHECK(c.flash->saved_bytes >= output_bytes);
    timed.emplace_back(AttentionKind::kFlash, *c.flash);
  }
  CHECK(c.kind == memopt::nn::pick_attention(timed, 0.05));
  CHECK(choices_for(shape) == 0);  // measuring is not choosing: the table is untouched
}

TEST_CASE("choose_attention measures a shape once, and attention_auto runs what it chose", "[attention][choice]") {
  auto q = torch::randn({1, 2, 72, 8}).requires_grad_();
  auto k = torch::randn({1, 2, 72, 8}).requires_grad_();
  const auto shape = AttentionShape::of(q, k, k, false, false);
  REQUIRE(choices_for(shape) == 0);
  const auto first = memopt::nn::choose_attention(shape);
  CHECK(choices_for(shape) == 1);
  const auto again = memopt::nn::choose_attention(shape);
  CHECK(again.sdpa.ms == first.sdpa.ms);  // remembered, not measured again
  CHECK(again.kind == first.kind);

  // attention_auto's output is bit-equal to the chosen kernel's (the other kernel's is not
  // guaranteed to be).
  const auto y = memopt::nn::attention_auto(q, k, k, false, 0.0, false);
  const auto blockwise = memopt::nn::BlockwiseAttentionOptions().causal(false);
  const auto want = first.kind == AttentionKind::kSdpa    ? memopt::nn::attention_sdpa(q, k, k, false, 0.0, false)
                    : first.kind == AttentionKind::kFlash ? memopt::nn::attention_flash(q, k, k, false, 0.0, false)
                                                          : memopt::nn::attention_blockwise(q, k, k, blockwise);
  CHECK(torch::equal(y, want));
  CHECK(choices_for(shape) == 1);
  INFO(shape.str());
  CHECK(shape.str() == "B1 H2/2 T72x72 D8 bidirectional Float");
}

TEST_CASE("a strided view is a shape of its own, and the probe keeps its layout", "[attention][choice]") {
  // q as LLaMA's projections make it: (B, T, H, D) seen as (B, H, T, D).
  auto q = torch::randn({1, 56, 2, 8}).transpose(1, 2);
  const auto strided = AttentionShape::of(q, q, q, true, false);
  const auto dense = AttentionShape::of(q.contiguous(), q.contiguous(), q.contiguous(), true, false);
  CHECK_FALSE(strided.contiguous());
  CHECK(dense.contiguous());
  CHECK(strided.key() != dense.key());
  CHECK(strided.str() == "B1 H2/2 T56x56 D8 causal Float strided");
  std::vector<int64_t> seen;
  const auto t = memopt::detail::time_attention(strided, 1, [&](auto& q, auto& k, auto& v, auto&) {
    seen = q.strides().vec();
    return memopt::nn::attention_sdpa(q, k, v, true, 0.0, false);
  });
  CHECK(seen == q.strides().vec());
  CHECK(t.ms > 0);
}

TEST_CASE("attention_auto runs SDPA for dropout and the blockwise kernel for causal padding, unmeasured",
          "[attention][choice]") {
  auto q = torch::randn({2, 2, 40, 8});
  const auto before = memopt::nn::attention_choices().size();
  SECTION("dropout in training: SDPA, the same draws") {
    torch::manual_seed(5);
    const auto y = memopt::nn::attention_auto(q, q, q, true, 0.5, true);
    torch::manual_seed(5);
    CHECK(torch::equal(y, memopt::nn::attention_sdpa(q, q, q, true, 0.5, true)));
  }
  SECTION("causal with key padding: blockwise") {
    auto mask = torch::ones({2, 40}, torch::kBool);
    mask[1].narrow(0, 30, 10).fill_(false);
    const auto y = memopt::nn::attention_auto(q, q, q, true, 0.0, false, mask);
    const auto want = memopt::nn::attention_blockwise(
        q, q, q, memopt::nn::BlockwiseAttentionOptions().causal(true).key_padding_mask(mask));
    CHECK(torch::equal(y, want));
  }
  CHECK(memopt::nn::attention_choices().size() == before);
}

TEST_CASE("attention_auto runs the blockwise kernel with its blocks, and blocks make a shape of their own",
          "[attention][choice]") {
  auto q = torch::randn({2, 2, 40, 8});
  const auto plain = AttentionShape::of(q, q, q, true, true);
  const auto blocked = AttentionShape::of(q, q, q, true, true, 8, 16);
  CHECK(plain.key() != blocked.key());
  CHECK(blocked.str() == "B2 H2/2 T40x40 D8 causal padded Float blocks 8x16");
  auto mask = torch::ones({2, 40}, torch::kBool);
  mask[1].narrow(0, 30, 10).fill_(false);
  const auto y = memopt::nn::attention_auto(q, q, q, true, 0.0, false, mask, 8, 16);  // causal + padded: blockwise
  const auto want = memopt::nn::attention_blockwise(
      q, q, q, memopt::nn::BlockwiseAttentionOptions().causal(true).key_padding_mask(mask).q_block(8).kv_block(16));
  CHECK(torch::equal(y, want));
}

TEST_CASE("measure_attention and attention_auto reject bad options and shapes with a HINT", "[attention][choice]") {
  using Catch::Matchers::Contains;
  const auto shape = unseen_shape(8, true);
  CHECK_THROWS_WITH(memopt::nn::measure_attention(shape, memopt::nn::AttentionChoiceOptions().reps(0)),
                    Contains("reps must be >= 1") && Contains("got 0") && Contains("HINT"));
  CHECK_THROWS_WITH(memopt::nn::measure_attention(shape, memopt::nn::AttentionChoiceOptions().tie(-1)),
                    Contains("tie") && Contains("HINT"));
  auto x = torch::randn({2, 40, 8});
  CHECK_THROWS_WITH(memopt::nn::attention_auto(x, x, x, true, 0.0, false),
                    Contains("attention_auto") && Contains("(B, H, T, D)") && Contains("HINT"));
}
