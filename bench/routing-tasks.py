#!/usr/bin/env python3
"""routing-tasks.py — Benchmark 3, pass-rate half (test "routing-tasks"): Python tasks
with tests, answered through kvlingod's OpenAI-compatible API by always-small,
always-large (prompts computed natively), the 1.5B on prompts translated from the 0.5B's
cache, and `auto` under the cascade router at several entropy thresholds; quality
is the share of tasks whose tests pass, cost the large model's generated tokens and the
wall time at the client.

    .venv/bin/python bench/routing-tasks.py [--kvlingod build/daemon/kvlingod]
        [--tasks bench/tasks/python-tasks.jsonl] [--thresholds 0.4,0.7,1.0,1.5]
        [--window 8] [--native-tail 32] [--max-tokens 256] [--out bench/results] [--check]
        [--settings baselines,translated,cascade] [--translated-tails 1,32] [--append]

Each task is a function signature and docstring (our own, bench/tasks/python-tasks.jsonl);
the model completes the body (greedy, stopped at the next top-level statement). The
completion, then the task's asserts, run in a sandboxed subprocess: `python3 -I` in an
empty temporary folder, no network (a new network namespace when `unshare -n` works
here), a 10 s CPU and wall limit, 1 GiB of address space, 1 MiB files, an empty
environment. `--check` runs the tasks' reference solutions through the same sandbox
(all must pass) and measures nothing. Writes bench/results/routing-tasks.json (+ .md);
bench/plot-routing.py draws both halves of Benchmark 3.
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import LARGE, ROOT, SMALL, Daemon, report  # noqa: E402

STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```", "\nassert"]


def _limits():
    resource.setrlimit(resource.RLIMIT_CPU, (10, 10))
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    os.setsid()


_UNSHARE = None


def sandboxed(program):
    """(passed, detail): run program in the sandbox; passed when it exits 0 in time."""
    global _UNSHARE
    if _UNSHARE is None:
        u = shutil.which("unshare")
        _UNSHARE = bool(u) and subprocess.run([u, "-n", "true"], capture_output=True).returncode == 0
        if not _UNSHARE:
            print("routing-tasks: no network namespace here (unshare -n failed): the sandbox keeps the network",
                  file=sys.stderr)
    d = tempfile.mkdtemp(prefix="kvl-task-")
    try:
        path = os.path.join(d, "task.py")
        with open(path, "w") as f:
            f.write(program)
        cmd = (["unshare", "-n"] if _UNSHARE else []) + [sys.executable if sys.executable else "python3", "-I", path]
        try:
            r = subprocess.run(cmd, cwd=d, env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, timeout=10, preexec_fn=_limits)
        except subprocess.TimeoutExpired:
            return False, "timeout"
        return r.returncode == 0, (r.stderr.strip().splitlines() or [""])[-1][:200]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def program(task, body):
    return task["prompt"] + body + "\n\n" + task["tests"] + "\n"


def complete(http, model, prompt, max_tokens, reprefill=False):
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stop": STOPS, "reprefill": reprefill}).encode()
    req = urllib.request.Request(f"http://{http}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as r:
        out = json.load(r)
    return out, time.perf_counter() - t0


def run_setting(http, name, model, tasks, max_tokens, reprefill=False):
    rows = []
    for i, t in enumerate(tasks):
        out, wall = complete(http, model, t["prompt"], max_tokens, reprefill)
        text = out["choices"][0]["text"]
        n = out["usage"]["completion_tokens"]
        kv = out.get("kvlingo", {})
        route = kv.get("route", {})
        served = out.get("model", model)
        if route.get("decision") == "escalated" or route.get("handoff_token", -1) >= 0:
            large_tokens = n - max(route.get("handoff_token", 0), 0)
        else:
            large_tokens = n if served == LARGE else 0
        ok, detail = sandboxed(program(t, text))
        usage = kv.get("usage", {})
        rows.append({"id": t["id"], "passed": ok, "tokens": n, "large_tokens": large_tokens, "wall_s": wall,
                     "translated_tokens": usage.get("translated_tokens", 0),
                     "decision": route.get("decision", ""), "handoff_token": route.get("handoff_token", -1),
                     "detail": "" if ok else detail, "completion": text})
        print(f"  {name:<22} {i + 1:>2}/{len(tasks)} {t['id']:<22} {'pass' if ok else 'FAIL'} {n:>3} tokens "
              f"({large_tokens} large) {wall:5.1f} s {'' if ok else detail[:60]}", flush=True)
    return rows


def summary(name, rows, threshold, window):
    n = len(rows)
    tok = sum(r["tokens"] for r in rows)
    return {"model": LARGE if name != "always-small" else SMALL, "test": "routing-tasks", "setting": name,
            "max_mean_entropy": threshold, "window": window if threshold is not None else None,
            "value": round(100.0 * sum(r["passed"] for r in rows) / n, 1), "unit": "% passed", "runs": n, "sd": 0,
            "passed": sum(r["passed"] for r in rows), "tasks": n, "tokens": tok,
            "large_tokens": sum(r["large_tokens"] for r in rows),
            "large_token_fraction": round(sum(r["large_tokens"] for r in rows) / max(tok, 1), 4),
            "escalated": sum(r["handoff_token"] >= 0 for r in rows),
            "translated_tokens": sum(r["translated_tokens"] for r in rows),
            "wall_s": round(sum(r["wall_s"] for r in rows), 1),
            "wall_median_s": round(statistics.median(r["wall_s"] for r in rows), 2), "per_task": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvlingod", default=os.path.join(ROOT, "build", "daemon", "kvlingod"))
    ap.add_argument("--tasks", default=os.path.join(ROOT, "bench", "tasks", "python-tasks.jsonl"))
    ap.add_argument("--thresholds", default="0.4,0.7,1.0,1.5", help="cascade max_mean_entropy values (nats)")
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--native-tail", type=int, default=32,
                    help="router.handoff_native_tail: positions the large model computes itself at the handoff")
    ap.add_argument("--native-head", type=int, default=32,
                    help="translate_native_head: positions the 1.5B computes itself at the start of a translated "
                         "prompt (the daemon's default, 32; 0 translates from position 0)")
    ap.add_argument("--translators", default="distilled", help="translator files X-to-Y.<this>.safetensors ('' = closed form)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--settings", default="baselines,translated,cascade",
                    help="which settings to run: baselines, translated, cascade")
    ap.add_argument("--translated-tails", default="1,32",
                    help="translate_native_tail values for the 1.5B on prompts translated from the 0.5B")
    ap.add_argument("--append", action="store_true",
                    help="merge into the existing results file (same setting, threshold and tail replaced)")
    ap.add_argument("--check", action="store_true", help="run the reference solutions through the sandbox; measure nothing")
    a = ap.parse_args()
    tasks = [json.loads(line) for line in open(a.tasks) if line.strip()]
    if a.check:
        bad = [t["id"] for t in tasks if not sandboxed(program(t, t["solution"]))[0]]
        print(f"{len(tasks) - len(bad)} of {len(tasks)} reference solutions pass in the sandbox"
              + (f"; failing: {', '.join(bad)}" if bad else ""))
        return 1 if bad else 0
    results = []
    thresholds = [float(x) for x in a.thresholds.split(",") if x]
    want = set(a.settings.split(","))
    if "baselines" in want:
        # computed natively (`reprefill`: no other model's cached lines translated, no
        # translated line reused)
        d = Daemon(a.kvlingod, translators=a.translators)
        for name, model in (("always-small", SMALL), ("always-large", LARGE)):
            print(f"{name}:", flush=True)
            results.append(summary(name, run_setting(d.http, name, model, tasks, a.max_tokens, True), None, None))
        d.stop()
    if "translated" in want:
        # the stateless protocol: the 0.5B has computed the prompt (one token asked of it),
        # then the 1.5B gets the same prompt and translates it from the 0.5B's cache, all but
        # the last `translate_native_tail` positions; a fresh daemon per tail
        for tail in [int(x) for x in a.translated_tails.split(",") if x]:
            name = f"large-on-translated-prompt (tail {tail})"
            print(f"{name}:", flush=True)
            d = Daemon(a.kvlingod, translators=a.translators,
                       extra_yaml=f"translate_native_tail: {tail}\ntranslate_native_head: {a.native_head}\n")
            for t in tasks:
                complete(d.http, SMALL, t["prompt"], 1, True)
            results.append(summary("large-on-translated-prompt", run_setting(d.http, name, LARGE, tasks, a.max_tokens),
                                   None, None))
            results[-1]["native_tail"] = tail
            results[-1]["native_head"] = a.native_head
            d.stop()
    if "cascade" in want:
        for tau in thresholds:
            name = f"cascade {tau:g}"
            print(f"{name}:", flush=True)
            d = Daemon(a.kvlingod, translators=a.translators,
                       extra_yaml=f"router: {{policy: cascade, small: {SMALL}, large: {LARGE}, "
                                  f"handoff_native_tail: {a.native_tail}, "
                                  f"cascade: {{window: {a.window}, max_mean_entropy: {tau}}}}}\n"
                                  f"translate_native_head: {a.native_head}\n")
            results.append(summary("cascade", run_setting(d.http, name, "auto", tasks, a.max_tokens), tau, a.window))
            results[-1]["native_tail"] = a.native_tail
            results[-1]["native_head"] = a.native_head
            d.stop()
    path = os.path.join(a.out, "routing-tasks.json")
    command = None
    if a.append and os.path.exists(path):  # keep the earlier run's other settings, with its command
        old = json.load(open(path))
        for r in old["results"]:  # files from before translate_native_tail: the tail was 1
            if r["setting"] == "large-on-translated-prompt":
                r.setdefault("native_tail", 1)
            if r["setting"] != "always-small" and r["setting"] != "always-large":
                r.setdefault("native_head", 0)  # ... and before translate_native_head: no head
        key = lambda r: (r["setting"], r.get("max_mean_entropy"), r.get("native_tail"), r.get("native_head"))  # noqa: E731
        mine = {key(r) for r in results}
        results = [r for r in old["results"] if key(r) not in mine] + results
        command = old["command"] + " ; " + " ".join(sys.argv)
    small = next(r for r in results if r["setting"] == "always-small")["value"]
    lr = next(r for r in results if r["setting"] == "always-large")
    large, large_tok = lr["value"], lr["large_tokens"]
    for r in results:
        r["gain_fraction"] = round((r["value"] - small) / (large - small), 3) if large != small else None
        r["large_tokens_vs_always_large"] = round(r["large_tokens"] / large_tok, 3) if large_tok else None
    rep = report("routing-tasks", results, command)
    rep["translators"] = a.translators or "closed-form"
    os.makedirs(a.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(rep, f, indent=2)
        f.write("\n")
    with open(os.path.join(a.out, "routing-tasks.md"), "w") as f:
        f.write(f"# routing-tasks — {rep['date']} — git {rep['git']}\n\n{rep['machine']['cpu']}, "
                f"{rep['machine']['cores']} cores; `{rep['command']}`\n\n"
                f"{len(tasks)} Python tasks (bench/tasks/python-tasks.jsonl), greedy, tests in a sandboxed subprocess; "
                f"cascade: the 0.5B answers, the 1.5B takes over from the translated cache ({rep['translators']} "
                f"translators; the last {a.native_tail} positions computed natively) once the mean entropy of the "
                f"last {a.window} tokens passes the threshold.\n\n"
                "| setting | threshold | passed | gain kept | large tokens (vs always-large) | escalated | "
                "positions translated | wall s |\n"
                "|---|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in results:
            g = "" if r["gain_fraction"] is None else f"{100 * r['gain_fraction']:.0f}%"
            lt = "" if r["large_tokens_vs_always_large"] is None else f"{100 * r['large_tokens_vs_always_large']:.0f}%"
            label = r["setting"] + (f" (native tail {r['native_tail']})" if r.get("native_tail") else "") + \
                (f" (native head {r['native_head']})" if r.get("native_head") else "")
            f.write(f"| {label} | {'' if r['max_mean_entropy'] is None else r['max_mean_entropy']} | "
                    f"{r['passed']}/{r['tasks']} ({r['value']:.1f}%) | {g} | {r['large_tokens']} ({lt}) | "
                    f"{r['escalated']} | {r['translated_tokens']} | {r['wall_s']:.0f} |\n")
    print(open(os.path.join(a.out, "routing-tasks.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
