#!/usr/bin/env python3
"""test-distill-store.py — `kvlingo distill` on the real pair, briefly: the sample store
grows instead of starting over, and a step runs on a batch through the real target.

1. --samples 2 prepares two samples into a fresh store and trains one step (batch 2);
2. --samples 3 on the same store loads those two and prepares only the third;
3. --samples 3 on an empty store prepares all three: the file must be byte for byte the
   one that step 2 grew (preparation is deterministic, the corpus hands out its windows in
   a fixed order, so reuse changes nothing);
4. --prepare-only --samples 12 on the grown store, stopped by SIGINT once it has stored a
   partial set (--save-every 0: after every sample): what was prepared stays stored, and
   asking for exactly its size makes it the complete store, and --samples 12 then prepares
   only the rest; the result equals a store of 12 prepared in one go (--prepare-only, no
   step run).

usage: test-distill-store.py KVLINGO MODELS_DIR REPO_ROOT
"""
import json
import os
import subprocess
import sys
import signal
import tempfile
import time

kvlingo, models, root = sys.argv[1:4]
src = os.path.join(models, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
dst = os.path.join(models, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
if not (os.path.exists(src) and os.path.exists(dst)):
    print("models missing (scripts/fetch-models): skipped")
    sys.exit(77)
init = os.path.join(root, "translator", "maps", "qwen2.5-coder-1.5b-to-qwen2.5-coder-0.5b.safetensors")
corpus = os.path.join(root, "translator", "corpus", "split.tsv")
failed = 0


def check(ok, what):
    global failed
    print(("ok   " if ok else "FAIL ") + what)
    failed += 0 if ok else 1


def distill(store, n, out):
    cmd = [kvlingo, "distill", "-s", src, "-t", dst, "--init", init, "-o", out, "--corpus", corpus,
           "--samples", str(n), "--eval-samples", "1", "--prefix", "32", "--cont", "8", "--topk", "8",
           "--steps", "1", "--batch", "2", "--eval-every", "1", "--sample-dir", store]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        print(r.stderr)
    return r


def prepare_cmd(store, n):
    return [kvlingo, "distill", "--prepare-only", "-s", src, "-t", dst, "--corpus", corpus, "--samples", str(n),
            "--eval-samples", "1", "--prefix", "32", "--cont", "8", "--topk", "8", "--save-every", "0",
            "--sample-dir", store]


with tempfile.TemporaryDirectory() as tmp:
    grown, fresh = os.path.join(tmp, "grown"), os.path.join(tmp, "fresh")
    name = lambda n: f"qwen2.5-coder-1.5b-to-qwen2.5-coder-0.5b.fit.n{n}-p32-c8-k8.samples"
    r = distill(grown, 2, os.path.join(tmp, "a.safetensors"))
    check(r.returncode == 0 and os.path.exists(os.path.join(grown, name(2))), "2 samples prepared and stored")
    log = [json.loads(l) for l in open(os.path.join(tmp, "a.safetensors.log.jsonl"))]
    step = [e for e in log if e.get("step") == 1]
    check(len(step) == 1 and step[0]["train_kl"] > 0 and step[0]["grad_norm"] > 0,
          f"one step on a batch of 2 through the 0.5B: {step[0] if step else log}")
    r = distill(grown, 3, os.path.join(tmp, "b.safetensors"))
    check(r.returncode == 0 and "2 samples from" in r.stderr and "preparing the other 1" in r.stderr,
          "3 samples: the stored 2 reused, 1 prepared")
    r = distill(fresh, 3, os.path.join(tmp, "c.safetensors"))
    check(r.returncode == 0 and "preparing the other" not in r.stderr, "3 samples in an empty store: all prepared")
    a, b = os.path.join(grown, name(3)), os.path.join(fresh, name(3))
    same = os.path.exists(a) and os.path.exists(b) and open(a, "rb").read() == open(b, "rb").read()
    check(same, "the grown store equals the one prepared from scratch, byte for byte")

    # 4: interrupted preparation keeps what it prepared
    p = subprocess.Popen(prepare_cmd(grown, 12), stderr=subprocess.PIPE, text=True)
    t0, part = time.time(), []
    while time.time() - t0 < 300 and p.poll() is None and not part:
        part = [n for n in range(4, 12) if os.path.exists(os.path.join(grown, name(n) + ".partial"))]
        time.sleep(0.01)
    if part:
        p.send_signal(signal.SIGINT)
    _, errs = p.communicate(timeout=300)
    left = sorted(n for n in range(4, 12) if os.path.exists(os.path.join(grown, name(n) + ".partial")))
    check(part and p.returncode != 0 and "stopped; " in errs and len(left) == 1 and left[0] < 12
          and os.path.exists(os.path.join(grown, name(3))) and not os.path.exists(os.path.join(grown, name(12))),
          f"SIGINT while preparing: one partial store kept ({left}), the one it grew from too")
    if left:  # asking for exactly the partial store's size completes it without preparing any
        r = subprocess.run(prepare_cmd(grown, left[0]), capture_output=True, text=True, timeout=600)
        check(r.returncode == 0 and "preparing the other 0" in r.stderr
              and os.path.exists(os.path.join(grown, name(left[0])))
              and not os.path.exists(os.path.join(grown, name(left[0]) + ".partial")),
              f"--samples {left[0]}: the partial store of {left[0]} becomes the complete one")
    r = subprocess.run(prepare_cmd(grown, 12), capture_output=True, text=True, timeout=600)
    check(r.returncode == 0 and left and f"{left[0]} samples from" in r.stderr
          and not [f for f in os.listdir(grown) if f.endswith(".partial")],
          "--samples 12 continues from the stored ones; no partial store is left")
    r = subprocess.run(prepare_cmd(fresh, 12), capture_output=True, text=True, timeout=600)
    check(r.returncode == 0 and "dense fp32 copy" not in r.stderr and "held-out KL" not in r.stderr,
          "--prepare-only: samples only, no dense copy, no run")
    a, b = os.path.join(grown, name(12)), os.path.join(fresh, name(12))
    same = os.path.exists(a) and os.path.exists(b) and open(a, "rb").read() == open(b, "rb").read()
    check(same, "interrupted and continued equals prepared in one go, byte for byte")
print(f"{failed} failed")
sys.exit(1 if failed else 0)
