"""Golden vectors for ggml's block formats, from the `gguf` PyPI package (gguf-py, llama.cpp's own).

For each type: `<T>.bytes` (u8, the stored blocks) and `<T>.values` (f32, gguf-py's dequantisation).
Q4_0 / Q4_1 / Q5_0 / Q8_0 bytes come from gguf-py's quantisers applied to `<T>.source` (so the same
file checks k3mini's quantisers byte for byte); gguf-py cannot quantise K-quants, so Q4_K / Q6_K
blocks are random bytes with sane f16 scales.

    .venv/bin/pip install gguf==0.19.0 numpy safetensors
    .venv/bin/python scripts/golden/gguf_quants.py
"""
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.numpy import save_file

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "golden"
OUT = GOLDEN / "gguf_quants.safetensors"
ROWS, COLS = 4, 256


def main() -> None:
    rng = np.random.default_rng(20261130)
    tensors = {}
    for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0):
        # Mixed scales per row, an all-zero block and an outlier: the quantisers' edge cases.
        source = rng.standard_normal((ROWS, COLS)).astype(np.float32)
        source *= np.array([[0.02], [1.0], [7.5], [0.3]], np.float32)
        source[2, :32] = 0.0
        source[3, 40] = 25.0
        raw = quantize(source, t)
        tensors[f"{t.name}.source"] = source
        tensors[f"{t.name}.bytes"] = raw.reshape(-1).astype(np.uint8)
        tensors[f"{t.name}.values"] = dequantize(raw, t).astype(np.float32).reshape(-1)
    for t, scale_offsets in ((T.Q4_K, (0, 2)), (T.Q6_K, (208,))):
        block_bytes = {T.Q4_K: 144, T.Q6_K: 210}[t]
        blocks = rng.integers(0, 256, (ROWS, block_bytes), dtype=np.uint8)
        for off in scale_offsets:
            scales = rng.uniform(1e-3, 2e-2, ROWS).astype(np.float16)
            blocks[:, off : off + 2] = scales.view(np.uint8).reshape(ROWS, 2)
        tensors[f"{t.name}.bytes"] = blocks.reshape(-1)
        tensors[f"{t.name}.values"] = dequantize(blocks, t).astype(np.float32).reshape(-1)
    save_file(tensors, str(OUT))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    write_tiny_gguf(tensors)


def write_tiny_gguf(tensors) -> None:
    """A small GGUF with every metadata kind and F32 / F16 / Q8_0 / Q4_K tensors, for the reader."""
    path = GOLDEN / "tiny.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("test.u32", 7)
    w.add_int32("test.i32", -3)
    w.add_float32("test.f32", 0.5)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "caf\u00e9")
    w.add_array("test.strings", ["<s>", "</s>", "hello"])
    w.add_array("test.ints", [1, 2, 3])
    w.add_uint64("test.u64", 1 << 40)
    w.add_float64("test.f64", 2.25)
    w.add_tensor("f32", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("f16", (np.arange(32, dtype=np.float32) / 8).astype(np.float16))
    w.add_tensor("q8_0", tensors["Q8_0.bytes"].reshape(ROWS, -1), raw_dtype=T.Q8_0)
    w.add_tensor("q4_k", tensors["Q4_K.bytes"].reshape(ROWS, -1), raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
