// memopt/optim/quantize.hpp — block-wise 8-bit quantisation as in bitsandbytes (Dettmers et
// al., "8-bit Optimizers via Block-wise Quantization", 2022): what optim::AdamW8bit stores
// its moments in.
//
// Format. Each moment of a parameter with n elements is n uint8 codes plus one fp32 absmax
// per block of kQuantBlockSize = 256 consecutive elements (the flattened parameter; the
// last block may be shorter): 2·n + 2·4·⌈n/256⌉ bytes for both moments, + the int64 step.
// A code indexes a sorted 256-entry map of values in [-1, 1]; the element is
// map[code] · absmax of its block. Block-wise scales keep one outlier from flattening the
// resolution of the whole tensor (256 is bitsandbytes' block size for optimizer states:
// small enough for outliers to stay local, large enough for the scales to cost 1.6%).
//
// Maps. The first moment uses bitsandbytes' signed dynamic tree map, the second the
// unsigned one (create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)): per
// decade 10^-k (k = 0..6) the codes are the midpoints of 2^(6-k) (signed, per sign) or
// 2^(7-k) (unsigned) equal steps of [0.1, 1]·10^-k, plus 0 and 1. Worst rounding error
// (half the widest gap between codes): 0.00703·absmax (signed), 0.00352·absmax (unsigned).
// Not a linear map: v is a square, so a 100× spread of gradients in a block is a 10^4×
// spread of v; a linear map's step absmax/255 turns every v below absmax/510 into 0, and
// m / (sqrt(v) + eps) then jumps by orders of magnitude. One change from bitsandbytes: a
// positive v never rounds to the code 0 (v in (0, 1.6e-7·absmax) rounds up to the smallest
// code, 3.25e-7·absmax), for the same reason (Li et al., "Memory Efficient Optimizers with 4-bit
// States", 2023, found v's zero code to be what breaks low-bit Adam). Measured on a small
// LLaMA's AdamW moments (tests/optim/quantize_test.cpp), relative L2 error of the update
// m̂/(sqrt(v̂)+eps) after 1 step / after 30: 3.9% / 1.6% here, 2500% / 1.6% with v rounding
// to 0 as in bitsandbytes, 2.6e6% / 3.8e5% with linear maps.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <torch/torch.h>

namespace memopt::optim {

/// Elements that share one fp32 absmax in a block-quantised tensor.
inline constexpr int64_t kQuantBlockSize = 256;

/// Blocks of kQuantBlockSize in n elements (the last one may be partial).
inline constexpr int64_t num_quant_blocks(int64_t n) { return (n + kQuantBlockSize - 1) / kQuantBlockSize; }

/// bitsandbytes' dynamic tree map: 256 sorted fp32 values in [-1, 1] (signed) or [0, 1]
/// (unsigned), dense near 0 in relative terms (see the header comment).
///   torch::Tensor map = memopt::optim::dynamic_map(/*is_signed=*/true);   // (256,)
inline torch::Tensor dynamic_map(bool is_signed) {
  constexpr int kMaxExponentBits = 7;
  std::vector<double> data;
  data.reserve(256);
  for (int i = 0; i < kMaxExponentBits; ++i) {
    const int64_t steps = is_signed ? (int64_t{1} << i) : (int64_t{1} << (i + 1));  // equal steps of [0.1, 1]
    const double scale = std::pow(10.0, i - (kMaxExponentBits - 1));
    for (int64_t k = 0; k < steps; ++k) {
      const double lo = 0.1 + 0.9 * static_cast<double>(k) / static_cast<double>(steps);
      const double hi = 0.1 + 0.9 * static_cast<double>(k + 1) / static_cast<double>(steps);
      data.push_back(scale * (lo + hi) / 2);
      if (is_signed) data.push_back(-scale * (lo + hi) / 2);
    }
  }
  data.push_back(0.0);
  data.push_back(1.0);
  std::sort(data.begin(), data.end());
  return torch::tensor(data, torch::kDouble).to(torch::kFloat);  // (256,)
}

/// A tensor quantised block-wise into a 256-entry map.
struct BlockQuantized {
  torch::Tensor codes;   // (n,) uint8: indices into the map
  torch::Tensor absmax;  // (⌈n/256⌉,) fp32: max |x| of each block
};

namespace detail {

/// The 255 decision boundaries of rounding to the nearest code: midpoints of neighbouring
/// codes; with keep_nonzero (a map of values >= 0 starting at 0) the first boundary is 0
/// itself, so only 0 takes the code of 0.
inline torch::Tensor map_boundaries(const torch::Tensor& map, bool keep_nonzero) {  // (256,) -> (255,)
  torch::Tensor boundaries = (map.slice(0, 1) + map.slice(0, 0, -1)) / 2;
  if (keep_nonzero) {
    TORCH_CHECK(map[0].item<float>() == 0, "memopt::optim: keep_nonzero needs a map of values >= 0 that starts at 0 ",
                "(got a first code of ", map[0].item<float>(), "). HINT: use memopt::optim::dynamic_map(false).");
    boundaries[0] = 0;
  }
  return boundaries;
}

/// Quantises x (len,) fp32, len a multiple of `width` (blocks of `width`), into
/// codes (len,) uint8 and absmax (len / width,) fp32. Overwrites x.
inline void quantize_into(torch::Tensor x, int64_t width, const torch::Tensor& boundaries, torch::Tensor codes,
                          torch::Tensor absmax) {
  torch::Tensor blocks = x.view({-1, width});  // (nb, width)
  torch::Tensor block_max = at::linalg_vector_norm(blocks, std::numeric_limits<double>::infinity(), {1});  // (nb,)
  absmax.copy_(block_max);
  blocks.div_(block_max.masked_fill(block_max == 0, 1).unsqueeze(1));  // in [-1, 1]; an all-zero block stays 0
  codes.copy_(torch::bucketize(x, boundaries, /*out_int32=*/true, /*right=*/false));
}

/// map[codes] · absmax of each block of `width`: (len,) fp32, a fresh tensor.
inline torch::Tensor dequantize(const torch::Tensor& codes, const torch::Tensor& absmax, int64_t width,
                                const torch::Tensor& map) {
  torch::Tensor values = map.index_select(0, codes.to(torch::kLong));  // (len,)
  values.view({-1, width}).mul_(absmax.unsqueeze(1));
  return values;
}

/// Calls fn(offset, len, width) over [0, n) in pieces of at most `chunk` elements (a multiple
/// of 256) whose blocks all have `width` elements: full blocks, then the partial last block.
template <class Fn>
void for_each_block_range(int64_t n, int64_t chunk, Fn&& fn) {
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start);
    const int64_t full = len / kQuantBlockSize * kQuantBlockSize;
    if (full > 0) fn(start, full, kQuantBlockSize);
    if (len > full) fn(start + full, len - full, len - full);
  }
}

/// Nearest-code rounding on the CPU in one table lookup and one compare: a table indexed by
/// the top 16 bits of the float (sign, exponent, 7 mantissa bits) holds the number of
/// boundaries below the smallest value with those bits; no such range of the dynamic maps
/// holds more than one boundary (checked here), so one compare finishes the count.
/// Same result as torch::bucketize(y, boundaries, right=false): #{boundaries < y}.
struct CodeBook {
  std::array<float, 256> codes{};
  std::array<float, 256> boundaries{};  // 255 boundaries, then +inf
  std::vector<uint8_t> start;           // 65536: #{boundaries < the smallest float of each key}

  CodeBook(const torch::Tensor& map, const torch::Tensor& bounds) : start(65536) {
    const torch::Tensor m = map.to(torch::kCPU, torch::kFloat).contiguous();
    const torch::Tensor b = bounds.to(torch::kCPU, torch::kFloat).contiguous();
    std::copy(m.data_ptr<float>(), m.data_ptr<float>() + 256, codes.begin());
    std::copy(b.data_ptr<float>(), b.data_ptr<float>() + 255, boundaries.begin());
    boundaries[255] = std::numeric_limits<float>::infinity();
    auto below = [&](float x) {  // #{boundaries < x}
      return std::lower_bound(boundaries.begin(), boundaries.begin() + 255, x) - boundaries.begin();
    };
    for (uint32_t key = 0; key < 65536; ++key) {
      // Positive keys grow with the value, negative ones shrink: the smallest and largest float of the key.
      const bool negative = (key & 0x8000u) != 0;
      const float smallest = std::bit_cast<float>(negative ? ((key << 16) | 0xFFFFu) : (key << 16));
      const float largest = std::bit_cast<float>(negative ? (key << 16) : ((key << 16) | 0xFFFFu));
      start[key] = static_cast<uint8_t>(below(smallest));
      TORCH_INTERNAL_ASSERT(!std::isfinite(smallest) || !std::isfinite(largest) || below(largest) - below(smallest) <= 1,
                            "memopt::optim::detail::CodeBook: more than one boundary between ", smallest, " and ",
                            largest);
    }
  }
  uint8_t encode(float y) const {
    const unsigned code = start[std::bit_cast<uint32_t>(y) >> 16];
    return static_cast<uint8_t>(code + (boundaries[code] < y));
  }
};

}  // namespace detail

/// Quantises x block-wise (blocks of 256 of the flattened tensor) into `map` with
/// nearest-code rounding. Error per element <= half the widest gap of the map · absmax.
/// keep_nonzero (non-negative maps, as AdamW8bit's second moment): only 0 takes the code
/// of 0; positive values below half the smallest positive code round up to it.
///   auto q = memopt::optim::quantize_blockwise(x, memopt::optim::dynamic_map(true));
inline BlockQuantized quantize_blockwise(const torch::Tensor& x, const torch::Tensor& map, bool keep_nonzero = false) {
  TORCH_CHECK(map.dim() == 1 && map.numel() == 256, "memopt::optim::quantize_blockwise: the map must hold 256 ",
              "sorted values (got shape ", map.sizes(), "). HINT: use memopt::optim::dynamic_map(is_signed).");
  torch::NoGradGuard no_grad;
  const torch::Tensor flat = x.detach().reshape({-1});  // (n,)
  const torch::Tensor boundaries = detail::map_boundaries(map.to(flat.device(), torch::kFloat), keep_nonzero);
  BlockQuantized q{torch::empty({flat.numel()}, flat.options().dtype(torch::kByte)),
                   torch::empty({num_quant_blocks(flat.numel())}, flat.options().dtype(torch::kFloat))};
  detail::for_each_block_range(flat.numel(), int64_t{1} << 18, [&](int64_t offset, int64_t len, int64_t width) {
    const int64_t block = offset / kQuantBlockSize;
    detail::quantize_into(flat.slice(0, offset, offset + len).to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true),
                          width, boundaries, q.codes.slice(0, offset, offset + len),
                          q.absmax.slice(0, block, block + len / width));
  });
  return q;
}

/// The fp32 values (n,) of a block-quantised tensor.
///   torch::Tensor x_hat = memopt::optim::dequantize_blockwise(q, map).view_as(x);
inline torch::Tensor dequantize_blockwise(const BlockQuantized& q, const torch::Tensor& map) {
  const int64_t n = q.codes.numel();
  TORCH_CHECK(q.absmax.numel() == num_quant_blocks(n), "memopt::optim::dequantize_blockwise: ", n, " codes need ",
              num_quant_blocks(n), " block scales (got ", q.absmax.numel(),
              "). HINT: pass the BlockQuantized that quantize_blockwise returned.");
  torch::Tensor out = torch::empty({n}, q.absmax.options());  // (n,)
  const torch::Tensor m = map.to(q.absmax.device(), torch::kFloat);
  detail::for_each_block_range(n, int64_t{1} << 18, [&](int64_t offset, int64_t len, int64_t width) {
    const int64_t block = offset / kQuantBlockSize;
    out.slice(0, offset, offset + len)
        .copy_(detail::dequantize(q.codes.slice(0, offset, offset + len),
                                  q.absmax.slice(0, block, block + len / width), width, m));
  });
  return out;
}

}  // namespace memopt::optim
