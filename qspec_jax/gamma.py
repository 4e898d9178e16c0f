"""γ chosen round by round (``generate(gamma="auto")``): a bytes cost model of each phase and the
acceptance observed so far pick the γ in ``0..gamma_max`` with the most tokens per unit of cost;
γ = 0 is plain W4A16 steps (docs/design.md §2).

Every forward of a decode step is memory-bound, so its cost is counted in bytes moved: the packed
weights (read again, in part, for every extra tile of rows a verify pass multiplies them with),
the KV cache a query reads, and the lm_head. The weights' term is scaled by ``1 + overhead`` for the
non-matmul kernels that grow with the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.layout import QuantizedWeight
from pallas_kernels.reference import AttentionWindow
from qspec_jax.config import LlamaConfig

ROWS_PER_TILE = 64  # token rows an INT4 matmul tile multiplies per dequantized weight tile
RETILE = 1.2  # extra weight reads per further tile of rows (a 64-row verify reads its weights 2.2 times)
OVERHEAD = 0.25  # the non-matmul kernels of a forward, as a fraction of its weight reads
PRIOR_ALPHA, PRIOR_DRAFTS = 0.8, 4  # acceptance added to each sequence's observed drafts (a prior)
# until the running sequences had this many drafts verified each (on average), γ is chosen as if every draft
# were accepted: a prior alone could pick γ = 0 forever, never observing the acceptance that would pay
EXPLORE_DRAFTS = 8
# drafting is tried only where it could gain more than this with every draft accepted: less cannot repay
# the auto loop's own cost (its W4A16 rounds inside a switch, the exploration; docs/design.md §2.5)
MIN_GAIN = 0.05
# each sequence's acceptance is taken this many standard deviations (its estimate's) above its mean:
# γ = 0 observes nothing, so a low estimate from a few early rejections would otherwise never be revised
OPTIMISM = 1.0


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The bytes each phase of a round moves (hashable: a static argument of the decode loop)."""

    weight_bytes: float  # the decoder linears' packed weights, scales and minimums
    head_bytes: float  # the verifier's lm_head
    draft_head_bytes: float  # the drafts' lm_head (the full head or a draft head)
    kv_bytes: float  # per cached token of one sequence: the verifier's keys and values, all layers
    draft_kv_bytes: float  # the same for what a draft reads (the cache, or its shadow)
    window: int | None = None  # slots a draft reads at most (a window's sinks + size)

    def best_gain(self, gamma_max: int, batch: int, slots: int) -> float:
        """The most any γ >= 1 can gain over W4A16 steps, every draft accepted: its tokens per byte over a
        W4A16 step's, for ``batch`` sequences at ``slots`` cached positions (the longest context, where a
        draft's views save the most). At most 1 where drafts read as many bytes as a W4A16 step (no
        smaller head, no cache view, no window shorter than ``slots``)."""
        with jax.ensure_compile_time_eval():  # constants, also while a loop is traced
            cost = np.asarray(self.round_costs(gamma_max, float(batch), float(slots)), np.float64)
        return float(np.max(np.arange(2, gamma_max + 2) / cost[1:]) * cost[0])

    def forward(self, rows: jax.Array, kv_tokens: jax.Array, head_bytes: float, kv_bytes: float) -> jax.Array:
        """Bytes of one forward of ``rows`` token rows that reads ``kv_tokens`` cached tokens in all."""
        tiles = (rows - 1) / ROWS_PER_TILE
        return self.weight_bytes * (1 + OVERHEAD + RETILE * tiles) + kv_tokens * kv_bytes + head_bytes

    def round_costs(self, gamma_max: int, batch: jax.Array, context: jax.Array) -> jax.Array:
        """``[gamma_max + 1]`` bytes of a round drafting γ tokens (γ = 0: one W4A16 step) for ``batch``
        running sequences at mean ``context``."""
        g = jnp.arange(gamma_max + 1, dtype=jnp.float32)
        seen = context if self.window is None else jnp.minimum(context, self.window)
        draft = self.forward(batch, batch * seen, self.draft_head_bytes, self.draft_kv_bytes)
        verify = self.forward(batch * (g + 1), batch * context, self.head_bytes, self.kv_bytes)
        return g * draft + verify


def cost_model(params: dict[str, Any], config: LlamaConfig, dtype: Any, draft_kv: int | None,
               window: AttentionWindow | None) -> CostModel:
    """The :class:`CostModel` of a params pytree (``params['draft_head']`` where the drafts use one) in
    compute ``dtype`` with the drafts' views of the cache."""
    itemsize = jnp.dtype(dtype).itemsize
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    head_bytes = float(np.prod(head.shape)) * itemsize
    draft_head = params.get("draft_head")
    per_head = 2 * config.num_layers * config.num_kv_heads  # keys and values of every layer
    kv = per_head * config.head_dim * itemsize
    draft_kv_bytes = kv if draft_kv is None else per_head * (config.head_dim * draft_kv / 8 + 4)  # + a scale
    return CostModel(
        weight_bytes=float(sum(a.nbytes for a in jax.tree.leaves(params["layers"]))),
        head_bytes=head_bytes,
        draft_head_bytes=head_bytes if draft_head is None else _head_bytes(draft_head["w"], itemsize),
        kv_bytes=float(kv), draft_kv_bytes=float(draft_kv_bytes),
        window=None if window is None else window.sinks + window.size)


def _head_bytes(w: QuantizedWeight | jax.Array, itemsize: int) -> float:
    """Bytes a draft head's matmul reads: the packed codes, scales and minimums of an INT4 copy, or a
    float copy in the compute dtype."""
    if isinstance(w, QuantizedWeight):
        return float(sum(a.nbytes for a in jax.tree.leaves(w)))
    return float(np.prod(w.shape)) * itemsize


def drafting_can_pay(gain: float) -> bool:
    """Whether a best gain (:meth:`CostModel.best_gain`) is worth the auto loop's switch over round
    bodies; if not, every round is γ = 0 and the loop is the W4A16 loop itself."""
    return gain >= 1 + MIN_GAIN


def expected_tokens(alpha: jax.Array, gamma: jax.Array) -> jax.Array:
    """Tokens a round commits when each draft is accepted independently with probability ``alpha``:
    ``(1 - alpha**(gamma+1)) / (1 - alpha)``."""
    alpha = jnp.minimum(alpha, 1 - 1e-6)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def choose_gamma(costs: CostModel, gamma_max: int, accepted: jax.Array, drafted: jax.Array, lengths: jax.Array,
                 running: jax.Array) -> jax.Array:
    """The γ (int32 scalar) with the most expected tokens per byte over the ``running`` sequences,
    each with its own acceptance so far (``accepted / drafted`` after a prior of
    :data:`PRIOR_DRAFTS` drafts at :data:`PRIOR_ALPHA`, plus :data:`OPTIMISM` standard deviations of
    that estimate); every draft counted as accepted until they had :data:`EXPLORE_DRAFTS` drafts
    verified each on average (so γ >= 1 is tried wherever it could pay)."""
    g = jnp.arange(gamma_max + 1, dtype=jnp.float32)
    weight = running.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(weight), 1.0)
    explore = jnp.sum(drafted * weight) < EXPLORE_DRAFTS * n
    seen = drafted + PRIOR_DRAFTS
    mean = (accepted + PRIOR_ALPHA * PRIOR_DRAFTS) / seen
    alpha = jnp.where(explore, 1.0, jnp.minimum(mean + OPTIMISM * jnp.sqrt(mean * (1 - mean) / seen), 1.0))
    tokens = jnp.sum(expected_tokens(alpha[:, None], g[None, :]) * weight[:, None], axis=0)
    context = jnp.sum(lengths * weight) / n
    return jnp.argmax(tokens / costs.round_costs(gamma_max, n, context)).astype(jnp.int32)
