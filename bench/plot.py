"""Tokens/s against batch size per method, one panel per model shape, from a ``bench/decode.py`` run.

    python -m bench.plot [bench/results/decode.json] [--context 512] [--gamma 3] \
        [--hf bench/results/hf_baseline.json] [--out bench/results/decode.svg]

Methods: the autoregressive ones (W16A16, W4A16, W4A8, W4A4) and QSPEC with each draft at one
gamma (default 3, ``generate``'s), labelled with its acceptance: replayed from the trace the run names
on the Llama shapes, measured on a real model (smollm2). ``--hf`` adds Hugging Face transformers'
bf16 decode rate (``bench/hf_baseline.py``) at the same context. Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.args import read_json  # noqa: E402

AR = ("w16a16", "w4a16", "w4a8", "w4a4")


def series(results: list[dict], context: int, gamma: int) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{model: {method label: [(batch, tokens/s), ...]}}`` for one context length (sections skipped or
    marked ``disturbed`` left out). Sections of different lengths (``new`` tokens) are not drawn together:
    their tokens/s average over different contexts."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    kept = [r for r in results if not r.get("skipped") and not r.get("disturbed") and r["context"] == context]
    if len(news := {r.get("new") for r in kept}) > 1:
        raise SystemExit(f"the sections at context {context} were measured with different numbers of new tokens "
                         f"({sorted(news, key=str)}): plot them from separate runs")
    for r in kept:
        per = out.setdefault(r["model"], {})
        for name, e in r["methods"].items():
            if name in AR:
                label = name
            elif name.endswith(f" g={gamma}"):
                acceptance = r.get("acceptance", "replayed")  # a section without the field: replayed
                label = f"{name.split()[0]} {name.split()[1]} draft, γ={gamma} ({acceptance} acceptance)"
            else:
                continue
            per.setdefault(label, []).append((r["batch"], e["tokens_per_s"]))
    return out


HF_LABEL = "HF transformers bf16 (decode rate)"


def hf_series(rows: list[dict], context: int) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{model: {label: [(batch, decode tokens/s), ...]}}`` from bench/hf_baseline.py rows; the label
    (:data:`HF_LABEL`) names the rows' new tokens where they record them."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for r in rows:
        if "skipped" not in r and r["context"] == context:
            label = HF_LABEL if "new" not in r else f"{HF_LABEL[:-1]}, {r['new']} new tokens)"
            out.setdefault(r["model"], {}).setdefault(label, []).append((r["batch"], r["decode_tokens_per_s"]))
    return out


def _linestyle(label: str) -> str:
    return "--" if label.startswith("qspec") else ":" if label.startswith(HF_LABEL[:-1]) else "-"


def colours(labels: list[str]) -> dict[str, tuple]:
    """A distinct colour per label: tab10 up to 10 labels, tab20 up to 20 (a method per colour in the
    legend), then repeating."""
    cmap, n = ("tab10", 10) if len(labels) <= 10 else ("tab20", 20)
    return {label: plt.get_cmap(cmap)(i % n) for i, label in enumerate(labels)}


PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def plot(data: dict, context: int, out: Path) -> None:
    """One panel per model; log-2 batch axis; one colour per method across panels, one legend."""
    models = sorted(data)
    if not models:
        raise SystemExit(f"no results at context {context}")
    labels = sorted({label for lines in data.values() for label in lines})
    palette = colours(labels)
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        for label, pts in sorted(data[model].items()):
            pts = sorted(pts)
            ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=label, color=palette[label],
                    linestyle=_linestyle(label))
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model}, context {context}")
        ax.set_xlabel("batch size")
        ax.set_ylabel("generated tokens/s (whole batch)")
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=palette[label], marker="o", label=label,
                          linestyle=_linestyle(label))
               for label in labels]
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 * ((len(labels) + 3) // 4), 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", nargs="?", type=Path, default=Path("bench/results/decode.json"),
                    help="the decode.json bench/decode.py wrote")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--hf", type=Path, default=None, help="hf_baseline.json from bench/hf_baseline.py")
    ap.add_argument("--out", type=Path, default=Path("bench/results/decode.svg"))
    args = ap.parse_args(argv)
    if args.out.suffix.lower() not in PLOT_SUFFIXES or args.out.is_dir():
        ap.error(f"--out {args.out}: give the plot's file name, ending in {' / '.join(PLOT_SUFFIXES)}")
    results = read_json(args.run, "run", {"results": list})["results"]
    if not all(isinstance(r, dict) and ("methods" in r or "skipped" in r) for r in results):
        raise SystemExit("a run's results must be bench.decode sections (objects with 'methods')")
    data = series(results, args.context, args.gamma)
    if not any("γ=" in label for lines in data.values() for label in lines):
        raise SystemExit(f"no QSPEC results at gamma {args.gamma} and context {args.context} in {args.run}")
    if args.hf:  # only for the models the decode runs have
        for model, lines in hf_series(read_json(args.hf, "--hf", {"rows": list})["rows"], args.context).items():
            if model in data:
                data[model] |= lines
    plot(data, args.context, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
