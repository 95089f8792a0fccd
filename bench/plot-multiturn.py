#!/usr/bin/env python3
"""plot-multiturn.py — the multi-turn quality figure from bench/results/multiturn-nll.json
(written by build/bench/bench-multiturn): per-turn NLL of the reference continuation
under re-prefill, the protocol and naive re-translation (left), and each scheme's
difference to re-prefill with ±1 standard error (right); the 0.05 nats/token bar dashed.

    .venv/bin/python bench/plot-multiturn.py [bench/results/multiturn-nll.json]
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
    sys.exit(print(__doc__))
path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                          "multiturn-nll.json")
rep = json.load(open(path))
rows = rep["results"]
turns = sorted({r["turn"] for r in rows})
fig, ax = plt.subplots(1, 2, figsize=(11, 4))
style = {"reprefill": ("k", "o-"), "protocol": ("tab:blue", "s-"), "naive": ("tab:red", "^-")}
for method, (color, mk) in style.items():
    rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["turn"])
    ax[0].plot([r["turn"] for r in rs], [r["value"] for r in rs], mk, color=color, label=method)
    if method != "reprefill":
        ax[1].errorbar([r["turn"] for r in rs], [r["minus_reprefill"] for r in rs],
                       yerr=[r["minus_reprefill_se"] for r in rs], fmt=mk, color=color, capsize=3, label=method)
ax[1].axhline(0.05, ls="--", color="gray", lw=1, label="0.05 nats/token")
ax[1].axhline(0, color="k", lw=0.5)
models = {r["turn"]: r["model"].replace("qwen2.5-coder-", "") for r in rows}
for x in ax:
    x.set_xticks(turns)
    x.set_xticklabels([f"{t}\n{models[t]}" for t in turns], fontsize=7)
    x.set_xlabel("turn (serving model)")
    x.grid(alpha=0.3)
    x.legend(fontsize=8)
ax[0].set_ylabel("NLL of the reference continuation, nats/token")
ax[1].set_ylabel("minus re-prefill, nats/token")
ax[1].set_yscale("symlog", linthresh=0.1)
n = rows[0]["runs"]
proto = next((r for r in rows if r["method"] == "protocol"), rows[0])
kind = {"distilled": "distilled translators", "": "closed-form translators"}.get(proto.get("translators", ""),
                                                                               f"translators '{proto['translators']}'")
fig.suptitle(f"Multi-turn quality, {n} held-out conversations, models alternating ({kind}, native head "
             f"{proto.get('native_head', 0)}) — git {rep['git']}", fontsize=9)
fig.tight_layout()
out = os.path.splitext(path)[0] + ".png"
fig.savefig(out, dpi=110)
print(out)
