"""Fidelity of every decoding method on SmolLM2: WikiText-2 perplexity per mode and GSM8K-dev
accuracy, agreement with W4A16, identical outputs, and QSPEC acceptance (the paper's Table 3).

    python -m bench.fidelity --gsm8k ../shared/data/gsm8k_test_dev.jsonl \
        --wikitext ../shared/data/wikitext2_test.raw [--limit 32] [--checkpoint DIR] [--out FILE] \
        [--drafts w4a8,w4a4,w4a8/kv8]

GSM8K: each question alone in the chat template (zero-shot), greedy, up to ``--max-new-tokens``;
answers extracted as lm-evaluation-harness does for gsm8k: "strict" takes the number after
``####``, "flexible" the last number in the output (commas and a trailing period dropped), each
compared with the reference answer's number after ``####``. For each method: accuracy (both
extractions), token agreement with W4A16 (positions where the two outputs hold the same token,
over the longer output's length), the fraction of problems whose output is identical to W4A16's,
and for QSPEC the acceptance rate and tokens per round. Perplexity: the first ``--ppl-tokens``
tokens in non-overlapping ``--window``-token windows (``bench/quality.py``'s protocol); QSPEC's
output distribution is W4A16's by construction, so its perplexity is W4A16's.

``--limit`` runs the first N problems (a CPU subset); without it, the whole dev set. ``--kernels``
picks the Pallas kernels or the references (``qspec_jax.kernels``; default: kernels on a GPU) for the
generation; the perplexity's full-window forwards have no row tile and run XLA's paths either way (with
``pallas``, W4A16 as a bf16 dot, as generate's prefill does).
``--drafts``: QSPEC's draft modes, each ``MODE[/kvBITS][/winSIZE[+SINKS]][/head[ROWS][q4]]`` (drafts over an
INT8 / INT4 KV shadow, ``generate(draft_kv=...)``, over sinks + a sliding window, ``draft_window`` /
``draft_sinks``, and with a draft head of the most frequent rows and / or INT4, ``draft_head`` /
``draft_head_bits``).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import jax
import numpy as np

from bench.args import at_least, command_line, git_commit, positive_int, read_gsm8k, utc_now
from bench.decode import DRAFT_GRAMMAR, DraftSpec, parse_draft
from bench.quality import wikitext_ids
from convert.embedded import default_checkpoint
from pallas_kernels.precision import parse_precision
from qspec_jax.api import Model, generate, load
from qspec_jax.evaluate import perplexity
from qspec_jax.kernels import KERNELS

AR_METHODS = ("w16a16", "w4a16", "w4a8", "w4a4")
_NUMBER = re.compile(r"-?[$0-9.,]{2,}|-?[0-9]+")
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def _clean(num: str) -> str:
    return num.replace(",", "").replace("$", "").rstrip(".")


def extract(text: str) -> tuple[str | None, str | None]:
    """(strict, flexible) answers of a generated text (None where there is none)."""
    strict = _STRICT.search(text)
    numbers = _NUMBER.findall(text)
    return (_clean(strict.group(1)) if strict else None), (_clean(numbers[-1]) if numbers else None)


def reference_answer(answer: str) -> str:
    """The number after a GSM8K answer's ``####`` (a ValueError where there is none)."""
    if "####" not in answer:
        raise ValueError(f"a GSM8K answer ends with '#### <number>'; this one has no '####': {answer[-60:]!r}")
    return _clean(answer.split("####")[-1].strip())


def _same_number(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """(positions holding the same token, the longer length)."""
    n = min(len(a), len(b))
    return int(np.sum(a[:n] == b[:n])), max(len(a), len(b))


def run_method(model: Model, questions: list[str], method: str, draft: DraftSpec | None, gamma: int, batch: int,
               max_new: int, kernels: str) -> tuple[list[np.ndarray], list[str], dict]:
    """Greedy outputs of one method over all questions, in batches; summed QSPEC counters (``draft``:
    QSPEC's drafts, None for an autoregressive method)."""
    seqs, texts = [], []
    tot = dict(rounds=0, drafted=0, accepted=0, in_rounds=0, seconds=0.0)
    for i in range(0, len(questions), batch):
        window = None if draft is None else draft.window  # the spec's views only: no window unless it names one
        qspec = {} if draft is None else {"draft": draft.mode, "gamma": gamma, "draft_kv": draft.kv,
                                          "draft_window": None if window is None else window.size}
        if window is not None:
            qspec["draft_sinks"] = window.sinks
        if draft is not None and draft.head:
            qspec |= {"draft_head": draft.head_rows, "draft_head_bits": draft.head_bits}
        res = generate(model, questions[i:i + batch], max_new_tokens=max_new, method=method, chat=True,
                       kernels=kernels, **qspec)
        seqs += res.sequences
        texts += res.texts
        st = res.stats
        if draft is not None:
            tot["rounds"] += st["rounds"]
            tot["drafted"] += st["drafted"]
            tot["accepted"] += st["accepted"]
            tot["in_rounds"] += st["tokens_per_round"] * st["rounds"]
        tot["seconds"] += st["wall_time_s"]
    return seqs, texts, tot


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gsm8k", type=Path, required=True, help="GSM8K dev JSONL (question, answer)")
    ap.add_argument("--wikitext", type=Path, help="WikiText-2 raw test file (skip perplexity without it)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--limit", type=positive_int, default=None, help="first N problems only (CPU subset)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=256)
    ap.add_argument("--batch", type=positive_int, default=16)
    ap.add_argument("--gamma", type=positive_int, default=3)
    ap.add_argument("--ppl-tokens", type=positive_int, default=40960)
    ap.add_argument("--window", type=at_least(2), default=512)
    ap.add_argument("--kernels", default="auto", choices=KERNELS)
    ap.add_argument("--drafts", default="w4a8,w4a4", help=f"QSPEC drafts: {DRAFT_GRAMMAR}, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("bench/results/fidelity.md"))
    args = ap.parse_args(argv)
    try:
        drafts = [(d, parse_draft(d)) for d in args.drafts.split(",")]
    except ValueError as e:
        ap.error(f"--drafts: {e}")
    if args.wikitext and not args.wikitext.is_file():
        raise SystemExit(f"--wikitext: no such file {args.wikitext}")
    if args.out.is_dir():
        raise SystemExit(f"--out {args.out} is a directory: give the report's file name")
    rows = read_gsm8k(args.gsm8k)[: args.limit]
    questions = [r["question"] for r in rows]
    try:
        answers = [reference_answer(r["answer"]) for r in rows]
    except ValueError as e:
        raise SystemExit(f"--gsm8k {args.gsm8k}: {e}") from None
    model = load(args.checkpoint or default_checkpoint())
    if args.wikitext and args.window > model.config.max_position_embeddings:
        raise SystemExit(f"--window {args.window} exceeds the model's {model.config.max_position_embeddings} positions")
    device = jax.devices()[0].device_kind
    print(f"{len(rows)} problems on {device}", flush=True)

    methods = [(m, m, None) for m in AR_METHODS] + [(f"qspec-{d}", "qspec", spec) for d, spec in drafts]
    out: dict = {"command": command_line("bench.fidelity", argv), "date": utc_now(), "commit": git_commit(),
                 "problems": len(rows), "device": device, "gamma": args.gamma, "methods": {}}
    outputs = {}
    for name, method, draft in methods:
        t = time.time()
        seqs, texts, tot = run_method(model, questions, method, draft, args.gamma, args.batch,
                                      args.max_new_tokens, args.kernels)
        outputs[name] = seqs
        ext = [extract(x) for x in texts]
        res = {"strict_acc": float(np.mean([_same_number(s, a) for (s, _), a in zip(ext, answers)])),
               "flexible_acc": float(np.mean([_same_number(f, a) for (_, f), a in zip(ext, answers)])),
               "tokens": int(sum(len(s) for s in seqs)), "seconds": tot["seconds"]}
        if method == "qspec":
            res["acceptance"] = tot["accepted"] / tot["drafted"] if tot["drafted"] else 0.0
            res["tokens_per_round"] = tot["in_rounds"] / tot["rounds"] if tot["rounds"] else 0.0
        out["methods"][name] = res
        print(f"{name}: flexible {res['flexible_acc']:.3f} strict {res['strict_acc']:.3f} "
              f"({time.time() - t:.0f} s)", flush=True)
    ref = outputs["w4a16"]
    for name, seqs in outputs.items():
        same = [agreement(a, b) for a, b in zip(seqs, ref)]
        r = out["methods"][name]
        r["token_agreement"] = sum(s for s, _ in same) / max(1, sum(n for _, n in same))
        r["identical"] = int(sum(np.array_equal(a, b) for a, b in zip(seqs, ref)))
        r["differing_problems"] = [i for i, (a, b) in enumerate(zip(seqs, ref)) if not np.array_equal(a, b)][:50]
    if args.wikitext:
        from qspec_jax.tokenizer import load_tokenizer
        ids = wikitext_ids(args.wikitext, load_tokenizer(model.checkpoint.path), args.ppl_tokens)
        ck = model.checkpoint
        out["ppl"] = {m: perplexity(ck.params, ck.config, ids, window=args.window, precision=parse_precision(m),
                                    online_rotation_seed=ck.online_rotation_seed, kernels=args.kernels)
                      for m in AR_METHODS}
        print("ppl", out["ppl"], flush=True)
    write(out, args)


def _number(v: float | None, digits: int) -> str:
    """A table cell: ``v`` to ``digits`` decimals, or "–" where the method has no such number."""
    return "–" if v is None else f"{v:.{digits}f}"


def write(out: dict, args) -> None:
    n = out["problems"]
    lines = ["# Fidelity on SmolLM2-135M-Instruct: GSM8K-dev and WikiText-2", "",
             f"Made by `{out['command']}` on {out['device']}, {out.get('date', 'date not recorded')}, "
             f"commit {out.get('commit', 'not recorded')}.", "",
             f"{n} GSM8K-dev problems, zero-shot chat template, greedy, up to {args.max_new_tokens} new tokens; "
             f"QSPEC with gamma = {out['gamma']}. Accuracy by lm-evaluation-harness-style extraction "
             "(strict: the number after `####`; flexible: the last number). Agreement and identity are "
             "against W4A16's outputs.", "",
             "| method | flexible acc | strict acc | token agreement with W4A16 | identical to W4A16 | "
             "acceptance | tokens/round | WikiText-2 ppl |",
             "|---|---|---|---|---|---|---|---|"]
    ppl = out.get("ppl", {})
    for name, r in out["methods"].items():
        p = ppl.get("w4a16" if name.startswith("qspec") else name)
        lines.append(f"| {name} | {r['flexible_acc']:.3f} | {r['strict_acc']:.3f} | {r['token_agreement']:.4f} | "
                     f"{r['identical']}/{n} | {_number(r.get('acceptance'), 3)} | "
                     f"{_number(r.get('tokens_per_round'), 2)} | {_number(p, 3)} |")
    lines += ["", "QSPEC's perplexity column is W4A16's: its committed tokens are W4A16's by construction "
              "(greedy: token-identical, see the identity column; sampled: the same distribution)."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
