"""Dequantisation of every supported block format against the `gguf` Python package.

Random blocks (scales forced finite) go through kvlingo's scalar reference
(tests/tools/gguf-dequant --raw) and through gguf.quants.dequantize, an independent
implementation; the results must be bit-identical.

usage: test-dequant-oracle.py PATH/TO/gguf-dequant
"""
import subprocess
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

# type -> byte offsets of the fp16 scale fields inside one block
HALF_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


def finite_halves(rng, n):
    h = rng.standard_normal(n).astype(np.float16) * np.float16(0.1)
    return h.view(np.uint8)


def make_blocks(rng, qt, n_blocks):
    blck, size = GGML_QUANT_SIZES[qt]
    if qt == Q.F32:
        return rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8)
    if qt == Q.F16:
        return finite_halves(rng, n_blocks)
    if qt == Q.BF16:
        f = rng.standard_normal(n_blocks).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in HALF_FIELDS[qt]:
        raw[:, off:off + 2] = finite_halves(rng, n_blocks).reshape(n_blocks, 2)
    return raw.reshape(-1)


def main():
    tool = sys.argv[1]
    rng = np.random.default_rng(1234)
    failed = 0
    for qt in [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]:
        blck, size = GGML_QUANT_SIZES[qt]
        n_blocks = 4096 if blck > 1 else 65536
        data = make_blocks(rng, qt, n_blocks)
        n = n_blocks * blck
        ref = quants.dequantize(data, qt).reshape(-1).astype(np.float32)
        out = subprocess.run([tool, "--raw", qt.name, str(n)], input=data.tobytes(),
                             capture_output=True, check=True).stdout
        ours = np.frombuffer(out, dtype=np.float32)
        same = ours.view(np.uint32) == ref.view(np.uint32)
        ok = ours.shape == ref.shape and bool(same.all())
        diff = float(np.max(np.abs(ours - ref))) if ours.shape == ref.shape else float("inf")
        print(f"{qt.name:5s} {n:8d} elements  bit-identical={ok}  max|diff|={diff:g}")
        failed += not ok
    print("FAILED" if failed else "all formats bit-identical to gguf")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
