"""Bar chart of a bench.json (needs matplotlib; the GPU machine has it):

    python scripts/plot_bench.py bench.json docs/bench_h200.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    cases: dict = {}
    for r in data["results"]:
        cases.setdefault(r["case"], []).append(r)
    names = list(cases)
    variants = []
    for c in names:
        for r in cases[c]:
            if r["variant"] not in variants:
                variants.append(r["variant"])
    fig, ax = plt.subplots(figsize=(2.6 * len(names) + 2, 4))
    w = 0.8 / len(variants)
    for vi, v in enumerate(variants):
        xs, ys = [], []
        for ci, c in enumerate(names):
            rows = [r for r in cases[c] if r["variant"] == v and r.get("median_ms")]
            if rows:
                eager = next(r["median_ms"] for r in cases[c] if r["variant"] == "eager")
                xs.append(ci + vi * w)
                ys.append(eager / rows[0]["median_ms"])
        ax.bar(xs, ys, w, label=v)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(names))], names)
    ax.set_ylabel("speed-up over eager (higher is better)")
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_title(f"whole training step (AdamW), {data['meta']['device']}, torch {data['meta']['torch']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
