"""What a user would run instead: Hugging Face transformers (PyTorch, bf16, static KV cache,
``generate``) decoding random-weight Llama shapes on the same GPU, tokens/s per batch size.

    PYTHONPATH=. python3 -m bench.hf_baseline [--models llama3-8b,llama2-7b] [--batches 8,16,32]
        [--context 512] [--new 128] [--out DIR]

Needs torch with CUDA and transformers (present on the lent H200, not in this project's
dependencies). The model shapes are bench/decode.py's; weights are transformers' random init in
bf16. Greedy, ``min_new_tokens = max_new_tokens`` so every sequence decodes all tokens; one warm-up
call (compilation of the static-cache graph), then the median of ``--reps`` timed calls.
Prefill is included in the time, as a user's ``generate`` call includes it; the table also gives
the prefill alone (``max_new_tokens=1``) so the decode rate can be read off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the shapes below import jax: keep it off the GPU
from bench.decode import MODELS  # noqa: E402


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


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama3-8b,llama2-7b")
    ap.add_argument("--batches", default="8,16,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows = []
    for name in args.models.split(","):
        with torch.device("cuda"):
            model = LlamaForCausalLM(hf_config(name)).to(torch.bfloat16).eval()
        for b in (int(x) for x in args.batches.split(",")):
            ids = torch.randint(1, MODELS[name].vocab_size, (b, args.context), device="cuda")
            with torch.inference_mode():
                total = time_generate(model, ids, args.new, args.reps)
                prefill = time_generate(model, ids, 1, args.reps)
            decode_rate = b * (args.new - 1) / max(total - prefill, 1e-9)
            rows.append({"model": name, "batch": b, "context": args.context, "new": args.new, "seconds": total,
                         "tokens_per_s": b * args.new / total, "prefill_s": prefill, "decode_tokens_per_s": decode_rate})
            print(f"{name} B={b}: {b * args.new / total:.0f} tok/s with prefill, {decode_rate:.0f} tok/s decode",
                  flush=True)
        del model
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_baseline.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    lines = ["# Hugging Face transformers baseline (bf16, static cache, greedy generate)", "",
             f"`python3 -m bench.hf_baseline {' '.join(sys.argv[1:])}` on {torch.cuda.get_device_name()}", "",
             "| model | batch | context + new | tok/s (incl. prefill) | decode tok/s |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['batch']} | {r['context']} + {r['new']} | {r['tokens_per_s']:.0f} | "
              f"{r['decode_tokens_per_s']:.0f} |" for r in rows]
    (args.out / "hf_baseline.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
