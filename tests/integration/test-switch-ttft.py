#!/usr/bin/env python3
"""test-switch-ttft.py — the headline benchmark's script (bench/switch-ttft.py) end to end
on the real pair, small: 64-token histories, 2 runs, --chain --warm-head, into a
temporary folder. Checks what it writes (shared/BENCH-FORMAT.md rows, one per direction,
with the positions the daemon reports: the warm head cached, the rest translated, the turn
prefilled), that --render-only rewrites the table from the JSON, and that --chain with one
direction is refused. No timing is checked: speed is the benchmark's business.

usage: test-switch-ttft.py KVLINGOD MODELS_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Checks  # noqa: E402

check = Checks()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "switch-ttft.py")


def main():
    kvlingod, models = sys.argv[1], sys.argv[2]
    files = [os.path.join(models, f"qwen2.5-coder-{s}-instruct-q4_k_m.gguf") for s in ("0.5b", "1.5b")]
    if not all(os.path.exists(f) for f in files):
        print("models missing (scripts/fetch-models): skipped")
        return 77  # as the other real-pair tests
    env = dict(os.environ, KVLINGO_MODELS=models, OMP_NUM_THREADS="2")
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, SCRIPT, "--kvlingod", kvlingod, "-c", "64", "-r", "2", "--chain",
                            "--warm-head", "--think-ms", "300", "--out", d], capture_output=True, text=True, env=env,
                           timeout=600)
        check(r.returncode == 0,
              f"64 tokens, 2 runs, chained (rc {r.returncode}) {r.stderr[-800:] if r.returncode else ''}")
        path = os.path.join(d, "switch-ttft.json")
        rep = json.load(open(path)) if os.path.exists(path) else {"results": []}
        rows = rep["results"]
        dirs = sorted(x["direction"] for x in rows)
        check(dirs == ["qwen2.5-coder-0.5b->qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b->qwen2.5-coder-0.5b"],
              f"one row per direction: {dirs}")
        check(rep.get("benchmark") == "switch-ttft" and "cpu" in rep.get("machine", {}) and rep.get("command"),
              "the report names the benchmark, the machine and the command")
        for x in rows:
            # the native head (32) found in the target's prefix cache (the warm head), the
            # other 32 history positions translated, the 32-token turn prefilled
            check(x["test"] == "switch-ttft" and x["unit"] == "x" and x["context_tokens"] == 64 and x["runs"] == 2
                  and x["chained"] and x["warm_head"] and x["measured_at"] == "gRPC client"
                  and x["translated_ms"] > 0 and x["reprefill_ms"] > 0 and x["value"] > 0,
                  f"{x['direction']}: a switch-ttft row ({x['translated_ms']:.0f} ms vs {x['reprefill_ms']:.0f} ms)")
            check((x["cached_positions"], x["translated_positions"], x["prefilled_positions"]) == (32, 32, 32),
                  f"{x['direction']}: cached / translated / prefilled positions "
                  f"{x['cached_positions']} / {x['translated_positions']} / {x['prefilled_positions']} (32 each)")
        md = os.path.join(d, "switch-ttft.md")
        check(os.path.exists(md) and open(md).read().count("| qwen2.5-coder-") == 2, "the table has both rows")
        os.remove(md)
        r = subprocess.run([sys.executable, SCRIPT, "--render-only", "--out", d], capture_output=True, text=True,
                           env=env)
        check(r.returncode == 0 and os.path.exists(md), f"--render-only rewrites the table (rc {r.returncode})")
        r = subprocess.run([sys.executable, SCRIPT, "--kvlingod", kvlingod, "-c", "64", "--chain", "--directions",
                            "small-to-large", "--out", os.path.join(d, "one")], capture_output=True, text=True, env=env,
                           timeout=300)
        check(r.returncode != 0 and "--chain needs both directions" in r.stderr,
              f"--chain with one direction refused (rc {r.returncode}: {r.stderr.strip()[-200:]})")
    print(f"{check.failed} failed")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
