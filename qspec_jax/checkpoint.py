"""Converted checkpoints: a safetensors file of the params pytree, a JSON manifest, the tokenizer.

Layout of a checkpoint directory::

    manifest.json        format + version, model config, quantization scheme, rotation seed,
                         which params are packed INT4 (and their group size), sha256 of every file
    model.safetensors    params, flattened with '.'-joined paths; a packed weight ``p`` is stored
                         as ``p.packed``, ``p.scales`` and (asymmetric) ``p.mins``; optionally
                         ``draft_vocab``: token ids by falling calibration frequency (a draft head's rows);
                         ``learned_rotation``: a learned residual-stream rotation (float64, already
                         folded into the weights; kept to reuse and inspect), and with it
                         ``learned_head_rotations``: the learned value-head rotations, one per layer;
                         its metadata holds the sha256 of the manifest's fields (all but the checksums),
                         so the manifest cannot be edited without the weights' checksum failing
    tokenizer.json, tokenizer_config.json, ...   loadable without torch
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.layout import QuantizedWeight
from qspec_jax.config import LlamaConfig

FORMAT = "qspec-jax"
FORMAT_VERSION = 3  # 2: the nibble-planar packed layout of pallas_kernels/layout.py; 3: the manifest's digest
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
# The tokenizer files a converted checkpoint keeps (those of its source), each listed and checksummed in
# the manifest; load() refuses one the manifest does not list, or a folder of extra chat templates (which
# the tokenizer loader also reads and the converter does not write), so a stale or foreign file cannot
# change the tokenization.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
EXTRA_TEMPLATES = "additional_chat_templates"
DRAFT_VOCAB = "draft_vocab"  # the tensor (and manifest entry) of the token ranking draft heads take rows from
MANIFEST_DIGEST = "qspec_jax.manifest_sha256"  # the weights file's metadata key of manifest_digest()
LEARNED_ROTATION = "learned_rotation"  # the tensor of a learned rotation (manifest: rotation kind "learned")
LEARNED_HEADS = "learned_head_rotations"  # its value-head rotations (record: "head_rotations": true)
ROTATION_KINDS = ("randomized-hadamard", "learned")
ORTHOGONAL_TOL = 1e-6  # a stored learned rotation (float64) must satisfy max |R^T R - I| <= this
# How a learned rotation was trained, as the manifest records it: each field's type and least value
LEARNED_FIELDS = {"steps": (int, 1), "lr": (float, 0.0), "seed": (int, 0), "n_samples": (int, 1),
                  "seq_len": (int, 2), "batch": (int, 1)}


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: config, params pytree (``{'embed': ..., 'layers': ...}``), manifest."""

    path: Path
    config: LlamaConfig
    params: dict[str, Any]
    manifest: dict[str, Any]
    draft_vocab: np.ndarray | None = None  # int32[V]: every token id, the most frequent in calibration text first
    rotation_matrix: np.ndarray | None = None  # float64[hidden, hidden]: a learned rotation, folded into params
    head_rotations: np.ndarray | None = None  # float64[layers, head_dim, head_dim]: its value-head rotations

    @property
    def online_rotation_seed(self) -> int | None:
        rot = self.manifest.get("rotation")
        return None if not rot or not rot.get("online") else int(rot["seed"])

    @property
    def quantized(self) -> bool:
        return self.manifest.get("quantization") is not None


def flatten_params(tree: dict[str, Any], prefix: str = "") -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """``(tensors by dotted name, {packed weight name: group size})`` of a params pytree."""
    tensors: dict[str, np.ndarray] = {}
    packed: dict[str, int] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if not isinstance(key, str) or not key or "." in key:  # '.'-joined names must split back the same way
            raise ValueError(f"param name {name!r}: each key must be a non-empty string without '.'")
        if isinstance(value, dict):
            sub_t, sub_p = flatten_params(value, name + ".")
            tensors.update(sub_t)
            packed.update(sub_p)
        elif isinstance(value, QuantizedWeight):
            value.validate()
            packed[name] = value.group_size
            tensors[name + ".packed"] = np.asarray(value.packed)
            tensors[name + ".scales"] = np.asarray(value.scales)
            if value.mins is not None:
                tensors[name + ".mins"] = np.asarray(value.mins)
        else:
            tensors[name] = np.asarray(value)
    return tensors, packed


def unflatten_params(tensors: dict[str, np.ndarray], packed: dict[str, int]) -> dict[str, Any]:
    """Inverse of :func:`flatten_params`."""
    tree: dict[str, Any] = {}

    def put(name: str, value: Any) -> None:
        *parents, leaf = name.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    parts = {n + s for n in packed for s in (".packed", ".scales", ".mins")}
    for name, group in packed.items():
        if name + ".packed" not in tensors or name + ".scales" not in tensors:
            raise ValueError(f"checkpoint lacks the arrays of packed weight {name!r}")
        put(name, QuantizedWeight(tensors[name + ".packed"], tensors[name + ".scales"],
                                  tensors.get(name + ".mins"), int(group)))  # validated by check_params
    for name, value in tensors.items():
        if name not in parts:
            put(name, value)
    return tree


def holds_checkpoint(path: Path) -> bool:
    """Whether directory ``path`` has a qspec-jax manifest (of any version): a conversion may replace it,
    and nothing else (another tool's ``manifest.json`` beside someone's files)."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def is_plain_name(name: Any) -> bool:
    """Whether ``name`` is a file name inside its directory (no separators, not '.' or '..')."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's fields but its file checksums (canonical JSON): stored in the weights
    file, whose checksum the manifest holds, so neither can change without the other noticing."""
    fields = {k: v for k, v in manifest.items() if k != "files"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def save_checkpoint(out: str | Path, params: dict[str, Any], config: LlamaConfig,
                    tokenizer_files: dict[str, str], ranking: np.ndarray | None = None,
                    rotation_matrix: np.ndarray | None = None, head_rotations: np.ndarray | None = None,
                    **manifest_fields: Any) -> Path:
    """Write a checkpoint directory; ``manifest_fields`` (quantization, rotation, source, how
    the token ``ranking`` was counted, as ``draft_vocab``) go in the manifest; ``rotation_matrix``: the
    learned rotation folded into ``params`` (its manifest rotation of kind "learned"), ``head_rotations``
    its value-head rotations (its record's ``head_rotations`` true). Tokenizer files an
    earlier checkpoint left in ``out`` that this one lacks are removed."""
    from safetensors.numpy import save_file

    out = Path(out)
    if unknown := set(tokenizer_files) - set(TOKENIZER_FILES):
        raise ValueError(f"not tokenizer files: {sorted(unknown)} (expected among {TOKENIZER_FILES})")
    tensors, packed = flatten_params(params)
    if ranking is not None:
        check_draft_vocab(ranking, config.vocab_size, "the token ranking")
        tensors[DRAFT_VOCAB] = np.asarray(ranking, np.int32)
    if rotation_matrix is not None:
        check_rotation_matrix(rotation_matrix, config.hidden_size, "the learned rotation")
        tensors[LEARNED_ROTATION] = np.asarray(rotation_matrix, np.float64)
    if head_rotations is not None:
        check_head_rotations(head_rotations, config.num_layers, config.head_dim, "the value-head rotations")
        tensors[LEARNED_HEADS] = np.asarray(head_rotations, np.float64)
    out.mkdir(parents=True, exist_ok=True)
    for name in set(TOKENIZER_FILES) - set(tokenizer_files):
        (out / name).unlink(missing_ok=True)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": config.to_hf(),
                **manifest_fields, "packed_weights": packed}
    manifest = json.loads(json.dumps(manifest))  # as load() will read it back (tuples as lists)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / WEIGHTS),
              metadata={MANIFEST_DIGEST: manifest_digest(manifest)})
    for name, text in tokenizer_files.items():
        (out / name).write_text(text)
    files = [WEIGHTS, *sorted(tokenizer_files)]
    manifest["files"] = {name: sha256(out / name) for name in files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out


def expected_param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Logical shape of every param (packed weights by their unpacked ``[..., N, K]``)."""
    from pallas_kernels.precision import W16A16
    from qspec_jax.model import Llama

    tok = jnp.zeros((1, 1), jnp.int32)
    shapes = jax.eval_shape(Llama(config, W16A16).init, jax.random.key(0), tok, tok)["params"]
    return {_path_name(path): tuple(s.shape) for path, s in jax.tree_util.tree_leaves_with_path(shapes)}


def _path_name(path) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def check_params(params: dict[str, Any], config: LlamaConfig, quantized: bool) -> None:
    """Raise ``ValueError`` naming any param missing, unexpected, of the wrong shape, or not a float
    array (packed weights: uint8 codes with float16 scales, :meth:`QuantizedWeight.validate`). A
    ``quantized`` checkpoint packs exactly the decoder linears (:data:`~qspec_jax.model.LINEAR_PATHS`),
    a float one nothing: the model reads every other param as a float array."""
    from qspec_jax.model import LINEAR_PATHS

    want = expected_param_shapes(config)
    linears = {".".join(("layers", *p, "w")) for p in LINEAR_PATHS}
    got: dict[str, tuple[int, ...]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(
            params, is_leaf=lambda x: isinstance(x, QuantizedWeight))[0]:
        name, packed = _path_name(path), isinstance(leaf, QuantizedWeight)
        if packed:
            leaf.validate()
        elif not jnp.issubdtype(dtype := leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype,
                                jnp.floating):
            raise ValueError(f"param {name!r} is {dtype}, expected a float array")
        if packed and name not in linears:
            raise ValueError(f"param {name!r} is a packed INT4 weight; only the decoder linears {sorted(linears)} "
                             "may be packed, the model reads it as a float array")
        if name in linears and packed != quantized:
            raise ValueError(f"param {name!r} is {'packed INT4' if packed else 'a float array'}, but the checkpoint "
                             f"is {'' if quantized else 'not '}marked quantized (its manifest's 'quantization'); "
                             "convert the model again")
        got[name] = (*leaf.packed.shape[:-1], leaf.packed.shape[-1] * 2) if packed else tuple(np.shape(leaf))
    for name in want.keys() - got.keys():
        raise ValueError(f"param {name!r} missing from checkpoint")
    for name in got.keys() - want.keys():
        raise ValueError(f"unexpected param {name!r} in checkpoint (config mismatch?)")
    for name, shape in want.items():
        if got[name] != shape:
            raise ValueError(f"param {name!r} has shape {got[name]}, config expects {shape}")


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load and verify a converted checkpoint (existence, checksums, format, shapes); its weights are
    placed on the default device once, so a jitted call does not copy them from the host each time."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    path = Path(path).expanduser()
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise FileNotFoundError(f"{mpath} not found: {path} is not a qspec-jax checkpoint "
                                "(create one with qspec-convert)")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{mpath} is corrupt: {e}") from e
    if not isinstance(manifest, dict):
        raise ValueError(f"{mpath} is corrupt: a JSON object expected, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{mpath}: format {manifest.get('format')!r} v{manifest.get('format_version')} "
                         f"is not {FORMAT!r} v{FORMAT_VERSION}; convert the model again (qspec-convert)")
    for key in ("files", "config", "packed_weights"):
        if not isinstance(manifest.get(key), dict):
            raise ValueError(f"{mpath} is corrupt: {key!r} must be a JSON object")
    if WEIGHTS not in manifest["files"]:
        raise ValueError(f"{mpath} is corrupt: it lists no checksum for {WEIGHTS}")
    if outside := [n for n in manifest["files"] if not is_plain_name(n)]:
        raise ValueError(f"{mpath} is corrupt: it lists files outside the checkpoint directory: {outside}")
    for name, digest in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint file {f} is missing")
        if sha256(f) != digest:
            raise ValueError(f"checksum mismatch for {f}: the file is corrupt or was modified")
    for name in (*TOKENIZER_FILES, EXTRA_TEMPLATES):
        if (path / name).exists() and name not in manifest["files"]:
            raise ValueError(f"{path / name} is not part of the checkpoint (its manifest does not list it) but the "
                             "tokenizer may read it; remove it, or convert into a new directory")
    _check_manifest_schemes(manifest, mpath)
    try:
        config = LlamaConfig.from_hf(manifest["config"])
    except ValueError as e:
        raise ValueError(f"{mpath}: its 'config' is not valid: {e}") from None
    tensors = load_file(str(path / WEIGHTS))
    _check_packed_scheme(tensors, manifest, mpath)
    for name, t in tensors.items():
        if jnp.issubdtype(t.dtype, jnp.floating) and not np.isfinite(t).all():
            raise ValueError(f"{path / WEIGHTS}: tensor {name!r} holds NaN or infinity")
    draft_vocab = tensors.pop(DRAFT_VOCAB, None)
    if (draft_vocab is None) != (manifest.get(DRAFT_VOCAB) is None):
        raise ValueError(f"{mpath} is corrupt: {DRAFT_VOCAB!r} must be both in the manifest and in {WEIGHTS}, "
                         "or in neither")
    if draft_vocab is not None:
        check_draft_vocab(draft_vocab, config.vocab_size, f"{path / WEIGHTS}: {DRAFT_VOCAB!r}")
    rotation_matrix = tensors.pop(LEARNED_ROTATION, None)
    if (rotation_matrix is None) != ((manifest.get("rotation") or {}).get("kind") != "learned"):
        raise ValueError(f"{mpath} is corrupt: a rotation of kind 'learned' in the manifest and the tensor "
                         f"{LEARNED_ROTATION!r} in {WEIGHTS} come together or not at all")
    if rotation_matrix is not None:
        check_rotation_matrix(rotation_matrix, config.hidden_size, f"{path / WEIGHTS}: {LEARNED_ROTATION!r}")
    head_rotations = tensors.pop(LEARNED_HEADS, None)
    recorded_heads = bool(((manifest.get("rotation") or {}).get("learned") or {}).get("head_rotations"))
    if (head_rotations is not None) != recorded_heads:
        raise ValueError(f"{mpath} is corrupt: a learned rotation's record 'head_rotations' and the tensor "
                         f"{LEARNED_HEADS!r} in {WEIGHTS} come together or not at all")
    if head_rotations is not None:
        check_head_rotations(head_rotations, config.num_layers, config.head_dim, f"{path / WEIGHTS}: {LEARNED_HEADS!r}")
    params = unflatten_params(tensors, manifest["packed_weights"])
    check_params(params, config, manifest.get("quantization") is not None)
    with safe_open(str(path / WEIGHTS), framework="np") as f:
        recorded = (f.metadata() or {}).get(MANIFEST_DIGEST)
    if recorded != manifest_digest(manifest):
        raise ValueError(f"{mpath} does not match {path / WEIGHTS}: its fields differ from those the checkpoint was "
                         "converted with (edited by hand, or copied from another checkpoint); convert the model "
                         "again rather than editing the manifest")
    return Checkpoint(path, config, jax.device_put(params), manifest, draft_vocab, rotation_matrix, head_rotations)


def check_draft_vocab(ranking: np.ndarray, vocab_size: int, what: str) -> None:
    """A draft vocabulary ranking is an integer permutation of ``range(vocab_size)``."""
    ranking = np.asarray(ranking)
    if (ranking.shape != (vocab_size,) or not np.issubdtype(ranking.dtype, np.integer)
            or not np.array_equal(np.sort(ranking), np.arange(vocab_size))):
        raise ValueError(f"{what} must order every token id once: a permutation of range({vocab_size}), got "
                         f"{ranking.dtype} of shape {ranking.shape}")


def check_rotation_matrix(r: np.ndarray, hidden: int, what: str) -> None:
    """A learned rotation is a float64 orthogonal ``hidden x hidden`` matrix (to :data:`ORTHOGONAL_TOL`)."""
    r = np.asarray(r)
    if r.shape != (hidden, hidden) or r.dtype != np.float64:
        raise ValueError(f"{what} must be a float64 {hidden} x {hidden} matrix, got {r.dtype} of shape {r.shape}")
    if not np.isfinite(r).all() or np.abs(r.T @ r - np.eye(hidden)).max() > ORTHOGONAL_TOL:
        raise ValueError(f"{what} is not orthogonal (max |R^T R - I| above {ORTHOGONAL_TOL})")


def check_head_rotations(r: np.ndarray, layers: int, head_dim: int, what: str) -> None:
    """Learned value-head rotations: float64 ``[layers, head_dim, head_dim]``, each orthogonal."""
    r = np.asarray(r)
    if r.shape != (layers, head_dim, head_dim) or r.dtype != np.float64:
        raise ValueError(f"{what} must be float64 [{layers}, {head_dim}, {head_dim}], got {r.dtype} of shape {r.shape}")
    for i, m in enumerate(r):
        check_rotation_matrix(m, head_dim, f"{what} (layer {i})")


def _check_rotation(rot: Any, mpath: Path) -> None:
    """``rotation``: null, or an object with ``online`` (true/false), an integer ``seed`` >= 0 when online,
    an optional ``kind`` of :data:`ROTATION_KINDS`, and for a learned one its training record."""
    if rot is None:
        return
    if not (isinstance(rot, dict) and isinstance(rot.get("online"), bool) and (
            not rot["online"] or (type(rot.get("seed")) is int and rot["seed"] >= 0))):
        raise ValueError(f"{mpath} is corrupt: 'rotation' must be null or an object with 'online' (true/false) "
                         f"and, when online, an integer 'seed' >= 0; got {rot!r}")
    if rot.get("kind", ROTATION_KINDS[0]) not in ROTATION_KINDS:
        raise ValueError(f"{mpath} is corrupt: rotation 'kind' must be one of {ROTATION_KINDS}, got {rot['kind']!r}")
    if rot.get("kind") != "learned":
        if "learned" in rot:
            raise ValueError(f"{mpath} is corrupt: a training record 'learned' in a rotation of kind "
                             f"{rot.get('kind', ROTATION_KINDS[0])!r}")
        return
    record = rot.get("learned")
    if not isinstance(record, dict):
        raise ValueError(f"{mpath} is corrupt: a learned rotation needs its training record 'learned' (an object)")
    if type(record.get("head_rotations", False)) is not bool:
        raise ValueError(f"{mpath} is corrupt: the learned rotation's 'head_rotations' must be true or false, got "
                         f"{record['head_rotations']!r}")
    for name, (kind, least) in LEARNED_FIELDS.items():
        value = record.get(name)
        ok = (type(value) is int if kind is int else type(value) in (int, float)) and value >= least
        if not ok or (kind is float and not value > least):
            raise ValueError(f"{mpath} is corrupt: the learned rotation's {name!r} must be a {kind.__name__} "
                             f"{'>' if kind is float else '>='} {least}, got {value!r}")


def _check_manifest_schemes(manifest: dict[str, Any], mpath: Path) -> None:
    """The manifest's ``rotation`` and ``quantization`` entries (None or well-formed objects) and the
    packed weights' group sizes."""
    _check_rotation(manifest.get("rotation"), mpath)
    quant = manifest.get("quantization")
    if quant is not None and not (isinstance(quant, dict) and isinstance(quant.get("symmetric"), bool)):
        raise ValueError(f"{mpath} is corrupt: 'quantization' must be null or an object with 'symmetric' "
                         f"(true/false), got {quant!r}")
    if not all(type(g) is int for g in manifest["packed_weights"].values()):
        raise ValueError(f"{mpath} is corrupt: 'packed_weights' must map names to integer group sizes")


def _check_packed_scheme(tensors: dict[str, np.ndarray], manifest: dict[str, Any], mpath: Path) -> None:
    """Packed weights need a quantization entry, and carry ``.mins`` exactly when it is asymmetric (the
    kernels read symmetry off the arrays, so a dropped or extra ``.mins`` would change the weights)."""
    packed, quant = manifest["packed_weights"], manifest.get("quantization")
    if packed and quant is None:
        raise ValueError(f"{mpath} is corrupt: it lists packed weights but no 'quantization'")
    for name in packed:
        if name + ".packed" in tensors and (name + ".mins" in tensors) == quant["symmetric"]:  # else unflatten_params names it
            raise ValueError(f"{mpath.parent / WEIGHTS}: packed weight {name!r} "
                             f"{'has' if quant['symmetric'] else 'lacks'} '.mins' but the manifest says "
                             f"symmetric={quant['symmetric']}")
