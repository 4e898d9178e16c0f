"""Readers for the checkpoints ``qspec-convert`` accepts: HF safetensors directories and GGUF files.

Both produce a :class:`SourceModel`: the model config, per-layer tensors under canonical names
(float32 ``[out, in]`` matrices, or packed weights where GGUF already stores INT4 blocks), and
the tokenizer files to copy into the converted checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_kernels.layout import QuantizedWeight, dequantize, pack_codes
from qspec_jax.checkpoint import TOKENIZER_FILES, is_plain_name
from qspec_jax.config import LlamaConfig
from qspec_jax.sampling import is_integer, is_real

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
Tensor = np.ndarray | QuantizedWeight


@dataclasses.dataclass
class SourceModel:
    """A checkpoint read into canonical names; ``layers[i]`` maps linear/norm names to tensors."""

    config: LlamaConfig
    embed: np.ndarray
    final_norm: np.ndarray
    lm_head: np.ndarray | None
    layers: list[dict[str, Tensor]]
    tokenizer_files: dict[str, str]
    kind: str


def as_float(t: Tensor) -> np.ndarray:
    """A tensor as float32 numpy (dequantizing packed weights exactly as the model does)."""
    if isinstance(t, QuantizedWeight):
        return np.asarray(dequantize(t, np.float32))
    return np.asarray(t, np.float32)


def expected_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer canonical tensor shapes for a config."""
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    shapes = {
        "attn_norm": (d,), "mlp_norm": (d,),
        "q": (c.num_heads * hd, d), "k": (c.num_kv_heads * hd, d), "v": (c.num_kv_heads * hd, d),
        "o": (d, c.num_heads * hd), "gate": (f, d), "up": (f, d), "down": (d, f),
    }
    if c.attention_bias:
        shapes.update(q_bias=(c.num_heads * hd,), k_bias=(c.num_kv_heads * hd,), v_bias=(c.num_kv_heads * hd,))
    return shapes


def _shape(t: Tensor) -> tuple[int, ...]:
    return t.shape if isinstance(t, QuantizedWeight) else tuple(np.shape(t))


def check_source(src: SourceModel) -> None:
    """Raise ``ValueError`` naming the first tensor whose shape does not match the config, or that
    holds a NaN or infinity (it would spread through every token's forward)."""
    c = src.config
    want = {"embed": (c.vocab_size, c.hidden_size), "final_norm": (c.hidden_size,)}
    got = {"embed": _shape(src.embed), "final_norm": _shape(src.final_norm)}
    if src.lm_head is not None:
        want["lm_head"], got["lm_head"] = want["embed"], _shape(src.lm_head)
    if len(src.layers) != c.num_layers:
        raise ValueError(f"config says {c.num_layers} layers, checkpoint has {len(src.layers)}")
    for i, layer in enumerate(src.layers):
        for name, shape in expected_shapes(c).items():
            if name not in layer:
                raise ValueError(f"layer {i}: tensor {name!r} missing from checkpoint")
            want[f"layers.{i}.{name}"], got[f"layers.{i}.{name}"] = shape, _shape(layer[name])
    for name, shape in want.items():
        if tuple(got[name]) != tuple(shape):
            raise ValueError(f"tensor {name}: shape {tuple(got[name])} does not match config {shape}")
    tensors = {"embed": src.embed, "final_norm": src.final_norm, "lm_head": src.lm_head,
               **{f"layers.{i}.{k}": t for i, layer in enumerate(src.layers) for k, t in layer.items()}}
    for name, t in tensors.items():
        parts = (t.scales, t.mins) if isinstance(t, QuantizedWeight) else (t,)
        if not all(p is None or np.isfinite(p).all() for p in parts):
            raise ValueError(f"tensor {name} holds NaN or infinite values: the checkpoint is corrupt")


# --------------------------------------------------------------------------- HF safetensors

_HF_NAMES = {
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight", "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
}


def read_hf(path: Path) -> SourceModel:
    """Read an HF directory: ``config.json`` plus ``model.safetensors`` or a sharded index."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: an HF checkpoint needs config.json")
    hf_config = _read_json(cfg_path)
    if not isinstance(hf_config, dict):
        raise ValueError(f"{cfg_path} is not a JSON object")
    config = LlamaConfig.from_hf(hf_config)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} has no 'weight_map' of tensor names to shard files")
        if outside := sorted({v for v in weight_map.values() if not is_plain_name(v)}):
            raise ValueError(f"{index} names shard files outside {path}: {outside}")
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, ["model.safetensors"]
    tensors: dict[str, np.ndarray] = {}
    where: dict[str, str] = {}
    for name in files:
        f = path / name
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found (listed by the checkpoint)")
        for key, t in _read_safetensors(f):
            if key in where:  # which copy a loader takes is up to it: refuse rather than guess
                raise ValueError(f"tensor {key!r} is in both {where[key]} and {name}")
            if not jnp.issubdtype(t.dtype, jnp.floating):  # numpy does not count bfloat16
                raise ValueError(f"{f}: tensor {key!r} is {t.dtype}, not a float: the checkpoint is "
                                 "already quantized; qspec-jax converts float checkpoints")
            tensors[key], where[key] = np.asarray(t.astype("float32")), name
    if weight_map is not None:
        for key, name in weight_map.items():
            if where.get(key) != name:
                raise ValueError(f"{index} puts tensor {key!r} in {name}, but it is "
                                 + (f"in {where[key]}" if key in where else "in no shard"))
    used: set[str] = set()

    def take(key: str) -> np.ndarray:
        if key not in tensors:
            raise ValueError(f"tensor {key!r} missing from {path}")
        used.add(key)
        return tensors[key]

    layers = []
    for i in range(config.num_layers):
        names = {k: v for k, v in _HF_NAMES.items() if config.attention_bias or not k.endswith("_bias")}
        layers.append({k: take(f"model.layers.{i}.{v}") for k, v in names.items()})
    embed, norm = take("model.embed_tokens.weight"), take("model.norm.weight")
    lm_head = None if config.tie_word_embeddings else take("lm_head.weight")
    if config.tie_word_embeddings and "lm_head.weight" in tensors:  # a tied copy saved anyway
        if not np.array_equal(take("lm_head.weight"), embed):
            raise ValueError(f"{path}: tie_word_embeddings is set but lm_head.weight differs from the embedding")
    unread = sorted(k for k in set(tensors) - used if not k.endswith("rotary_emb.inv_freq"))  # derived buffers
    _refuse_unread(unread, path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path / 'tokenizer.json'} not found: the converted checkpoint needs a tokenizer")
    tok = {n: _read_text(path / n) for n in TOKENIZER_FILES if (path / n).is_file()}
    src = SourceModel(config, embed, norm, lm_head, layers, tok, "hf")
    check_source(src)
    return src


def _read_safetensors(f: Path) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` of each tensor in a safetensors file; a file that is not one (a Git LFS pointer,
    a truncated download) is a ``ValueError`` naming it."""
    from safetensors import SafetensorError, safe_open

    with open(f, "rb") as fh:
        lfs = fh.read(24) == b"version https://git-lfs."
    if lfs:
        raise ValueError(f"{f} is a Git LFS pointer, not the weights: fetch them (git lfs pull)")
    try:
        with safe_open(str(f), framework="flax") as sf:
            for key in sf.keys():
                yield key, sf.get_tensor(key)
    except SafetensorError as e:
        raise ValueError(f"{f} is not a readable safetensors file: {e}") from None


def _read_text(path: Path) -> str:
    """A text file's contents; a ``.json`` one must parse (refused here, by name, rather than when the
    converted checkpoint's tokenizer loads)."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: {e}") from None
    if path.suffix == ".json":
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    return text


def _read_json(path: Path) -> Any:
    return json.loads(_read_text(path))


def _refuse_unread(unread: list[str], path: Path) -> None:
    """Raise ``ValueError`` for tensors the model has no place for (a bias, an extra norm, ...)."""
    if unread:
        more = f" and {len(unread) - 5} more" if len(unread) > 5 else ""
        raise ValueError(f"{path} holds tensors the Llama model does not use: {', '.join(unread[:5])}{more}; "
                         "converting without them would change the model")


# --------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate",
    "up": "ffn_up", "down": "ffn_down", "attn_norm": "attn_norm", "mlp_norm": "ffn_norm",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
}
_FLOAT_TYPES = ("F32", "F16", "BF16", "Q8_0")  # read as float (Q8_0 dequantized exactly)
_PACKED_TYPES = ("Q4_0", "Q4_1")  # kept as packed INT4, group 32, without re-rounding


def _gguf_blocks_to_packed(data: np.ndarray, kind: str) -> QuantizedWeight:
    """Repack GGUF Q4_0 / Q4_1 blocks ``uint8[N, blocks * bytes]`` into the project's layout."""
    n = data.shape[0]
    block_bytes = 18 if kind == "Q4_0" else 20
    blocks = np.ascontiguousarray(data).reshape(n, -1, block_bytes)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0] if kind == "Q4_1" else None
    qs = blocks[..., block_bytes - 16:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # GGUF: low nibbles first, then high
    return QuantizedWeight(pack_codes(codes.reshape(n, -1)), scales, mins, 32)


def _permute_rows(t: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs back to rotate-half order)."""
    rows = _shape(t)[0]
    perm = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)
    inv = np.argsort(perm)
    if isinstance(t, QuantizedWeight):
        return QuantizedWeight(t.packed[inv], t.scales[inv], None if t.mins is None else t.mins[inv], t.group_size)
    return t[inv]


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_int(reader, key: str, default: int | None = None, minimum: int = 1) -> int | None:
    """An integer GGUF field >= ``minimum``; ``default`` where the file has none."""
    value = _gguf_field(reader, key)
    if value is None:
        return default
    if not is_integer(value) or value < minimum:
        raise ValueError(f"GGUF field {key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _gguf_float(reader, key: str, default: float) -> float:
    """A numeric GGUF field; ``default`` where the file has none."""
    value = _gguf_field(reader, key, default)
    if not is_real(value):
        raise ValueError(f"GGUF field {key} must be a number, got {value!r}")
    return float(value)


def gguf_tokenizer_files(reader) -> dict[str, str]:
    """Rebuild a ``tokenizers`` BPE tokenizer (and its config) from a GGUF's vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    model = _gguf_field(reader, "tokenizer.ggml.model")
    pre = _gguf_field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2'); "
                         "convert from the HF checkpoint instead")
    splits = {
        "smollm": [pre_tokenizers.Digits(individual_digits=True)],
        "gpt2": [], "default": [],
        "llama-bpe": [pre_tokenizers.Split(Regex(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated")],
    }
    if pre not in splits:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported ({', '.join(splits)}); "
                         "convert from the HF checkpoint instead")
    if _gguf_field(reader, "tokenizer.ggml.tokens") is None:
        raise ValueError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    tokens = list(_gguf_field(reader, "tokenizer.ggml.tokens"))
    types = list(_gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    if _gguf_field(reader, "tokenizer.ggml.merges") is None:  # llama.cpp refuses such a file too
        raise ValueError("GGUF file has no tokenizer merges (tokenizer.ggml.merges): its BPE would split every "
                         "word into single characters")
    merges = [tuple(m.split(" ", 1)) for m in _gguf_field(reader, "tokenizer.ggml.merges")]
    if bad := next((m for m in merges if len(m) != 2), None):
        raise ValueError(f"GGUF tokenizer.ggml.merges holds {' '.join(bad)!r}, not a pair 'left right'")
    # Llama-3's tokenizer (HF's tokenizer.json and llama.cpp alike) takes a word that is in the vocabulary
    # as one token before applying merges, which may not reach it
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                               ignore_merges=pre == "llama-bpe"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "llama-bpe")
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits[pre] + [byte_level])
    tok.decoder = decoders.ByteLevel()
    # control tokens (type 3) are special: decoding skips them; user-defined ones (4) are matched whole
    # but decode to their text, as in llama.cpp and HF's added tokens with special=False
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])

    def token(key: str) -> str | None:
        i = _gguf_int(reader, f"tokenizer.ggml.{key}_token_id", None, 0)
        if i is not None and i >= len(tokens):
            raise ValueError(f"GGUF tokenizer.ggml.{key}_token_id {i} is outside the vocabulary of {len(tokens)}")
        return None if i is None else tokens[i]

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
        "pad_token": token("padding"), "add_bos_token": bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": _gguf_int(reader, "llama.context_length", 2048),
    }
    template = _gguf_field(reader, "tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(cfg, indent=1)}


def read_gguf(path: Path) -> SourceModel:
    """Read a llama-architecture GGUF file, keeping Q4_0 / Q4_1 layers packed (no re-rounding)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises assorted errors on truncated or foreign files
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}: qspec-jax reads 'llama' GGUF files")
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise ValueError("GGUF carries rope_freqs (Llama-3.1 rope scaling); convert from the HF checkpoint instead")
    scaling = _gguf_field(reader, "llama.rope.scaling.type", "none")
    if scaling != "none" or _gguf_float(reader, "llama.rope.scaling.factor", 1.0) != 1.0:
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported; convert from the HF checkpoint instead")

    def a(key: str, default=None) -> int:
        value = _gguf_int(reader, f"llama.{key}", default)
        if value is None:
            raise ValueError(f"{path} lacks the GGUF field llama.{key}")
        return value

    heads, hidden = a("attention.head_count"), a("embedding_length")
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    config = LlamaConfig(
        vocab_size=a("vocab_size", None if tokens is None else len(tokens)), hidden_size=hidden,
        intermediate_size=a("feed_forward_length"), num_layers=a("block_count"),
        num_heads=heads, num_kv_heads=a("attention.head_count_kv", heads),
        head_dim=a("rope.dimension_count", hidden // heads),
        rms_norm_eps=_gguf_float(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=_gguf_float(reader, "llama.rope.freq_base", 10000.0),
        max_position_embeddings=a("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_gguf_int(reader, "tokenizer.ggml.bos_token_id", None, 0),
        eos_token_id=_gguf_int(reader, "tokenizer.ggml.eos_token_id", None, 0),
    )
    used: set[str] = set()

    def tensor(name: str) -> Tensor:
        ts = [t for t in reader.tensors if t.name == name]
        if not ts:
            raise ValueError(f"tensor {name!r} missing from {path}")
        t = ts[0]
        used.add(name)
        kind = t.tensor_type.name
        if kind in _PACKED_TYPES:
            return _gguf_blocks_to_packed(np.asarray(t.data), kind)
        if kind not in _FLOAT_TYPES:
            raise ValueError(f"tensor {name!r} has GGUF type {kind}, which qspec-jax does not read "
                             f"(supported: {', '.join(_FLOAT_TYPES + _PACKED_TYPES)})")
        shape = tuple(int(x) for x in reversed(t.shape))
        return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)

    layers = []
    for i in range(config.num_layers):
        layer = {k: tensor(f"blk.{i}.{v}" + ("" if k.endswith("_bias") else ".weight"))
                 for k, v in _GGUF_NAMES.items() if config.attention_bias or not k.endswith("_bias")}
        layer["q"] = _permute_rows(layer["q"], config.num_heads)
        layer["k"] = _permute_rows(layer["k"], config.num_kv_heads)
        for b, h in (("q_bias", config.num_heads), ("k_bias", config.num_kv_heads)):
            if b in layer:
                layer[b] = _permute_rows(layer[b], h)
        layers.append(layer)
    lm_head = None if config.tie_word_embeddings else as_float(tensor("output.weight"))
    embed, norm = as_float(tensor("token_embd.weight")), as_float(tensor("output_norm.weight"))
    _refuse_unread(sorted(names - used), path)
    src = SourceModel(config, embed, norm, lm_head, layers, gguf_tokenizer_files(reader), "gguf")
    check_source(src)
    return src


def read_source(path: str | Path) -> SourceModel:
    """Read an HF checkpoint directory or a ``.gguf`` file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir():
        return read_hf(path)
    if path.suffix != ".gguf":
        raise ValueError(f"{path}: expected an HF checkpoint directory or a .gguf file")
    return read_gguf(path)
