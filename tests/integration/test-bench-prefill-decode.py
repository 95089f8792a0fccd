#!/usr/bin/env python3
"""test-bench-prefill-decode.py — bench-prefill-decode on a tiny model: prefill at a depth
(pp<N>@d<D>), decode, decode after a longer prompt (--tg-depth: tg<N>@d<D>, also on the
CUDA backend compiled for the CPU, its pool kept and staged), and the result rows it writes
(shared/BENCH-FORMAT.md); a depth
beyond the model's context and bad options are refused with a message, and no result
file is written then.

usage: test-bench-prefill-decode.py BENCH_PREFILL_DECODE TINY_GGUF_TOOL
"""
import json
import os
import subprocess
import sys
import tempfile

bad = 0


def check(cond, what):
    global bad
    print(("ok   " if cond else "FAIL ") + what)
    bad += 0 if cond else 1


def main():
    exe, tiny_tool = sys.argv[1], sys.argv[2]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    with tempfile.TemporaryDirectory() as d:
        model = os.path.join(d, "tiny.gguf")
        subprocess.run([tiny_tool, model], check=True)
        out = os.path.join(d, "out")
        r = subprocess.run([exe, "-m", model, "-p", "8,16", "-d", "24", "-n", "4", "-r", "2", "--peak", "0", "--out", out],
                           capture_output=True, text=True, env=env)
        check(r.returncode == 0, f"pp at depth 24 and tg4 run (rc {r.returncode}) {r.stderr[-500:] if r.returncode else ''}")
        rep = json.load(open(os.path.join(out, "prefill-decode.json")))
        rows = {x["test"]: x for x in rep["results"]}
        check(set(rows) == {"pp8@d24", "pp16@d24", "tg4"}, f"rows pp8@d24, pp16@d24, tg4: {sorted(rows)}")
        for t in ("pp8@d24", "pp16@d24"):
            x = rows.get(t, {})
            check(x.get("depth") == 24 and x.get("runs") == 2 and x.get("value", 0) > 0 and x.get("unit") == "tokens/s",
                  f"{t}: depth 24, 2 runs, a positive tokens/s ({x.get('value')})")
        check(rows.get("tg4", {}).get("value", 0) > 0 and "depth" not in rows.get("tg4", {}), "tg4: a positive tokens/s, no depth")
        md = open(os.path.join(out, "prefill-decode.md")).read()
        check("pp16@d24" in md, "the markdown table has the depth rows")

        # without -d the names stay pp<N> and depth is 0
        out0 = os.path.join(d, "out0")
        r = subprocess.run([exe, "-m", model, "-p", "8", "-n", "0", "-r", "1", "--peak", "0", "--out", out0],
                           capture_output=True, text=True, env=env)
        rows0 = {x["test"]: x for x in json.load(open(os.path.join(out0, "prefill-decode.json")))["results"]} \
            if r.returncode == 0 else {}
        check(set(rows0) == {"pp8"} and rows0["pp8"].get("depth") == 0, f"no -d: one row pp8 at depth 0 ({sorted(rows0)})")

        # --tg-depth: decode after a longer prompt (tg<N>@d<D>), on the CPU and on the CUDA backend compiled
        # for the CPU, whose rows carry its copies: with the pool kept on the device a step copies in far
        # less than staging the history per layer would (KVL_CUDA_KV_KEEP=0)
        # less than staging the history per layer would (KVL_CUDA_KV_KEEP=0); and a step's logits stay
        # there, only their summary crossing, unless --full-logits asks for the row
        kib, out = {}, {}
        for backend, keep, full in (("cpu", "1", False), ("cuda-sim", "1", False), ("cuda-sim", "0", False),
                                    ("cuda-sim", "1", True)):
            outd = os.path.join(d, f"outd-{backend}-{keep}-{full}")
            r = subprocess.run([exe, "-m", model, "-p", "0", "-n", "2", "--tg-depth", "100", "-r", "1", "--peak", "0",
                                "--backend", backend, "--out", outd] + (["--full-logits"] if full else []),
                               capture_output=True, text=True,
                               env=dict(env, KVL_CUDA_KV_KEEP=keep, KVL_CUDA_KV_CHECK="1"))
            rowsd = {x["test"]: x for x in json.load(open(os.path.join(outd, "prefill-decode.json")))["results"]} \
                if r.returncode == 0 else {}
            x = rowsd.get("tg2@d100", {})
            check(set(rowsd) == {"tg2@d100"} and x.get("prompt_tokens") == 100 and x.get("value", 0) > 0,
                  f"--tg-depth 100 on {backend} (keep {keep}): one row tg2@d100 after 100 tokens ({sorted(rowsd)}) "
                  f"{r.stderr[-300:] if r.returncode else ''}")
            check(x.get("decode_logits") == ("full" if full else "summary"), f"decode_logits {x.get('decode_logits')}")
            if not full:
                kib[(backend, keep)] = x.get("device_kib_in_per_token")
            out[(backend, keep, full)] = x.get("device_kib_out_per_token")
        check(kib[("cpu", "1")] is None, "the CPU's row has no device traffic")
        kept, staged = kib[("cuda-sim", "1")] or 1e9, kib[("cuda-sim", "0")] or 0
        check(kept * 4 < staged, f"cuda-sim: {kept:.1f} KiB in per step with the pool kept, {staged:.1f} staged")
        summ, whole = out[("cuda-sim", "1", False)] or 1e9, out[("cuda-sim", "1", True)] or 0
        check(summ < whole, f"cuda-sim: {summ:.2f} KiB out per step with the logits summarised, {whole:.2f} whole")

        # a depth past the model's context: refused by name, nothing written
        out1 = os.path.join(d, "out1")
        r = subprocess.run([exe, "-m", model, "-p", "8", "-d", "1000000", "-n", "0", "-r", "1", "--peak", "0",
                            "--out", out1], capture_output=True, text=True, env=env)
        check(r.returncode != 0 and "exceed the model's context" in r.stderr and not os.path.exists(out1),
              f"-d 1000000 refused, no result file (rc {r.returncode}: {r.stderr.strip()[-200:]})")
        for args, what in ((["-d", "-3"], "a negative depth"), (["-d", "x"], "a depth that is not a number")):
            r = subprocess.run([exe, "-m", model, "-p", "8", "-n", "0", "--out", out1] + args, capture_output=True,
                               text=True, env=env)
            check(r.returncode == 2 and "-d must be an integer" in r.stderr, f"{what} refused with usage status 2")
    print(f"{'FAIL' if bad else 'ok'}: {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
