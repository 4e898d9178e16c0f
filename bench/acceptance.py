"""QSPEC acceptance on SmolLM2: GSM8K-dev prompts decoded greedily with ``method="qspec"`` for
gamma = 1..6 and both draft precisions; acceptance rate and mean tokens per round, next to the
teacher-forced agreement of ``bench/results/quality.json`` (same checkpoint) when available.

    python -m bench.acceptance --gsm8k ../shared/data/gsm8k_test_dev.jsonl [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from bench.args import command_line
from convert.embedded import default_checkpoint
from qspec_jax.api import DRAFTS, generate, load

NOTE = ("How to read it: the acceptance rate (accepted / drafted) falls with gamma even at a constant per-token agreement, because once a draft is rejected the rest of the round is discarded; compare the measured tokens per round with the tokens per round simulated from the teacher-forced agreement (`bench/quality.py`, same checkpoint), and gamma=1 acceptance with alpha. The two measure slightly different things: the teacher-forced run computes every position with the draft's own KV cache for the whole prefix, while a QSPEC draft step reads the verifier's W4A16 KV for all committed tokens and its own KV only for the drafts of the current round, so measured acceptance is higher (most visibly for a poor draft).")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gsm8k", type=Path, required=True)
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gammas", default="1,2,3,4,5,6")
    ap.add_argument("--quality", type=Path, default=Path("bench/results/quality.json"),
                    help="teacher-forced agreement to compare with (if the checkpoint is in it)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/acceptance.md"))
    args = ap.parse_args(argv)

    model = load(args.checkpoint or default_checkpoint())
    questions = [json.loads(line)["question"] for line in args.gsm8k.read_text().splitlines()
                 if line.strip()][: args.prompts]
    gammas = [int(g) for g in args.gammas.split(",")]
    ref = generate(model, questions, max_new_tokens=args.max_new_tokens, method="w4a16", chat=True)
    rows, identical = [], True
    for draft in DRAFTS:
        for g in gammas:
            t = time.time()
            res = generate(model, questions, max_new_tokens=args.max_new_tokens, method="qspec", draft=draft,
                           gamma=g, draft_window=None, chat=True)
            same = all(np.array_equal(a, b) for a, b in zip(res.sequences, ref.sequences))
            identical &= same
            rows.append((draft, g, res.stats, same))
            print(f"{draft} gamma={g}: acceptance {res.stats['acceptance_rate']:.4f}, tokens/round "
                  f"{res.stats['tokens_per_round']:.2f}, identical to w4a16: {same} ({time.time() - t:.0f} s)",
                  flush=True)

    tf = {}
    name = Path(model.checkpoint.manifest.get("source", {}).get("path", "")).name
    if args.quality.is_file():
        q = json.loads(args.quality.read_text())["results"]
        match = [k for k, v in q.items() if v.get("digest", "").startswith(model.checkpoint.manifest["files"]
                                                                          ["model.safetensors"])]
        if match and "agreement" in q[match[0]]:
            tf = q[match[0]]["agreement"]
            name = match[0]
    lines = [f"# QSPEC acceptance on SmolLM2-135M-Instruct ({jax.devices()[0].device_kind}, greedy)", "",
             f"Made by `{command_line('bench.acceptance', argv)}`.", "",
             f"Checkpoint `{model.checkpoint.path}` ({name}); {len(questions)} GSM8K-dev questions (chat "
             f"template) x {args.max_new_tokens} new tokens, batch {len(questions)}. Acceptance = accepted "
             "drafts / drafted; tokens per round counts every token committed by a round (accepted drafts "
             "plus the target's token; the first token comes from the prefill). "
             f"Greedy QSPEC output identical to greedy W4A16 on every prompt and setting: **{identical}**.", "",
             "| draft | gamma | acceptance | tokens/round | teacher-forced alpha | simulated tokens/round |",
             "|---|---|---|---|---|---|"]
    for draft, g, st, _ in rows:
        a = tf.get(draft, {})
        sim = a.get("tokens_per_round", {}).get(str(g), a.get("tokens_per_round", {}).get(g))
        lines.append(f"| {draft} | {g} | {st['acceptance_rate']:.4f} | {st['tokens_per_round']:.2f} | "
                     f"{a.get('alpha', float('nan')):.4f} | {'' if sim is None else f'{sim:.2f}'} |")
    lines += ["", NOTE]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
