"""The checkpoint's tokenizer, loaded without torch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "PyTorch was not found" notice

from transformers import PreTrainedTokenizerFast  # noqa: E402


def load_tokenizer(checkpoint_dir: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer stored in a converted checkpoint (``tokenizer.json`` + config)."""
    path = Path(checkpoint_dir)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path / 'tokenizer.json'} not found")
    return PreTrainedTokenizerFast.from_pretrained(str(path))


ROLES = ("system", "user", "assistant")


def check_messages(messages) -> list[dict[str, str]]:
    """A conversation: a non-empty list of ``{"role": ..., "content": str}`` with roles of :data:`ROLES`,
    a system message first if at all."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"a conversation is a non-empty list of messages, got {messages!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"} or not isinstance(m["content"], str):
            raise ValueError(f"message {i} must be {{'role': ..., 'content': str}}, got {m!r}")
        if m["role"] not in ROLES or (m["role"] == "system" and i > 0):
            raise ValueError(f"message {i}: role {m['role']!r} must be one of {ROLES}, 'system' only first")
    return [dict(m) for m in messages]


def chat_prompt(tokenizer: PreTrainedTokenizerFast, prompt: str | Sequence[dict[str, str]],
                system: str | None = None) -> list[int]:
    """Token ids of ``prompt`` (one user turn, or a list of messages) through the chat template, ready for
    the reply; ``system``: a system message put first."""
    if not tokenizer.chat_template:
        raise ValueError("this tokenizer has no chat template")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else check_messages(prompt)
    if system is not None:
        if not isinstance(system, str):
            raise ValueError(f"system must be a string, got {system!r}")
        if messages[0]["role"] == "system":
            raise ValueError("the conversation has a system message already: leave out system=")
        messages = [{"role": "system", "content": system}, *messages]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def cut_at_stop(tokenizer: PreTrainedTokenizerFast, tokens: Sequence[int],
                stop: Sequence[str]) -> tuple[Sequence[int], str] | None:
    """Where the text of ``tokens`` first contains a ``stop`` string: ``(the fewest tokens whose text
    contains it, the text before it)``; None where none occurs."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    hits = [(text.find(s), len(s)) for s in stop if s in text]
    if not hits:
        return None
    at = min(i for i, _ in hits)
    end = at + min(n for i, n in hits if i == at)
    lo, hi = 1, len(tokens)  # the shortest prefix whose text reaches the match's end (texts grow with prefixes)
    while lo < hi:
        mid = (lo + hi) // 2
        if tokenizer.decode(tokens[:mid], skip_special_tokens=True).startswith(text[:end]):
            hi = mid
        else:
            lo = mid + 1
    return tokens[:lo], text[:at]
