"""SmolLM2-135M from the GGUF against Hugging Face transformers (PyTorch) loaded from the same file.

transformers + torch are not installed in CI (PyTorch for Python 3.12 is a multi-GB CUDA build),
so the reference outputs are golden files written by ``tests/golden/make_golden.py``, which runs
transformers' ``LlamaForCausalLM`` and tokenizer on the GGUF (see its docstring).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from qspec_jax.checkpoint import load_checkpoint
from qspec_jax.model import forward
from qspec_jax.tokenizer import load_tokenizer
from tests.conftest import GOLDEN
from pallas_kernels.precision import W16A16


@pytest.fixture(scope="module")
def golden_logits():
    return np.load(GOLDEN / "smollm2_logits.npz")


@pytest.fixture(scope="module")
def golden_tokens():
    return json.loads((GOLDEN / "smollm2_tokenizer.json").read_text())


def test_w16a16_logits_match_transformers(smollm2_ckpt, golden_logits):
    ck = load_checkpoint(smollm2_ckpt)
    cols = golden_logits["cols"]
    n_prompts = sum(1 for k in golden_logits.files if k.startswith("ids_"))
    assert n_prompts >= 3
    for i in range(n_prompts):
        ids = golden_logits[f"ids_{i}"]
        logits, _ = forward(ck.params, ck.config, jnp.asarray(ids)[None], jnp.arange(len(ids))[None],
                            precision=W16A16, dtype=jnp.float32)
        logits = np.asarray(logits[0])
        diff = np.abs(logits[:, cols] - golden_logits[f"logits_{i}"]).max()
        assert diff < 1e-3, f"prompt {i}: max |dlogit| {diff}"
        assert np.array_equal(logits.argmax(-1), golden_logits[f"argmax_{i}"]), f"prompt {i}: argmax differs"
        np.testing.assert_allclose(logits.max(-1), golden_logits[f"max_{i}"], atol=1e-3)


def test_tokenizer_matches_transformers(smollm2_ckpt, golden_tokens):
    tok = load_tokenizer(smollm2_ckpt)
    assert len(golden_tokens["cases"]) >= 20
    for case in golden_tokens["cases"]:
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids"], repr(case["text"])
    chat = golden_tokens["chat"]
    text = tok.apply_chat_template(chat["messages"], tokenize=False, add_generation_prompt=True)
    assert text == chat["text"]
    assert tok.encode(text, add_special_tokens=False) == chat["ids"]


def test_tokenizer_special_ids_follow_the_gguf(smollm2_ckpt, gguf_path):
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    tok = load_tokenizer(smollm2_ckpt)
    # transformers' GGUF loader reports eos = <|im_start|>; the GGUF says <|im_end|>, which is what
    # the chat model emits at the end of a turn. We follow the file.
    assert tok.eos_token_id == int(reader.fields["tokenizer.ggml.eos_token_id"].contents())
    assert tok.bos_token_id == int(reader.fields["tokenizer.ggml.bos_token_id"].contents())
    assert tok.decode(tok.encode("naïve café 😀 123", add_special_tokens=False)) == "naïve café 😀 123"
