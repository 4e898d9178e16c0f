"""The ops layer: every op the model calls, each picking the jnp reference or a Pallas kernel.

How an op runs is one static :class:`Execution`: a resolved ``backend`` (``"reference"``:
:mod:`pallas_kernels.reference` and jnp ops everywhere, ``"pallas"``: the GPU kernels,
``"interpret"``: the same kernels run by Pallas' interpreter, how the CPU tests run them) and a
``row_tile``. The user-facing ``kernels`` switch (:data:`KERNELS`; ``"auto"``: the Pallas kernels on
a GPU, the references elsewhere) is resolved into it once, at the API boundary. The kernels serve
the decode-time calls, the ones made with a ``row_tile`` (decode steps, draft steps, verify passes),
where a token's result must not depend on how many tokens share the call; prefill and evaluation
(no ``row_tile``) run the reference math, on the ``"pallas"`` backend with the W4A16 product as an XLA
bfloat16 dot (the same products, float32 accumulation) and the prefill's attention as cuDNN's flash
attention. A shape a kernel cannot tile (e.g. a head_dim that is not a
power of two, a dimension not a multiple of 16) runs the fixed-tile reference instead: still
row-count invariant, slower on a GPU.

On the kernel path the RMSNorm, the SwiGLU and the attention merge return a lazy :class:`Pending`
step: :func:`linear` fuses it into an INT4 kernel's activation prologue, any other consumer (a float
linear, the online rotation) computes it with :func:`materialize`, the same computation as the op
run eagerly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import gpu_activations, gpu_attention, gpu_matmul, gpu_norm, gpu_rope, reference
from pallas_kernels.launch import check_layer
from pallas_kernels.layout import QuantizedWeight, dequantize, w4a16_weights
from pallas_kernels.precision import W4A16, Precision
from pallas_kernels.rows import map_row_tiles

BACKENDS = ("reference", "pallas", "interpret")
KERNELS = ("auto", *BACKENDS)
ROW_TILE = 8  # row tile of every decode-time forward (row-count invariance, pallas_kernels/rows.py)


def resolve_kernels(kernels: str) -> str:
    """``kernels`` with ``"auto"`` replaced by ``"pallas"`` on a GPU and ``"reference"`` elsewhere."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; expected one of {KERNELS}")
    if kernels == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return kernels


@dataclasses.dataclass(frozen=True)
class Execution:
    """How a forward runs its ops (hashable: a static argument of jitted functions). ``backend``: one
    of :data:`BACKENDS` (resolved, never ``"auto"``); ``row_tile``: every token's result independent
    of how many tokens share the call (decode-time forwards), ``None`` for prefill and evaluation,
    which then never take the kernels."""

    backend: str = "reference"
    row_tile: int | None = None
    # a prompt's forward: every row's positions exactly 0..T-1 (the caller's promise; forward checks them
    # where they are known), so attention runs causally over the new keys alone (:func:`attention`)
    causal_prompt: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {BACKENDS} (resolve 'auto' with "
                             "Execution.decode / Execution.prefill)")
        if self.row_tile is not None and (not isinstance(self.row_tile, int) or self.row_tile < 1):
            raise ValueError(f"row_tile must be a positive integer or None, got {self.row_tile!r}")
        if self.causal_prompt and self.row_tile is not None:
            raise ValueError("a causal_prompt forward has no row tile (use Execution.for_prompt)")

    @classmethod
    def decode(cls, kernels: str = "auto", row_tile: int = ROW_TILE) -> Execution:
        """Decode-time forwards (row-count invariant) with ``kernels`` resolved."""
        return cls(resolve_kernels(kernels), row_tile)

    @classmethod
    def prefill(cls, kernels: str = "auto") -> Execution:
        """Prefill / evaluation forwards (no row tile) with ``kernels`` resolved."""
        return cls(resolve_kernels(kernels), None)

    def for_prompt(self) -> Execution:
        """The same backend for a prefill beside these decode steps: no row tile, ``causal_prompt`` (so
        only for a forward whose positions are 0..T-1 in every row)."""
        return dataclasses.replace(self, row_tile=None, causal_prompt=True)

    @property
    def on_kernels(self) -> bool:
        """Ops may run the Pallas kernels (which need a row tile's decode-time call)."""
        return self.backend != "reference" and self.row_tile is not None

    @property
    def interpret(self) -> bool:
        return self.backend == "interpret"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:
    """Layer ``index`` of ``stacked``, a per-layer array (or :class:`QuantizedWeight`) stacked along
    axis 0, left unsliced: the INT4 matmul, attention and RMSNorm kernels read it in place (a slice
    handed to a kernel would be copied out first, every weight and the KV cache once per decode
    step); the references and the float (W16A16, dense) paths slice it."""

    stacked: Any
    index: jax.Array

    def get(self) -> Any:
        """The layer's own arrays (a slice: what the reference implementations take)."""
        check_layer(self.index, jax.tree.leaves(self.stacked)[0].shape[0])
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.index, keepdims=False), self.stacked)


def layer_view(tree: Any, index: jax.Array) -> Any:
    """``tree`` (stacked weights, or a KV cache) with every array leaf a :class:`Layer` view at
    ``index``; packed weights stay whole leaves."""
    return jax.tree.map(lambda a: Layer(a, index), tree, is_leaf=lambda a: isinstance(a, QuantizedWeight))


def stacked_of(tree: Any) -> Any:
    """The inverse of :func:`layer_view`: the stacked arrays back in ``tree``'s structure."""
    return jax.tree.map(lambda v: v.stacked, tree, is_leaf=lambda a: isinstance(a, Layer))


class Pending:
    """A step not yet computed: on the kernel path an INT4 linear layer runs it fused with its
    activation prologue (:mod:`pallas_kernels.gpu_activations`: the W4AX quantization,
    :meth:`quantized`, or the W4A16 bf16 planes, :meth:`planes`); any other consumer computes it
    first (:func:`materialize`). Quacks like the array it stands for (``shape``, ``dtype``)."""

    shape: tuple[int, ...]
    dtype: Any

    def value(self) -> jax.Array:
        raise NotImplementedError

    def planes(self) -> jax.Array:
        raise NotImplementedError

    def quantized(self, bits: int) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError


def materialize(x: jax.Array | Pending) -> jax.Array:
    """``x`` computed: the same computation as the op that deferred it run eagerly."""
    return x.value() if isinstance(x, Pending) else x


class _OnRows(Pending):
    """A :class:`Pending` step of an array ``x`` (its rows, ``x[..., K]`` as ``[M, K]``)."""

    x: jax.Array

    @property
    def dtype(self) -> Any:
        return self.x.dtype

    def rows(self) -> jax.Array:
        return self.x.reshape(-1, self.x.shape[-1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingNorm(_OnRows):
    """The RMSNorm of ``x``."""

    x: jax.Array
    scale: Any  # [H] or a Layer of stacked scales
    eps: float = dataclasses.field(metadata=dict(static=True))
    execution: Execution = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.x.shape

    def value(self) -> jax.Array:
        return _rms_norm_now(self.x, self.scale, self.eps, self.execution)

    def _norm(self) -> dict:
        scale, layer = _split_layer(self.scale)
        return dict(scale=scale, eps=self.eps, layer=layer, interpret=self.execution.interpret)

    def planes(self) -> jax.Array:
        return gpu_activations.rms_norm_planes(self.rows(), **self._norm())

    def quantized(self, bits: int) -> tuple[jax.Array, jax.Array]:
        return gpu_activations.rms_norm_quantize(self.rows(), bits=bits, **self._norm())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingSwiGLU(_OnRows):
    """The MLP's ``silu(gate) * up`` (:func:`pallas_kernels.reference.swiglu`) of ``x = [gate | up]``."""

    x: jax.Array
    execution: Execution = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.x.shape[:-1], self.x.shape[-1] // 2)

    def value(self) -> jax.Array:
        return reference.swiglu(*jnp.split(self.x, 2, axis=-1))

    def planes(self) -> jax.Array:
        return gpu_activations.swiglu_planes(self.rows(), interpret=self.execution.interpret)

    def quantized(self, bits: int) -> tuple[jax.Array, jax.Array]:
        return gpu_activations.swiglu_quantize(self.rows(), bits, interpret=self.execution.interpret)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingAttention(Pending):
    """The attention output as rows ``[B, T, H * d]``, its cache splits not yet merged
    (:class:`pallas_kernels.gpu_attention.Partials`)."""

    partials: gpu_attention.Partials
    execution: Execution = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        b, t, h, d = self.partials.shape
        return (b, t, h * d)

    @property
    def dtype(self) -> Any:
        return self.partials.dtype

    def value(self) -> jax.Array:
        return gpu_attention.merge(self.partials).reshape(self.shape)

    def planes(self) -> jax.Array:
        return gpu_activations.attention_planes(self.partials, interpret=self.execution.interpret)

    def quantized(self, bits: int) -> tuple[jax.Array, jax.Array]:
        return gpu_activations.attention_quantize(self.partials, bits, interpret=self.execution.interpret)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitSum:
    """A linear layer's float32 result not yet summed over its K splits nor rounded, for a consumer
    kernel that adds and rounds it itself (:func:`rope_store`):
    :func:`pallas_kernels.reference.split_sum` of ``parts [S, ..., N]`` (one part where K is not
    split) and the W4AX row ``scale [..., 1]`` (None where the parts are already scaled)."""

    parts: jax.Array
    scale: jax.Array | None


def unstack(v: Any) -> Any:
    """``v.get()`` for a :class:`Layer`, ``v`` itself otherwise."""
    return v.get() if isinstance(v, Layer) else v


def _split_layer(v: Any) -> tuple[Any, jax.Array | None]:
    return (v.stacked, v.index) if isinstance(v, Layer) else (v, None)


def _matmul_supported(w: QuantizedWeight | jax.Array, precision: Precision) -> bool:
    if not isinstance(w, QuantizedWeight) or not precision.quantized:
        return gpu_matmul.supported("dense", *w.shape[-2:], 0)
    return gpu_matmul.supported("w4ax" if precision.int_acts else "w4a16", *w.shape, w.group_size)


def linear(x: jax.Array | Pending, w: QuantizedWeight | jax.Array | Layer, precision: Precision,
           execution: Execution = Execution(), out_dtype=jnp.float32, parts: bool = False) -> jax.Array | SplitSum:
    """``x @ W.T`` in ``precision``, the float32 result rounded once to ``out_dtype``: packed weights
    in any precision, float weights only in W16A16; ``w`` may be a :class:`Layer` of stacked
    weights, ``x`` a :class:`Pending` step (fused into an INT4 kernel's activation prologue, else
    materialized). (The INT4 kernels store a result they need not sum over K splits in ``out_dtype``
    themselves, sparing a separate convert.) ``parts``: the float32 result as a :class:`SplitSum`
    instead (the INT4 kernels' K splits and W4AX row scales; one part elsewhere), for a consumer
    kernel that adds and rounds it itself.

    With a row tile the result is row-count invariant: the references run rows in fixed tiles, the
    kernels are invariant by construction.
    """
    w, layer = _split_layer(w)
    packed = isinstance(w, QuantizedWeight)
    if not packed and precision.quantized:
        raise ValueError(
            f"precision {precision.name} needs packed INT4 weights, but this layer holds float weights "
            "(convert the checkpoint with quantization)")
    on_kernel = execution.on_kernels and _matmul_supported(w, precision)
    if on_kernel and packed and precision.quantized:
        return _int4_matmul(x, w, layer, precision, execution.interpret, out_dtype, parts)
    x = materialize(x)
    if layer is not None:
        w = Layer(w, layer).get()
    if not on_kernel:
        if packed and precision == W4A16 and execution.backend == "pallas" and execution.row_tile is None:
            wd = w4a16_weights(w)
            y = jnp.einsum("...k,nk->...n", x.astype(jnp.bfloat16), wd, preferred_element_type=jnp.float32)
        elif packed:
            y = reference.quantized_matmul(x, w, precision, execution.row_tile)
        else:
            y = reference.dense_matmul(x, w, execution.row_tile)
        return SplitSum(y[None], None) if parts else y.astype(out_dtype)
    rows = x.reshape(-1, x.shape[-1])
    wf = dequantize(w, x.dtype) if packed else w.astype(x.dtype)
    y = gpu_matmul.dense_matmul(rows, wf, interpret=execution.interpret).reshape(*x.shape[:-1], -1)
    return SplitSum(y[None], None) if parts else y.astype(out_dtype)


def _int4_matmul(x: jax.Array | Pending, w: QuantizedWeight, layer: jax.Array | None, precision: Precision,
                 interpret: bool, out_dtype, parts: bool) -> jax.Array | SplitSum:
    """An INT4 kernel matmul reading the (stacked) weight in place: the activation prologue
    (:mod:`pallas_kernels.gpu_activations`) prepares the input, with a :class:`Pending` step fused
    into it; W4A16 takes bf16 rows (laid out by the kernel wrapper) or the fused planes."""
    pending = isinstance(x, Pending)
    if not precision.int_acts:
        xin = x.planes() if pending else x.reshape(-1, x.shape[-1])
        y = gpu_matmul.w4a16_matmul(xin, w, layer=layer, out_dtype=out_dtype, parts=parts, interpret=interpret)
        y = y.reshape(*y.shape[:-2], *x.shape[:-1], y.shape[-1])
        return SplitSum(y, None) if parts else y
    bits = precision.act_bits
    qx, sa = x.quantized(bits) if pending else gpu_activations.quantize_rows(
        x.reshape(-1, x.shape[-1]), bits, interpret=interpret)
    y = gpu_matmul.w4ax_quantized(qx, sa, w, layer=layer, out_dtype=out_dtype, parts=parts, interpret=interpret)
    y = y.reshape(*y.shape[:-2], *x.shape[:-1], y.shape[-1])
    return SplitSum(y, sa.reshape(*x.shape[:-1], 1)) if parts else y


def attention(q: jax.Array, k: jax.Array | Layer, v: jax.Array | Layer, q_pos: jax.Array,
              execution: Execution = Execution(), scales: tuple[jax.Array | Layer, jax.Array | Layer] | None = None,
              window: reference.AttentionWindow | None = None,
              new: tuple[jax.Array, jax.Array] | None = None) -> jax.Array | PendingAttention:
    """Attention of ``q[B,T,H,d]`` over a KV cache ``k, v[B,S,KV,d]`` (or :class:`Layer` views of
    the model's stacked cache) whose slot ``s`` holds position ``s`` (visible to a query iff
    ``s <= q_pos``): ``[B,T,H,d]``. With ``scales`` (the key and value scales, head-major
    ``[B, KV, S]``), ``k, v`` are the draft's quantized KV shadow
    (:func:`pallas_kernels.reference.quantize_kv`). ``window``: each query sees only the slots of its
    :class:`~pallas_kernels.reference.AttentionWindow` (a draft's view). With a row tile, row-count invariant: the
    reference runs each sequence's queries in padded tiles of it. On the kernel path, where the heads
    allow, a :class:`PendingAttention` (rows ``[B, T, H*d]``) whose cache splits are merged by its
    consumer (an INT4 linear's activation prologue, or :func:`materialize`). ``new``: the keys and
    values ``[B,T,KV,d]`` just written; in a ``causal_prompt`` forward the queries attend over them alone."""
    if execution.causal_prompt and new is not None and scales is None and window is None:
        return prompt_attention(q, *new, execution)
    (ks, layer), (vs, _) = _split_layer(k), _split_layer(v)
    bits = None if scales is None else reference.kv_shadow_bits(ks.shape[-1], q.shape[-1])
    if execution.on_kernels and gpu_attention.supported(q.shape[-1], ks.shape[-3], bits):
        if scales is None and (ks.dtype != q.dtype or vs.dtype != q.dtype):  # casting would copy the cache
            raise ValueError(f"the KV cache ({ks.dtype}, {vs.dtype}) must have the compute dtype {q.dtype} "
                             "on the kernel path")
        kv_heads = ks.shape[-2]
        partials = gpu_attention.attention_partials(
            q, ks, vs, q_pos, layer=layer, interpret=execution.interpret,
            scales=None if scales is None else tuple(_split_layer(sc)[0] for sc in scales), window=window)
        if gpu_activations.attention_merge_supported(kv_heads, q.shape[2] // kv_heads, q.shape[-1]):
            return PendingAttention(partials, execution)
        return gpu_attention.merge(partials)
    if scales is not None:
        k, v = (reference.dequantize_kv(unstack(c), jnp.swapaxes(unstack(sc), -1, -2), bits)  # scales head-major
                for c, sc in zip((k, v), scales))
    k, v = unstack(k).astype(q.dtype), unstack(v).astype(q.dtype)
    b = q.shape[0]
    k_pos = jnp.broadcast_to(jnp.arange(k.shape[1]), (b, k.shape[1]))
    row_tile = execution.row_tile
    if row_tile is None:
        return reference.attention(q, k, v, q_pos, k_pos, window)
    t = q.shape[1]
    pad = (-t) % row_tile
    n = (t + pad) // row_tile
    qt = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b * n, row_tile, *q.shape[2:])
    pt = jnp.pad(q_pos, ((0, 0), (0, pad))).reshape(b * n, row_tile)

    def one(i):
        seq = i // n
        return reference.attention(qt[i][None], k[seq][None], v[seq][None], pt[i][None], k_pos[seq][None],
                                   window)[0]

    out = jax.lax.map(one, jnp.arange(b * n))
    return out.reshape(b, t + pad, *q.shape[2:])[:, :t]


def flash_supported(dtype, head_dim: int) -> bool:
    """Whether cuDNN's flash attention takes a prompt of ``dtype`` and ``head_dim`` (16-bit, a multiple of 8
    up to 128)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 8 == 0 \
        and head_dim <= 128


def prompt_attention(q: jax.Array, k: jax.Array, v: jax.Array, execution: Execution) -> jax.Array:
    """Causal attention of a prompt's queries ``[B,T,H,d]`` over its own keys and values ``[B,T,KV,d]``
    (query and key ``t`` at position ``t``): cuDNN's flash attention on the Pallas backend where it takes
    the shapes (no ``[T, T]`` scores in memory), else :func:`reference.attention`'s float32 softmax."""
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    if execution.backend == "pallas" and flash_supported(q.dtype, q.shape[-1]):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").astype(q.dtype)
    pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    return reference.attention(q, k, v, pos, pos)


def merge_heads(x: jax.Array | PendingAttention) -> jax.Array | PendingAttention:
    """:func:`attention`'s output as rows ``[B, T, H*d]`` (a :class:`PendingAttention` already is)."""
    return x if isinstance(x, Pending) else x.reshape(*x.shape[:-2], -1)


def fuses_rope_store(dtype, pair: Layer, written: Layer, head_dim: int, execution: Execution) -> bool:
    """Whether :func:`rope_store` runs the new tokens' RoPE and KV write in compute ``dtype``: on the
    kernel path, where the cache pair holds ``dtype`` and :func:`pallas_kernels.gpu_rope.supported`
    takes the head size and the array written (the pair's keys, or the shadow's key words)."""
    return (execution.on_kernels and pair.stacked.dtype == dtype
            and gpu_rope.supported(head_dim, written.stacked, dtype))


def rope_store(qkv: jax.Array | SplitSum, cos: jax.Array, sin: jax.Array, positions: jax.Array,
               written: tuple[Layer, ...], heads: int, execution: Execution) -> tuple[jax.Array, tuple[Layer, ...]]:
    """The fused qkv projection's queries rotated ``[B, T, heads, d]``, and ``written`` (one layer's
    views of the pair ``(k, v)``, or of the draft's shadow ``(k_words, v_words, k_scales, v_scales)``:
    :meth:`qspec_jax.model.KVCache.written`) with the rotated keys and the values written at
    ``positions`` in place, in one kernel (:func:`pallas_kernels.gpu_rope.rope_store`; ``qkv`` may be a
    :class:`SplitSum`, which the kernel adds, scales and rounds); see :func:`fuses_rope_store`."""
    index = written[0].index
    qkv, scale = (qkv.parts, qkv.scale) if isinstance(qkv, SplitSum) else (qkv, None)
    q, arrays = gpu_rope.rope_store(qkv, cos, sin, positions, tuple(c.stacked for c in written), heads=heads,
                                    layer=index, scale=scale, interpret=execution.interpret)
    return q, tuple(Layer(a, index) for a in arrays)


def swiglu(gate_up: jax.Array, execution: Execution = Execution()) -> jax.Array | PendingSwiGLU:
    """The MLP's ``silu(gate) * up`` of ``gate_up = [gate | up]`` (:func:`pallas_kernels.reference.swiglu`,
    elementwise: row-count invariant as it is). On the kernel path a :class:`PendingSwiGLU`, for its
    consumer to fuse with an activation prologue or :func:`materialize`."""
    if execution.on_kernels and gate_up.shape[-1] % (2 * gpu_activations.PACK_BLOCK) == 0:
        return PendingSwiGLU(gate_up, execution)
    return reference.swiglu(*jnp.split(gate_up, 2, axis=-1))


def rms_norm(x: jax.Array, scale: jax.Array | Layer, eps: float,
             execution: Execution = Execution()) -> jax.Array | PendingNorm:
    """``scale * (x * rsqrt(mean(x^2) + eps))`` over the last axis, statistics in float32; ``scale``
    may be a :class:`Layer` of stacked scales. On the kernel path a :class:`PendingNorm`, for its
    consumer to fuse with an activation prologue or :func:`materialize`."""
    if execution.on_kernels and x.shape[-1] % gpu_activations.PACK_BLOCK == 0:
        return PendingNorm(x, scale, eps, execution)
    return _rms_norm_now(x, scale, eps, execution)


def _rms_norm_now(x: jax.Array, scale: jax.Array | Layer, eps: float, execution: Execution) -> jax.Array:
    if execution.on_kernels and x.shape[-1] % 16 == 0:
        stacked, layer = _split_layer(scale)
        y = gpu_norm.rms_norm(x.reshape(-1, x.shape[-1]), stacked, eps, layer=layer,  # cast in the kernel
                              interpret=execution.interpret)
        return y.reshape(x.shape)
    scale = unstack(scale).astype(x.dtype)

    def norm(r):
        rf = r.astype(jnp.float32)
        rf = rf * jax.lax.rsqrt(jnp.mean(rf * rf, axis=-1, keepdims=True) + eps)
        return scale * rf.astype(r.dtype)

    return map_row_tiles(norm, x, execution.row_tile)
