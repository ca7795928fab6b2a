"""Golden bytes from ggml's own C quantisers (libggml-base of llama-cpp-python 0.3.36, which vendors
llama.cpp 0c1e57098), for gguf/tests/gguf.rs: `<T>.source` (f32) and `<T>.bytes` (the blocks
`quantize_row_<t>_ref` writes) for every type k3mini quantises to, K-quants included (gguf-py cannot
quantise those). The same calls back `k3mini export`'s byte-exactness claim.

    CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python==0.3.36 numpy safetensors
    python scripts/golden/ggml_quants.py
"""
import ctypes
from pathlib import Path

import llama_cpp
import numpy as np
from safetensors.numpy import save_file

OUT = Path(__file__).resolve().parents[2] / "tests" / "golden" / "ggml_quants.safetensors"
LIB = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
# (name, block values, block bytes)
TYPES = [("q4_0", 32, 18), ("q4_1", 32, 20), ("q5_0", 32, 22), ("q8_0", 32, 34),
         ("q4_K", 256, 144), ("q6_K", 256, 210)]


def source(rng, rows, cols):
    """Rows of very different scales, an all-zero block, outliers, tiny values and a constant run."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x *= np.geomspace(1e-3, 20.0, rows).astype(np.float32)[:, None]
    x[1, :256] = 0.0
    x[2, 7] = 40.0
    x[3, 300:320] = 0.25
    x[4] = np.abs(x[4])  # all positive: min > 0 paths
    x[5, :256] = -np.abs(x[5, :256])
    return x


def main():
    rng = np.random.default_rng(20261130)
    tensors = {}
    for name, bs, nbytes in TYPES:
        x = source(rng, 8, 512)
        fn = getattr(LIB, f"quantize_row_{name}_ref")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        out = np.zeros(x.size // bs * nbytes, np.uint8)
        fn(x.ctypes.data, out.ctypes.data, x.size)
        tensors[f"{name}.source"] = x
        tensors[f"{name}.bytes"] = out
    save_file(tensors, str(OUT))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
