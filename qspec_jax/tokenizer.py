"""The checkpoint's tokenizer, loaded without torch."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "PyTorch was not found" notice

from transformers import PreTrainedTokenizerFast  # noqa: E402


def load_tokenizer(checkpoint_dir: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer stored in a converted checkpoint (``tokenizer.json`` + config)."""
    path = Path(checkpoint_dir)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path / 'tokenizer.json'} not found")
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def chat_prompt(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn through the chat template, ready for the reply."""
    if not tokenizer.chat_template:
        raise ValueError("this tokenizer has no chat template")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)
