"""What a user would run instead: Hugging Face transformers (PyTorch, bf16, static KV cache,
``generate``) decoding random-weight Llama shapes on the same GPU, tokens/s per batch size.

    PYTHONPATH=. python3 -m bench.hf_baseline [--models llama3-8b,llama2-7b,llama2-13b]
        [--batches 1,8,16,32,64] [--contexts 512,3584] [--new 128] [--budget-s 500] [--out DIR]

Needs torch with CUDA and transformers (not in this project's dependencies). The model shapes are
bench/shapes.py's; weights are transformers' random init in
bf16. Greedy, ``min_new_tokens = max_new_tokens`` so every sequence decodes all tokens; one warm-up
call (compilation of the static-cache graph), then the median of ``--reps`` timed calls.
Prefill is included in the time, as a user's ``generate`` call includes it; the table also gives
the prefill alone (``max_new_tokens=1``) so the decode rate can be read off. The table is written
after every configuration; one that runs out of GPU memory is recorded as skipped; none starts after
``--budget-s``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the shapes below import jax: keep it off the GPU
from bench.shapes import MODELS  # noqa: E402
from bench.args import command_line


def hf_config(name: str):
    from transformers import LlamaConfig as HFConfig

    c = MODELS[name]
    return HFConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                    num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                    max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                    tie_word_embeddings=c.tie_word_embeddings)


def time_generate(model, ids, new: int, reps: int) -> float:
    import torch

    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
              pad_token_id=0)
    model.generate(ids, **kw)  # warm-up / compile
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def markdown(run: dict) -> str:
    lines = ["# Hugging Face transformers baseline (bf16, static cache, greedy generate)", "",
             f"`{run['command']}` on {run['device']}", "",
             "| model | batch | context + new | tok/s (incl. prefill) | decode tok/s | decode ms/step |",
             "|---|---|---|---|---|---|"]
    for r in run["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['context']} + {r['new']} | {r['skipped']} | | |")
        else:
            lines.append(f"| {r['model']} | {r['batch']} | {r['context']} + {r['new']} | {r['tokens_per_s']:.0f} | "
                         f"{r['decode_tokens_per_s']:.0f} | {1e3 * r['batch'] / r['decode_tokens_per_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama3-8b,llama2-7b,llama2-13b")
    ap.add_argument("--batches", default="1,8,16,32,64")
    ap.add_argument("--contexts", default="512")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="start no configuration after this")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    args = ap.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError as e:
        raise SystemExit(f"needs torch with CUDA and transformers ({e}); torch is not a dependency of this project")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    deadline = time.perf_counter() + args.budget_s
    run = {"command": command_line("bench.hf_baseline", argv), "device": torch.cuda.get_device_name(),
           "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        with torch.device("cuda"):
            model = LlamaForCausalLM(hf_config(name)).to(torch.bfloat16).eval()
        for context in (int(c) for c in args.contexts.split(",")):
            for b in (int(x) for x in args.batches.split(",")):
                row = {"model": name, "batch": b, "context": context, "new": args.new}
                if time.perf_counter() > deadline:
                    print(f"{name} B={b} ctx={context}: time budget spent, not run", flush=True)
                    continue
                ids = torch.randint(1, MODELS[name].vocab_size, (b, context), device="cuda")
                try:
                    with torch.inference_mode():
                        total = time_generate(model, ids, args.new, args.reps)
                        prefill = time_generate(model, ids, 1, args.reps)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    row["skipped"] = "out of GPU memory"
                else:
                    row |= {"seconds": total, "tokens_per_s": b * args.new / total, "prefill_s": prefill,
                            "decode_tokens_per_s": b * (args.new - 1) / max(total - prefill, 1e-9)}
                run["rows"].append(row)
                print(f"{name} B={b} ctx={context}: " + (row.get("skipped") or
                      f"{row['tokens_per_s']:.0f} tok/s with prefill, {row['decode_tokens_per_s']:.0f} tok/s decode"),
                      flush=True)
                (args.out / "hf_baseline.json").write_text(json.dumps(run, indent=1))
                (args.out / "hf_baseline.md").write_text(markdown(run))
        del model
        torch.cuda.empty_cache()
    print(markdown(run))


if __name__ == "__main__":
    main()
