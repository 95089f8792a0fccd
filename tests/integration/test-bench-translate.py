#!/usr/bin/env python3
"""test-bench-translate.py — bench-translate at 64 positions in both directions of the pair:
with --shapes (no model files: the pair's shapes, a random translator) or on the real
models; the rows it writes (shared/BENCH-FORMAT.md), and a bad --backend refused with the
usage status and no result file. With --shapes also on the CUDA backend compiled for the
CPU (--backend cuda-sim): the pools staged, kept on the device, and kept and pinned (the
target written back on a second stream; call_ms <= value <= landed_ms: the call returns,
the device has run it, the target is on the host) give the same target cache, bit for bit.

usage: test-bench-translate.py BENCH_TRANSLATE shapes|real
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Checks  # noqa: E402

check = Checks()


def main():
    exe, mode = sys.argv[1], sys.argv[2]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    extra = ["--shapes"] if mode == "shapes" else []
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out")
        r = subprocess.run([exe, *extra, "--max", "64", "-r", "2", "--precision", "fp32", "--out", out],
                           capture_output=True, text=True, env=env)
        check(r.returncode == 0, f"{mode}: 64 positions each way (rc {r.returncode}) {r.stderr[-500:] if r.returncode else ''}")
        rows = json.load(open(os.path.join(out, "translate.json")))["results"] if r.returncode == 0 else []
        pairs = sorted(x["model"] for x in rows)
        check(pairs == ["qwen2.5-coder-0.5b->qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b->qwen2.5-coder-0.5b"],
              f"{mode}: one row per direction: {pairs}")
        for x in rows:
            check(x["test"] == "translate-64" and x["unit"] == "ms" and x["value"] > 0 and x["runs"] == 2
                  and x["precision"] == "fp32" and x["gflops"] > 0,
                  f"{mode}: {x['model']}: translate-64, 2 runs, {x['value']:.3f} ms, {x['gflops']:.1f} GFLOP/s")
            check((x.get("models") == "shapes only (--shapes)") == (mode == "shapes"),
                  f"{mode}: the row says whether the models were shapes only ({x.get('models')})")
        out2 = os.path.join(d, "out2")
        r = subprocess.run([exe, *extra, "--backend", "tpu", "--out", out2], capture_output=True, text=True, env=env)
        check(r.returncode == 2 and "--backend is cpu, cuda or cuda-sim, not 'tpu'" in r.stderr
              and not os.path.exists(out2), f"{mode}: --backend tpu refused with status 2 and no results ({r.stderr.strip()})")
        if mode == "shapes":  # the CUDA backend compiled for the CPU: its pools staged, then kept on the device
            out3 = os.path.join(d, "out3")
            r = subprocess.run([exe, *extra, "--backend", "cuda-sim", "--max", "64", "-r", "1", "--out", out3],
                               capture_output=True, text=True, env=dict(env, KVL_CUDA_KV_CHECK="1"))
            rows = json.load(open(os.path.join(out3, "translate.json")))["results"] if r.returncode == 0 else []
            prec = sorted((x["model"], x["precision"]) for x in rows)
            kinds = {"cuda-bf16", "cuda-bf16-kept", "cuda-bf16-kept-pinned"}
            check(r.returncode == 0 and len(prec) == 6 and {p for _, p in prec} == kinds,
                  f"cuda-sim: each direction staged, kept, kept and pinned ({prec}) "
                  f"{r.stderr[-500:] if r.returncode else ''}")
            for x in rows:
                if x["precision"] != "cuda-bf16":
                    check(x.get("rel_rms_vs_staged") == 0, f"cuda-sim {x['model']}: the {x['precision']} target cache "
                          f"is the staged one's, bit for bit (relative RMS difference {x.get('rel_rms_vs_staged')})")
                if x["precision"] == "cuda-bf16-kept-pinned":
                    check(0 <= x.get("call_ms", -1) <= x["value"] <= x.get("landed_ms", -1),
                          f"cuda-sim {x['model']}: the call returned after {x.get('call_ms')} ms, ran on the "
                          f"device after {x['value']} ms, written back after {x.get('landed_ms')} ms")
    sys.exit(1 if check.failed else 0)


if __name__ == "__main__":
    main()
