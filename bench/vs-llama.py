#!/usr/bin/env python3
"""vs-llama.py — kvlingo's prefill and decode speed against llama.cpp's on the same
machine, the same GGUF files and the same thread count (test "vs-llama", value = kvlingo
tokens/s / llama.cpp tokens/s).

    .venv/bin/python bench/vs-llama.py [--llama-bench PATH] [-p 64,512] [-n 128] [-d 0]
                                       [--rounds 3] [-r 3] [--out DIR]

A shared host drifts by 10-30 % within minutes, more than the differences worth knowing,
so the two programs run in turn, --rounds times each (bench-prefill-decode, then
llama-bench, then again), each call timing -r runs; a figure is the median over the
rounds of each call's own median (kvlingo) or mean (llama-bench reports a mean), the
ratio (value) is taken of those, and sd is the spread of the rounds' own ratios. Both get OMP_NUM_THREADS / -t = the machine's cores.

llama-bench is not built here by default: scripts/build-llama-bench builds it from the
llama-cpp-python source package on the package index (into ~/.cache/kvlingo/llama.cpp).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import LARGE, ROOT, SMALL, report  # noqa: E402

DEFAULT_LLAMA = os.path.expanduser("~/.cache/kvlingo/llama.cpp/build/bin/llama-bench")


def models_dir():
    return os.environ.get("KVLINGO_MODELS", os.path.expanduser("~/.cache/kvlingo/models"))


def kvlingo_round(exe, paths, a, threads):
    """One bench-prefill-decode call: {(model, test): tokens/s}."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [exe, "-p", a.prefill, "-n", str(a.decode), "-r", str(a.runs), "--peak", "0", "--out", out]
        if a.depth:
            cmd += ["-d", str(a.depth)]
        for p in paths:
            cmd += ["-m", p]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"vs-llama: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        rep = json.load(open(os.path.join(out, "prefill-decode.json")))
    return {(x["model"], x["test"]): x["value"] for x in rep["results"]}


def llama_round(exe, paths, names, a, threads):
    """One llama-bench call: {(model, test): tokens/s} with kvlingo's test names, and the build."""
    cmd = [exe, "-p", a.prefill, "-n", str(a.decode), "-r", str(a.runs), "-t", str(threads), "-o", "json"]
    if a.depth:
        cmd += ["-d", str(a.depth)]
    for p in paths:
        cmd += ["-m", p]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"vs-llama: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    out, build = {}, None
    for x in json.loads(r.stdout):
        name = names[os.path.basename(x["model_filename"])]
        test = f"tg{x['n_gen']}" if x["n_gen"] > 0 else f"pp{x['n_prompt']}"
        if x.get("n_depth"):  # bench-prefill-decode's depth applies to pp only: a tg at depth matches nothing
            test += f"@d{x['n_depth']}"
        out[(name, test)] = x["avg_ts"]
        build = x.get("build_commit")
    if build in (None, "unknown"):  # built from a source package: scripts/build-llama-bench notes which
        marker = os.path.join(os.path.dirname(os.path.abspath(exe)), "..", "..", "kvlingo-source")
        if os.path.exists(marker):
            with open(marker) as f:
                build = f"unknown ({f.read().strip()})"
    return out, build


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH", DEFAULT_LLAMA),
                    help="llama.cpp's llama-bench (default $LLAMA_BENCH, else %(default)s)")
    ap.add_argument("--prefill-decode", default=os.path.join(ROOT, "build", "bench", "bench-prefill-decode"),
                    help="kvlingo's bench-prefill-decode (default build/bench/bench-prefill-decode)")
    ap.add_argument("-m", "--model", action="append", help="a .gguf file (repeatable; default: the real pair)")
    ap.add_argument("-p", "--prefill", default="64,512", help="prompt lengths, comma-separated (0: none)")
    ap.add_argument("-n", "--decode", type=int, default=128, help="decode steps (0: none)")
    ap.add_argument("-d", "--depth", type=int, default=0,
                    help="positions already in the cache before each prompt (with -n 0: llama-bench would decode at that depth too)")
    ap.add_argument("--rounds", type=int, default=3, help="calls of each program, in turn")
    ap.add_argument("-r", "--runs", type=int, default=3, help="timed runs per call")
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    a = ap.parse_args()
    for exe in (a.llama_bench, a.prefill_decode):
        if not os.access(exe, os.X_OK):
            sys.exit(f"vs-llama: {exe} not found or not executable"
                     + (" (scripts/build-llama-bench builds it)" if exe == a.llama_bench else " (ninja -C build)"))
    if a.rounds < 1 or a.runs < 1:
        sys.exit("vs-llama: --rounds and -r must be >= 1")
    paths = a.model or [os.path.join(models_dir(), f"{m}-instruct-q4_k_m.gguf") for m in (SMALL, LARGE)]
    for p in paths:
        if not os.path.exists(p):
            sys.exit(f"vs-llama: {p} not found (scripts/fetch-models fetches the pair)")
    # the model names bench-prefill-decode gives (file name less ".gguf", "-instruct" and the quantisation)
    names = {}
    for p in paths:
        base = os.path.basename(p)
        stem = base[:-5] if base.endswith(".gguf") else base
        for q in ("-q4_k_m", "-q8_0", "-q6_k", "-f16", "-bf16", "-f32"):
            if stem.endswith(q):
                stem = stem[: -len(q)]
        names[base] = stem.replace("-instruct", "")
    threads = os.cpu_count()
    k_runs, l_runs, build = [], [], None
    for i in range(a.rounds):
        print(f"round {i + 1}/{a.rounds}: kvlingo", file=sys.stderr, flush=True)
        k_runs.append(kvlingo_round(a.prefill_decode, paths, a, threads))
        print(f"round {i + 1}/{a.rounds}: llama.cpp", file=sys.stderr, flush=True)
        got, build = llama_round(a.llama_bench, paths, names, a, threads)
        l_runs.append(got)
    results = []
    for key in sorted(k_runs[0], key=lambda k: (k[0], not k[1].startswith("pp"), k[1])):
        if not all(key in r for r in l_runs):
            print(f"vs-llama: {key[0]} {key[1]}: no llama-bench figure to compare with, left out", file=sys.stderr)
            continue
        kv = [r[key] for r in k_runs]
        lv = [r[key] for r in l_runs]
        km, lm = statistics.median(kv), statistics.median(lv)
        per_round = [k / ll for k, ll in zip(kv, lv)]  # each round's own ratio: their spread is the sd
        sd = statistics.stdev(per_round) if len(per_round) > 1 else 0.0
        results.append({"model": key[0], "test": "vs-llama", "workload": key[1], "value": round(km / lm, 3),
                        "unit": "x", "runs": a.rounds, "sd": round(sd, 3), "kvlingo_tps": round(km, 2),
                        "llama_tps": round(lm, 2),
                        "kvlingo_rounds": [round(x, 2) for x in kv], "llama_rounds": [round(x, 2) for x in lv],
                        "threads": threads, "llama_build": build, "runs_per_call": a.runs})
        print(f"{key[0]:<20} {key[1]:<10} kvlingo {km:8.1f}  llama.cpp {lm:8.1f}  {km / lm:5.2f}x")
    rep = report("vs-llama", results)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "vs-llama.json"), "w") as f:
        json.dump(rep, f, indent=2)
        f.write("\n")
    with open(os.path.join(a.out, "vs-llama.md"), "w") as f:
        m = rep["machine"]
        f.write(f"# vs-llama — {rep['date']} — git {rep['git']}\n\n{m['cpu']}, {m['cores']} cores "
                f"({', '.join(m['flags'])}); llama.cpp build {build}; `{rep['command']}`\n\n"
                "kvlingo (`bench-prefill-decode`) and llama.cpp (`llama-bench`) called in turn, "
                f"{a.rounds} times each, {a.runs} timed runs per call, {threads} threads, the same GGUF files; "
                "each figure the median over the rounds.\n\n"
                "| model | test | kvlingo tokens/s | llama.cpp tokens/s | ratio | kvlingo rounds | llama.cpp rounds |\n"
                "|---|---|---:|---:|---:|---|---|\n")
        for r in results:
            f.write(f"| {r['model']} | {r['workload']} | {r['kvlingo_tps']:.1f} | {r['llama_tps']:.1f} | "
                    f"**{r['value']:.2f}×** | {', '.join(f'{x:.1f}' for x in r['kvlingo_rounds'])} | "
                    f"{', '.join(f'{x:.1f}' for x in r['llama_rounds'])} |\n")
    print(f"wrote {a.out}/vs-llama.json and {a.out}/vs-llama.md")


if __name__ == "__main__":
    main()
