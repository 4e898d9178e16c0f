"""The conversion pipeline: source tensors -> (rotation) -> fused, quantized, stacked params pytree."""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from convert.gptq import gptq_quantize
from convert.learn_rotation import LearnedRotation, LearnOptions, learn_rotation
from convert.quantize import QuantScheme, asymmetric_form, quantize_rtn
from convert.rotate import rotate
from convert.sources import SourceModel, Tensor, as_float, read_source
from pallas_kernels.layout import QuantizedWeight
from pallas_kernels.precision import W16A16
from qspec_jax.checkpoint import holds_checkpoint, save_checkpoint
from qspec_jax.config import LlamaConfig
from qspec_jax.model import LINEAR_PATHS, DecoderLayer, Linear, rope_frequencies, rope_tables


def _fuse(parts: list[Tensor]) -> Tensor:
    """Concatenate linears along their outputs (packed ones stay packed when schemes agree)."""
    if all(isinstance(p, QuantizedWeight) for p in parts) and len(
            {(p.group_size, p.symmetric) for p in parts}) == 1:
        mins = None if parts[0].mins is None else np.concatenate([p.mins for p in parts])
        return QuantizedWeight(np.concatenate([p.packed for p in parts]),
                               np.concatenate([p.scales for p in parts]), mins, parts[0].group_size)
    return np.concatenate([as_float(p) for p in parts])


def layer_tree(layer: dict[str, Tensor]) -> dict[str, Any]:
    """One decoder layer in the model's params layout (q/k/v and gate/up fused)."""
    qkv: dict[str, Any] = {"w": _fuse([layer["q"], layer["k"], layer["v"]])}
    if "q_bias" in layer:
        qkv["b"] = np.concatenate([as_float(layer[b]) for b in ("q_bias", "k_bias", "v_bias")])
    return {
        "attn_norm": {"scale": as_float(layer["attn_norm"])},
        "attn": {"qkv": qkv, "o": {"w": layer["o"]}},
        "mlp_norm": {"scale": as_float(layer["mlp_norm"])},
        "mlp": {"gate_up": {"w": _fuse([layer["gate"], layer["up"]])}, "down": {"w": layer["down"]}},
    }


def _map_linears(tree: dict[str, Any], fn) -> dict[str, Any]:
    out = jax.tree.map(lambda x: x, tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    for a, b in LINEAR_PATHS:
        out[a][b] = dict(out[a][b], w=fn((a, b), tree[a][b]["w"]))
    return out


def _rtn(scheme: QuantScheme):
    def fn(_path, w: Tensor) -> QuantizedWeight:
        if isinstance(w, QuantizedWeight) and scheme.matches(w):
            return w  # already in this scheme: keep the source's codes bit for bit
        if isinstance(w, QuantizedWeight) and w.symmetric and not scheme.symmetric and (
                w.group_size == scheme.group_for(w.shape[1])) and (exact := asymmetric_form(w)) is not None:
            return exact  # Q4_0 under an asymmetric scheme: the same values, not rounded again
        return quantize_rtn(as_float(w), scheme)
    return fn


def _linear_inputs_hessians(layer_params, x, positions, config, seed):
    """Run one layer (w16a16) and return its output and ``X^T X`` of each linear's input."""
    captured: dict[tuple[str, ...], jax.Array] = {}

    def intercept(next_fun, args, kwargs, context):
        if isinstance(context.module, Linear) and context.method_name == "__call__":
            captured[tuple(context.module.path)] = args[0]
        return next_fun(*args, **kwargs)

    rope = rope_tables(positions, rope_frequencies(config), x.dtype)
    with nn.intercept_methods(intercept):
        y, _ = DecoderLayer(config, W16A16, online_rotation_seed=seed).apply({"params": layer_params}, x, None,
                                                                            positions, rope)
    hess = {p: jnp.einsum("...k,...l->kl", a, a, precision=jax.lax.Precision.HIGHEST)
            for p, a in captured.items()}
    return y, hess


def calibration_texts(path: Path) -> list[str]:
    """The "Question: ...\\nAnswer: ..." texts of a GSM8K-style JSONL calibration file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration data {path} not found")
    texts = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                texts.append(f"Question: {row['question']}\nAnswer: {row['answer']}")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i}: not a JSON object with 'question' and 'answer' ({e!r})") from None
    if not texts:
        raise ValueError(f"calibration data {path} holds no problems")
    return texts


def token_ranking(path: Path, tokenizer_json: str, vocab_size: int) -> tuple[np.ndarray, int]:
    """``(every token id by falling frequency in the calibration texts, ties by id; tokens counted)``:
    the rows a draft head over the most frequent tokens keeps first."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    counts = np.zeros(vocab_size, np.int64)
    for enc in tok.encode_batch([t + "\n\n" for t in calibration_texts(path)], add_special_tokens=False):
        ids = np.asarray(enc.ids, np.int64)
        if ids.size and ids.max() >= vocab_size:
            raise ValueError(f"the tokenizer yields id {int(ids.max())}, past the model's vocabulary of {vocab_size}")
        counts += np.bincount(ids, minlength=vocab_size)
    return np.lexsort((np.arange(vocab_size), -counts)).astype(np.int32), int(counts.sum())


def calibration_tokens(path: Path, tokenizer_json: str, n_samples: int, seq_len: int, seed: int) -> np.ndarray:
    """``int32[n_samples, seq_len]`` windows drawn from GSM8K-style JSONL (question + answer) text."""
    from tokenizers import Tokenizer

    if n_samples < 1 or seq_len < 1:
        raise ValueError(f"GPTQ calibration needs n_samples >= 1 and seq_len >= 1, got {n_samples!r} / {seq_len!r}")
    texts = calibration_texts(path)
    rng = np.random.default_rng(seed)
    rng.shuffle(texts)
    tok = Tokenizer.from_str(tokenizer_json)
    ids: list[int] = []
    for t in texts:
        ids.extend(tok.encode(t + "\n\n", add_special_tokens=False).ids)
        if len(ids) >= n_samples * seq_len * 2:
            break
    ids_arr = np.asarray(ids, np.int32)
    if len(ids_arr) < seq_len + 1:
        raise ValueError(f"calibration data {path} has only {len(ids_arr)} tokens")
    starts = rng.integers(0, len(ids_arr) - seq_len, n_samples)
    return np.stack([ids_arr[s:s + seq_len] for s in starts])


def _gptq_layers(layers: list[dict], embed: np.ndarray, config: LlamaConfig, seed: int | None,
                 scheme: QuantScheme, tokens: np.ndarray, batch: int = 8) -> list[dict]:
    """Quantize layer by layer; each layer's inputs come from the already-quantized layers before it."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), (min(batch, len(tokens)), tokens.shape[1]))
    step = jax.jit(lambda p, x: _linear_inputs_hessians(p, x, positions[: x.shape[0]], config, seed))
    xs = [jnp.asarray(embed)[jnp.asarray(tokens[i:i + batch])] for i in range(0, len(tokens), batch)]
    out = []
    for tree in tqdm(layers, desc="GPTQ layers", unit="layer"):
        float_tree = _map_linears(tree, lambda _p, w: as_float(w))
        hess = {p: np.zeros((float_tree[p[0]][p[1]]["w"].shape[1],) * 2) for p in LINEAR_PATHS}
        for x in xs:
            _, h = step(float_tree, x)
            for p in LINEAR_PATHS:
                hess[p] += np.asarray(h[p], np.float64)
        qtree = _map_linears(float_tree, lambda p, w: gptq_quantize(w, hess[p], scheme))
        xs = [step(qtree, x)[0] for x in xs]
        out.append(qtree)
    return out


def _stack(trees: list[dict]) -> dict:
    return jax.tree.map(lambda *xs: np.stack(xs), *trees)


def convert_model(src: SourceModel, scheme: QuantScheme | None, rotation_seed: int | None,
                  calibration: Path | None = None, n_samples: int = 64, seq_len: int = 512,
                  learned: LearnedRotation | None = None,
                  ) -> tuple[dict[str, Any], LlamaConfig, dict[str, Any]]:
    """``(params, config, manifest fields)`` of a converted model; ``scheme=None`` keeps float weights.
    ``learned``: an R1 and R2 (:func:`train_rotation`) folded in place of ``rotation_seed``'s Hadamard; the
    online transforms still come from ``rotation_seed``."""
    manifest: dict[str, Any] = {"rotation": None, "quantization": None}
    if learned is not None and rotation_seed is None:
        raise ValueError("a learned rotation needs a rotation seed (its online transforms)")
    if rotation_seed is not None:
        src = rotate(src, rotation_seed, None if learned is None else learned.matrix,
                     None if learned is None else learned.heads)
        manifest["rotation"] = {"seed": rotation_seed, "online": True, "kind": "randomized-hadamard"}
        if learned is not None:
            manifest["rotation"] = {"seed": rotation_seed, "online": True, "kind": "learned",
                                    "learned": learned.record}
    layers = [layer_tree(layer) for layer in src.layers]
    if scheme is None:
        layers = [_map_linears(t, lambda _p, w: as_float(w)) for t in layers]
    elif scheme.method == "rtn":
        layers = [_map_linears(t, _rtn(scheme)) for t in tqdm(layers, desc="RTN layers", unit="layer")]
    else:
        if calibration is None:
            raise ValueError("GPTQ needs calibration data (--calibration PATH to a GSM8K-style JSONL)")
        tokens = calibration_tokens(calibration, src.tokenizer_files["tokenizer.json"], n_samples, seq_len, 0)
        layers = _gptq_layers(layers, src.embed, src.config, rotation_seed, scheme, tokens)
    if scheme is not None:
        manifest["quantization"] = {
            "bits": 4, "group_size": scheme.group_size, "symmetric": scheme.symmetric,
            "method": scheme.method,
            **({"calibration": {"path": str(calibration), "n_samples": n_samples, "seq_len": seq_len}}
               if scheme.method == "gptq" else {}),
        }
    params: dict[str, Any] = {"embed": src.embed, "layers": _stack(layers),
                              "final_norm": {"scale": src.final_norm}}
    if src.lm_head is not None:
        params["lm_head"] = src.lm_head
    return params, src.config, manifest


def train_rotation(src: SourceModel, scheme: QuantScheme | None, seed: int, calibration: Path | None,
                   options: LearnOptions) -> LearnedRotation:
    """R1 (from the Hadamard of ``seed``) and R2 learned on windows of the ``calibration`` JSONL, for weights in
    ``scheme`` (the default scheme where the checkpoint keeps float weights)."""
    if calibration is None:
        raise ValueError("a learned rotation needs calibration data (--calibration PATH to a GSM8K-style JSONL)")
    tokens = calibration_tokens(calibration, src.tokenizer_files["tokenizer.json"], options.n_samples,
                                options.seq_len, seed)
    learned = learn_rotation(src, tokens, scheme or QuantScheme(), seed, options)
    return dataclasses.replace(learned, record={**learned.record, "calibration": str(Path(calibration).resolve())})


def convert(source: str | Path, out: str | Path, scheme: QuantScheme | None, rotation_seed: int | None,
            calibration: Path | None = None, n_samples: int = 64, seq_len: int = 512,
            draft_vocab: Path | None = None, learned: LearnOptions | LearnedRotation | None = None) -> Path:
    """Read ``source`` (HF directory or GGUF), convert, and write a checkpoint directory at ``out``;
    ``draft_vocab``: a calibration JSONL whose token frequencies rank the rows draft heads keep;
    ``learned``: options to train R1 and R2 on ``calibration`` (:func:`train_rotation`), or rotations trained
    before; the matrices are saved with the checkpoint."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    if blocker := next((p for p in out.absolute().parents if p.exists() and not p.is_dir()), None):
        raise ValueError(f"output {out} cannot be created: {blocker} is not a directory")
    if out.is_dir() and any(out.iterdir()) and not holds_checkpoint(out):
        raise ValueError(f"output {out} is a non-empty directory that is not a qspec-jax checkpoint: refusing to "
                         "write into it (the source itself, or someone's files); give a new directory")
    if rotation_seed is not None and rotation_seed < 0:
        raise ValueError(f"the rotation seed must be an integer >= 0, got {rotation_seed}")
    src = read_source(source)
    if isinstance(learned, LearnOptions):
        if rotation_seed is None:
            raise ValueError("a learned rotation needs a rotation seed (its Hadamard starting point)")
        learned = train_rotation(src, scheme, rotation_seed, calibration, learned)
    params, config, manifest = convert_model(src, scheme, rotation_seed, calibration, n_samples, seq_len, learned)
    manifest["source"] = {"path": str(Path(source).resolve()), "kind": src.kind}
    ranking = None
    if draft_vocab is not None:
        ranking, counted = token_ranking(draft_vocab, src.tokenizer_files["tokenizer.json"], config.vocab_size)
        manifest["draft_vocab"] = {"calibration": str(Path(draft_vocab).resolve()), "tokens_counted": counted}
    return save_checkpoint(out, params, config, src.tokenizer_files, ranking=ranking,
                           rotation_matrix=None if learned is None else learned.matrix,
                           head_rotations=None if learned is None else learned.heads, **manifest)
