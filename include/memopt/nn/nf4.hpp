// memopt/nn/nf4.hpp — NF4, the 4-bit NormalFloat of QLoRA (Dettmers et al., "QLoRA: Efficient
// Finetuning of Quantized LLMs", 2023): frozen base weights in 4 bits per parameter, bit for bit
// as bitsandbytes' quantize_4bit(w, blocksize, quant_type="nf4", compress_statistics).
//
// Layout. The flattened weight (n elements) is cut into blocks of `blocksize` (64: QLoRA's);
// each element becomes the index 0..15 of the NF4 code (kNf4Codes, sorted, code 7 = 0) nearest
// to element / absmax of its block. Two indices share a byte, the even element in the high
// nibble: packed[i] = idx[2i] << 4 | idx[2i + 1], ⌈n/2⌉ bytes, bitsandbytes' packed tensor
// flattened. A numel that is not a multiple of blocksize leaves a short last block, quantised
// as if padded with zeros (its absmax is that of its real elements; an odd n pads the low
// nibble of the last byte with 7, the code of 0). Scales: one fp32 absmax per block, 0.5625
// B/param; or with double quantisation (QLoRA §3, the default) offset = mean(absmax) and
// absmax - offset quantised with optim::quantize_blockwise (blocks of 256, the signed 8-bit
// dynamic map): 1 B per block + 4 B per 256 blocks + 4 B, 0.5159 B/param.
//
// Reference: bitsandbytes 0.50.2 on the CPU (tests/nn/nf4_test.cpp, tests/baselines/
// nf4_reference.py): same codes, absmax, double-quant state and dequantised values, bit for bit.
// Matched: nearest code, a value on a midpoint taking the lower code (torch.bucketize);
// full blocks scaled by x · (1/absmax), the short last block by x / absmax; an all-zero short
// last block stores absmax 1e-38 (bnb clamps it there), a full one 0; the dynamic map computed
// in fp32 as bnb's create_dynamic_map (optim::dynamic_map(true) computes in double and differs
// in the last bit of 72 codes). Not matched: bnb's CPU C kernel of the 8-bit step rounds through
// a 65536-entry table, so ~0.2% of its double-quant codes are a neighbour of the nearest one;
// memopt follows bnb's pure-torch kernel (nearest code). memopt divides by the 256-block absmax
// where bnb multiplies by its reciprocal: a code could differ for a value within 1 ulp of a
// midpoint (none in 142k values measured).
//   auto q = memopt::nn::quantize_nf4(linear->weight, memopt::nn::Nf4Options().blocksize(64));
//   torch::Tensor w = q.dequantize(torch::kBFloat16);   // linear->weight's shape; q.nbytes(): 0.516 B/param
#pragma once

#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/parallel.hpp"
#include "memopt/optim/quantize.hpp"

namespace memopt::nn {

/// The 16 NF4 codes, sorted (bitsandbytes' get_4bit_type("nf4"), QLoRA's quantiles of N(0, 1)
/// scaled to [-1, 1], with an exact 0 at index 7).
inline constexpr std::array<float, 16> kNf4Codes = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

/// The NF4 codes as a (16,) fp32 tensor.  torch::Tensor map = memopt::nn::nf4_map();
inline torch::Tensor nf4_map(torch::Device device = torch::kCPU) {
  return torch::tensor(std::vector<float>(kNf4Codes.begin(), kNf4Codes.end()), torch::kFloat).to(device);
}

/// Options for quantize_nf4.  memopt::nn::Nf4Options().blocksize(64).double_quant(true)
struct Nf4Options {
  /// Elements per absmax: a power of two from 32 to 4096, as bitsandbytes allows.
  TORCH_ARG(int64_t, blocksize) = 64;
  /// Quantise the absmax too (8 bits, blocks of 256 around their mean), as QLoRA.
  TORCH_ARG(bool, double_quant) = true;
};

/// A weight in NF4: packed 4-bit codes and the scales of its blocks.
struct Nf4Tensor {
  torch::Tensor packed;                 // (⌈numel/2⌉,) uint8: two code indices a byte, the first high
  torch::Tensor absmax;                 // (blocks,) fp32; undefined with double quantisation
  optim::BlockQuantized absmax_quant;   // double quantisation: codes (blocks,) uint8 of absmax - offset,
                                        // absmax (⌈blocks/256⌉,) fp32 of each 256 of them
  torch::Tensor absmax_offset;          // double quantisation: () fp32, the mean of the absmax
  std::vector<int64_t> shape;           // the original weight's
  torch::ScalarType dtype = torch::kFloat;
  int64_t blocksize = 64;
  int64_t numel = 0;

  bool double_quant() const { return absmax_offset.defined(); }
  int64_t num_blocks() const { return (numel + blocksize - 1) / blocksize; }
  /// Bytes held: packed codes and scales (not the code tables, which are constants).
  int64_t nbytes() const {
    if (!double_quant()) return static_cast<int64_t>(packed.nbytes() + absmax.nbytes());
    return static_cast<int64_t>(packed.nbytes() + absmax_quant.codes.nbytes() + absmax_quant.absmax.nbytes() +
                                absmax_offset.nbytes());
  }
  /// The fp32 absmax of each block (blocks,), decoded from the double quantisation if any.
  torch::Tensor block_absmax() const;
  /// The weight in `dtype` (a floating type), of the original shape.
  ///   torch::Tensor w = q.dequantize(torch::kBFloat16);
  torch::Tensor dequantize(torch::ScalarType dtype) const;
  /// The same in the original dtype.
  torch::Tensor dequantize() const { return dequantize(dtype); }
};

namespace detail {

/// bitsandbytes' create_dynamic_map(signed=True) as it computes it, in fp32 torch ops: per
/// decade 10^(i-6), the midpoints of 2^i equal steps of linspace(0.1, 1) times ±10^(i-6); then
/// 0 and 1, sorted: (256,) fp32. Holds the same values as optim::dynamic_map(true) up to the
/// last bit, which the double-quant state must match.
inline torch::Tensor nested_map(torch::Device device = torch::kCPU) {
  constexpr std::array<double, 7> kDecades = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};  // Python's 10 ** (i - 6)
  std::vector<torch::Tensor> parts;
  for (int64_t i = 0; i < 7; ++i) {
    const torch::Tensor edges = torch::linspace(0.1, 1, (int64_t{1} << i) + 1, torch::kFloat);  // (2^i + 1,)
    const torch::Tensor means = (edges.slice(0, 0, -1) + edges.slice(0, 1)) / 2.0;                // (2^i,)
    parts.push_back(means * kDecades[i]);
    parts.push_back(means * -kDecades[i]);
  }
  parts.push_back(torch::tensor({0.0f, 1.0f}));
  return std::get<0>(torch::cat(parts).sort()).to(device);  // (256,)
}

/// The NF4 values of every byte's two codes, the high nibble first: (256, 2) fp32, row b =
/// (code[b >> 4], code[b & 15]).
inline torch::Tensor nf4_pair_map(torch::Device device) {
  const torch::Tensor byte = torch::arange(256, torch::kLong);
  const torch::Tensor codes = nf4_map();
  const torch::Tensor high = codes.index_select(0, byte.bitwise_right_shift(4));  // (256,)
  const torch::Tensor low = codes.index_select(0, byte.bitwise_and(15));          // (256,)
  return torch::stack({high, low}, 1).to(device);                                 // (256, 2)
}

inline void check_blocksize(int64_t blocksize, const char* who) {
  TORCH_CHECK(blocksize >= 32 && blocksize <= 4096 && (blocksize & (blocksize - 1)) == 0, who,
              ": blocksize must be a power of two from 32 to 4096, as bitsandbytes' quantize_4bit accepts (got ",
              blocksize, "). HINT: use 64, QLoRA's (Nf4Options's default).");
}

/// Elements [begin, end) of q's flattened weight into out[0, end - begin): code · absmax in fp32,
/// then T's rounding (what the composite's fp32 product and .to(T) give, bit for bit). One pass
/// over the packed bytes; `scale` (blocks,) fp32 from block_absmax(). Each block's 16 values are
/// made once (16 products and roundings per block, not one per element), then each byte is two
/// look-ups.
template <class T>
void dequantize_nf4_range(const uint8_t* packed, const float* scale, int64_t blocksize, int64_t begin, int64_t end,
                          T* out) {
  T value[16];
  for (int64_t e = begin; e < end;) {
    const int64_t block = e / blocksize, stop = std::min(end, (block + 1) * blocksize);
    const float s = scale[block];
    for (int c = 0; c < 16; ++c) value[c] = static_cast<T>(kNf4Codes[c] * s);
    T* dst = out + (e - begin);
    if ((e & 1) && e < stop) *dst++ = value[packed[e >> 1] & 15], ++e;  // a low nibble first
    const uint8_t* byte = packed + (e >> 1);
    for (; e + 1 < stop; e += 2, ++byte, dst += 2) dst[0] = value[*byte >> 4], dst[1] = value[*byte & 15];
    if (e < stop) *dst = value[*byte >> 4], ++e;  // a high nibble last
  }
}

/// A (rows, cols) tensor of `dtype` holding q's flattened elements first + r · stride + c, as
/// dequantize_nf4_range computes them, on ATen's threads; q on the CPU. The whole weight:
/// (q, scale, 0, 0, 1, numel); rows [r0, r0 + n) of an (out, in) weight: (r0 · in, in, n, in);
/// its columns [c0, c0 + n): (c0, in, out, n).
inline torch::Tensor dequantize_nf4_cpu(const Nf4Tensor& q, const torch::Tensor& scale, int64_t first, int64_t stride,
                                        int64_t rows, int64_t cols, torch::ScalarType dtype) {
  constexpr int64_t kGrain = int64_t{1} << 16;  // elements a chunk: below that a thread costs more than it saves
  torch::Tensor out = torch::empty({rows, cols}, torch::TensorOptions().dtype(dtype));
  const auto* packed = q.packed.data_ptr<uint8_t>();
  const auto* s = scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(torch::kBFloat16, torch::kHalf, dtype, "dequantize_nf4_cpu", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    memopt::detail::parallel_chunks(rows * cols, kGrain, [&](int64_t lo, int64_t hi, int64_t) {
      for (int64_t f = lo; f < hi;) {  // f: flat index into out; one row's run at a time
        const int64_t r = f / cols, c = f % cols, n = std::min(hi - f, cols - c);
        const int64_t begin = first + r * stride + c;
        dequantize_nf4_range(packed, s, q.blocksize, begin, begin + n, dst + f);
        f += n;
      }
    });
  });
  return out;
}

}  // namespace detail

/// Quantises a floating tensor of any shape to NF4, computing in fp32 (see the header comment).
///   auto q = memopt::nn::quantize_nf4(w, memopt::nn::Nf4Options().double_quant(false));
inline Nf4Tensor quantize_nf4(const torch::Tensor& w, const Nf4Options& options = {}) {
  const char* who = "memopt::nn::quantize_nf4";
  TORCH_CHECK(w.defined(), who, ": w is undefined. HINT: pass a weight, e.g. linear->weight.");
  TORCH_CHECK(at::isFloatingType(w.scalar_type()), who, ": w must be a floating-point tensor (got ",
              w.scalar_type(), "). HINT: NF4 quantises float weights; cast integers with .to(torch::kFloat).");
  TORCH_CHECK(w.numel() > 0, who, ": w is empty (shape ", w.sizes(),
              "). HINT: quantise only weights with elements; keep empty ones as they are.");
  const int64_t bs = options.blocksize();
  detail::check_blocksize(bs, who);
  torch::NoGradGuard no_grad;
  const torch::Tensor flat = w.detach().reshape({-1}).to(torch::kFloat);  // (n,) fp32
  const torch::Tensor bad = flat.isfinite().logical_not();                  // (n,) bool
  if (bad.any().item<bool>()) {
    const int64_t first = bad.nonzero()[0][0].item<int64_t>();
    TORCH_CHECK(false, who, ": w holds ", bad.sum().item<int64_t>(), " non-finite value(s) in fp32, the first ",
                w.detach().reshape({-1})[first].item<double>(), " at flat index ", first,
                ". HINT: an absmax of inf or nan would spoil the whole block; find where the weight diverged "
                "(or, for a float64 weight, a value beyond fp32's range).");
  }

  Nf4Tensor q;
  q.shape = w.sizes().vec();
  q.dtype = w.scalar_type();
  q.blocksize = bs;
  q.numel = flat.numel();
  const int64_t n = q.numel, full = n / bs * bs, blocks = q.num_blocks();
  const auto f32 = flat.options();

  // ---- scale: absmax per block, elements into [-1, 1] as bitsandbytes' quantize_4bit ----
  torch::Tensor absmax = torch::empty({blocks}, f32);   // (blocks,)
  torch::Tensor scaled = torch::zeros({n + n % 2}, f32);  // (n rounded up to even,): an odd n pads a 0
  if (full > 0) {
    const torch::Tensor body = flat.slice(0, 0, full).view({-1, bs});  // (full / bs, bs)
    const torch::Tensor body_max = body.abs().amax(1);                  // (full / bs,): 0 for a zero block
    absmax.slice(0, 0, full / bs).copy_(body_max);
    scaled.slice(0, 0, full).view({-1, bs}).copy_(
        torch::clamp(body * body_max.clamp_min(1e-38).reciprocal().unsqueeze(1), -1, 1));
  }
  if (full < n) {  // the short last block: divided by its absmax, which is stored clamped to 1e-38
    const torch::Tensor tail = flat.slice(0, full);                  // (n - full,)
    const torch::Tensor tail_max = tail.abs().max().clamp_min(1e-38);  // ()
    absmax.slice(0, blocks - 1).copy_(tail_max);
    scaled.slice(0, full, n).copy_(torch::clamp(tail / tail_max, -1, 1));
  }

  // ---- round to the nearest code (on a midpoint: the lower one), pack two a byte ----
  const torch::Tensor map = nf4_map(flat.device());
  const torch::Tensor bounds = (map.slice(0, 0, -1) + map.slice(0, 1)) / 2;  // (15,)
  const torch::Tensor idx = torch::bucketize(scaled, bounds, /*out_int32=*/true, /*right=*/false)
                                .to(torch::kByte).view({-1, 2});  // (⌈n/2⌉, 2)
  q.packed = (idx.select(1, 0) * 16 + idx.select(1, 1)).contiguous();  // (⌈n/2⌉,) uint8

  // ---- scales: fp32, or 8-bit codes of absmax - mean in blocks of 256 ----
  if (!options.double_quant()) {
    q.absmax = absmax;
    return q;
  }
  static_assert(optim::kQuantBlockSize == 256, "bitsandbytes double-quantises the absmax in blocks of 256");
  q.absmax_offset = absmax.mean();  // () fp32
  q.absmax_quant = optim::quantize_blockwise(absmax - q.absmax_offset, detail::nested_map(flat.device()));
  const int64_t outer = q.absmax_quant.absmax.numel();
  if (blocks % optim::kQuantBlockSize != 0) {  // bnb clamps a zero short last block's absmax to 1e-38 too
    q.absmax_quant.absmax.slice(0, outer - 1).clamp_min_(1e-38);
  }
  return q;
}

/// The weight of `q` in `dtype`, of its original shape: code · absmax in fp32, then cast.
///   torch::Tensor w = memopt::nn::dequantize_nf4(q, torch::kFloat);
inline torch::Tensor dequantize_nf4(const Nf4Tensor& q, torch::ScalarType dtype) {
  const char* who = "memopt::nn::dequantize_nf4";
  TORCH_CHECK(at::isFloatingType(dtype), who, ": dtype must be a floating type (got ", dtype,
              "). HINT: torch::kFloat, torch::kBFloat16 or torch::kFloat16.");
  TORCH_CHECK(q.packed.defined() && q.packed.scalar_type() == torch::kByte && q.packed.numel() == (q.numel + 1) / 2,
              who, ": ", q.numel, " elements need ", (q.numel + 1) / 2, " packed uint8 bytes (got ",
              q.packed.defined() ? q.packed.numel() : 0, "). HINT: pass the Nf4Tensor that quantize_nf4 returned.");
  detail::check_blocksize(q.blocksize, who);
  torch::NoGradGuard no_grad;
  const torch::Tensor scale = q.block_absmax();  // (blocks,) fp32
  const int64_t n = q.numel, bs = q.blocksize, full = n / bs * bs, blocks = q.num_blocks();
  TORCH_CHECK(scale.numel() == blocks, who, ": ", n, " elements in blocks of ", bs, " need ", blocks,
              " absmax (got ", scale.numel(), "). HINT: pass the Nf4Tensor that quantize_nf4 returned.");
  if (q.packed.is_cpu() && q.packed.is_contiguous()) {  // one pass, no fp32 copy on the way
    return detail::dequantize_nf4_cpu(q, scale.contiguous(), 0, 0, 1, n, dtype).view(q.shape);
  }
  // On other devices: one look-up in the (256, 2) table of code pairs (a byte holds two codes),
  // indexed by the packed bytes as int32 (index_select's narrowest index type).
  const torch::Tensor pairs = detail::nf4_pair_map(q.packed.device());  // (256, 2) fp32
  torch::Tensor values =
      pairs.index_select(0, q.packed.to(torch::kInt)).view({-1}).slice(0, 0, n);  // (n,) fp32
  if (full > 0) values.slice(0, 0, full).view({-1, bs}).mul_(scale.slice(0, 0, full / bs).unsqueeze(1));
  if (full < n) values.slice(0, full).mul_(scale.slice(0, blocks - 1));
  return values.to(dtype).view(q.shape);
}

inline torch::Tensor Nf4Tensor::block_absmax() const {
  if (!double_quant()) return absmax;
  TORCH_CHECK(absmax_quant.codes.defined() && absmax_quant.absmax.defined(), "memopt::nn::Nf4Tensor: the absmax ",
              "offset is set but not its codes. HINT: pass the Nf4Tensor that quantize_nf4 returned.");
  return optim::dequantize_blockwise(absmax_quant, detail::nested_map(absmax_quant.absmax.device())) + absmax_offset;
}

inline torch::Tensor Nf4Tensor::dequantize(torch::ScalarType dtype) const { return dequantize_nf4(*this, dtype); }

}  // namespace memopt::nn
