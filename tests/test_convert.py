"""Conversion: exact Q4_1 passthrough, rotation invariance, checkpoint round trips, and bad input."""

from __future__ import annotations

import collections
import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert import cli
from convert.pipeline import (_gptq_layers, _linear_inputs_hessians, _map_linears, convert, convert_model,
                              layer_tree)
from convert.quantize import QuantScheme, quantize_rtn
from convert.sources import as_float, read_source
from pallas_kernels.layout import QuantizedWeight, dequantize
from qspec_jax.checkpoint import MANIFEST, WEIGHTS, load_checkpoint, save_checkpoint
from qspec_jax.config import LlamaConfig
from qspec_jax.model import LINEAR_PATHS
from tests.conftest import TINY, jit_forward, random_source, tiny_variant, write_gguf, write_hf_dir
from pallas_kernels.precision import parse_precision


def _logits(params, config, tokens, mode="w16a16", seed=None):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(jit_forward(params, config, jnp.asarray(tokens), pos, precision=parse_precision(mode),
                                  online_rotation_seed=seed)[0])


def _transformers_reverse_permute(w: np.ndarray, heads: int) -> np.ndarray:
    # transformers' GGUF loader: reshape(heads, dim, 2, ...) then swap -> HF rotate-half row order
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def test_q4_1_layers_reproduced_exactly(smollm2_ckpt, gguf_path):
    """Asymmetric group-32 INT4 of every Q4_1 layer dequantizes bit for bit to GGUF's own dequantization."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    ck = load_checkpoint(smollm2_ckpt)
    c = ck.config
    lay = ck.params["layers"]
    hq, hk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    f = c.intermediate_size

    def gguf_float(name):
        t = tensors[name]
        assert t.tensor_type.name == "Q4_1"
        return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))

    def ours(w: QuantizedWeight, i):
        assert w.group_size == 32 and not w.symmetric
        return np.asarray(dequantize(jax.tree.map(lambda a: a[i], w), jnp.float32))

    checked = 0
    for i in range(c.num_layers):
        qkv, gate_up = ours(lay["attn"]["qkv"]["w"], i), ours(lay["mlp"]["gate_up"]["w"], i)
        pairs = [
            (qkv[:hq], _transformers_reverse_permute(gguf_float(f"blk.{i}.attn_q.weight"), c.num_heads)),
            (qkv[hq:hq + hk], _transformers_reverse_permute(gguf_float(f"blk.{i}.attn_k.weight"), c.num_kv_heads)),
            (qkv[hq + hk:], gguf_float(f"blk.{i}.attn_v.weight")),
            (ours(lay["attn"]["o"]["w"], i), gguf_float(f"blk.{i}.attn_output.weight")),
            (gate_up[:f], gguf_float(f"blk.{i}.ffn_gate.weight")),
            (gate_up[f:], gguf_float(f"blk.{i}.ffn_up.weight")),
            (ours(lay["mlp"]["down"]["w"], i), gguf_float(f"blk.{i}.ffn_down.weight")),
        ]
        for mine, theirs in pairs:
            assert mine.shape == theirs.shape
            assert np.array_equal(mine.view(np.uint32), theirs.astype(np.float32).view(np.uint32))
            checked += 1
    assert checked == 7 * c.num_layers == sum(t.tensor_type.name == "Q4_1" for t in reader.tensors)


def test_rotation_preserves_smollm2_float_logits(smollm2_source, rng):
    tokens = rng.integers(0, smollm2_source.config.vocab_size, (2, 12))
    plain, cfg, _ = convert_model(smollm2_source, None, None)
    seed = int(rng.integers(0, 2**31))
    rotated, rcfg, manifest = convert_model(smollm2_source, None, seed)
    assert manifest["rotation"]["seed"] == seed and not rcfg.tie_word_embeddings
    a = _logits(plain, cfg, tokens)
    b = _logits(rotated, rcfg, tokens, seed=seed)
    assert np.abs(a - b).max() < 2e-3 * np.abs(a).max()
    assert np.array_equal(a.argmax(-1), b.argmax(-1))
    # the rotation really changed the weights (not an identity)
    assert not np.allclose(plain["embed"], rotated["embed"])


@pytest.mark.parametrize("changes", [dict(), dict(attention_bias=True, tie_word_embeddings=True),
                                     dict(intermediate_size=86, num_kv_heads=4)])  # 86 = 2*43: no Hadamard
def test_rotation_preserves_tiny_float_logits(rng, changes):
    src = random_source(tiny_variant(**changes), rng)
    tokens = rng.integers(0, src.config.vocab_size, (2, 9))
    plain, cfg, _ = convert_model(src, None, None)
    seed = int(rng.integers(2**31))
    rotated, rcfg, _ = convert_model(src, None, seed)
    a, b = _logits(plain, cfg, tokens), _logits(rotated, rcfg, tokens, seed=seed)
    np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(a).max())


@pytest.mark.parametrize("rotate", [False, True])
def test_checkpoint_roundtrip_is_bitwise(tmp_path, rng, rotate):
    src = random_source(tiny_variant(attention_bias=bool(rng.integers(2))), rng, '{"stub": 1}')
    scheme = QuantScheme(int(rng.choice([8, 16])) if rng.integers(2) else None, bool(rng.integers(2)), "rtn")
    params, config, manifest = convert_model(src, scheme, int(rng.integers(2**31)) if rotate else None)
    out = save_checkpoint(tmp_path / "ck", params, config, src.tokenizer_files, **manifest)
    ck = load_checkpoint(out)
    assert ck.config == config
    is_q = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    a, ta = jax.tree.flatten(params, is_leaf=is_q)
    b, tb = jax.tree.flatten(ck.params, is_leaf=is_q)
    assert ta == tb
    # on the device already: a jitted call must not copy the weights from the host on every call
    assert all(isinstance(y, jax.Array) and y.devices() == {jax.devices()[0]} for y in jax.tree.leaves(b))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()
    tokens = rng.integers(0, config.vocab_size, (1, 5))
    for mode in ("w4a16", "w4a4"):
        assert np.array_equal(_logits(params, config, tokens, mode, ck.online_rotation_seed),
                              _logits(ck.params, ck.config, tokens, mode, ck.online_rotation_seed))


@pytest.fixture
def tiny_ckpt(tmp_path, rng):
    src = random_source(TINY, rng, '{"stub": 1}')
    params, config, manifest = convert_model(src, QuantScheme(16, False, "rtn"), None)
    return save_checkpoint(tmp_path / "ck", params, config, src.tokenizer_files, **manifest)


def test_corrupt_weights_fail_checksum(tiny_ckpt):
    data = bytearray((tiny_ckpt / WEIGHTS).read_bytes())
    data[len(data) // 2] ^= 0x01
    (tiny_ckpt / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch for .*model.safetensors"):
        load_checkpoint(tiny_ckpt)


def test_missing_files_are_named(tiny_ckpt, tmp_path):
    (tiny_ckpt / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_checkpoint(tiny_ckpt)
    with pytest.raises(FileNotFoundError, match="not a qspec-jax checkpoint"):
        load_checkpoint(tmp_path / "nowhere")


def test_manifest_config_mismatch_is_a_shape_error(tiny_ckpt):
    m = json.loads((tiny_ckpt / MANIFEST).read_text())
    m["config"]["intermediate_size"] = 96
    (tiny_ckpt / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"param 'layers\.mlp\..*' has shape"):
        load_checkpoint(tiny_ckpt)


@pytest.mark.parametrize("edit", ["rotation changed", "rms_norm_eps", "rope_theta", "source", "field added"])
def test_hand_edited_manifest_is_refused(tiny_ckpt, rng, edit):
    """A well-formed manifest edited after conversion (its checksums untouched, still valid) no longer
    matches the digest the weights file holds: refused, where it would load and decode differently."""
    m = json.loads((tiny_ckpt / MANIFEST).read_text())
    if edit == "rotation changed":  # the case: a rotated checkpoint's rotation set to null, or the reverse
        m["rotation"] = None if m.get("rotation") else {"online": True, "seed": int(rng.integers(0, 1000))}
    elif edit == "rms_norm_eps":
        m["config"]["rms_norm_eps"] = float(m["config"]["rms_norm_eps"]) * float(rng.uniform(1.5, 10))
    elif edit == "rope_theta":
        m["config"]["rope_theta"] = float(rng.uniform(1e3, 1e6))
    elif edit == "source":
        m["source"] = "another model"
    else:
        m["note"] = "edited"
    (tiny_ckpt / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match="does not match .*model.safetensors.*convert the model again"):
        load_checkpoint(tiny_ckpt)


def test_manifest_of_another_checkpoint_is_refused(tmp_path, rng):
    """Two conversions of one source that differ only in a manifest field: the manifests swapped, with
    the checksums made right, do not load."""
    src = random_source(TINY, rng, '{"stub": 1}')
    params, config, manifest = convert_model(src, QuantScheme(16, False, "rtn"), None)
    a = save_checkpoint(tmp_path / "a", params, config, src.tokenizer_files, **manifest)
    b = save_checkpoint(tmp_path / "b", params, config, src.tokenizer_files, **{**manifest, "source": "renamed"})
    m = json.loads((b / MANIFEST).read_text())
    m["files"] = json.loads((a / MANIFEST).read_text())["files"]
    (a / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match="does not match"):
        load_checkpoint(a)
    assert load_checkpoint(b).manifest["source"] == "renamed"


def test_load_expands_the_home_directory(tiny_ckpt, monkeypatch):
    """``~`` in a checkpoint path is the home directory, for the weights and the tokenizer."""
    import qspec_jax.tokenizer
    from qspec_jax.api import load

    monkeypatch.setenv("HOME", str(tiny_ckpt.parent))
    monkeypatch.setattr(qspec_jax.tokenizer, "load_tokenizer", lambda path: Path(path))  # its stub is no tokenizer
    model = load(f"~/{tiny_ckpt.name}")
    assert model.checkpoint.path == tiny_ckpt and model.tokenizer == tiny_ckpt
    assert load_checkpoint(Path("~") / tiny_ckpt.name).path == tiny_ckpt


def test_unknown_format_version(tiny_ckpt):
    m = json.loads((tiny_ckpt / MANIFEST).read_text())
    m["format_version"] = 999
    (tiny_ckpt / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match="v999"):
        load_checkpoint(tiny_ckpt)


@pytest.mark.parametrize("edit", ["not an object", "no files", "no config", "files listed empty", "file outside"])
def test_malformed_manifest_is_named(tiny_ckpt, edit):
    m = json.loads((tiny_ckpt / MANIFEST).read_text())
    if edit == "not an object":
        m = [m]
    elif edit == "no files":
        del m["files"]
    elif edit == "no config":
        m["config"] = None
    elif edit == "file outside":  # someone else's file with its right checksum, which the loader would trust
        from qspec_jax.checkpoint import sha256

        (tiny_ckpt.parent / "other.json").write_text("{}")
        m["files"]["../other.json"] = sha256(tiny_ckpt.parent / "other.json")
    else:  # no checksum left to check: refused rather than loaded unverified
        m["files"] = {}
    (tiny_ckpt / MANIFEST).write_text(json.dumps(m))
    match = "outside the checkpoint directory" if edit == "file outside" else ""
    with pytest.raises(ValueError, match=f"{MANIFEST} is corrupt: .*{match}"):
        load_checkpoint(tiny_ckpt)


@pytest.mark.parametrize("edit", ["rotation without seed", "rotation as a string", "negative seed",
                                  "quantization as a string", "group size as a string"])
def test_malformed_manifest_schemes_are_named(tiny_ckpt, edit):
    m = json.loads((tiny_ckpt / MANIFEST).read_text())
    if edit == "rotation without seed":
        m["rotation"] = {"online": True, "kind": "randomized-hadamard"}
    elif edit == "rotation as a string":
        m["rotation"] = "hadamard"
    elif edit == "negative seed":
        m["rotation"] = {"online": True, "seed": -3}
    elif edit == "quantization as a string":
        m["quantization"] = "rtn"
    else:
        m["packed_weights"] = {k: str(v) for k, v in m["packed_weights"].items()}
    (tiny_ckpt / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match=f"{MANIFEST} is corrupt"):
        load_checkpoint(tiny_ckpt)


def _rewrite_weights(ckpt: Path, edit) -> None:
    """Edit a checkpoint's tensors and re-sign them in the manifest, as a hand edit would."""
    from safetensors.numpy import load_file, save_file

    from qspec_jax.checkpoint import sha256

    tensors = load_file(str(ckpt / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(ckpt / WEIGHTS))
    m = json.loads((ckpt / MANIFEST).read_text())
    m["files"][WEIGHTS] = sha256(ckpt / WEIGHTS)
    (ckpt / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("edit,match", [
    ("nan", r"tensor 'layers\.attn_norm\.scale' holds NaN"),
    ("inf scale", r"tensor 'layers\.mlp\.down\.w\.scales' holds NaN or infinity"),
    ("mins dropped", r"packed weight 'layers\.attn\.o\.w' lacks '\.mins' but the manifest says symmetric=False"),
    ("arrays dropped", r"checkpoint lacks the arrays of packed weight 'layers\.mlp\.down\.w'"),
])
def test_resigned_weights_checked_at_load(tiny_ckpt, rng, edit, match):
    """Tensors with a valid checksum are still checked: finite, and ``.mins`` exactly when asymmetric."""
    def change(t):
        if edit == "nan":
            t["layers.attn_norm.scale"][0, int(rng.integers(t["layers.attn_norm.scale"].shape[1]))] = np.nan
        elif edit == "inf scale":
            t["layers.mlp.down.w.scales"].flat[int(rng.integers(t["layers.mlp.down.w.scales"].size))] = np.inf
        elif edit == "mins dropped":
            del t["layers.attn.o.w.mins"]
        else:
            del t["layers.mlp.down.w.packed"], t["layers.mlp.down.w.scales"]
    _rewrite_weights(tiny_ckpt, change)
    with pytest.raises(ValueError, match=match):
        load_checkpoint(tiny_ckpt)


def test_packed_weights_need_a_symmetric_flag(tiny_ckpt):
    m = json.loads((tiny_ckpt / MANIFEST).read_text())
    del m["quantization"]["symmetric"]
    (tiny_ckpt / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match=f"{MANIFEST} is corrupt: 'quantization' must be null or an object with"):
        load_checkpoint(tiny_ckpt)
    m["quantization"] = None
    (tiny_ckpt / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match="lists packed weights but no 'quantization'"):
        load_checkpoint(tiny_ckpt)


def test_reconversion_drops_the_old_tokenizer_files(tmp_path, rng):
    """Converting over a checkpoint removes its tokenizer files the new source lacks; a tokenizer file
    the manifest does not list is refused at load (the tokenizer would silently read it)."""
    from qspec_jax.api import load

    src = random_source(TINY, rng)
    params, config, manifest = convert_model(src, None, None)
    tok = json.dumps({"model_max_length": 7})
    out = save_checkpoint(tmp_path / "ck", params, config,
                          {"tokenizer.json": "{}", "tokenizer_config.json": tok}, **manifest)
    assert (out / "tokenizer_config.json").read_text() == tok
    save_checkpoint(out, params, config, {"tokenizer.json": "{}"}, **manifest)
    assert not (out / "tokenizer_config.json").exists()
    assert set(load_checkpoint(out).manifest["files"]) == {WEIGHTS, "tokenizer.json"}
    (out / "special_tokens_map.json").write_text("{}")
    with pytest.raises(ValueError, match="special_tokens_map.json is not part of the checkpoint"):
        load(out)
    (out / "special_tokens_map.json").unlink()
    (out / "additional_chat_templates").mkdir()
    (out / "additional_chat_templates" / "default.jinja").write_text("{{ 'other' }}")
    with pytest.raises(ValueError, match="additional_chat_templates is not part of the checkpoint"):
        load(out)
    with pytest.raises(ValueError, match=r"not tokenizer files: \['config.json'\]"):
        save_checkpoint(tmp_path / "other", params, config, {"tokenizer.json": "{}", "config.json": "{}"})


def test_param_names_must_split_back(tmp_path, rng):
    """A '.' inside a param key would be read back as nesting: refused when saving."""
    params, config, manifest = convert_model(random_source(TINY, rng), None, None)
    params["final_norm"] = {"scale.v2": params["final_norm"]["scale"]}
    with pytest.raises(ValueError, match=r"param name 'final_norm\.scale\.v2'"):
        save_checkpoint(tmp_path / "ck", params, config, {"tokenizer.json": "{}"}, **manifest)


def test_param_dtypes_checked(tiny_ckpt):
    """A float param stored as integers (or a packed weight's scales as float32) is refused by name."""
    from qspec_jax.checkpoint import check_params

    ck = load_checkpoint(tiny_ckpt)
    params = jax.tree.map(lambda a: a, ck.params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    params["final_norm"]["scale"] = np.asarray(params["final_norm"]["scale"]).astype(np.int32)
    with pytest.raises(ValueError, match="param 'final_norm.scale' is int32, expected a float array"):
        check_params(params, ck.config, quantized=True)
    params = jax.tree.map(lambda a: a, ck.params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    w = params["layers"]["mlp"]["down"]["w"]
    params["layers"]["mlp"]["down"]["w"] = QuantizedWeight(w.packed, w.scales.astype(jnp.float32), w.mins, w.group_size)
    with pytest.raises(ValueError, match="scales must be float16"):
        check_params(params, ck.config, quantized=True)


def test_packing_must_match_the_manifest(tmp_path, rng):
    """A quantized checkpoint packs exactly the decoder linears, a float one nothing; anything else is
    refused at load, by name. Before, a packed embedding or norm failed later with Flax's shape error,
    and float linears in a checkpoint marked quantized passed load() and failed in generate() with
    advice to convert with quantization."""
    src = random_source(TINY, rng, '{"stub": 1}')
    quant, config, q_manifest = convert_model(src, QuantScheme(16, False, "rtn"), None)
    floats, _, f_manifest = convert_model(src, None, None)
    a, b = LINEAR_PATHS[rng.integers(len(LINEAR_PATHS))]
    one_float = jax.tree.map(lambda x: x, quant, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    one_float["layers"][a][b]["w"] = np.asarray(dequantize(quant["layers"][a][b]["w"]), np.float32)
    packed_embed = dict(quant, embed=quantize_rtn(np.asarray(quant["embed"]), QuantScheme(16, False, "rtn")))
    cases = [
        (floats, q_manifest, r"'layers\.\w+\.\w+\.w' is a float array, but the checkpoint is marked quantized"),
        (one_float, q_manifest, rf"'layers\.{a}\.{b}\.w' is a float array, but the checkpoint is marked quantized"),
        (packed_embed, q_manifest, r"'embed' is a packed INT4 weight; only the decoder linears"),
    ]
    for i, (params, manifest, msg) in enumerate(cases):
        path = save_checkpoint(tmp_path / f"ck{i}", params, config, src.tokenizer_files, **manifest)
        with pytest.raises(ValueError, match=msg):
            load_checkpoint(path)
    for i, (params, manifest) in enumerate(((quant, q_manifest), (floats, f_manifest))):
        assert load_checkpoint(save_checkpoint(tmp_path / f"ok{i}", params, config, src.tokenizer_files,
                                               **manifest)).quantized == (i == 0)


def test_unknown_architecture_rejected(tmp_path, rng):
    d = write_hf_dir(tmp_path / "hf", random_source(TINY, rng), "{}")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        read_source(d)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LlamaConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 8})
    # either field would pass alone: together they must name the same model
    for archs, model_type in ((["GPT2LMHeadModel"], "llama"), (["LlamaForCausalLM"], "qwen2"),
                              (["LlamaForCausalLM", "Qwen2ForCausalLM"], None),
                              (["LlamaForCausalLM", "GPT2LMHeadModel"], "llama")):
        cfg.update(architectures=archs, model_type=model_type)
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match="contradicts itself"):
            read_source(d)


def test_hf_tensor_shape_mismatch_named(tmp_path, rng):
    src = random_source(TINY, rng)
    src.layers[1]["down"] = src.layers[1]["down"][:, :-4]
    with pytest.raises(ValueError, match=r"layers\.1\.down: shape"):
        read_source(write_hf_dir(tmp_path / "hf", src, "{}"))


def test_hf_missing_shard_named(tmp_path, rng):
    d = write_hf_dir(tmp_path / "hf", random_source(TINY, rng), "{}")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        read_source(d)


@pytest.mark.parametrize("case", ["duplicated", "misplaced"])
def test_hf_shards_must_match_the_index(tmp_path, rng, case):
    """A tensor in two shards, or in another shard than the index names, is refused (not last-wins)."""
    from safetensors.numpy import load_file, save_file

    d = write_hf_dir(tmp_path / "hf", random_source(TINY, rng), "{}")
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    key = first[int(rng.integers(len(first)))]
    shard2 = {k: tensors[k] for k in second}
    if case == "duplicated":
        shard2[key] = tensors[key] + 1.0
    save_file({k: tensors[k] for k in first if case == "duplicated" or k != key}, str(d / "a.safetensors"))
    save_file(shard2 if case == "duplicated" else {**shard2, key: tensors[key]}, str(d / "b.safetensors"))
    weight_map = {**{k: "a.safetensors" for k in first}, **{k: "b.safetensors" for k in second}}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    match = (f"tensor '{key}' is in both a.safetensors and b.safetensors" if case == "duplicated"
             else f"puts tensor '{key}' in a.safetensors, but it is in b.safetensors")
    with pytest.raises(ValueError, match=match):
        read_source(d)


@pytest.mark.parametrize("case", ["lfs pointer", "garbage", "bad tokenizer json", "tokenizer not utf-8"])
def test_unreadable_hf_files_are_named(tmp_path, rng, case):
    d = write_hf_dir(tmp_path / "hf", random_source(TINY, rng), "{}")
    if case == "lfs pointer":
        (d / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\n")
        match = "model.safetensors is a Git LFS pointer"
    elif case == "garbage":
        (d / "model.safetensors").write_bytes(rng.integers(0, 256, 64, dtype=np.uint8).tobytes())
        match = "model.safetensors is not a readable safetensors file"
    elif case == "bad tokenizer json":
        (d / "tokenizer_config.json").write_text('{"model_max_length": ')
        match = "tokenizer_config.json is not valid JSON"
    else:
        (d / "special_tokens_map.json").write_bytes(b'{"bos_token": "\xff\xfe"}')
        match = "special_tokens_map.json is not UTF-8 text"
    with pytest.raises(ValueError, match=match):
        read_source(d)


def _hf_dir(tmp_path, rng, config_edit=None, tensors_edit=None) -> Path:
    """A tiny HF checkpoint directory, its config.json and tensors edited."""
    from safetensors.numpy import load_file, save_file

    d = write_hf_dir(tmp_path / "hf", random_source(TINY, rng), "{}")
    if config_edit:
        cfg = json.loads((d / "config.json").read_text())
        config_edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if tensors_edit:
        tensors = load_file(str(d / "model.safetensors"))
        tensors_edit(tensors)
        save_file(tensors, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("case,match", [
    ("mlp bias tensor", r"does not use: model\.layers\.0\.mlp\.down_proj\.bias"),
    ("o_proj bias tensor", r"does not use: model\.layers\.1\.self_attn\.o_proj\.bias"),
    ("extra norm", r"does not use: model\.layers\.0\.post_feedforward_layernorm\.weight"),
    ("untied lm_head", "lm_head.weight differs from the embedding"),
    ("int8 weight", r"'model\.layers\.0\.mlp\.up_proj\.weight' is int8, not a float"),
    ("quantization_config", "already quantized.*gptq"),
    ("mlp_bias", "mlp_bias is not supported"),
    ("llama attention_bias", "o_proj bias"),
    ("gelu", "hidden_act 'gelu_pytorch_tanh' is not supported"),
    ("sliding window", "sliding-window attention"),
    ("negative eps", "rms_norm_eps must be a finite number >= 0"),
    ("eos out of vocab", "eos_token_id 97 is outside the vocabulary"),
    ("string field", "config.json field 'intermediate_size' must be an integer, got 'eighty'"),
    ("numeric string", "config.json field 'num_hidden_layers' must be an integer, got '2'"),
    ("false as a string", "config.json field 'tie_word_embeddings' must be true or false, got 'false'"),
    ("fractional int", "config.json field 'head_dim' must be an integer, got 16.5"),
    ("rope_parameters string", "config.json field 'rope_parameters' must be an object"),
    ("architectures number", "config.json field 'architectures' must be a list, got 5"),
    ("bos out of vocab", "bos_token_id 4096 is outside the vocabulary"),
    ("zero heads", "num_heads must be positive, got 0"),
    ("eos list with null", r"field 'eos_token_id' must list integers, got \[2, None\]"),
    ("nan weight", r"tensor layers\.1\.o holds NaN or infinite values"),
    ("rope factor 0", "llama3 rope_scaling needs factor >= 1"),
    ("rope keys missing", "llama3 rope_scaling needs numbers factor"),
    ("float sliding window", "sliding-window attention"),
    ("rope theta twice", r"RoPE's base twice, differently: .*: 500000\.0, 'rope_theta': 10000\.0"),
    ("rope scaling twice", "RoPE's scaling twice, differently"),
    ("linear rope_parameters", "unsupported rope_scaling type 'linear'"),
    ("linear rope_parameters as type", "unsupported rope_scaling type 'linear'"),
    ("partial rotary", "partial_rotary_factor 0.5 is not supported"),
    ("zero max positions", "max_position_embeddings must be positive, got 0"),
])
def test_hf_features_the_model_lacks_are_refused(tmp_path, rng, case, match):
    """A checkpoint the Llama model cannot reproduce (biases, extra tensors, integer or pre-quantized
    weights, another activation, sliding windows, bad values) is refused, not converted without them."""
    def put(name, shape, dtype=np.float32):
        return lambda t: t.update({name: rng.standard_normal(shape).astype(dtype)})
    tensors_edit = {
        "mlp bias tensor": put("model.layers.0.mlp.down_proj.bias", (TINY.hidden_size,)),
        "o_proj bias tensor": put("model.layers.1.self_attn.o_proj.bias", (TINY.hidden_size,)),
        "extra norm": put("model.layers.0.post_feedforward_layernorm.weight", (TINY.hidden_size,)),
        "int8 weight": lambda t: t.update({k: (v * 20).astype(np.int8) for k, v in t.items() if "up_proj" in k}),
        "nan weight": lambda t: t["model.layers.1.self_attn.o_proj.weight"].__setitem__((3, 5), np.inf),
    }.get(case)
    config_edit = {
        "untied lm_head": lambda c: c.update(tie_word_embeddings=True),  # lm_head.weight is a different matrix
        "quantization_config": lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}),
        "mlp_bias": lambda c: c.update(mlp_bias=True),
        "llama attention_bias": lambda c: c.update(attention_bias=True),
        "gelu": lambda c: c.update(hidden_act="gelu_pytorch_tanh"),
        "sliding window": lambda c: c.update(architectures=["MistralForCausalLM"], model_type="mistral",
                                             sliding_window=64),
        "negative eps": lambda c: c.update(rms_norm_eps=-1e-6),
        "eos out of vocab": lambda c: c.update(eos_token_id=[2, TINY.vocab_size]),
        "string field": lambda c: c.update(intermediate_size="eighty"),
        "numeric string": lambda c: c.update(num_hidden_layers="2"),
        "false as a string": lambda c: c.update(tie_word_embeddings="false"),  # bool("false") is True
        "fractional int": lambda c: c.update(head_dim=16.5),
        "rope_parameters string": lambda c: (c.pop("rope_theta"), c.update(rope_parameters="default")),
        "architectures number": lambda c: c.update(architectures=5),
        "bos out of vocab": lambda c: c.update(bos_token_id=4096),
        "zero heads": lambda c: c.update(num_attention_heads=0),
        "eos list with null": lambda c: c.update(eos_token_id=[2, None]),
        "rope factor 0": lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 0.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "rope keys missing": lambda c: c.update(rope_scaling={"rope_type": "llama3"}),
        "float sliding window": lambda c: c.update(architectures=["MistralForCausalLM"], model_type="mistral",
                                                   sliding_window=16.0),
        # both RoPE forms at once, disagreeing: transformers would pick one by precedence
        "rope theta twice": lambda c: c.update(rope_theta=1e4, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 5e5}),
        "rope scaling twice": lambda c: c.update(rope_scaling=dict(LLAMA3_SCALING), rope_parameters={
            "rope_type": "default", "rope_theta": c["rope_theta"]}),
        "linear rope_parameters": lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 2.0}),
        "linear rope_parameters as type": lambda c: (c.pop("rope_theta"), c.update(rope_parameters={
            "type": "linear", "factor": 2.0, "rope_theta": 1e4})),
        "partial rotary": lambda c: c.update(partial_rotary_factor=0.5),
        "zero max positions": lambda c: c.update(max_position_embeddings=0),
    }.get(case)
    with pytest.raises(ValueError, match=match):
        read_source(_hf_dir(tmp_path, rng, config_edit, tensors_edit))


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def test_hf_rope_forms_read_as_transformers_reads_them():
    """RoPE's base and scaling written as transformers 4 writes them (top-level ``rope_theta`` /
    ``rope_scaling``), as transformers 5 does (``rope_parameters``, its type under ``rope_type`` or
    ``type``), or both at once in agreement: read as transformers' own LlamaConfig reads each."""
    import transformers

    base = {k: v for k, v in TINY.to_hf().items() if k not in ("rope_theta", "rope_scaling")}
    theta = float(np.random.default_rng().choice([1e4, 5e5]))
    new_form = {**LLAMA3_SCALING, "rope_theta": theta}
    forms = [dict(rope_theta=theta, rope_scaling=dict(LLAMA3_SCALING)), dict(rope_parameters=new_form),
             dict(rope_theta=theta, rope_parameters=new_form),
             dict(rope_parameters={**{k: v for k, v in new_form.items() if k != "rope_type"}, "type": "llama3"}),
             dict(rope_theta=theta, rope_scaling=dict(LLAMA3_SCALING), rope_parameters=new_form),
             dict(rope_theta=theta), dict(rope_parameters={"rope_type": "default", "rope_theta": theta})]
    for form in forms:
        ours = LlamaConfig.from_hf({**base, **form})
        hf = transformers.LlamaConfig.from_dict({**base, **form}).rope_parameters
        assert ours.rope_theta == hf["rope_theta"] == theta, form
        scaling = dict(ours.rope_scaling or {"rope_type": "default"})
        assert scaling.get("rope_type") == hf.get("rope_type", hf.get("type")), form
        for key in LLAMA3_SCALING.keys() - {"rope_type"} if scaling["rope_type"] == "llama3" else ():
            assert scaling[key] == hf[key], (form, key)


def test_hf_config_variants_accepted(tmp_path, rng):
    """What is refused above stays accepted where it changes nothing: a tied lm_head saved as the same
    matrix, derived rotary buffers, a sliding window no shorter than the context or switched off,
    Qwen2's q/k/v biases, an EOS list (kept whole: generation stops at any) or an empty one."""
    def tied(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"]
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(TINY.head_dim // 2, np.float32)
    src = read_source(_hf_dir(tmp_path, rng, lambda c: c.update(tie_word_embeddings=True), tied))
    assert src.config.tie_word_embeddings and src.lm_head is None
    base = TINY.to_hf()
    for edit, eos in ((dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=256), 2),
                      (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None), 2),
                      (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=16,
                            use_sliding_window=False, eos_token_id=[5, 2, 7]), (5, 2, 7)),
                      (dict(eos_token_id=[]), None), (dict(eos_token_id=[4]), 4),
                      (dict(num_hidden_layers=2.0, eos_token_id=2.0), 2)):  # integers written as floats
        cfg = LlamaConfig.from_hf({**base, **edit})
        assert cfg.eos_token_id == eos
        assert LlamaConfig.from_hf(cfg.to_hf()) == cfg
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    del qwen2["attention_bias"]
    assert LlamaConfig.from_hf(qwen2).attention_bias


def test_bfloat16_hf_source_converts(tmp_path, rng):
    """A bfloat16 checkpoint (the usual HF format) is a float source: read exactly, as float32."""
    from safetensors.flax import load_file, save_file

    d = _hf_dir(tmp_path, rng)
    tensors = load_file(str(d / "model.safetensors"))
    save_file({k: v.astype(jnp.bfloat16) for k, v in tensors.items()}, str(d / "model.safetensors"))
    src = read_source(d)
    want = np.asarray(tensors["model.layers.1.mlp.down_proj.weight"].astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(src.layers[1]["down"], want)
    assert not np.array_equal(want, np.asarray(tensors["model.layers.1.mlp.down_proj.weight"]))  # really rounded


def test_scale_overflow_is_refused(rng):
    """A weight too large for INT4 with float16 group scales / minimums is refused, not stored as inf,
    by RTN and by GPTQ (per group and per channel)."""
    from convert.gptq import gptq_quantize

    for value, symmetric in ((1e6, False), (-7e4, False), (5e5, True)):
        w = rng.standard_normal((8, 64)).astype(np.float32)
        w[rng.integers(8), rng.integers(64)] = value
        for quantize in (lambda g: quantize_rtn(w, QuantScheme(g, symmetric)),
                         lambda g: gptq_quantize(w, np.eye(64), QuantScheme(g, symmetric, "gptq"))):
            for group in (32, None):
                with pytest.raises(ValueError, match="overflows the float16 group scale"):
                    quantize(group)


@pytest.mark.parametrize("case", ["corrupt config", "config not an object", "index without weight_map",
                                  "shard outside"])
def test_malformed_hf_files_are_named(tmp_path, rng, case):
    d = _hf_dir(tmp_path, rng)
    if case == "corrupt config":
        (d / "config.json").write_text('{"hidden_size": 48,')
        match = "config.json is not valid JSON"
    elif case == "config not an object":
        (d / "config.json").write_text("[1, 2]")
        match = "config.json is not a JSON object"
    elif case == "index without weight_map":
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
        match = "index.json has no 'weight_map'"
    else:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "model.norm.weight": "../elsewhere/model.safetensors"}}))
        match = r"names shard files outside .*: \['../elsewhere/model.safetensors'\]"
    with pytest.raises(ValueError, match=match):
        read_source(d)


def test_hf_and_gguf_sources_give_the_same_model(tmp_path, rng):
    """The GGUF path (llama.cpp's q/k row order undone) and the HF path give identical logits."""
    src = random_source(TINY, rng)
    hf = read_source(write_hf_dir(tmp_path / "hf", src, "{}"))
    gg = read_source(write_gguf(tmp_path / "m.gguf", src))
    tokens = rng.integers(0, src.config.vocab_size, (2, 7))
    a = _logits(*convert_model(hf, None, None)[:2], tokens)
    b = _logits(*convert_model(gg, None, None)[:2], tokens)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind,symmetric", [("Q4_0", True), ("Q4_1", False)])
def test_gguf_int4_blocks_kept_without_rerounding(tmp_path, rng, kind, symmetric):
    import gguf

    src = random_source(tiny_variant(hidden_size=64, intermediate_size=96, head_dim=16), rng)  # K % 32 == 0
    path = write_gguf(tmp_path / "m.gguf", src, linear_type=kind)
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    theirs = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(src.layers[1]["down"].shape)
    params, _, _ = convert_model(read_source(path), QuantScheme(32, symmetric, "rtn"), None)
    w = jax.tree.map(lambda a: a[1], params["layers"]["mlp"]["down"]["w"])
    assert w.symmetric == symmetric
    assert np.array_equal(np.asarray(dequantize(w, jnp.float32)), theirs.astype(np.float32))


def test_q4_0_under_an_asymmetric_scheme_keeps_its_values(tmp_path, rng):
    """Symmetric Q4_0 blocks converted with an asymmetric group-32 scheme (the CLI's default) are
    written as s * u + m with m = -8 s: the GGUF's own values, bit for bit, not rounded again."""
    import gguf

    src = random_source(tiny_variant(hidden_size=64, intermediate_size=96, head_dim=16), rng)
    path = write_gguf(tmp_path / "m.gguf", src, linear_type="Q4_0")
    reader = gguf.GGUFReader(str(path))
    params, _, _ = convert_model(read_source(path), QuantScheme(32, False, "rtn"), None)
    for i in range(src.config.num_layers):
        t = next(t for t in reader.tensors if t.name == f"blk.{i}.ffn_down.weight")
        theirs = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(src.layers[i]["down"].shape)
        w = jax.tree.map(lambda a: a[i], params["layers"]["mlp"]["down"]["w"])
        assert not w.symmetric
        assert np.array_equal(np.asarray(dequantize(w, jnp.float32)), theirs.astype(np.float32))


def test_unsupported_gguf_type_named(tmp_path, rng):
    src = random_source(tiny_variant(hidden_size=64, intermediate_size=96, head_dim=16), rng)
    path = write_gguf(tmp_path / "m.gguf", src, linear_type="Q5_0")
    with pytest.raises(ValueError, match="GGUF type Q5_0"):
        read_source(path)


def test_unsupported_gguf_architecture(tmp_path, rng):
    path = write_gguf(tmp_path / "m.gguf", random_source(TINY, rng), arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        read_source(path)


@pytest.mark.parametrize("case,match", [
    ("rope scaling", "GGUF rope scaling 'linear' is not supported"),
    ("no head count", "lacks the GGUF field llama.attention.head_count"),
    ("no vocabulary size", "lacks the GGUF field llama.vocab_size"),
    ("output bias", r"does not use: blk\.0\.attn_output\.bias"),
    ("zero heads", "GGUF field llama.attention.head_count must be an integer >= 1, got 0"),
    ("string heads", "GGUF field llama.attention.head_count must be an integer >= 1, got '4'"),
    ("string eps", "GGUF field llama.attention.layer_norm_rms_epsilon must be a number"),
    ("bos beyond vocabulary", "bos_token_id 97 is outside the vocabulary"),
    ("padding beyond vocabulary", "tokenizer.ggml.padding_token_id 500 is outside the vocabulary of 97"),
    ("merge without a pair", "merges holds 'ab', not a pair"),
    ("no merges", "GGUF file has no tokenizer merges"),
])
def test_gguf_features_the_model_lacks_are_refused(tmp_path, rng, case, match):
    import gguf

    def edit(w):
        if case == "rope scaling":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(4.0)
        elif case == "no head count":
            del w.kv_data[0]["llama.attention.head_count"]
        elif case == "no vocabulary size":
            del w.kv_data[0]["tokenizer.ggml.tokens"]
        elif case in ("zero heads", "string heads"):
            w.add_key_value("llama.attention.head_count", 0 if case == "zero heads" else "4",
                            gguf.GGUFValueType.UINT32 if case == "zero heads" else gguf.GGUFValueType.STRING)
        elif case == "string eps":
            w.add_key_value("llama.attention.layer_norm_rms_epsilon", "1e-5", gguf.GGUFValueType.STRING)
        elif case == "bos beyond vocabulary":
            w.add_bos_token_id(TINY.vocab_size)
        elif case == "padding beyond vocabulary":
            w.add_pad_token_id(500)
        elif case == "merge without a pair":
            w.kv_data[0]["tokenizer.ggml.merges"].value = ["a b", "ab"]
        elif case == "no merges":
            del w.kv_data[0]["tokenizer.ggml.merges"]
        else:
            w.add_tensor("blk.0.attn_output.bias", rng.standard_normal(TINY.hidden_size).astype(np.float32))
    with pytest.raises(ValueError, match=match):
        read_source(write_gguf(tmp_path / "m.gguf", random_source(TINY, rng), edit=edit))


@pytest.mark.parametrize("pre", ["llama-bpe", "smollm"])
def test_gguf_tokenizer_follows_llama_cpp(tmp_path, rng, pre):
    """The tokenizer rebuilt from a GGUF: Llama-3's ('llama-bpe') takes a word in the vocabulary whole
    before merging (llama.cpp's ignore_merges; HF's Llama-3 tokenizer.json sets it), others merge; control
    tokens (type 3) are dropped when decoding, user-defined ones (type 4) are matched whole and kept."""
    from tokenizers import Tokenizer

    vocab = ["t0", "t1", "t2", "a", "b", "ab", "c", "abc", "<think>"] + [f"t{i}" for i in range(9, TINY.vocab_size)]

    def edit(w):
        w.kv_data[0]["tokenizer.ggml.pre"].value = pre
        w.kv_data[0]["tokenizer.ggml.token_type"].value = [3, 3, 3, 1, 1, 1, 1, 1, 4] + [1] * (TINY.vocab_size - 9)

    src = read_source(write_gguf(tmp_path / "m.gguf", random_source(TINY, rng), vocab=vocab, edit=edit))
    tok = Tokenizer.from_str(src.tokenizer_files["tokenizer.json"])
    assert tok.encode("abc", add_special_tokens=False).tokens == (["abc"] if pre == "llama-bpe" else ["ab", "c"])
    ids = tok.encode("t1<think>ab", add_special_tokens=False).ids
    assert ids == [1, 8, 5]
    assert tok.decode(ids, skip_special_tokens=True) == "<think>ab"


def test_truncated_gguf_is_a_clear_error(tmp_path, rng):
    path = write_gguf(tmp_path / "m.gguf", random_source(TINY, rng))
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match="not a readable GGUF"):
        read_source(path)


def test_cli_converts_and_reports_errors(tmp_path, rng, capsys):
    src_dir = write_hf_dir(tmp_path / "hf", random_source(TINY, rng), '{"stub": 1}')
    out = tmp_path / "out"
    assert cli.main([str(src_dir), str(out), "--group-size", "16", "--symmetric", "--rotate", "--seed", "5"]) == 0
    ck = load_checkpoint(out)
    assert ck.manifest["quantization"] == {"bits": 4, "group_size": 16, "symmetric": True, "method": "rtn"}
    assert ck.online_rotation_seed == 5
    assert cli.main([str(tmp_path / "missing"), str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main([str(src_dir), str(out), "--group-size", "7"]) == 2
    assert "group size" in capsys.readouterr().err
    assert cli.main([str(src_dir), str(out), "--quant", "gptq"]) == 2
    assert "calibration" in capsys.readouterr().err
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"question": "q", "answer": "a"}\n{"question": "no answer"}\n')
    gptq = [str(src_dir), str(tmp_path / "out_gptq"), "--quant", "gptq", "--calibration", str(calib)]
    assert cli.main(gptq) == 2
    assert "calib.jsonl:2" in capsys.readouterr().err
    for flag in ("--n-samples", "--seq-len"):
        assert cli.main([*gptq, flag, "0"]) == 2
        assert "n_samples >= 1 and seq_len >= 1" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert cli.main([str(src_dir), str(tmp_path / "a_file")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert cli.main([str(src_dir), str(tmp_path / "a_file" / "sub" / "out")]) == 2  # refused before converting
    assert "a_file is not a directory" in capsys.readouterr().err
    before = {f.name: f.read_bytes() for f in src_dir.iterdir()}
    assert cli.main([str(src_dir), str(src_dir)]) == 2  # would overwrite the source's model.safetensors
    assert "non-empty directory that is not a qspec-jax checkpoint" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in src_dir.iterdir()} == before
    assert cli.main([str(src_dir), str(out), "--rotate", "--seed", "-1"]) == 2
    assert "rotation seed must be an integer >= 0" in capsys.readouterr().err
    assert cli.main([str(src_dir), str(out), "--group-size", "16"]) == 0  # over an earlier checkpoint: allowed
    for flags in (["--group-size", "32"], ["--symmetric"], ["--asymmetric"]):  # would be ignored: refused
        with pytest.raises(SystemExit):
            cli.main([str(src_dir), str(tmp_path / "float"), "--quant", "none", *flags])
        assert "not with --quant none" in capsys.readouterr().err
    assert cli.main([str(src_dir), str(tmp_path / "float"), "--quant", "none"]) == 0
    assert load_checkpoint(tmp_path / "float").manifest["quantization"] is None
    for flags, msg in ((["--seed", "3"], "needs --rotate"), (["--calibration", str(calib)], "need --quant gptq"),
                       (["--n-samples", "8"], "need --quant gptq"), (["--seq-len", "64"], "need --quant gptq")):
        with pytest.raises(SystemExit):  # would be ignored: refused
            cli.main([str(src_dir), str(tmp_path / "ignored"), *flags])
        assert msg in capsys.readouterr().err
    foreign = tmp_path / "foreign"  # another tool's manifest.json beside someone's files
    foreign.mkdir()
    (foreign / MANIFEST).write_text('{"name": "their model"}')
    (foreign / "generation_config.json").write_text("{}")
    assert cli.main([str(src_dir), str(foreign)]) == 2
    assert "non-empty directory that is not a qspec-jax checkpoint" in capsys.readouterr().err
    assert sorted(f.name for f in foreign.iterdir()) == ["generation_config.json", MANIFEST]


def test_draft_vocab_ranks_the_calibration_tokens(tmp_path, rng, smollm2_tokenizer_json):
    """``--draft-vocab``: the checkpoint's ranking orders token ids by their count in the calibration
    texts (counted here with a Counter), ties and unseen ids by id; the manifest and the tensor must
    come together; a ranking that is not a permutation is refused."""
    from tokenizers import Tokenizer

    words = ["apples", "cost", "seven", "dollars", "each", "how", "many", "total", "Tom", "buys", "42", "+"]
    rows = [{"question": " ".join(rng.choice(words, int(rng.integers(3, 12)))),
             "answer": " ".join(rng.choice(words, int(rng.integers(1, 6))))} for _ in range(20)]
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_variant(vocab_size=49152)
    src_dir = write_hf_dir(tmp_path / "hf", random_source(cfg, rng), smollm2_tokenizer_json)
    out = tmp_path / "out"
    assert cli.main([str(src_dir), str(out), "--group-size", "16", "--draft-vocab", str(calib)]) == 0
    ck = load_checkpoint(out)
    tok = Tokenizer.from_str(smollm2_tokenizer_json)
    counts = collections.Counter()
    for r in rows:
        counts.update(tok.encode(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n",
                                 add_special_tokens=False).ids)
    seen = sorted(counts, key=lambda i: (-counts[i], i))
    want = seen + sorted(set(range(cfg.vocab_size)) - set(seen))
    np.testing.assert_array_equal(ck.draft_vocab, want)
    assert ck.manifest["draft_vocab"]["tokens_counted"] == sum(counts.values())
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["draft_vocab"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="draft_vocab"):
        load_checkpoint(out)
    bad = np.asarray(want, np.int32)
    bad[1] = bad[0]
    with pytest.raises(ValueError, match="permutation"):
        save_checkpoint(tmp_path / "bad", ck.params, cfg, {}, ranking=bad)


def test_gptq_layers_run_on_calibration_tokens(rng):
    """GPTQ conversion layer by layer (each layer's inputs from the quantized layers before it): every
    linear comes out packed with the scheme's group, and the first layer's qkv Hessian is ``X^T X``
    of the embedded calibration tokens' RMSNorm computed in float64 numpy."""
    src = random_source(TINY, rng)
    tokens = rng.integers(0, TINY.vocab_size, (4, 16))
    trees = [layer_tree(layer) for layer in src.layers]
    out = _gptq_layers(trees, src.embed, TINY, None, QuantScheme(16, False, "gptq"), tokens)
    assert len(out) == TINY.num_layers
    for tree in out:
        for a, b in LINEAR_PATHS:
            assert isinstance(tree[a][b]["w"], QuantizedWeight) and tree[a][b]["w"].group_size == 16
    x = np.asarray(src.embed, np.float64)[tokens]
    normed = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + TINY.rms_norm_eps)
    normed = normed * np.asarray(trees[0]["attn_norm"]["scale"], np.float64)
    positions = jnp.broadcast_to(jnp.arange(16), (4, 16))
    _, hess = _linear_inputs_hessians(_map_linears(trees[0], lambda _p, w: as_float(w)),
                                      jnp.asarray(src.embed)[tokens], positions, TINY, None)
    want = np.einsum("btk,btl->kl", normed, normed)
    np.testing.assert_allclose(np.asarray(hess[("attn", "qkv")], np.float64), want, rtol=1e-4,
                               atol=1e-4 * abs(want).max())


def _fake_checkpoint(dst, tag: str = "") -> None:
    from qspec_jax.checkpoint import FORMAT_VERSION

    Path(dst).mkdir()
    (Path(dst) / MANIFEST).write_text(json.dumps({"format_version": FORMAT_VERSION, "tag": tag}))


@pytest.mark.parametrize("content", ["{broken", "[]", '{"format_version": 0}'])
def test_embedded_cache_converted_again_when_unreadable(tmp_path, monkeypatch, content):
    """A cached conversion whose manifest is corrupt or of another format version is converted again,
    beside the target and renamed into place; a temp dir a killed process left is removed (the
    conversion itself stubbed: it is tested above)."""
    import convert.pipeline
    from convert import embedded

    monkeypatch.setenv("QSPEC_JAX_CACHE", str(tmp_path))
    out, lock = tmp_path / "smollm2-rtn-asym-g32", tmp_path / "smollm2-rtn-asym-g32.lock"
    out.mkdir()
    (out / "stale.bin").write_text("")
    (out / MANIFEST).write_text(content)
    (tmp_path / ".smollm2-rtn-asym-g32.killed").mkdir()
    calls = []

    def fake_convert(src, dst, scheme, seed):
        calls.append(Path(dst))
        _fake_checkpoint(dst)

    monkeypatch.setattr(convert.pipeline, "convert", fake_convert)
    assert embedded.default_checkpoint() == out
    assert len(calls) == 1 and calls[0].parent.parent == tmp_path  # converted beside the target
    assert not (out / "stale.bin").exists() and sorted(tmp_path.iterdir()) == [out, lock]  # temp dirs removed
    assert embedded.default_checkpoint() == out and len(calls) == 1  # now current: kept


def test_embedded_cache_conversion_waits_for_another_process(tmp_path, monkeypatch):
    """A process that finds the conversion missing while another one converts waits for its lock and
    then uses that conversion; a failed conversion leaves no checkpoint and no temp dir behind."""
    import threading

    import convert.pipeline
    from filelock import FileLock
    from convert import embedded

    monkeypatch.setenv("QSPEC_JAX_CACHE", str(tmp_path))
    out, lock = tmp_path / "smollm2-rtn-asym-g32", tmp_path / "smollm2-rtn-asym-g32.lock"
    calls, got = [], []
    monkeypatch.setattr(convert.pipeline, "convert", lambda src, dst, *a: calls.append(dst))
    other = FileLock(lock)  # the other process, converting
    other.acquire()
    waiter = threading.Thread(target=lambda: got.append(embedded.default_checkpoint()))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not got  # waits for the lock
    _fake_checkpoint(out, "other process")
    other.release()
    waiter.join(10)
    assert got == [out] and calls == []  # the other process's conversion, used as it is
    assert json.loads((out / MANIFEST).read_text())["tag"] == "other process"

    shutil.rmtree(out)

    def failing_convert(src, dst, scheme, seed):
        Path(dst).mkdir()
        raise RuntimeError("disk full")

    monkeypatch.setattr(convert.pipeline, "convert", failing_convert)
    with pytest.raises(RuntimeError, match="disk full"):
        embedded.default_checkpoint()
    assert list(tmp_path.iterdir()) == [lock]
