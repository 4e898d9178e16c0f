"""A soak run of ``generate``: every GSM8K-dev problem through QSPEC in batches of mixed sizes, prompt
lengths, budgets and sampling settings, checking that nothing drifts over a long session.

    python -m bench.soak --gsm8k ../shared/data/gsm8k_test_dev.jsonl [--limit N] [--checkpoint DIR] \
        [--out bench/results/soak.json]

Batches cycle through sizes (``--batch-sizes``), 0-2 GSM8K-train shots before the question (three
prompt-length buckets) and budgets (``--budgets``, one per prompt). Two of every three batches are
greedy: QSPEC (``--gamma`` drafts per round, W4A8) and W4A16 both run and must be identical token for
token; the third samples (QSPEC, the same γ), each prompt with its own temperature and top-p. Recorded: the compiled prefill / decode functions'
cache sizes against the number of distinct (method, sampling, batch, prompt bucket, budget bucket)
buckets seen — equal when no setting value forces a compilation — and the process's resident memory
every ``--report-every`` prompts (flat after warm-up when nothing leaks). JSON + markdown out.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import numpy as np

from bench.args import command_line, git_commit, positive_int, read_gsm8k, utc_now
from convert.embedded import default_checkpoint
from qspec_jax.api import NEW_TOKENS_MULTIPLE, PROMPT_MULTIPLE, generate, load, tokenize
from qspec_jax.core import decode_jit, prefill_jit


def rss_mib() -> float:
    """The process's resident set size now (Linux ``/proc``), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def prompt_text(question: str, shots: list[dict[str, str]]) -> str:
    return "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots) + f"Question: {question}\nAnswer:"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--gsm8k", type=Path, required=True, help="GSM8K-dev JSONL (the questions)")
    ap.add_argument("--gsm8k-train", type=Path, default=Path("../shared/data/gsm8k_train.jsonl"),
                    help="GSM8K-train JSONL (the shots)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="converted checkpoint (none: the embedded SmolLM2)")
    ap.add_argument("--limit", type=positive_int, default=None, help="the first N problems (none: all)")
    ap.add_argument("--batch-sizes", default="8", help="batch sizes, cycled (each a shape: compiled apart)")
    ap.add_argument("--budgets", default="16,24,40", help="max_new_tokens values, cycled over the prompts")
    ap.add_argument("--gamma", type=positive_int, default=3, help="QSPEC's drafts per round")
    ap.add_argument("--report-every", type=positive_int, default=100, help="prompts between memory readings")
    ap.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",")]
        budgets = [int(x) for x in args.budgets.split(",")]
    except ValueError:
        ap.error("--batch-sizes and --budgets are comma-separated integers")
    if min(sizes) < 1 or min(budgets) < 1:
        ap.error("--batch-sizes and --budgets must be >= 1")
    questions = [r["question"] for r in read_gsm8k(args.gsm8k, answers=False)][:args.limit]
    shots = read_gsm8k(args.gsm8k_train)
    model = load(default_checkpoint() if args.checkpoint is None else args.checkpoint)
    rng = np.random.default_rng(0)

    buckets: set = set()
    memory, mismatches, start, done, batch_no, t0 = [], [], 0, 0, 0, time.perf_counter()
    drafted = accepted = 0  # greedy QSPEC's drafts, over the run
    base = (decode_jit._cache_size(), prefill_jit._cache_size())
    next_report = 0
    while start < len(questions):
        size = sizes[batch_no % len(sizes)]
        qs = questions[start:start + size]
        prompts = [prompt_text(q, shots[(start + i) % len(shots):][:(start + i) % 3]) for i, q in enumerate(qs)]
        new = [budgets[(start + i) % len(budgets)] for i in range(len(qs))]
        width = -(-max(len(p) for p in tokenize(model, prompts, chat=True)) // PROMPT_MULTIPLE) * PROMPT_MULTIPLE
        room = -(-max(new) // NEW_TOKENS_MULTIPLE) * NEW_TOKENS_MULTIPLE
        kw = dict(max_new_tokens=new, chat=True)
        if batch_no % 3 == 2:
            temps = rng.uniform(0.3, 1.2, len(qs)).round(3).tolist()
            top_p = rng.uniform(0.7, 1.0, len(qs)).round(3).tolist()
            generate(model, prompts, **kw, gamma=args.gamma, temperature=temps, top_p=top_p, seed=batch_no)
            buckets.add(("qspec", "sampled", len(qs), width, room))
        else:
            q = generate(model, prompts, **kw, gamma=args.gamma)
            drafted += q.stats["drafted"]
            accepted += q.stats["accepted"]
            w = generate(model, prompts, **kw, method="w4a16")
            buckets |= {("qspec", "greedy", len(qs), width, room), ("w4a16", "greedy", len(qs), width, room)}
            mismatches += [start + i for i, (a, b) in enumerate(zip(q.sequences, w.sequences))
                           if not np.array_equal(a, b)]
        start += len(qs)
        batch_no += 1
        if start >= next_report or start >= len(questions):
            compiled = (decode_jit._cache_size() - base[0], prefill_jit._cache_size() - base[1])
            memory.append({"prompts": start, "rss_mib": round(rss_mib(), 1), "seconds": round(time.perf_counter() - t0, 1),
                           "decode_compiles": compiled[0], "prefill_compiles": compiled[1], "buckets": len(buckets)})
            print(json.dumps(memory[-1]), flush=True)
            next_report = start + args.report_every
    after_warm = [m["rss_mib"] for m in memory[len(memory) // 2:]]
    out = {"command": command_line("bench.soak", argv), "date": utc_now(), "commit": git_commit(),
           "device": jax.devices()[0].device_kind, "machine": platform.processor() or platform.machine(),
           "prompts": len(questions), "batches": batch_no, "buckets": len(buckets),
           "decode_compiles": memory[-1]["decode_compiles"], "prefill_compiles": memory[-1]["prefill_compiles"],
           "gamma": args.gamma, "greedy_drafted": drafted, "greedy_accepted": accepted,
           "greedy_mismatches": mismatches, "rss_growth_second_half_mib": round(max(after_warm) - min(after_warm), 1),
           "memory": memory}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(out))
    return out


def markdown(r: dict) -> str:
    rows = "\n".join(f"| {m['prompts']} | {m['seconds']} | {m['rss_mib']} | {m['decode_compiles']} | "
                     f"{m['prefill_compiles']} | {m['buckets']} |" for m in r["memory"])
    return (f"# Soak run: {r['prompts']} GSM8K-dev prompts through generate\n\n"
            f"Made by `{r['command']}` on {r['device']} ({r['machine']}), {r['date']}, commit {r['commit']}.\n\n"
            f"- {r['batches']} batches; greedy QSPEC (γ = {r['gamma']}) vs W4A16 mismatches: "
            f"{len(r['greedy_mismatches'])}; greedy QSPEC drafted {r['greedy_drafted']} tokens, "
            f"{r['greedy_accepted'] / max(r['greedy_drafted'], 1):.3f} of them accepted\n"
            f"- compilations: decode {r['decode_compiles']}, prefill {r['prefill_compiles']}, for {r['buckets']} "
            f"distinct buckets\n- resident memory over the second half of the run: "
            f"+{r['rss_growth_second_half_mib']} MiB at most\n\n"
            "| prompts | s | RSS MiB | decode compiles | prefill compiles | buckets |\n|---|---|---|---|---|---|\n"
            f"{rows}\n")


if __name__ == "__main__":
    main()
