// memopt/data/random.hpp — the one random-number scheme of data/: std::mt19937_64 streams (the
// standard fixes their sequence, and their state writes out as text for an exact resume), drawn
// from with uniform_below() and shuffle() — rejection sampling and Fisher–Yates, the same on
// every platform, unlike std::uniform_int_distribution and std::shuffle — and seeded per
// purpose with mix_seed(), so each stream depends on its own inputs only.
//   memopt::data::Rng rng(memopt::data::mix_seed({seed, epoch}));
//   memopt::data::shuffle(rng, order);
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <random>
#include <utility>
#include <vector>

namespace memopt::data {

/// The engine of every random choice in data/.
using Rng = std::mt19937_64;

/// Uniform in [0, n), n >= 1: 64-bit draws by rejection, no modulo bias.
inline uint64_t uniform_below(Rng& rng, uint64_t n) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  const uint64_t limit = kMax - kMax % n;
  uint64_t x = rng();
  while (x >= limit) x = rng();
  return x % n;
}

/// Fisher–Yates from the back: element i swaps with a uniform one of [0, i].
template <class T>
void shuffle(Rng& rng, std::vector<T>& v) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[uniform_below(rng, i)]);
}

/// A seed derived from several values (order matters): SplitMix64's finaliser folded over them.
inline uint64_t mix_seed(std::initializer_list<uint64_t> values) {
  auto splitmix = [](uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  uint64_t h = 0x243F6A8885A308D3ull;
  for (uint64_t v : values) h = splitmix(h ^ (v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2)));
  return h;
}

}  // namespace memopt::data
