"""The README's result tables, generated from the JSON files in ``bench/results/``.

    python -m bench.report            # rewrite the tables in README.md
    python -m bench.report --check    # exit 1 and print a diff if README.md is stale

Each table lives in README.md between two markers, ``<!-- results:NAME -->`` and
``<!-- /results:NAME -->``; everything between them is replaced, nothing outside them is touched.
One table per benchmark:

| NAME | from | made by |
|---|---|---|
| ``decode`` | ``decode.json`` | ``bench/decode.py --preset headline`` |
| ``decode-views`` | ``decode_views.json`` | ``bench/decode.py`` at long context, draft views of the cache |
| ``decode-gamma5``, ``decode-heads`` | ``decode_gamma5.json``, ``decode_heads.json`` | ``bench/decode.py``: γ up to 5, draft heads |
| ``decode-default`` | ``decode_default.json`` | ``bench/decode.py --preset headline`` on its Llama shapes |
| ``decode-long`` | ``decode_long.json`` | ``bench/decode.py`` at context 4096, batch 8-32, draft views |
| ``kernels`` | ``kernels.json`` | ``bench/kernels.py`` |
| ``fidelity`` | ``fidelity.json`` | ``bench/fidelity.py`` |
| ``fidelity-window`` | ``fidelity_window.json`` | ``bench/fidelity.py`` with window drafts |
| ``quality`` | ``quality.json`` | ``bench/quality.py`` |
| ``hf`` | ``hf_baseline.json`` | ``bench/hf_baseline.py`` |

Every table comes with a caption naming the device, date, commit and command that produced it, as far
as the JSON records them (``not recorded`` where it does not). The generator only reads; it needs no
GPU and no JAX. A JSON file that is missing, or a decode run that holds only some configurations,
gives a smaller table (or a line saying nothing was measured), never an error.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"

NOT_RECORDED = "not recorded"
MODEL_NAMES = {"llama3-8b": "Llama-3-8B", "llama2-7b": "Llama-2-7B", "llama2-13b": "Llama-2-13B",
               "smollm2": "SmolLM2-135M"}
AR_METHODS = ("w16a16", "w4a16", "w4a8", "w4a4")
KERNEL_M = 16  # the row count of the kernels table (tokens per matmul at batch 16, one token each)
KERNEL_MODEL = "llama3-8b"  # the model whose shapes the table shows (kernels.md has every model)
SKIP_REASONS = {"memory": "more memory than the card has"}  # a skipped configuration's ``skip_reason``, in words


def model_name(key: str) -> str:
    return MODEL_NAMES.get(key, key)


def method_name(key: str) -> str:
    """``w4a8/kv8`` -> ``W4A8 + INT8 KV``; ``w4a8/win512+4`` -> ``W4A8 + window 512 (4 sinks)``;
    ``w4a16`` -> ``W4A16``."""
    base, *views = key.split("/")
    words = [base.upper()]
    for view in views:
        if view.startswith("win"):
            size, plus, sinks = view[3:].partition("+")
            words.append(f"window {size}" + (f" ({sinks} sinks)" if plus else ""))
        elif view.startswith("head"):
            rows, q4 = view[4:].removesuffix("q4"), view.endswith("q4")
            words.append(("INT4 " if q4 else "") + (f"head of {rows} rows" if rows else "head"))
        else:
            words.append(f"INT{view[2:]} KV" if view.startswith("kv") else view)
    return " + ".join(words)


def first_call(command: str) -> str:
    """A command as the caption shows it: runs built over several calls record them joined by
    ``; then``; the caption gives the first and says how many followed."""
    calls = [c.strip() for c in command.split("; then ") if c.strip()]
    if len(calls) <= 1:
        return f"`{command.strip()}`"
    n = len(calls) - 1
    return f"`{calls[0]}` and {n} further call{'s' if n > 1 else ''}"


def caption(device: Any, date: Any, commit: Any, command: Any, source: str) -> str:
    return (f"*{device or NOT_RECORDED}; date: {date or NOT_RECORDED}; commit: {commit or NOT_RECORDED}; "
            f"from [`{source}`](bench/results/{source}), made by "
            f"{first_call(command) if command else NOT_RECORDED}.*")


def file_caption(data: dict, source: str) -> str:
    """:func:`caption` from a results file's own ``device`` / ``date`` / ``commit`` / ``command`` keys."""
    return caption(data.get("device"), data.get("date"), data.get("commit"), data.get("command"), source)


def _x(ratio: float) -> str:
    return f"{ratio:.2f}×"


def _commits(sections: list[dict]) -> list[str]:
    """The commits named by the sections' ``commit`` fields or their labels, in first-seen order."""
    out: list[str] = []
    for r in sections:
        found = [r["commit"]] if r.get("commit") else re.findall(r"\b[0-9a-f]{7,40}\b", r.get("label", ""))
        out += [c for c in found if c not in out]
    return out


# ------------------------------------------------------------------------------------------ decode

def _valid_sections(run: dict) -> list[dict]:
    return [r for r in run.get("results", []) if not r.get("skipped") and not r.get("disturbed")
            and r.get("methods")]


def _qspec_methods(sections: list[dict]) -> list[str]:
    """QSPEC drafts (``w4a8``, ``w4a8/kv8``, ...) in first-seen order."""
    drafts: list[str] = []
    for r in sections:
        for m in r["methods"]:
            if m.startswith("qspec "):
                d = m[len("qspec "):].split(" g=")[0]
                if d not in drafts:
                    drafts.append(d)
    return drafts


def _best_gamma(methods: dict, draft: str) -> tuple[int, dict] | None:
    found = [(int(m.rsplit("g=", 1)[1]), e) for m, e in methods.items()
             if m.startswith(f"qspec {draft} g=") and m != f"qspec {draft} g=auto" and "tokens_per_s" in e]
    return max(found, key=lambda ge: ge[1]["tokens_per_s"]) if found else None


def vs_w4a16(entry: dict, base: float) -> float:
    """A method's speed-up over W4A16 AR: its own where it was timed beside that loop (γ auto), else its
    tokens/s over ``base``, the configuration's W4A16 AR tokens/s."""
    return entry.get("speedup_vs_w4a16", entry["tokens_per_s"] / base)


def render_decode(run: dict, source: str = "decode.json") -> str:
    """One table per (model, context) of a ``bench/decode.py`` run read from ``source``."""
    sections = _valid_sections(run)
    if not sections:
        return "*No decode configuration measured yet.*"
    commits = _commits(sections) or ([run["commit"]] if run.get("commit") else [])
    devices = list(dict.fromkeys(str(r["gpu"]) for r in sections if r.get("gpu"))) or \
        ([run["device"]] if run.get("device") else [])
    days = sorted({str(r["date"])[:10] for r in sections if r.get("date")}) or \
        ([run["date"]] if run.get("date") else [])
    date = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}" if days else None
    cap = caption(", ".join(devices), date, ", ".join(commits), run.get("command"), source)
    lines = [cap, "",
             "Tokens/s of the whole batch; in brackets the speed-up over W4A16 AR in the same run. "
             "QSPEC: the best of the fixed γ measured (γ given; every γ is in "
             f"[{Path(source).stem}.md](bench/results/{Path(source).stem}.md)). "
             + ("γ auto: `generate`'s default, γ chosen every round (the mean γ given, a W4A16 step counting "
                "as γ = 0). " if any(k.endswith(" g=auto") for r in sections for k in r["methods"]) else "")
             + ("Llama shapes: random INT4 weights with QSPEC's acceptance replayed from a trace recorded on "
                "SmolLM2's real weights." if any(r.get("acceptance") == "replayed" for r in sections) else "")
             + (" SmolLM2: real weights, measured acceptance."
                if any(r.get("acceptance") == "measured" for r in sections) else "")]
    groups: dict[tuple[str, int, Any], list[dict]] = {}
    for r in sections:
        groups.setdefault((r["model"], r["context"], r.get("new")), []).append(r)
    for (model, context, new), rows in groups.items():
        rows = sorted(rows, key=lambda r: r["batch"])
        ar = [m for m in AR_METHODS if any(m in r["methods"] for r in rows)]
        drafts = _qspec_methods(rows)
        auto = [d for d in drafts if any(f"qspec {d} g=auto" in r["methods"] for r in rows)]
        head = ["batch", *(f"{method_name(m)} AR" for m in ar), *(f"QSPEC, {method_name(d)} draft" for d in drafts),
                *(f"QSPEC, {method_name(d)} draft, γ auto" for d in auto)]
        lines += ["", f"**{model_name(model)}, context {context}" + (f" + {new} new tokens" if new else "") + "**", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            base = r["methods"].get("w4a16", {}).get("tokens_per_s")
            cells = [str(r["batch"])]
            for m in ar:
                e = r["methods"].get(m)
                if not e or "tokens_per_s" not in e:
                    cells.append("–")
                elif m == "w4a16" or not base:
                    cells.append(f"{e['tokens_per_s']:.0f}")
                else:
                    cells.append(f"{e['tokens_per_s']:.0f} ({_x(e['tokens_per_s'] / base)})")
            for d in drafts:
                best = _best_gamma(r["methods"], d)
                if best is None:
                    cells.append("–")
                else:
                    g, e = best
                    ratio = f"{_x(e['tokens_per_s'] / base)}, " if base else ""
                    cells.append(f"{e['tokens_per_s']:.0f} ({ratio}γ={g})")
            for d in auto:
                e = r["methods"].get(f"qspec {d} g=auto")
                if not e or "tokens_per_s" not in e:
                    cells.append("–")
                else:
                    ratio = f"{_x(vs_w4a16(e, base))}, " if base else ""
                    cells.append(f"{e['tokens_per_s']:.0f} ({ratio}mean γ {e['mean_gamma']:.1f})")
            lines.append("| " + " | ".join(cells) + " |")
    left = _left_out(run)
    lines += _speedup_summary(sections)
    return "\n".join(lines + (["", f"Not shown (see [{Path(source).stem}.md](bench/results/{Path(source).stem}.md)): "
                                 + "; ".join(left) + "."] if left else []))


def _speedup_summary(sections: list[dict]) -> list[str]:
    """The mean, lowest and highest speed-up over W4A16 AR of QSPEC's best draft and fixed γ over the
    Llama-shape configurations shown (replayed acceptance), and the lowest and highest of γ auto's over all."""
    best, auto = [], []
    for r in sections:
        base = r["methods"].get("w4a16", {}).get("tokens_per_s")
        if not base:
            continue
        where = f"{model_name(r['model'])} batch {r['batch']}, context {r['context']}"
        fixed = [b[1]["tokens_per_s"] for d in _qspec_methods([r]) if (b := _best_gamma(r["methods"], d))]
        if fixed and r.get("acceptance") == "replayed":
            best.append((max(fixed) / base, where))
        auto += [(vs_w4a16(e, base), where) for m, e in r["methods"].items()
                 if m.endswith(" g=auto") and "tokens_per_s" in e]
    out = []
    if best:
        out.append(f"QSPEC's best draft and fixed γ over W4A16 AR, over the {len(best)} Llama-shape configurations "
                   f"shown: mean {_x(statistics.fmean(b for b, _ in best))}, lowest {_x(min(best)[0])} "
                   f"({min(best)[1]}), highest {_x(max(best)[0])} ({max(best)[1]}).")
    if auto:
        out.append(f"γ auto over W4A16 AR, over the {len(auto)} configurations shown: lowest {_x(min(auto)[0])} ({min(auto)[1]}), "
                   f"highest {_x(max(auto)[0])} ({max(auto)[1]}).")
    return ["", " ".join(out)] if out else []


def _left_out(run: dict) -> list[str]:
    """The run's configurations that have no row: too large for the card, or timed while disturbed."""
    why: dict[tuple[str, int, str], list[int]] = {}
    for r in run.get("results", []):
        if r.get("skipped"):
            reason = SKIP_REASONS.get(r.get("skip_reason"), str(r["skipped"]))
        elif r.get("disturbed"):
            reason = "its timing was disturbed (a round came out shorter than its phases timed alone)"
        else:
            continue
        why.setdefault((r["model"], r["context"], reason), []).append(r["batch"])
    return [f"{model_name(m)} batch {', '.join(map(str, sorted(b)))} at context {c}: {reason}"
            for (m, c, reason), b in why.items()]


# ----------------------------------------------------------------------------------------- kernels

def render_kernels(data: dict) -> str:
    runs = data.get("runs") or [{}]
    rows = [t for t in data.get("table", {}).values() if t.get("M") == KERNEL_M]
    if any(t.get("model") == KERNEL_MODEL for t in rows):
        rows = [t for t in rows if t.get("model") == KERNEL_MODEL]
    if not rows:
        return "*No kernel table measured yet.*"
    used = sorted({t.get("run", 0) for t in rows})
    meta = [runs[i] if i < len(runs) else {} for i in used]
    join = lambda key: ", ".join(dict.fromkeys(str(m[key]) for m in meta if m.get(key))) or None  # noqa: E731
    lines = [caption(join("device"), join("date"), join("commit"), join("command"), "kernels.json"), "",
             f"One call at M = {KERNEL_M} tokens (µs, GPU kernel time); %BW: the bytes it must move over "
             "the measured copy bandwidth. W4A4 includes quantizing its input. Every M from 1 to 256 and "
             "decode attention, on every model: [kernels.md](bench/results/kernels.md).", "",
             "| model | shape (N × K) | W4A16 µs | W4A16 %BW | W4A4 µs | XLA bf16 µs | XLA `int4` µs | "
             "W4A16 vs XLA bf16 |", "|---|---|---|---|---|---|---|---|"]
    for t in rows:
        def us(key: str) -> str:
            return f"{t[key]['us']:.1f}" if isinstance(t.get(key), dict) and "us" in t[key] else "–"
        w, bf = t.get("w4a16", {}), t.get("xla_bf16", {})
        pct = f"{w['pct_copy']:.0f}%" if "pct_copy" in w else "–"
        vs = _x(bf["us"] / w["us"]) if "us" in w and "us" in bf else "–"
        lines.append(f"| {model_name(t['model'])} | {t['shape']} {t['N']} × {t['K']} | {us('w4a16')} | {pct} | "
                     f"{us('w4a4')} | {us('xla_bf16')} | {us('xla_int4')} | {vs} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- fidelity

def render_fidelity(data: dict, source: str = "fidelity.json") -> str:
    methods = data.get("methods", {})
    if not methods:
        return "*No fidelity run recorded yet.*"
    n = data.get("problems")
    lines = [file_caption(data, source),
             "", f"SmolLM2-135M-Instruct, {n} GSM8K-dev problems, greedy, up to 256 new tokens, QSPEC at "
             f"γ = {data.get('gamma', '?')}. Identity and token agreement are against W4A16's outputs; "
             "perplexity on WikiText-2 (QSPEC's is W4A16's: it commits W4A16's tokens).", "",
             "| method | identical to W4A16 | token agreement | acceptance | tokens/round | WikiText-2 ppl | "
             "GSM8K acc (flexible) |", "|---|---|---|---|---|---|---|"]
    ppl = data.get("ppl", {})
    for m, e in methods.items():
        qspec = m.startswith("qspec-")
        name = f"QSPEC, {method_name(m[len('qspec-'):])} draft" if qspec else f"{method_name(m)} AR"
        p = ppl.get("w4a16" if qspec else m)
        acc = (f"{e['acceptance']:.3f} | {e['tokens_per_round']:.2f}" if qspec and "acceptance" in e else "– | –")
        lines.append(f"| {name} | {e['identical']}/{n} | {e['token_agreement']:.3f} | {acc} | "
                     f"{f'{p:.2f}' if p is not None else '–'} | {e['flexible_acc']:.3f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- quality

def render_quality(data: dict) -> str:
    results = data.get("results", {})
    if not results:
        return "*No quality run recorded yet.*"
    s = data.get("settings", {})
    lines = [file_caption(data, "quality.json"),
             "", f"SmolLM2-135M-Instruct converted from its GGUF (Q4_1) by `qspec-convert`: RTN or GPTQ, without "
             f"rotation, with a randomized Hadamard or with a learned rotation. Perplexity: WikiText-2, {s.get('ppl_tokens', '?')} tokens in windows of "
             f"{s.get('window', '?')} (float weights: {data.get('float_ppl', float('nan')):.2f}). α: teacher-forced "
             f"top-1 agreement of the draft with W4A16 along {s.get('answers', '?')} GSM8K-dev answers; "
             "tokens/round simulated from it at γ = 3; conversion time on the machine of the run.", "",
             "| checkpoint | W4A16 ppl | W4A8 ppl | W4A4 ppl | α W4A8 | α W4A4 | tokens/round W4A8 (γ 3) | "
             "tokens/round W4A4 (γ 3) | conversion s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        ppl, agr = r.get("ppl", {}), r.get("agreement", {})

        def p(m: str) -> str:
            return f"{ppl[m]:.2f}" if m in ppl else "–"

        def a(m: str) -> str:
            return f"{agr[m]['alpha']:.3f}" if m in agr else "–"

        def t(m: str) -> str:
            per_gamma = agr.get(m, {}).get("tokens_per_round", {})
            return f"{per_gamma['3']:.2f}" if "3" in per_gamma else "–"
        same = f" (= {r['same_weights_as']})" if r.get("same_weights_as") else ""
        secs = f"{r['conversion_s']:.0f}" if "conversion_s" in r else "–"
        lines.append(f"| {name}{same} | {p('w4a16')} | {p('w4a8')} | {p('w4a4')} | {a('w4a8')} | {a('w4a4')} | "
                     f"{t('w4a8')} | {t('w4a4')} | {secs} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- hf

def render_hf(data: dict, decode: dict | None = None) -> str:
    rows = data.get("rows", [])
    if not rows:
        return "*No Hugging Face baseline recorded yet.*"
    ours = {}  # only sections measured on the baseline's GPU: speeds of two cards are not compared
    for r in _valid_sections(decode or {}):
        e = r["methods"].get("w4a16", {})
        if "tokens_per_s" in e and r.get("gpu") == data.get("device"):
            ours[(r["model"], r["batch"], r["context"])] = e["tokens_per_s"]
    lines = [file_caption(data, "hf_baseline.json"),
             "", "Hugging Face transformers, PyTorch bf16, static cache, greedy `generate`, random weights of the "
             "model's shape; decode rate without the prefill. qspec-jax W4A16 AR: the same model, batch and "
             "prompt length in [decode.json](bench/results/decode.json) (its own number of new tokens), "
             "shown only where it ran on the same GPU.", "",
             "| model | batch | prompt + new | HF decode tok/s | qspec-jax W4A16 AR tok/s | ratio |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        mine = ours.get((r["model"], r["batch"], r["context"]))
        hf = r.get("decode_tokens_per_s", r.get("tokens_per_s"))
        lines.append(f"| {model_name(r['model'])} | {r['batch']} | {r['context']} + {r['new']} | {hf:.0f} | "
                     + (f"{mine:.0f} | {_x(mine / hf)} |" if mine else "– | – |"))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ README

def _read(results: Path, name: str) -> dict | None:
    path = results / name
    return json.loads(path.read_text()) if path.exists() else None


def tables(results: Path = RESULTS) -> dict[str, str]:
    """``{marker name: table markdown}`` from the JSON files in ``results``."""
    decode = _read(results, "decode.json")
    makers: dict[str, tuple[str, Callable[[dict], str]]] = {
        "decode": ("decode.json", render_decode),
        "decode-views": ("decode_views.json", lambda d: render_decode(d, "decode_views.json")),
        "decode-gamma5": ("decode_gamma5.json", lambda d: render_decode(d, "decode_gamma5.json")),
        "decode-heads": ("decode_heads.json", lambda d: render_decode(d, "decode_heads.json")),
        "decode-default": ("decode_default.json", lambda d: render_decode(d, "decode_default.json")),
        "decode-long": ("decode_long.json", lambda d: render_decode(d, "decode_long.json")),
        "kernels": ("kernels.json", render_kernels),
        "fidelity": ("fidelity.json", render_fidelity),
        "fidelity-window": ("fidelity_window.json", lambda d: render_fidelity(d, "fidelity_window.json")),
        "quality": ("quality.json", render_quality),
        "hf": ("hf_baseline.json", lambda d: render_hf(d, decode)),
    }
    out = {}
    for name, (source, make) in makers.items():
        data = _read(results, source)
        out[name] = make(data) if data is not None else f"*`bench/results/{source}` not present.*"
    return out


def fill(readme: str, generated: dict[str, str]) -> str:
    """``readme`` with each ``<!-- results:NAME -->`` ... ``<!-- /results:NAME -->`` block replaced by
    ``generated[NAME]``. A marker without its end, or a NAME the generator does not know, is an error."""
    for name in re.findall(r"<!-- results:([\w-]+) -->", readme):
        if name not in generated:
            raise SystemExit(f"README marker results:{name}: no such table (known: {', '.join(generated)})")
        pattern = re.compile(rf"(<!-- results:{name} -->\n).*?(<!-- /results:{name} -->)", re.S)
        if not pattern.search(readme):
            raise SystemExit(f"README marker results:{name} has no <!-- /results:{name} --> after it")
        readme = pattern.sub(lambda m: m.group(1) + generated[name] + "\n" + m.group(2), readme)
    return readme


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", type=Path, default=README)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff if the README is stale")
    args = ap.parse_args(argv)
    old = args.readme.read_text()
    new = fill(old, tables(args.results))
    if args.check:
        if new != old:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       str(args.readme), "generated"))
            print(f"\n{args.readme} is stale: run `python -m bench.report`", file=sys.stderr)
            return 1
        print(f"{args.readme}: result tables up to date")
        return 0
    if new != old:
        args.readme.write_text(new)
        print(f"{args.readme}: result tables rewritten")
    else:
        print(f"{args.readme}: result tables already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
