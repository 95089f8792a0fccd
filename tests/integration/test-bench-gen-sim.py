#!/usr/bin/env python3
"""test-bench-gen-sim.py — the scheduler on the CUDA backend compiled for the CPU
(bench-gen-throughput --backend cuda-sim) with a tiny model: 1 and 4 streams, every prompt
opening with the same prefix (blocks shared from the prefix cache, the shared tail block
copied on write), greedy decoding. The scheduler's pools carry write stamps, so the
backend keeps a copy of each on the "device"; KVL_CUDA_KV_CHECK=1 makes every attention
call compare the rows it reads there with the host pool, bit for bit, and abort on a
difference. Checks: the run ends well, both rows are written, every stream generated its
tokens, the prefix cache was hit, and the backend named is the simulated one.

usage: test-bench-gen-sim.py BENCH_GEN_THROUGHPUT TINY_GGUF_TOOL
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
    exe, tiny_tool = sys.argv[1], sys.argv[2]
    env = dict(os.environ, OMP_NUM_THREADS="2", KVL_CUDA_KV_CHECK="1")
    with tempfile.TemporaryDirectory() as d:
        model = os.path.join(d, "tiny.gguf")
        subprocess.run([tiny_tool, model], check=True)
        out = os.path.join(d, "out")
        r = subprocess.run([exe, "-m", model, "--backend", "cuda-sim", "-c", "1,4", "-n", "32", "--prefix-share",
                            "--out", out], capture_output=True, text=True, env=env)
        check(r.returncode == 0, f"1 and 4 streams on cuda-sim with KVL_CUDA_KV_CHECK=1 (rc {r.returncode}) "
              f"{r.stderr[-600:] if r.returncode else ''}")
        if r.returncode != 0:
            return 1
        # the same with every row of logits brought to the host whole (KVL_CUDA_LOGITS_TOP=0)
        out0 = os.path.join(d, "out0")
        r0 = subprocess.run([exe, "-m", model, "--backend", "cuda-sim", "-c", "4", "-n", "32", "--prefix-share",
                             "--out", out0], capture_output=True, text=True, env=dict(env, KVL_CUDA_LOGITS_TOP="0"))
        check(r0.returncode == 0, f"4 streams with KVL_CUDA_LOGITS_TOP=0 (rc {r0.returncode})")
        whole = json.load(open(os.path.join(out0, "gen-throughput-shared.json")))["results"][0] if r0.returncode == 0 else {}
        rep = json.load(open(os.path.join(out, "gen-throughput-shared.json")))
        rows = {x["concurrency"]: x for x in rep["results"]}
        check(sorted(rows) == [1, 4], f"rows for 1 and 4 streams: {sorted(rows)}")
        for c, x in sorted(rows.items()):
            check(x.get("generated_tokens") == 32 * c, f"c={c}: {32 * c} tokens generated ({x.get('generated_tokens')})")
            check("kvl_sim" in x.get("backend", ""), f"c={c}: on the simulated CUDA backend ({x.get('backend')})")
        # the pools kept on the device: a decode step copies in its new rows, not its context
        # (staged, each step would copy every layer's blocks of its context: ~56 KiB per token here)
        kib = rows.get(4, {}).get("device_kib_in_per_token", 1e9)
        check(kib < 20, f"c=4: {kib:.1f} KiB copied in per generated token (less than 20: the pools stay on the device)")
        # greedy decoding samples from the row's summary: the decode steps' logits stay on the device
        o_top, o_whole = rows.get(4, {}).get("device_kib_out_per_token", 1e9), whole.get("device_kib_out_per_token", 0)
        check(o_top < o_whole, f"c=4: {o_top:.2f} KiB out per token with the logits summarised, {o_whole:.2f} whole")
        check(whole.get("generated_tokens") == 128 and whole.get("tokens_digest", "a") == rows.get(4, {}).get("tokens_digest", "b"),
              "c=4: the same tokens either way")
        # sampling at a temperature, from the whole distribution: the device draws (the scheduler takes
        # the point of each draw from the stream in advance), or the row comes whole; the same tokens
        dig = {}
        for top in ("1", "0"):
            o = os.path.join(d, f"outT{top}")
            rt = subprocess.run([exe, "-m", model, "--backend", "cuda-sim", "-c", "4", "-n", "32", "--temperature", "1",
                                 "--out", o], capture_output=True, text=True, env=dict(env, KVL_CUDA_LOGITS_TOP=top))
            x = json.load(open(os.path.join(o, "gen-throughput.json")))["results"][0] if rt.returncode == 0 else {}
            check(x.get("generated_tokens") == 128 and x.get("temperature") == 1,
                  f"temperature 1, KVL_CUDA_LOGITS_TOP={top}: 128 tokens (rc {rt.returncode}, {x.get('generated_tokens')})")
            dig[top] = (x.get("tokens_digest"), x.get("device_kib_out_per_token", 0))
        check(dig["1"][0] is not None and dig["1"][0] == dig["0"][0],
              f"temperature 1: the same tokens drawn on the device and from whole rows ({dig})")
        check(dig["1"][1] < dig["0"][1], f"temperature 1: {dig['1'][1]:.2f} KiB out per token drawn on the device, "
              f"{dig['0'][1]:.2f} with whole rows")
        check(rows.get(4, {}).get("prefix_hit_rate", 0) > 0,
              f"c=4: prompts shared the prefix cache (hit rate {rows.get(4, {}).get('prefix_hit_rate')})")
    print(f"{check.failed} failed")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
