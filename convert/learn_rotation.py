"""Learned rotations (SpinQuant's R1 and R2): optimize an orthogonal residual-stream ``R`` and, per
layer, an orthogonal ``R2`` of the value heads so that the fake-quantized rotated model matches the
float model's next-token distribution.

``R = R0 @ cayley(A)``: ``R0`` the randomized Hadamard of the plain rotation, ``A`` skew-symmetric
(``P - P^T``, ``P`` trained with optax: SGD with momentum on the normalized gradient), so ``R`` stays
exactly orthogonal for any ``P``; ``R2 = cayley(A2)`` per layer, from the identity: ``v_proj``'s output
heads become ``v R2`` and ``o_proj`` reads them back through ``R2^T`` (before its online transform),
so the float model is unchanged while its v / o weights and o's W4A4 input are quantized in the new
basis. The
loss is ``KL(float || W4A4) + KL(float || W4A16)`` on calibration tokens: weights rounded to the
checkpoint's INT4 scheme (RTN), W4A4 activations per token to INT4, straight-through rounding with
scales that follow their inputs. RMSNorm scales and the online transforms (o_proj input per head,
down_proj input) are folded as :mod:`convert.rotate` does, so the trained model is the converted one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from convert.quantize import QuantScheme
from convert.sources import SourceModel, as_float
from qspec_jax.config import LlamaConfig
from qspec_jax.model import apply_rope, rope_frequencies, rope_tables
from qspec_jax.rotation import apply_transform, random_hadamard, transform_matrix
from pallas_kernels import reference


@dataclasses.dataclass(frozen=True)
class LearnOptions:
    """How R1 is trained: optimizer steps, learning rate (the length of a step in ``P`` before momentum,
    cosine-decayed), calibration sequences (``n_samples`` of ``seq_len`` tokens, ``batch`` per step)."""

    steps: int = 100
    lr: float = 3e-3
    n_samples: int = 128
    seq_len: int = 128
    batch: int = 2

    def __post_init__(self):
        for name in ("steps", "n_samples", "seq_len", "batch"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"learned rotation: {name} must be an integer >= 1, got {value!r}")
        if self.seq_len < 2:
            raise ValueError(f"learned rotation: seq_len must be >= 2 (a next token to predict), got {self.seq_len}")
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not 0 < self.lr < 1:
            raise ValueError(f"learned rotation: lr must be a number in (0, 1), got {self.lr!r}")


@dataclasses.dataclass(frozen=True)
class LearnedRotation:
    """A trained R1 (float64 ``[hidden, hidden]``, orthogonal), the value-head rotations R2 (float64
    ``[layers, head_dim, head_dim]``, orthogonal; None: none) and the manifest record of the training."""

    matrix: np.ndarray
    record: dict[str, Any]
    heads: np.ndarray | None = None


def _ste_round(x: jax.Array) -> jax.Array:
    """Round in the forward pass, identity in the backward pass."""
    return x + jax.lax.stop_gradient(jnp.round(x) - x)


def fake_quant_weight(w: jax.Array, scheme: QuantScheme) -> jax.Array:
    """RTN INT4 of ``w[N, K]`` per (row, group) as :func:`convert.quantize.quantize_rtn` rounds it."""
    n, k = w.shape
    g = scheme.group_for(k)
    wg = w.reshape(n, k // g, g)
    lo, hi = wg.min(-1, keepdims=True), wg.max(-1, keepdims=True)
    if scheme.symmetric:
        s = jnp.maximum(hi / 7.0, -lo / 8.0)
        s = jnp.where(s > 0, s, 1.0)
        q = jnp.clip(_ste_round(wg / s), -8, 7) * s
    else:
        s = jnp.where(hi > lo, (hi - lo) / 15.0, 1.0)
        q = jnp.clip(_ste_round((wg - lo) / s), 0, 15) * s + lo
    return q.reshape(n, k)


def fake_quant_acts(x: jax.Array, bits: int | None) -> jax.Array:
    """Per-token symmetric ``bits``-bit activations as :func:`pallas_kernels.reference.quantize_activations`
    computes them (None: float)."""
    if bits is None:
        return x
    qmax = 2 ** (bits - 1) - 1
    absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    s = jnp.where(absmax > 0, absmax / qmax, 1.0)
    return jnp.clip(_ste_round(x / s), -qmax - 1, qmax) * s


def folded_weights(src: SourceModel, seed: int) -> dict[str, Any]:
    """The source's weights with norm scales and online transforms folded in, not yet rotated (float32):
    ``x`` rows enter ``qkv``/``gate_up`` as ``x @ R @ W.T``; ``o``/``down`` write ``(. @ W.T) @ R``."""
    c = src.config
    t_o = np.kron(np.eye(c.num_heads), transform_matrix(c.head_dim, seed))
    t_d = transform_matrix(c.intermediate_size, seed)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    layers = []
    for layer in src.layers:
        ga, gm = (as_float(layer[n]).astype(np.float64) for n in ("attn_norm", "mlp_norm"))
        tree = {"qkv": f32(np.concatenate([as_float(layer[n]) * ga for n in ("q", "k", "v")])),
                "o": f32(as_float(layer["o"]) @ t_o),
                "gate_up": f32(np.concatenate([as_float(layer[n]) * gm for n in ("gate", "up")])),
                "down": f32(as_float(layer["down"]) @ t_d)}
        if "q_bias" in layer:
            tree["qkv_bias"] = f32(np.concatenate([as_float(layer[n]) for n in ("q_bias", "k_bias", "v_bias")]))
        layers.append(tree)
    head = src.embed if src.lm_head is None else src.lm_head
    return {"embed": f32(src.embed), "head": f32(head * as_float(src.final_norm)),
            "layers": jax.tree.map(lambda *xs: np.stack(xs), *layers)}


def _norm(x: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def head_rotated(lw: dict[str, Any], r2: jax.Array, config: LlamaConfig, seed: int) -> dict[str, Any]:
    """A folded layer's weights with its value heads rotated by ``r2`` ``[d, d]``: v rows (and bias) per KV
    head ``R2^T W_v``, o's columns per query head ``W_o R2`` under the online transform ``T`` (``o`` holds
    ``W_o T`` per head, so it becomes ``o T^T R2 T``)."""
    c = config
    hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
    t = jnp.asarray(transform_matrix(d, seed), r2.dtype)
    split = [hq * d, (hq + hk) * d]
    q, k, v = jnp.split(lw["qkv"], split, axis=0)
    v = jnp.einsum("ji,hjk->hik", r2, v.reshape(hk, d, -1)).reshape(hk * d, -1)
    out = {**lw, "qkv": jnp.concatenate([q, k, v], axis=0)}
    o = lw["o"].reshape(lw["o"].shape[0], hq, d)
    out["o"] = jnp.einsum("nhj,jk->nhk", o, t.T @ r2 @ t).reshape(lw["o"].shape)
    if "qkv_bias" in lw:
        bq, bk, bv = jnp.split(lw["qkv_bias"], split)
        out["qkv_bias"] = jnp.concatenate([bq, bk, (bv.reshape(hk, d) @ r2).reshape(-1)])
    return out


def rotated_logits(weights: dict[str, Any], r: jax.Array | None, tokens: jax.Array, config: LlamaConfig, seed: int,
                   scheme: QuantScheme | None, act_bits: tuple[int | None, ...],
                   heads: jax.Array | None = None) -> list[jax.Array]:
    """Logits ``[B, T, V]`` of the model rotated by ``r`` (None: unrotated) and its value heads by
    ``heads`` ``[layers, d, d]`` (None: not), one per entry of ``act_bits`` (activation bits of the decoder
    linears, None = float); ``scheme``: weights fake-quantized (None: float). The streams share each
    layer's rotated weights."""
    c = config
    b, t = tokens.shape
    hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cos, sin = rope_tables(positions, rope_frequencies(c), jnp.float32)
    x = jnp.take(weights["embed"], tokens, axis=0)
    x = x if r is None else x @ r
    rin = (lambda w: w) if r is None else (lambda w: w @ r)  # noqa: E731  W [N, D] reading the rotated stream
    rout = (lambda w: w) if r is None else (lambda w: r.T @ w)  # noqa: E731  W [D, K] writing it
    wq = (lambda w: w) if scheme is None else (lambda w: fake_quant_weight(w, scheme))  # noqa: E731

    def mm(h, w, bits):
        return fake_quant_acts(h, bits) @ w.T

    @jax.checkpoint
    def layer(xs, scanned):
        lw, r2 = scanned
        lw = lw if r2 is None else head_rotated(lw, r2, c, seed)
        w_qkv, w_o, w_gu, w_down = wq(rin(lw["qkv"])), wq(rout(lw["o"])), wq(rin(lw["gate_up"])), wq(rout(lw["down"]))
        out = []
        for x_i, bits in zip(xs, act_bits):
            qkv = mm(_norm(x_i, c.rms_norm_eps), w_qkv, bits) + lw.get("qkv_bias", 0.0)
            q, k, v = jnp.split(qkv, [hq * d, (hq + hk) * d], axis=-1)
            q, k = apply_rope(q.reshape(b, t, hq, d), cos, sin), apply_rope(k.reshape(b, t, hk, d), cos, sin)
            a = reference.attention(q, k, v.reshape(b, t, hk, d), positions, positions)
            a = apply_transform(a, seed).reshape(b, t, hq * d)
            x_i = x_i + mm(a, w_o, bits)
            g, u = jnp.split(mm(_norm(x_i, c.rms_norm_eps), w_gu, bits), 2, axis=-1)
            x_i = x_i + mm(apply_transform(jax.nn.silu(g) * u, seed), w_down, bits)
            out.append(x_i)
        return tuple(out), None

    xs, _ = jax.lax.scan(layer, tuple(x for _ in act_bits), (weights["layers"], heads))
    # the rotated lm_head is head @ r: un-rotate the normalized stream instead of rotating the head
    return [(_norm(x_i, c.rms_norm_eps) if r is None else _norm(x_i, c.rms_norm_eps) @ r.T) @ weights["head"].T
            for x_i in xs]


def cayley(a: jax.Array) -> jax.Array:
    """``(I - A)^-1 (I + A)``: orthogonal for skew-symmetric ``A``."""
    eye = jnp.eye(a.shape[0], dtype=a.dtype)
    return jnp.linalg.solve(eye - a, eye + a)


def rotation_of(r0: np.ndarray, p: np.ndarray) -> np.ndarray:
    """``R0 @ cayley(P - P^T)`` in float64 (``p`` may carry leading axes, ``r0`` broadcasts): the trained
    rotation, orthogonal to float64 rounding."""
    p = np.asarray(p, np.float64)
    a = p - np.swapaxes(p, -1, -2)
    eye = np.broadcast_to(np.eye(a.shape[-1]), a.shape)
    return np.asarray(r0, np.float64) @ np.linalg.solve(eye - a, eye + a)


def _kl(teacher_logp: jax.Array, logits: jax.Array) -> jax.Array:
    """Mean over tokens of ``KL(teacher || student)``."""
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - logq), axis=-1))


DRAFT_BITS = (4, None)  # the student streams: W4A4 (the draft) and W4A16 (the verifier)


def learn_rotation(src: SourceModel, tokens: np.ndarray, scheme: QuantScheme, seed: int, options: LearnOptions,
                   progress: bool = True) -> LearnedRotation:
    """Train R1 for ``src`` on calibration ``tokens[n, seq_len]`` (int), starting from the randomized
    Hadamard of ``seed`` (``seed`` also orders the batches); weights fake-quantized in ``scheme``."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"calibration tokens must be integers [n >= 1, seq_len >= 2], got {tokens.dtype} "
                         f"{tokens.shape}")
    if tokens.min() < 0 or tokens.max() >= src.config.vocab_size:
        raise ValueError(f"calibration token ids must lie in [0, {src.config.vocab_size})")
    c = src.config
    weights = jax.device_put(folded_weights(src, seed))
    r0_exact = random_hadamard(c.hidden_size, seed)
    r0 = jnp.asarray(r0_exact, jnp.float32)
    # steps of norm lr (the gradient's direction, not Adam's per-entry scaling, which spreads the noise of small
    # batches over every entry of P) with momentum averaging the batches
    opt = optax.chain(optax.normalize_by_update_norm(),
                      optax.sgd(optax.cosine_decay_schedule(options.lr, options.steps), momentum=0.9))

    def loss_fn(p, batch):
        teacher = rotated_logits(weights, None, batch, c, seed, None, (None,))[0]
        teacher_logp = jax.lax.stop_gradient(jax.nn.log_softmax(teacher, axis=-1))
        p1, p2 = p
        r = r0 @ cayley(p1 - p1.T)
        heads = jax.vmap(cayley)(p2 - jnp.swapaxes(p2, -1, -2))
        students = rotated_logits(weights, r, batch, c, seed, scheme, DRAFT_BITS, heads)
        return sum(_kl(teacher_logp, s) for s in students)

    @jax.jit
    def step(p, state, batch):
        loss, grad = jax.value_and_grad(loss_fn)(p, batch)
        updates, state = opt.update(grad, state, p)
        return optax.apply_updates(p, updates), state, loss

    p = (jnp.zeros((c.hidden_size, c.hidden_size), jnp.float32),
         jnp.zeros((c.num_layers, c.head_dim, c.head_dim), jnp.float32))
    state = opt.init(p)
    order = np.random.default_rng(seed)
    losses = []
    start = time.time()
    bar = tqdm(range(options.steps), desc="learning R1, R2", unit="step", disable=not progress)
    for _ in bar:
        rows = order.choice(len(tokens), min(options.batch, len(tokens)), replace=False)
        p, state, loss = step(p, state, jnp.asarray(tokens[rows], jnp.int32))
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    record = {"method": "cayley-sgd-momentum", "objective": "kl(w16a16 || w4a4) + kl(w16a16 || w4a16)",
              "steps": options.steps, "lr": options.lr, "seed": seed, "n_samples": int(len(tokens)),
              "seq_len": int(tokens.shape[1]), "batch": options.batch,
              "weights": {"group_size": scheme.group_size, "symmetric": scheme.symmetric},
              "head_rotations": True, "loss": [round(v, 6) for v in losses], "seconds": round(time.time() - start, 1)}
    return LearnedRotation(rotation_of(r0_exact, np.asarray(p[0])), record, rotation_of(np.eye(c.head_dim), p[1]))
