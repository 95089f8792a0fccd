#!/usr/bin/env python3
"""switch-ttft.py — the headline benchmark, measured at a gRPC client: time to first token
when a conversation moves to the other model, by translating its KV cache versus
re-prefilling everything (test "switch-ttft", value = reprefill_ms / translated_ms).

    .venv/bin/python bench/switch-ttft.py [--kvlingod build/daemon/kvlingod]
        [-c 64,512,2048,8192] [-r 5] [--turn 32] [--out bench/results]

It starts its own kvlingod (the real pair, the committed translators, port 0). For each
history length C and direction S -> T, per run:
  the history: C tokens written by S (a request to S with a conversation id, token ids
      in, one token out; not timed) — so S holds them natively;
  translated: the same conversation + a new 32-token user turn, sent to T: T translates
      the C positions from S's line, prefills the turn and decodes its first token;
  reprefill:  a fresh history of the same length + the turn, sent to T with
      `reprefill` set: everything computed natively by T (nothing cached).
With --chain (for long histories, whose writing costs as much as a re-prefill) the
directions take turns and each re-prefill carries a conversation id: what it wrote natively
into T is the next switch's history, from T to S, so no history is written just for the
benchmark after the first. The switch request then differs from that transcript from
position C on, as it does from S's own one-token answer without --chain.
TTFT = from sending the request to the first streamed token, at the client. Medians over
the runs; every run uses fresh tokens after a first <|im_start|> (as a chat transcript
starts: both sides reuse that position's K/V, which depends on the token alone), so no
prefix cache helps either side. Writes
bench/results/switch-ttft.json (+ .md, .png) in shared/BENCH-FORMAT.md's format.
"""
import argparse
import datetime
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from benchlib import machine  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvlingod", default=os.path.join(ROOT, "build", "daemon", "kvlingod"))
    ap.add_argument("-c", "--contexts", default="64,512,2048,8192")
    ap.add_argument("-r", "--runs", type=int, default=5)
    ap.add_argument("--turn", type=int, default=32)
    ap.add_argument("--native-head", type=int, default=32,
                    help="translate_native_head: positions the target computes itself at the start (daemon default 32)")
    ap.add_argument("--system", type=int, default=0,
                    help="every history starts with the same N-token system prompt, written natively into both "
                         "models once before timing (a deployment's shared prompt: both sides find it in their "
                         "prefix cache); 0 = fresh histories with nothing shared but <|im_start|>")
    ap.add_argument("--warm-head", action="store_true",
                    help="the daemon's translate_warm_head: after the history is written, the target computes its "
                         "head in the background, so the switch prefills only the new turn (see --think-ms)")
    ap.add_argument("--think-ms", type=int, default=None,
                    help="pause before each timed request, as a user reads and types (default: 1000 with "
                         "--warm-head, else 0): background work of the previous request ends before timing")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--directions", default="small-to-large,large-to-small")
    ap.add_argument("--translation-precision", default="auto", choices=["auto", "bf16", "fp32"],
                    help="the daemon's translation_precision (auto: bf16 products where the processor has a bf16 GEMM)")
    ap.add_argument("--chain", action="store_true",
                    help="both directions in turn, each re-prefill (into T, under a new conversation id) being the "
                         "next switch's history (T -> S): long histories are written once, not twice per run")
    ap.add_argument("--append", action="store_true",
                    help="keep the results already in the output file for other history lengths")
    ap.add_argument("--render-only", action="store_true", help="rewrite the table and plot from the JSON; measure nothing")
    a = ap.parse_args()
    if a.render_only:
        return render(json.load(open(os.path.join(a.out, "switch-ttft.json"))), a)
    contexts = [int(x) for x in a.contexts.split(",")]
    if a.chain and sorted(a.directions.split(",")) != ["large-to-small", "small-to-large"]:
        sys.exit("--chain needs both directions")
    think = (1000 if a.warm_head else 0) if a.think_ms is None else a.think_ms
    small, large = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
    need = max(contexts) + a.turn + 64
    tmp = tempfile.mkdtemp(prefix="kvl-bench-switch-")
    cfg = os.path.join(tmp, "kvlingod.yaml")
    with open(cfg, "w") as f:
        f.write(f"listen: 127.0.0.1\ngrpc_port: 0\nhttp_port: -1\nlog_level: warn\nspill_dir: {tmp}\n"
                f"max_prompt_tokens: {need}\nmax_concurrent: 4\n"
                f"quality_gate: {{shadow_fraction: 0}}\n"  # no background shadows while timing
                f"translate_native_head: {a.native_head}\n"
                f"translation_precision: {a.translation_precision}\n"
                f"translate_warm_head: {'true' if a.warm_head else 'false'}\n"
                "models:\n"
                f"  - {{name: {small}, path: {small}, hot_mib: 2048, cold_mib: 512, max_model_len: {need + 64}}}\n"
                f"  - {{name: {large}, path: {large}, hot_mib: 3072, cold_mib: 512, max_model_len: {need + 64}}}\n"
                "translators:\n" +
                "".join(f"  - {ROOT}/translator/maps/{x}-to-{y}.safetensors\n" for x, y in ((small, large), (large, small))))
    def die_with_parent():  # the daemon goes when this script goes, however it ends
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    dlog = open(os.path.join(tmp, "kvlingod.log"), "w")
    d = subprocess.Popen([a.kvlingod, "--config", cfg, "--log-level", "info"], stdout=subprocess.PIPE, stderr=dlog,
                         text=True, preexec_fn=die_with_parent)
    line = d.stdout.readline()
    if not line.startswith("kvlingod listening"):
        sys.exit(f"kvlingod did not start: {line}")
    port = dict(p.split("=", 1) for p in line.split()[2:])["grpc"]
    dlog.flush()
    precision = sorted({json.loads(ln).get("precision", "fp32") for ln in open(dlog.name) if '"translator_loaded"' in ln})
    precision = ",".join(precision) or "unknown"  # what the daemon chose, as its log says
    print(f"translation precision: {precision}", flush=True)
    from kvlingo_client import pb, rpc  # noqa: E402
    import grpc  # noqa: E402
    stub = rpc.InferenceStub(grpc.insecure_channel(port))
    rng = random.Random(2026)

    def fresh(n):  # ordinary token ids (no specials), fresh every time
        return [rng.randrange(200, 150000) for _ in range(n)]

    IM_START = 151644  # both models' <|im_start|>: a chat transcript's first token

    sys_rng = random.Random(7)
    system = [IM_START] + [sys_rng.randrange(200, 150000) for _ in range(a.system - 1)] if a.system > 0 else []

    def history(n):  # fresh, but starting as every chat transcript does (with the shared system prompt if any)
        return system + fresh(n - len(system)) if system else [IM_START] + fresh(n - 1)

    def ttft(model, ids, conv="", reprefill=False):
        req = pb.GenerateRequest(tokens=pb.TokenIds(ids=ids), model=model, max_tokens=1, ignore_eos=True,
                                 conversation_id=conv, reprefill=reprefill, sampling=pb.SamplingParams(temperature=0))
        t0 = time.perf_counter()
        first, last = None, None
        for m in stub.Generate(req, timeout=3600):
            if first is None and m.token_ids:
                first = time.perf_counter()
            last = m
        return (first - t0) * 1e3, last

    dirs = {"small-to-large": (small, large), "large-to-small": (large, small)}
    for model in (small, large):  # untimed: first products repack weights (the bf16 level), fault pages in
        ttft(model, history(64), reprefill=True)  # with --system: also leaves the system prompt in its prefix cache
    results = []
    names = a.directions.split(",")
    for C in contexts:
        # per direction: translated, reprefill, translation, daemon ttft (ms), and the last usage
        runs = {name: ([], [], [], [], [None]) for name in names}
        held = None  # --chain: (conversation, tokens) the next switch's source holds natively
        for k, name in [(k, n) for k in range(a.runs) for n in names] if a.chain else \
                [(k, n) for n in names for k in range(a.runs)]:
            S, T = dirs[name]
            tr, rp, tx, sv, usage = runs[name]
            if held is None:
                conv = f"bench-{C}-{name}-{k}-{rng.randrange(1 << 30)}"
                hist = history(C)
                ttft(S, hist, conv)  # S writes the history natively (not timed)
            else:
                conv, hist = held
            time.sleep(think / 1e3)
            ms, last = ttft(T, hist + fresh(a.turn), conv)
            tr.append(ms)
            tx.append(last.timings.translation_seconds * 1e3)
            sv.append(last.timings.time_to_first_token_seconds * 1e3)
            usage[0] = last.usage
            time.sleep(think / 1e3)
            full = history(C) + fresh(a.turn)
            conv2 = f"bench-{C}-{name}-{k}-rp-{rng.randrange(1 << 30)}" if a.chain else ""
            ms2, last2 = ttft(T, full, conv2, reprefill=True)
            rp.append(ms2)
            if a.chain:  # T now holds `full` natively: its first C tokens are the other direction's next history
                held = (conv2, full[:C])
            print(f"  {S} -> {T}, {C} tokens: translated {ms:.0f} ms (daemon: {sv[-1]:.0f} ms, of which translation "
                  f"{tx[-1]:.0f} ms, queue {last.timings.queue_seconds * 1e3:.0f} ms; {usage[0].translated_tokens} "
                  f"translated, {usage[0].prefilled_tokens} prefilled, {usage[0].cached_native_tokens} cached), "
                  f"reprefill {ms2:.0f} ms ({last2.usage.prefilled_tokens} prefilled, "
                  f"{last2.usage.cached_native_tokens} cached)", flush=True)
        for name in names:
            S, T = dirs[name]
            tr, rp, tx, sv, (usage,) = runs[name]
            ratios = [r / t for r, t in zip(rp, tr)]
            results.append({"model": T, "test": "switch-ttft", "direction": f"{S}->{T}", "context_tokens": C,
                            "turn_tokens": a.turn, "reprefill_ms": round(statistics.median(rp), 1),
                            "translated_ms": round(statistics.median(tr), 1),
                            "value": round(statistics.median(rp) / statistics.median(tr), 2), "unit": "x",
                            "runs": a.runs, "sd": round(statistics.stdev(ratios), 2) if len(ratios) > 1 else 0,
                            "reprefill_sd_ms": round(statistics.stdev(rp), 1) if len(rp) > 1 else 0,
                            "translated_sd_ms": round(statistics.stdev(tr), 1) if len(tr) > 1 else 0,
                            "translation_ms": round(statistics.median(tx), 1),  # of translated_ms: the daemon's own timing
                            "daemon_ttft_ms": round(statistics.median(sv), 1),  # arrival to first token, in the daemon
                            "translated_positions": usage.translated_tokens,
                            "prefilled_positions": usage.prefilled_tokens, "native_head": a.native_head,
                            "system_tokens": a.system, "cached_positions": usage.cached_native_tokens,
                            "warm_head": a.warm_head, "think_ms": think, "chained": a.chain,
                            "cpu_level": os.environ.get("KVL_CPU") or "auto", "translation_precision": precision,
                            "measured_at": "gRPC client"})
    d.terminate()
    d.wait(timeout=120)
    cmd = " ".join(shlex.quote(x) for x in sys.argv)
    path = os.path.join(a.out, "switch-ttft.json")
    if a.append and os.path.exists(path):  # an earlier run's other lengths stay, with its command
        old = json.load(open(path))
        key = lambda r: (r["direction"], r["context_tokens"], r.get("system_tokens", 0),  # noqa: E731
                         r.get("translation_precision", "fp32"), r.get("warm_head", False))
        mine = {key(r) for r in results}
        results = sorted([r for r in old["results"] if key(r) not in mine] + results,
                         key=lambda r: (r.get("system_tokens", 0), r.get("warm_head", False), r["context_tokens"],
                                        r["direction"]))
        cmd = old["command"] + " ; " + cmd
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rep = {"benchmark": "switch-ttft", "git": git or "unknown",
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": machine(),
           "command": cmd, "results": results}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "switch-ttft.json"), "w") as f:
        json.dump(rep, f, indent=2)
        f.write("\n")
    render(rep, a)


def render(rep, a):
    """switch-ttft.md and .png from the report (the JSON is the record)."""
    results = rep["results"]
    small, large = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
    dirs = {"small-to-large": (small, large), "large-to-small": (large, small)}
    with open(os.path.join(a.out, "switch-ttft.md"), "w") as f:
        turn = results[0].get("turn_tokens", a.turn) if results else a.turn
        f.write(f"# switch-ttft — {rep['date']} — git {rep['git']}\n\n{rep['machine']['cpu']}, "
                f"{rep['machine']['cores']} cores; `{rep['command']}`\n\n"
                "Time to first token after a switch, at the gRPC client: the history was written by the other "
                f"model, then a {turn}-token user turn. Medians (± sd) over the runs.\n\n"
                "`shared system prompt`: the history's first N tokens are a system prompt both models already "
                "hold natively in their prefix cache (`--system N`), so neither side computes them; 0: a fresh "
                "history.\n\n"
                "`precision`: the translators' products (the daemon's translation_precision; fp32 before it existed).\n\n"
                "`warm head`: the daemon's translate_warm_head — the target computed the history's first 32 "
                "positions in the background after the history was written (`--warm-head`, with a pause of "
                "`think_ms` before each timed request), so the switch translated the rest and prefilled only the "
                "turn.\n\n"
                "| direction | history tokens | shared system prompt | warm head | precision | runs | translated ms "
                "| re-prefill ms | speed-up |\n"
                "|---|---|---|---|---|---|---|---|---|\n")
        for r in results:
            f.write(f"| {r['direction']} | {r['context_tokens']} | {r.get('system_tokens', 0)} | "
                    f"{'yes' if r.get('warm_head') else 'no'} | "
                    f"{r.get('translation_precision', 'fp32')} | {r['runs']} | "
                    f"{r['translated_ms']:.0f} ± "
                    f"{r['translated_sd_ms']:.0f} | {r['reprefill_ms']:.0f} ± {r['reprefill_sd_ms']:.0f} | "
                    f"**{r['value']:.1f}×** |\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        precs = sorted({r.get("translation_precision", "fp32") for r in results})
        for name, sysn, prec, warm in [(n, k, p, w) for k in sorted({r.get("system_tokens", 0) for r in results})
                                       for w in (False, True) for p in precs for n in ("small-to-large", "large-to-small")]:
            S, T = dirs[name]
            rs = [r for r in results if r["direction"] == f"{S}->{T}" and r.get("system_tokens", 0) == sysn and
                  r.get("translation_precision", "fp32") == prec and r.get("warm_head", False) == warm]
            if not rs:
                continue
            xs = [r["context_tokens"] for r in rs]
            tag = (f", shared {sysn}-token system prompt" if sysn else "") + (f", {prec}" if len(precs) > 1 else "") + \
                (", warm head" if warm else "")
            ax[0].plot(xs, [r["reprefill_ms"] for r in rs], "o--", label=f"re-prefill in {T}{tag}")
            ax[0].plot(xs, [r["translated_ms"] for r in rs], "o-", label=f"translate {S}→{T}{tag}")
            ax[1].plot(xs, [r["value"] for r in rs], "s:" if sysn else "^-." if warm else "o-", label=f"{S}→{T}{tag}")
        for x in ax:
            x.set_xscale("log", base=2)
            x.set_xlabel("history tokens (written by the other model)")
            x.grid(alpha=0.3)
            x.legend(fontsize=8)
        ax[0].set_yscale("log")
        ax[0].set_ylabel("time to first token, ms")
        ax[1].set_ylabel("speed-up (re-prefill / translated)")
        fig.suptitle(f"Model switch TTFT at the gRPC client — {rep['machine']['cpu']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "switch-ttft.png"), dpi=110)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    print(open(os.path.join(a.out, "switch-ttft.md")).read())


if __name__ == "__main__":
    main()
