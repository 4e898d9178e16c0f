"""Shared fixtures: fresh random seeds, tiny random Llama models (as sources, HF dirs, GGUF files),
and the embedded SmolLM2 converted once per session."""

from __future__ import annotations

import json
import os
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.pipeline import convert
from convert.quantize import QuantScheme
from convert.sources import LINEARS, SourceModel, expected_shapes, read_source
from qspec_jax.config import LlamaConfig
from convert.embedded import embedded_gguf
from qspec_jax.core import Decoder, init_state, prefill_jit
from qspec_jax.decode import Runtime
from qspec_jax.model import forward
from pallas_kernels.precision import W4A16

# forward under jit, for tests that call the model directly: calls of one shape share a compile
# (called eagerly, each call compiled its layer scan again)
jit_forward = jax.jit(forward, static_argnames=("config", "precision", "dtype", "online_rotation_seed", "execution",
                                                "read_shadow"))



def prefilled(params, rt: Runtime, prompts, lengths, new: int, buffer_len: int, cache_len: int | None = None):
    """A W4A16-prefilled decode state of ``prompts [B, P]`` with a budget of ``new`` tokens, greedy."""
    dec = Decoder(rt, W4A16)
    return prefill_jit(params, dec, init_state(dec, jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths, jnp.int32),
                                               jax.random.key(0), max_new_tokens=new, buffer_len=buffer_len,
                                               cache_len=cache_len))


GOLDEN = Path(__file__).parent / "golden"
SMOLLM2_TOKENIZER = None  # filled lazily by smollm2_tokenizer_json

TINY = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=12, rms_norm_eps=1e-5, rope_theta=10000.0,
                   max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A fresh random generator per test; its seed is printed (shown when the test fails)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"{request.node.nodeid}: seed {seed}")
    return np.random.default_rng(seed)


def random_source(config: LlamaConfig, rng: np.random.Generator, tokenizer_json: str = "{}") -> SourceModel:
    """A random float model with non-trivial norm scales (so folding them is exercised)."""
    def mat(*shape, scale=0.2):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    layers = []
    for _ in range(config.num_layers):
        layer = {name: mat(*shape) for name, shape in expected_shapes(config).items()}
        for norm in ("attn_norm", "mlp_norm"):
            layer[norm] = (1 + 0.3 * rng.standard_normal(config.hidden_size)).astype(np.float32)
        layers.append(layer)
    lm_head = None if config.tie_word_embeddings else mat(config.vocab_size, config.hidden_size)
    final = (1 + 0.3 * rng.standard_normal(config.hidden_size)).astype(np.float32)
    return SourceModel(config, mat(config.vocab_size, config.hidden_size, scale=1.0), final, lm_head, layers,
                       {"tokenizer.json": tokenizer_json}, "random")


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return embedded_gguf()


@pytest.fixture(scope="session")
def smollm2_source(gguf_path):
    return read_source(gguf_path)


@pytest.fixture(scope="session")
def smollm2_ckpt(tmp_path_factory, gguf_path) -> Path:
    """The embedded SmolLM2 converted with the default scheme (asymmetric group-32, no rotation)."""
    return convert(gguf_path, tmp_path_factory.mktemp("smollm2") / "rtn", QuantScheme(32, False, "rtn"), None)


@pytest.fixture(scope="session")
def smollm2_tokenizer_json(smollm2_ckpt) -> str:
    return (smollm2_ckpt / "tokenizer.json").read_text()


def write_hf_dir(path: Path, src: SourceModel, tokenizer_json: str) -> Path:
    """Write ``src`` as a Hugging Face Llama checkpoint directory (config.json + safetensors)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    hf_names = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
                "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
                "down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
                "mlp_norm": "post_attention_layernorm.weight", "q_bias": "self_attn.q_proj.bias",
                "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias"}
    tensors = {"model.embed_tokens.weight": src.embed, "model.norm.weight": src.final_norm}
    if src.lm_head is not None:
        tensors["lm_head.weight"] = src.lm_head
    for i, layer in enumerate(src.layers):
        for k, v in layer.items():
            tensors[f"model.layers.{i}.{hf_names[k]}"] = np.asarray(v)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(src.config.to_hf()))
    (path / "tokenizer.json").write_text(tokenizer_json)
    return path


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (as its HF -> GGUF converter writes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, src: SourceModel, linear_type: str = "F32", arch: str = "llama",
               vocab: list[str] | None = None, edit=None) -> Path:
    """Write ``src`` as a llama GGUF file; decoder linears stored as ``linear_type`` (F32, Q4_0, Q4_1, Q5_0, ...);
    ``edit(writer)`` runs before the header is written (to add or drop metadata). The tokenizer's vocabulary
    (by default ``t<i>`` but for "a", "b", "ab" at 3..5) holds 3 control tokens and the merge "a b"."""
    import gguf

    c = src.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    vocab = vocab or ["t0", "t1", "t2", "a", "b", "ab"] + [f"t{i}" for i in range(6, c.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab)
    w.add_token_types([3 if i < 3 else 1 for i in range(len(vocab))])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    qtype = getattr(gguf.GGMLQuantizationType, linear_type)

    def add(name, arr, quantize=False):
        arr = np.ascontiguousarray(arr, np.float32)
        if quantize and linear_type != "F32":
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", src.embed)
    add("output_norm.weight", src.final_norm)
    if src.lm_head is not None:
        add("output.weight", src.lm_head)
    names = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate",
             "up": "ffn_up", "down": "ffn_down"}
    for i, layer in enumerate(src.layers):
        for k in LINEARS:
            t = np.asarray(layer[k])
            if k in ("q", "k"):
                t = llama_cpp_permute(t, c.num_heads if k == "q" else c.num_kv_heads)
            add(f"blk.{i}.{names[k]}.weight", t, quantize=True)
        add(f"blk.{i}.attn_norm.weight", layer["attn_norm"])
        add(f"blk.{i}.ffn_norm.weight", layer["mlp_norm"])
    if edit is not None:
        edit(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_config() -> LlamaConfig:
    return TINY


def tiny_variant(**changes) -> LlamaConfig:
    return dataclasses.replace(TINY, **changes)


def memory_model(params, config: LlamaConfig, quantized: bool = True, rotation_seed: int | None = None,
                 draft_vocab: np.ndarray | None = None):
    """A ``generate``-ready model from an in-memory params pytree (no tokenizer; ``draft_vocab``: a
    token ranking for draft heads)."""
    from qspec_jax.checkpoint import Checkpoint
    from qspec_jax.api import Model

    manifest = {"quantization": {"bits": 4} if quantized else None,
                "rotation": None if rotation_seed is None else {"seed": rotation_seed, "online": True}}
    return Model(Checkpoint(Path("<memory>"), config, params, manifest, draft_vocab), None)
