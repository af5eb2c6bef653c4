#!/usr/bin/env python3
"""tests/baselines/nf4_reference.py — bitsandbytes' NF4 quantisation of the weights that
tests/nn/nf4_test.cpp wrote, for memopt/nn/nf4.hpp to reproduce bit for bit.

  nf4_reference.py IN OUT

IN (a safetensors file written by memopt::io::save_safetensors) holds, per case C,
  C/w           the weight (F32, BF16 or F16; any shape)
  C/blocksize   I64 scalar
OUT (written with safetensors.torch) holds
  nf4_code, dynamic_code   get_4bit_type("nf4") and create_dynamic_map(signed=True): the code tables
  C/packed, C/absmax       quantize_4bit(w, blocksize, quant_type="nf4"): packed codes, flattened
                           (U8, ceil(n/2)), and the fp32 absmax per block
  C/deq, C/deq_f32         dequantize_4bit of that state in w's dtype and in fp32 (w's shape)
  C/dq/...                 the same with double quantisation (compress_statistics=True):
    offset, codes, absmax2 the mean of the absmax, the uint8 codes of absmax - offset and the
                           fp32 absmax of each 256 of them, rounded to the nearest code by
                           bitsandbytes' pure-torch kernel (backends/default) of quantize_blockwise
    deq, deq_f32           dequantize_4bit of that state
    cpu_offset, cpu_codes, cpu_absmax2
                           quantize_4bit(compress_statistics=True) as it runs on the CPU, whose C
                           kernel for the 8-bit step rounds through a 65536-entry table over
                           [-1, 1] rather than to the nearest code (csrc/cpu_ops.cpp,
                           quantize_cpu_impl): a code can be a neighbour of the nearest one

Two things about bitsandbytes 0.50.2 on the CPU that the script steps around:
- dequantize_4bit's AVX-512 kernel (csrc/cpu_ops.cpp, dequantizeBlockwise4bitCpu) looks the
  absmax up per row, block_idx * (n / blocksize) + column / blocksize, which is wrong when the
  last dimension is not a multiple of blocksize (shape (3, 96), blocksize 64: flat elements
  128..159 take block 1's absmax instead of block 2's, 192..255 block 2's instead of block 3's).
  The script dequantises the flattened state (shape (n,): one row, where that indexing is the
  flat one) and reshapes; the products are the same.
- its pure-torch dequantisation is wrapped in torch.compile; TORCH_COMPILE_DISABLE runs it
  eagerly (the same fp32 products, without compiling once per shape).

Exit status 0 on success, 1 when bitsandbytes disagrees with itself (the reason on stderr),
2 on bad usage or when bitsandbytes or safetensors cannot be imported.
"""
import os
import sys
import warnings

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
warnings.filterwarnings("ignore")  # bitsandbytes warns that the optional 'kernels' package is missing

try:
    import torch
    import safetensors.torch
    import bitsandbytes
    import bitsandbytes.functional as F
except ImportError as e:
    sys.stderr.write(f"nf4_reference.py: {e}. HINT: run scripts/deps (requirements.txt installs bitsandbytes "
                     "and safetensors into .venv)\n")
    sys.exit(2)

# bitsandbytes' own pure-torch kernel of quantize_blockwise (nearest code, ties to the lower
# one), called past the CPU kernel registered over it.
DEFAULT_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def fail(message):
    sys.stderr.write("nf4_reference.py: " + message + "\n")
    sys.exit(1)


def dequantize(packed, state, shape, dtype):
    """dequantize_4bit of `state` as a flat (n,) tensor in `dtype`, reshaped to `shape`."""
    state.shape = torch.Size([shape.numel()])
    state.dtype = dtype
    return F.dequantize_4bit(packed, state, quant_type="nf4").reshape(shape)


def reference(name, w, blocksize):
    out = {}
    packed, state = F.quantize_4bit(w, blocksize=blocksize, quant_type="nf4", compress_statistics=False)
    out[f"{name}/packed"] = packed.flatten()
    out[f"{name}/absmax"] = state.absmax
    out[f"{name}/deq"] = dequantize(packed, state, w.shape, w.dtype)
    out[f"{name}/deq_f32"] = dequantize(packed, state, w.shape, torch.float32)

    # Double quantisation as bitsandbytes runs it on the CPU.
    packed_dq, cpu = F.quantize_4bit(w, blocksize=blocksize, quant_type="nf4", compress_statistics=True)
    if not torch.equal(packed_dq, packed):
        fail(f"{name}: quantize_4bit's codes change with compress_statistics")
    out[f"{name}/dq/cpu_offset"] = cpu.offset
    out[f"{name}/dq/cpu_codes"] = cpu.absmax
    out[f"{name}/dq/cpu_absmax2"] = cpu.state2.absmax

    # The same steps as functional.quantize_4bit(compress_statistics=True), the 8-bit one by
    # the nearest-code kernel: offset = absmax.mean(), quantize_blockwise(absmax - offset, 256).
    offset = state.absmax.mean()
    codes, absmax2 = torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(
        DEFAULT_KERNEL, state.absmax - offset, cpu.state2.code, 256)
    if not torch.equal(offset, cpu.offset):
        fail(f"{name}: offset {offset.item()} != quantize_4bit's {cpu.offset.item()}")
    state2 = F.QuantState(absmax=absmax2, code=cpu.state2.code, blocksize=256, dtype=torch.float32)
    nested = F.QuantState(absmax=codes, shape=w.shape, dtype=w.dtype, blocksize=blocksize, code=cpu.code,
                          quant_type="nf4", offset=offset, state2=state2)
    out[f"{name}/dq/offset"] = offset
    out[f"{name}/dq/codes"] = codes
    out[f"{name}/dq/absmax2"] = absmax2
    out[f"{name}/dq/deq"] = dequantize(packed, nested, w.shape, w.dtype)
    out[f"{name}/dq/deq_f32"] = dequantize(packed, nested, w.shape, torch.float32)
    return out


def main(path_in, path_out):
    tensors = safetensors.torch.load_file(path_in)
    names = sorted(key[: -len("/w")] for key in tensors if key.endswith("/w"))
    if not names:
        fail(f"{path_in} holds no tensor named <case>/w")
    out = {"nf4_code": F.get_4bit_type("nf4", device="cpu"), "dynamic_code": F.create_dynamic_map(signed=True)}
    for name in names:
        out.update(reference(name, tensors[f"{name}/w"], int(tensors[f"{name}/blocksize"].item())))
    out = {key: value.contiguous() for key, value in out.items()}
    safetensors.torch.save_file(out, path_out)
    print(f"wrote {len(names)} cases to {path_out} with bitsandbytes {bitsandbytes.__version__}, "
          f"torch {torch.__version__}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.stderr.write(__doc__)
        sys.exit(2)
    main(sys.argv[1], sys.argv[2])
