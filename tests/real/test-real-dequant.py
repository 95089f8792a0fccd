"""Every tensor of the real models, dequantised by kvlingo, against the `gguf` package.

For each model file in the cache ($KVLINGO_MODELS or ~/.cache/kvlingo/models) that the
manifest lists, streams kvlingo's dequantisation of every tensor (tests/tools/gguf-dequant)
and compares it with gguf.quants.dequantize on the same bytes. Reports, per file and type,
tensors, elements, bit-identical count and max |diff|; fails unless every tensor is
bit-identical. Exits 77 (skipped) when no model has been fetched.

usage: test-real-dequant.py PATH/TO/gguf-dequant PATH/TO/scripts/models.tsv
"""
import os
import subprocess
import sys
from collections import defaultdict

import numpy as np
from gguf import GGUFReader, quants


def model_files(manifest):
    cache = os.environ.get("KVLINGO_MODELS", os.path.expanduser("~/.cache/kvlingo/models"))
    for line in open(manifest):
        if line.startswith("#") or not line.strip():
            continue
        cols = line.rstrip("\n").split("\t")
        path = os.path.join(cache, cols[1])
        if os.path.exists(path):
            yield cols[0], path


def check(tool, name, path):
    r = GGUFReader(path)
    proc = subprocess.Popen([tool, path], stdout=subprocess.PIPE)
    stats = defaultdict(lambda: [0, 0, 0, 0.0])  # tensors, elements, identical, maxdiff
    bad = 0
    for t in r.tensors:
        ref = quants.dequantize(t.data, t.tensor_type).reshape(-1).astype(np.float32)
        buf = proc.stdout.read(ref.size * 4)
        ours = np.frombuffer(buf, dtype=np.float32)
        if ours.size != ref.size:
            print(f"{name}: {t.name}: short output ({ours.size} of {ref.size})")
            return 1
        same = np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
        s = stats[t.tensor_type.name]
        s[0] += 1
        s[1] += ref.size
        s[2] += same
        s[3] = max(s[3], float(np.max(np.abs(ours - ref))))
        if not same:
            bad += 1
            print(f"{name}: {t.name} ({t.tensor_type.name}) differs, max|diff| {np.max(np.abs(ours - ref)):g}")
    proc.stdout.close()
    if proc.wait() != 0:
        print(f"{name}: gguf-dequant failed")
        return 1
    for ty, (n, el, same, md) in sorted(stats.items()):
        print(f"{name:20s} {ty:5s} tensors={n:4d} elements={el:11d} bit-identical={same}/{n} max|diff|={md:g}")
    return bad


def main():
    tool, manifest = sys.argv[1], sys.argv[2]
    files = list(model_files(manifest))
    if not files:
        print("no models fetched (scripts/fetch-models): skipping")
        sys.exit(77)
    bad = sum(check(tool, n, p) for n, p in files)
    print("FAILED" if bad else f"all tensors of {len(files)} models bit-identical to gguf")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
