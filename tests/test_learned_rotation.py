"""Learned rotations: orthogonality, float invariance of the converted checkpoint, the training loss,
the manifest record and the matrix saved with the checkpoint, and bad options."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from convert import cli
from convert.learn_rotation import LearnedRotation, LearnOptions, learn_rotation, rotated_logits, folded_weights
from convert.pipeline import convert_model
from convert.quantize import QuantScheme
from convert.rotate import rotate
from qspec_jax.checkpoint import MANIFEST, load_checkpoint
from qspec_jax.rotation import random_hadamard
from qspec_jax.api import generate
from tests.conftest import TINY, jit_forward, memory_model, random_source, write_gguf
from pallas_kernels.precision import W16A16

SCHEME = QuantScheme(16, False)  # divides the tiny model's 48 and 80 input features


def _logits(params, config, tokens, seed=None):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(jit_forward(params, config, jnp.asarray(tokens), pos, precision=W16A16,
                                  online_rotation_seed=seed)[0])


@pytest.fixture(scope="module")
def trained():
    """A tiny random model, its calibration tokens and an R1 trained on them (every step on all of them).
    Every embedding carries an outlier along the direction the starting Hadamard maps onto one channel,
    as outlier features in real models: W4A4 loses that token's other channels until R1 turns away."""
    rng = np.random.default_rng()
    seed = int(rng.integers(2**31))
    print(f"trained: seed {seed}")
    src = random_source(TINY, rng)
    # an outlier of 24 and 24 steps: with a smaller outlier or fewer steps the loss's rounding noise can hide
    # the descent on some seeds
    src.embed[:] += 24 * random_hadamard(TINY.hidden_size, seed)[:, 0]
    tokens = rng.integers(0, TINY.vocab_size, (4, 24))
    learned = learn_rotation(src, tokens, SCHEME, seed, LearnOptions(steps=24, lr=1e-2, n_samples=4, seq_len=24,
                                                                     batch=4), progress=False)
    return src, tokens, seed, learned


def test_learned_rotation_is_orthogonal_and_moved_from_its_hadamard(trained):
    src, _, seed, learned = trained
    r = learned.matrix
    assert r.dtype == np.float64 and r.shape == (TINY.hidden_size,) * 2
    np.testing.assert_allclose(r.T @ r, np.eye(TINY.hidden_size), atol=1e-12)
    assert np.abs(r - random_hadamard(TINY.hidden_size, seed)).max() > 1e-3
    d = TINY.hidden_size // TINY.num_heads
    heads = learned.heads  # R2: one value-head rotation per layer, trained from the identity
    assert heads.dtype == np.float64 and heads.shape == (TINY.num_layers, d, d)
    for r2 in heads:
        np.testing.assert_allclose(r2.T @ r2, np.eye(d), atol=1e-12)
        assert np.abs(r2 - np.eye(d)).max() > 1e-4


def test_training_lowers_the_loss(trained):
    loss = trained[3].record["loss"]
    assert len(loss) == 24 and all(np.isfinite(loss))
    # the quantized loss jumps as roundings flip (a tiny model has few channels): the best step, and the
    # second half's best, not each step
    assert min(loss[1:]) < 0.99 * loss[0] and min(loss[12:]) < loss[0], loss


def test_training_forward_is_the_model(trained, rng):
    """The training forward without quantization, rotated by R1 (and R2) or not, gives the model's float logits."""
    src, tokens, seed, learned = trained
    params, cfg, _ = convert_model(src, None, None)
    want = _logits(params, cfg, tokens)
    w = folded_weights(src, seed)
    r1, r2 = jnp.asarray(learned.matrix, jnp.float32), jnp.asarray(learned.heads, jnp.float32)
    for r, heads in ((None, None), (r1, None), (r1, r2), (None, r2)):
        got = np.asarray(rotated_logits(w, r, jnp.asarray(tokens), TINY, seed, None, (None,), heads)[0])
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_learned_checkpoint_keeps_the_float_logits(trained, tmp_path):
    src, tokens, seed, learned = trained
    plain, cfg, _ = convert_model(src, None, None)
    rotated, rcfg, manifest = convert_model(src, None, seed, learned=learned)
    assert manifest["rotation"]["kind"] == "learned" and manifest["rotation"]["learned"] == learned.record
    assert not np.allclose(rotated["embed"], plain["embed"])
    a, b = _logits(plain, cfg, tokens), _logits(rotated, rcfg, tokens, seed)
    np.testing.assert_allclose(b, a, atol=1e-4 * np.abs(a).max())


def test_rotate_refuses_a_matrix_that_is_not_orthogonal(rng):
    src = random_source(TINY, rng)
    r = random_hadamard(TINY.hidden_size, 0)
    with pytest.raises(ValueError, match="not orthogonal"):
        rotate(src, 0, r * 1.01)
    with pytest.raises(ValueError, match="float64 48 x 48"):
        rotate(src, 0, r[:, :40])


@pytest.mark.parametrize("options, match", [
    (dict(steps=0), "steps must be an integer >= 1"), (dict(lr=0.0), "lr must be a number in"),
    (dict(lr=5.0), "lr must be a number in"), (dict(n_samples=2.5), "n_samples must be an integer"),
    (dict(seq_len=1), "seq_len must be >= 2"), (dict(batch=True), "batch must be an integer")])
def test_bad_options_are_clear_errors(options, match):
    with pytest.raises(ValueError, match=match):
        LearnOptions(**options)


def test_bad_calibration_tokens_are_clear_errors(rng):
    src = random_source(TINY, rng)
    for tokens, match in ((np.zeros((2, 1), np.int32), r"\[n >= 1, seq_len >= 2\]"),
                          (np.full((2, 8), TINY.vocab_size), "must lie in"), (np.zeros((2, 8)), "integers")):
        with pytest.raises(ValueError, match=match):
            learn_rotation(src, tokens, SCHEME, 0, LearnOptions(steps=1), progress=False)


def _calibration(path):
    words = ["a", "b", "ab"]
    rows = [{"question": " ".join(words[(i + j) % 3] for j in range(9)), "answer": " ".join(words[(i * j) % 3]
            for j in range(12))} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_learned_rotation_checkpoint(tmp_path, rng, capsys):
    """qspec-convert --rotate learned: the matrix saved with the checkpoint, the manifest's record, and
    a manifest whose record is broken refused."""
    gguf = write_gguf(tmp_path / "m.gguf", random_source(TINY, rng))
    calib = _calibration(tmp_path / "calib.jsonl")
    seed = int(rng.integers(2**20))
    out = tmp_path / "out"
    args = [str(gguf), str(out), "--group-size", "16", "--rotate", "learned", "--seed", str(seed),
            "--calibration", str(calib), "--rotation-steps", "3", "--rotation-samples", "4",
            "--rotation-seq-len", "16", "--rotation-lr", "0.002"]
    assert cli.main(args) == 0
    ck = load_checkpoint(out)
    rot = ck.manifest["rotation"]
    assert rot["kind"] == "learned" and rot["seed"] == seed and ck.online_rotation_seed == seed
    rec = rot["learned"]
    assert (rec["steps"], rec["lr"], rec["seed"], rec["n_samples"], rec["seq_len"]) == (3, 0.002, seed, 4, 16)
    assert rec["calibration"] == str(calib.resolve()) and len(rec["loss"]) == 3
    np.testing.assert_allclose(ck.rotation_matrix.T @ ck.rotation_matrix, np.eye(TINY.hidden_size), atol=1e-12)
    assert rec["head_rotations"] is True and ck.head_rotations.shape[0] == TINY.num_layers
    for r2 in ck.head_rotations:
        np.testing.assert_allclose(r2.T @ r2, np.eye(r2.shape[0]), atol=1e-12)
    hadamard = tmp_path / "had"
    assert cli.main([str(gguf), str(hadamard), "--group-size", "16", "--rotate", "--seed", str(seed)]) == 0
    plain = load_checkpoint(hadamard)
    assert plain.manifest["rotation"]["kind"] == "randomized-hadamard" and plain.rotation_matrix is None
    m = json.loads((out / MANIFEST).read_text())
    m["rotation"]["learned"]["steps"] = 0
    (out / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match="learned rotation's 'steps' must be a int >= 1"):
        load_checkpoint(out)
    m["rotation"] = {"seed": seed, "online": True, "kind": "randomized-hadamard"}  # the matrix left behind
    (out / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match="come together or not at all"):
        load_checkpoint(out)
    m["rotation"]["kind"] = "spin"
    (out / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match="rotation 'kind' must be one of"):
        load_checkpoint(out)


def test_cli_refuses_bad_learned_rotation_flags(tmp_path, rng, capsys):
    gguf = write_gguf(tmp_path / "m.gguf", random_source(TINY, rng))
    calib = _calibration(tmp_path / "calib.jsonl")
    base = [str(gguf), str(tmp_path / "out"), "--group-size", "16"]
    for flags, msg in ((["--rotate", "--rotation-steps", "3"], "need --rotate learned"),
                       (["--rotation-lr", "0.1"], "need --rotate learned"),
                       (["--rotate", "spin"], "invalid choice"),
                       (["--rotate", "learned", "--n-samples", "4"], "need --quant gptq")):
        with pytest.raises(SystemExit):
            cli.main([*base, *flags])
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a bare --rotate before the positionals would take SRC as its kind
        cli.main(["--rotate", *base])
    assert "a bare --rotate goes after SRC OUT" in capsys.readouterr().err
    for flags, msg in ((["--rotate", "learned"], "needs calibration data"),
                       (["--rotate", "learned", "--calibration", str(calib), "--rotation-steps", "0"],
                        "steps must be an integer >= 1"),
                       (["--rotate", "learned", "--calibration", str(calib), "--rotation-lr", "2"],
                        "lr must be a number in (0, 1)")):
        assert cli.main([*base, *flags]) == 2
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_learned_rotation_record_is_reused(trained):
    """An R1 and R2 trained before fold without training again (as the quality bench reuses them)."""
    src, _, seed, learned = trained
    again = LearnedRotation(learned.matrix.copy(), dict(learned.record), learned.heads.copy())
    a, _, _ = convert_model(src, SCHEME, seed, learned=learned)
    b, _, _ = convert_model(src, SCHEME, seed, learned=again)
    assert all(np.array_equal(x.packed, y.packed) for x, y in
               zip((a["layers"]["attn"]["qkv"]["w"],), (b["layers"]["attn"]["qkv"]["w"],)))


def test_greedy_qspec_with_w4a4_drafts_equals_w4a16_on_a_learned_rotation(trained, rng):
    """On a checkpoint with the learned R1 and R2 folded in (online transforms on), greedy QSPEC with W4A4
    drafts commits bitwise the W4A16 tokens, and some drafts are accepted."""
    src, _, seed, learned = trained
    params, config, _ = convert_model(src, SCHEME, seed, learned=learned)
    model = memory_model(params, config, rotation_seed=seed)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 11, 8)]
    ref = generate(model, prompts, max_new_tokens=24, method="w4a16", eos_token_id=-1)
    got = generate(model, prompts, max_new_tokens=24, method="qspec", draft="w4a4", gamma=3, eos_token_id=-1)
    for i, (a, b) in enumerate(zip(got.sequences, ref.sequences)):
        assert np.array_equal(a, b), f"sequence {i}: {a} != {b}"
    assert got.stats["accepted"] > 0, got.stats
