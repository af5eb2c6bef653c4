#!/usr/bin/env python3
"""tests/io/safetensors_check.py — cross-checks memopt::io's safetensors files both ways, with an
independent reader and writer (json and numpy only) byte for byte, and with the `safetensors`
package itself (safetensors.torch, what HF and PyTorch users load and save with).

  safetensors_check.py verify FILE           FILE (written by memopt) must hold exactly RECIPE
  safetensors_check.py write FILE            writes RECIPE for memopt to read: no header padding,
                                             a scrambled order and unaligned offsets
  safetensors_check.py verify-package FILE   safetensors.torch.load_file(FILE) must equal RECIPE
                                             and safe_open must see its metadata
  safetensors_check.py write-package FILE    safetensors.torch.save_file(RECIPE, FILE, metadata)

RECIPE is also spelled out in tests/io/safetensors_test.cpp (recipe()); keep the two equal.
Exit status 0 on success, 1 on a mismatch (the reason on stderr), 2 on bad usage or no numpy.
"""
import json
import struct
import sys

try:
    import numpy as np
except ImportError:
    sys.stderr.write("safetensors_check.py: cannot import numpy. HINT: apt-get install python3-numpy\n")
    sys.exit(2)

# name, safetensors dtype, shape, values in row-major order (exact in their dtype, but f32's
# 0.1 and 1e30, which round to nearest on both sides)
RECIPE = [
    ("f32", "F32", [2, 3], [-1.25, 0.0, 0.1, 3.5, 1e30, -7.0]),
    ("f64", "F64", [3], [0.0, 1.0 / 3.0, -2.5e-300]),
    ("f16", "F16", [2, 2], [0.5, -2.0, 65504.0, 2.0**-14]),
    ("bf16", "BF16", [6], [1.0, -0.5, 256.0, 2.0**-7, -3.0, 1.5]),
    ("i64", "I64", [3], [-(2**40), 0, 2**62 + 5]),
    ("i32", "I32", [2, 2], [-(2**31), -1, 0, 2**31 - 1]),
    ("i16", "I16", [3], [-32768, 7, 32767]),
    ("i8", "I8", [3], [-128, 0, 127]),
    ("u8", "U8", [2, 3], [0, 1, 128, 200, 254, 255]),
    ("bool", "BOOL", [4], [True, False, False, True]),
    ("scalar", "F32", [], [3.5]),
    ("empty", "F32", [0, 3], []),
]
METADATA = {"format": "pt", "recipe": "memopt-check-v1"}

NUMPY = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
         "I8": "i1", "U8": "u1", "BOOL": "?"}


def encode(dtype, values):
    """The little-endian bytes of `values` stored as `dtype`."""
    if dtype == "BF16":  # bf16 = the top 16 bits of a float32 (exact for the recipe's values)
        bits = np.array(values, dtype="<f4").view("<u4") >> 16
        return bits.astype("<u2").tobytes()
    return np.array(values, dtype=NUMPY[dtype]).tobytes()


def decode(dtype, raw):
    """`raw` bytes of `dtype` as a numpy array (bf16 widened to float32 by a 16-bit shift)."""
    if dtype == "BF16":
        return (np.frombuffer(raw, dtype="<u2").astype("<u4") << 16).view("<f4")
    return np.frombuffer(raw, dtype=NUMPY[dtype])


def fail(message):
    sys.stderr.write("safetensors_check.py: " + message + "\n")
    sys.exit(1)


def verify(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        fail(f"{path}: {len(blob)} bytes, fewer than the length field")
    (n,) = struct.unpack("<Q", blob[:8])
    if n % 8 != 0 or 8 + n > len(blob):
        fail(f"{path}: header length {n} is not a multiple of 8 or runs past the file ({len(blob)} bytes)")
    text = blob[8:8 + n].decode("utf-8")
    if not (text.startswith("{") and text.rstrip(" ").endswith("}")):
        fail(f"{path}: header is not a JSON object padded with spaces")
    header = json.loads(text)
    data = blob[8 + n:]
    if header.pop("__metadata__", None) != METADATA:
        fail(f"{path}: metadata differs from {METADATA}")
    if list(header) != [name for name, *_ in RECIPE]:
        fail(f"{path}: tensors {list(header)} are not the recipe's, in the recipe's order")
    offset = 0
    for name, dtype, shape, values in RECIPE:
        entry = header[name]
        if entry["dtype"] != dtype or entry["shape"] != shape:
            fail(f"{path}: '{name}' is {entry['dtype']} {entry['shape']}, expected {dtype} {shape}")
        begin, end = entry["data_offsets"]
        if begin != offset:
            fail(f"{path}: '{name}' starts at {begin}, expected {offset} (tensors in order, no holes)")
        raw = data[begin:end]
        if raw != encode(dtype, values):
            fail(f"{path}: '{name}' bytes differ: got {decode(dtype, raw).tolist()}, expected {values}")
        if not np.array_equal(decode(dtype, raw), np.array(values, dtype="<f4" if dtype == "BF16" else NUMPY[dtype])):
            fail(f"{path}: '{name}' decodes to {decode(dtype, raw).tolist()}, expected {values}")
        offset = end
    if offset != len(data):
        fail(f"{path}: {len(data) - offset} trailing bytes after the last tensor")
    print(f"ok: {path} holds the {len(RECIPE)} recipe tensors, bit for bit")


def write(path):
    # Scrambled order: u8 (6 bytes), bool (4), i8 (3), then f32 at offset 13: unaligned.
    order = ["u8", "bool", "i8", "f32", "scalar", "bf16", "empty", "i64", "f16", "i16", "f64", "i32"]
    recipe = {name: (dtype, shape, values) for name, dtype, shape, values in RECIPE}
    header, chunks, offset = {}, [], 0
    for name in order:
        dtype, shape, values = recipe[name]
        raw = encode(dtype, values)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    header["__metadata__"] = METADATA
    text = json.dumps(header).encode("utf-8")  # no padding: the data need not be aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))
    print(f"wrote {path}: {len(order)} tensors, header {len(text)} bytes")


def package():
    """safetensors.torch and torch, or exit 2 with a HINT."""
    try:
        import safetensors
        import safetensors.torch
        import torch
    except ImportError as e:
        sys.stderr.write(f"safetensors_check.py: {e}. HINT: run scripts/deps (requirements.txt: safetensors, torch)\n")
        sys.exit(2)
    return safetensors, torch


def recipe_tensors(torch):
    """RECIPE as torch tensors (bf16 from float32: exact for the recipe's values)."""
    dtypes = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
    out = {}
    for name, dtype, shape, values in RECIPE:
        wide = torch.float64 if dtype in ("F32", "F64", "F16", "BF16") else torch.int64
        out[name] = torch.tensor(values, dtype=wide).to(dtypes[dtype]).reshape(shape)
    return out


def verify_package(path):
    safetensors, torch = package()
    got = safetensors.torch.load_file(path)
    expected = recipe_tensors(torch)
    if sorted(got) != sorted(expected):
        fail(f"{path}: safetensors.torch sees tensors {sorted(got)}, expected {sorted(expected)}")
    for name, want in expected.items():
        t = got[name]
        if t.dtype != want.dtype or list(t.shape) != list(want.shape) or not torch.equal(t, want):
            fail(f"{path}: safetensors.torch reads '{name}' as {t.dtype} {list(t.shape)} {t.flatten().tolist()}, "
                 f"expected {want.dtype} {list(want.shape)} {want.flatten().tolist()}")
    with safetensors.safe_open(path, framework="pt") as f:
        if f.metadata() != METADATA:
            fail(f"{path}: safetensors sees metadata {f.metadata()}, expected {METADATA}")
    print(f"ok: safetensors {safetensors.__version__} reads the {len(RECIPE)} recipe tensors from {path}")


def write_package(path):
    safetensors, torch = package()
    safetensors.torch.save_file(recipe_tensors(torch), path, metadata=METADATA)
    print(f"wrote {path} with safetensors {safetensors.__version__}")


if __name__ == "__main__":
    modes = {"verify": verify, "write": write, "verify-package": verify_package, "write-package": write_package}
    if len(sys.argv) != 3 or sys.argv[1] not in modes:
        sys.stderr.write(__doc__)
        sys.exit(2)
    modes[sys.argv[1]](sys.argv[2])
