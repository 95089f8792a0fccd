#!/usr/bin/env python3
"""test-translators.py — the committed translators on the real pair.

Every translator in translator/maps/ must load against the two Qwen2.5-Coder models (the
fingerprints agree), and on held-out code the target continuing from the translated cache
must predict the first continuation tokens better than the target with no context (the
floor of issue [translator]) and stay within a sane KL of its native cache; a distilled
translator (stage 2) must be closer to the native cache than the closed form it started from. A broken
translator (wrong layer order, transposed map, RoPE not undone) fails this: its translated
cache is worse than no context at all.

usage: test-translators.py KVLINGO MODELS_DIR MAPS_DIR
"""
import glob
import json
import os
import subprocess
import sys
import tempfile

kvlingo, models, maps = sys.argv[1:4]
a = os.path.join(models, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
b = os.path.join(models, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
if not (os.path.exists(a) and os.path.exists(b)):
    print("models missing (scripts/fetch-models): skipped")
    sys.exit(77)
files = sorted(glob.glob(os.path.join(maps, "*.safetensors")))
if len(files) < 2:
    print(f"no committed translators in {maps}")
    sys.exit(1)
failed = 0
with tempfile.TemporaryDirectory() as out:
    corpus = os.path.join(os.path.dirname(os.path.abspath(maps)), "corpus", "split.tsv")
    cmd = [kvlingo, "eval", "-a", a, "-b", b, "--corpus", corpus, "--samples", "4", "--prefix", "128", "--cont", "16",
           "--domains", "code", "--boot", "200", "-o", out]
    for f in files:
        cmd += ["-t", f]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr)
        sys.exit(1)
    ev = json.load(open(os.path.join(out, "eval.json")))
    for name, t in ev["translators"].items():
        d = t["domains"]["code"]
        floor = ev["native"][t["target"]]["code"]["floor_nll16"]["mean"]
        native = ev["native"][t["target"]]["code"]["nll16"]["mean"]
        got = d["nll16"]["mean"]
        kl = d["kl"]["mean"]
        ok = got < floor and 0 < kl < 5
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: first-16 NLL {got:.3f} (native {native:.3f}, "
              f"no context {floor:.3f}), KL {kl:.3f}, agree {d['agree']['mean']:.2f}")
        for kv in ("heldout_r2_k", "heldout_r2_v"):
            r2 = t[kv]
            if not all(x == x and -1 < x <= 1 for x in r2):  # NaN or absurd
                print(f"FAIL {name}: {kv} {r2}")
                failed += 1
    # stage 2 against its closed form: a distilled translator must be closer to the native cache
    for name, t in ev["translators"].items():
        if t.get("fit", {}).get("stage") != "distill":
            continue
        base = name[:-len(".distilled")] if name.endswith(".distilled") else None
        if base not in ev["translators"]:
            print(f"FAIL {name}: its closed form ({base}) is not committed beside it")
            failed += 1
            continue
        k1, k2 = ev["translators"][base]["domains"]["code"]["kl"]["mean"], t["domains"]["code"]["kl"]["mean"]
        ok = k2 < k1
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: KL {k2:.3f} below its closed form's {k1:.3f} "
              f"({100 * (k2 / k1 - 1):+.0f}%)")
sys.exit(1 if failed else 0)
