// tests/data/random_test.cpp — memopt/data/random.hpp: Rng is the standard's mt19937_64 (the
// same sequence everywhere), uniform_below stays in [0, n) and is uniform (rejection, no modulo
// bias), shuffle is a uniform permutation fixed by the seed, mix_seed tells its inputs and
// their order apart.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include <memopt/data/random.hpp>

using memopt::data::mix_seed;
using memopt::data::Rng;
using memopt::data::uniform_below;

TEST_CASE("Rng is mt19937_64: the standard's 10000th value, and one sequence per seed", "[data][random]") {
  Rng standard;  // default seed 5489
  standard.discard(9999);
  CHECK(standard() == 9981545732273789042ull);  // [rand.predef] in the C++ standard
  Rng a(42), b(42), c(43);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    const uint64_t x = a();
    CHECK(x == b());
    differs = differs || x != c();
  }
  CHECK(differs);
}

TEST_CASE("uniform_below stays below n, repeats by seed and is uniform", "[data][random]") {
  Rng rng(1);
  for (const uint64_t n : {uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{7}, uint64_t{1000}, (uint64_t{1} << 63) + 1,
                           ~uint64_t{0}}) {
    INFO("n = " << n);
    for (int i = 0; i < 1000; ++i) CHECK(uniform_below(rng, n) < n);
  }
  Rng first(7), again(7);
  for (int i = 0; i < 100; ++i) CHECK(uniform_below(first, 1000) == uniform_below(again, 1000));

  // 100000 draws over 10 values: each count is 10000 ± 95 (one standard deviation); 600 is
  // over 6 of them, so only a real bias fails (the draws are fixed by the seed anyway).
  std::vector<int> counts(10, 0);
  for (int i = 0; i < 100000; ++i) ++counts[uniform_below(rng, 10)];
  for (int v = 0; v < 10; ++v) {
    INFO("value " << v << " drawn " << counts[static_cast<size_t>(v)] << " times");
    CHECK(std::abs(counts[static_cast<size_t>(v)] - 10000) < 600);
  }
}

TEST_CASE("uniform_below rejects the draws a modulo would bias", "[data][random]") {
  // n = 3·2^62: a plain x % n of a uniform 64-bit x lands below 2^62 half the time (x in
  // [0, 2^62) and in [n, 2^64)); uniform in [0, n) it does a third of the time. 30000 draws:
  // standard deviation 0.0027, so [0.31, 0.36] holds the third and not the half.
  const uint64_t n = uint64_t{3} << 62;
  Rng rng(3);
  int below = 0;
  for (int i = 0; i < 30000; ++i) below += uniform_below(rng, n) < (uint64_t{1} << 62) ? 1 : 0;
  const double fraction = below / 30000.0;
  INFO("fraction below 2^62: " << fraction);
  CHECK(fraction > 0.31);
  CHECK(fraction < 0.36);
}

TEST_CASE("shuffle is a permutation, fixed by the seed, and each order equally likely", "[data][random]") {
  std::vector<int> v(100);
  std::iota(v.begin(), v.end(), 0);
  auto a = v, b = v, c = v;
  Rng ra(5), rb(5), rc(6);
  memopt::data::shuffle(ra, a);
  memopt::data::shuffle(rb, b);
  memopt::data::shuffle(rc, c);
  CHECK(a == b);
  CHECK(a != v);
  CHECK(a != c);
  CHECK(std::is_permutation(a.begin(), a.end(), v.begin()));
  CHECK(std::is_permutation(c.begin(), c.end(), v.begin()));

  std::vector<int> empty, one{9};
  memopt::data::shuffle(ra, empty);
  memopt::data::shuffle(ra, one);
  CHECK(empty.empty());
  CHECK(one == std::vector<int>{9});

  // The 6 orders of 3 elements over 60000 shuffles: each 10000 ± 91 (one standard deviation).
  // Swapping with any of the 3 elements instead of one of [0, i] makes 9 equally likely paths
  // to the 6 orders: three orders would come 2/9 · 60000 ≈ 13300 times, three 6700.
  std::map<std::vector<int>, int> orders;
  Rng rng(11);
  for (int i = 0; i < 60000; ++i) {
    std::vector<int> three{0, 1, 2};
    memopt::data::shuffle(rng, three);
    ++orders[three];
  }
  CHECK(orders.size() == 6);
  for (const auto& [order, count] : orders) {
    INFO("order " << order[0] << order[1] << order[2] << " came " << count << " times");
    CHECK(std::abs(count - 10000) < 600);
  }
}

TEST_CASE("mix_seed gives each list of inputs its own seed, order and length count", "[data][random]") {
  CHECK(mix_seed({1, 2}) == mix_seed({1, 2}));
  CHECK(mix_seed({1, 2}) != mix_seed({2, 1}));
  CHECK(mix_seed({1}) != mix_seed({1, 0}));
  CHECK(mix_seed({0}) != mix_seed({0, 0}));
  CHECK(mix_seed({}) != mix_seed({0}));
  // Every (seed, epoch) of a 100 × 100 grid gets a distinct seed, and neighbours' streams differ.
  std::set<uint64_t> seen;
  for (uint64_t seed = 0; seed < 100; ++seed)
    for (uint64_t epoch = 0; epoch < 100; ++epoch) seen.insert(mix_seed({seed, epoch}));
  CHECK(seen.size() == 10000);
  Rng x(mix_seed({7, 0})), y(mix_seed({7, 1}));
  CHECK(x() != y());
}
