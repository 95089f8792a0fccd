#!/usr/bin/env python3
"""plot-routing.py — Benchmark 3's figure: quality against the large model's share of the
work, for always-small, always-large and the cascade at each threshold. Left: held-out
NLL per token (bench/results/routing-nll.json, from build/bench/bench-routing), one line
per handoff (translated, translated + native tail, re-prefill). Right: the pass rate on
the Python tasks (bench/results/routing-tasks.json, from bench/routing-tasks.py) when
present. The issue's bar, 90% of always-large's gain at 50% of its large-model tokens,
is the shaded corner.

    .venv/bin/python bench/plot-routing.py [--results bench/results] [-o docs/img/routing.png]
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bar_corner(ax, small, large, higher_is_better):
    """Shade where a setting meets the bar: >= 90% of the gain with <= 50% large tokens."""
    target = small + 0.9 * (large - small)
    lo, hi = (target, max(small, large) + abs(large - small) * 0.3) if higher_is_better else \
        (min(small, large) - abs(large - small) * 0.3, target)
    ax.fill_between([0, 0.5], lo, hi, color="tab:green", alpha=0.12, label="bar: ≥ 90% of the gain, ≤ 50% large tokens")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("-o", "--out", default=os.path.join(ROOT, "docs", "img", "routing.png"))
    a = ap.parse_args()
    nll = json.load(open(os.path.join(a.results, "routing-nll.json")))
    tasks_path = os.path.join(a.results, "routing-tasks.json")
    tasks = json.load(open(tasks_path)) if os.path.exists(tasks_path) else None
    fig, axes = plt.subplots(1, 2 if tasks else 1, figsize=(12 if tasks else 6.5, 4.6), squeeze=False)
    ax = axes[0][0]
    rows = nll["results"]
    small = next(r for r in rows if r["setting"] == "always-small")
    large = next(r for r in rows if r["setting"] == "always-large")
    bar_corner(ax, small["value"], large["value"], False)
    ax.plot([0], [small["value"]], "o", color="tab:blue", ms=9, label=f"always-small ({small['model']})")
    ax.plot([1], [large["value"]], "o", color="tab:red", ms=9, label=f"always-large ({large['model']})")
    ax.plot([0, 1], [small["value"], large["value"]], ":", color="k", lw=0.8, label="proportional (no selectivity)")
    bound = sorted((r for r in rows if r["setting"] == "per-token-entropy-bound"), key=lambda r: r["large_token_fraction"])
    if bound:
        ax.plot([0] + [r["large_token_fraction"] for r in bound] + [1],
                [small["value"]] + [r["value"] for r in bound] + [large["value"]], "-", color="tab:green", lw=1,
                label="bound: highest-entropy tokens, one by one, native")
    style = {"cascade": ("tab:purple", "s-", "cascade, translated handoff"),
             "cascade-tail": ("tab:orange", "D-", "cascade, translated + native tail"),
             "cascade-reprefill": ("tab:gray", "^--", "cascade, re-prefill handoff")}
    for setting, (color, mk, label) in style.items():
        rs = sorted((r for r in rows if r["setting"] == setting), key=lambda r: r["large_token_fraction"])
        if not rs:
            continue
        if setting == "cascade-tail":
            label += f" ({rs[0]['native_tail']} tokens)"
        ax.plot([r["large_token_fraction"] for r in rs], [r["value"] for r in rs], mk, color=color, label=label)
        if setting == "cascade":
            for r in rs:
                ax.annotate(f"τ={r['max_mean_entropy']:g}", (r["large_token_fraction"], r["value"]), fontsize=7,
                            xytext=(3, 4), textcoords="offset points")
    ax.set_xlabel("large model's share of the scored tokens")
    ax.set_ylabel("held-out NLL, nats/token (lower is better)")
    ax.set_title(f"Held-out NLL: {small['runs']} documents, {small.get('prompt_tokens')} + "
                 f"{small.get('cont_tokens')} tokens", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if tasks:
        ax = axes[0][1]
        rows = tasks["results"]
        s = next(r for r in rows if r["setting"] == "always-small")
        lg = next(r for r in rows if r["setting"] == "always-large")
        bar_corner(ax, s["value"], lg["value"], True)
        total = lg["large_tokens"] or 1
        ax.plot([0], [s["value"]], "o", color="tab:blue", ms=9, label="always-small")
        ax.plot([1], [lg["value"]], "o", color="tab:red", ms=9, label="always-large")
        tp = next((r for r in rows if r["setting"] == "large-on-translated-prompt"), None)
        if tp:
            ax.plot([tp["large_tokens"] / total], [tp["value"]], "x", color="tab:red", ms=9, mew=2,
                    label="1.5B on the prompt translated from the 0.5B")
        rs = sorted((r for r in rows if r["setting"] == "cascade"), key=lambda r: r["large_tokens"])
        ax.plot([r["large_tokens"] / total for r in rs], [r["value"] for r in rs], "s-", color="tab:purple",
                label=f"cascade ({tasks.get('translators', '')} translators)")
        for r in rs:
            ax.annotate(f"τ={r['max_mean_entropy']:g}", (r["large_tokens"] / total, r["value"]), fontsize=7,
                        xytext=(3, 4), textcoords="offset points")
        ax.set_xlabel("large-model tokens, as a share of always-large's")
        ax.set_ylabel("Python tasks passed, %")
        ax.set_title(f"{s['tasks']} Python tasks, tests in a sandbox", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Routing quality vs cost — {nll['machine']['cpu']}, git {nll['git']}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
