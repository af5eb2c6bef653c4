// memopt/detail/parallel.hpp — not API. at::parallel_for is an inline template: with
// LibTorch's OpenMP backend it runs serially in code compiled without -fopenmp, as memopt's
// header-only code (and its users') is. parallel_chunks runs chunks of a range on LibTorch's
// own OpenMP threads instead, through TensorIterator::for_each (compiled in LibTorch, with
// OpenMP) over a tensor of chunk indices: the threads ATen's kernels use, so no second pool
// competes for the cores with OpenMP's spinning workers (a thread pool of our own did: 2-7x
// slower steps, measured on 2 cores). At most at::get_num_threads() chunks.
//   memopt::detail::parallel_chunks(rows, grain, [&](int64_t begin, int64_t end, int64_t chunk) { ... });
#pragma once

#include <ATen/TensorIterator.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>

namespace memopt::detail {

/// The number of chunks parallel_chunks makes of n items, at least `grain` each.
inline int64_t parallel_chunk_count(int64_t n, int64_t grain) {
  return std::clamp<int64_t>(n / std::max<int64_t>(grain, 1), 1, std::max<int64_t>(at::get_num_threads(), 1));
}

/// fn(begin, end, chunk) over [0, n) in parallel_chunk_count(n, grain) contiguous chunks, the
/// same split whichever threads run them; `chunk` indexes per-chunk scratch. Returns when
/// every chunk is done; rethrows the first exception a chunk threw.
template <class F>
void parallel_chunks(int64_t n, int64_t grain, const F& fn) {
  const int64_t chunks = parallel_chunk_count(n, grain);
  if (chunks == 1) {
    if (n > 0) fn(int64_t{0}, n, int64_t{0});
    return;
  }
  const auto ids = torch::arange(chunks, torch::kLong);  // (chunks,) one element per task
  auto iter = at::TensorIteratorConfig().add_const_input(ids).check_all_same_dtype(false).build();
  iter.for_each(
      [&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
        for (int64_t j = 0; j < size1; ++j) {
          for (int64_t i = 0; i < size0; ++i) {
            const int64_t c = *reinterpret_cast<const int64_t*>(data[0] + i * strides[0] + j * strides[1]);
            fn(n * c / chunks, n * (c + 1) / chunks, c);
          }
        }
      },
      /*grain_size=*/1);
}

}  // namespace memopt::detail
