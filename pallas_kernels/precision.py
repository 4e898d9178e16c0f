"""The precision a linear layer runs in: weight bits and activation bits, as one typed value.

One packed INT4 params pytree serves :data:`W4A16` (the verifier: weights dequantized to bfloat16),
:data:`W4A8` / :data:`W4A4` (the drafts: activations quantized per token to INT8 / INT4) and
:data:`W16A16` (float weights, or the packed ones dequantized in the compute dtype). User input
(method names, CLI and benchmark flags) becomes a :class:`Precision` through :func:`parse_precision`
only; everything below dispatches on the fields.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Precision:
    """``weight_bits``: 16 (float) or 4 (packed INT4); ``act_bits``: 16 (float) or the integer
    width activations are quantized to. Hashable: a static argument of jitted functions."""

    weight_bits: int
    act_bits: int

    def __post_init__(self):
        if (self.weight_bits, self.act_bits) not in _KNOWN:
            raise ValueError(f"unsupported precision w{self.weight_bits}a{self.act_bits}; expected one of "
                             f"{', '.join(p for p in _NAMES)}")

    @property
    def name(self) -> str:
        """``"w4a8"`` etc.: for display and result files."""
        return f"w{self.weight_bits}a{self.act_bits}"

    @property
    def quantized(self) -> bool:
        """Packed INT4 weights (float weights can only run :data:`W16A16`)."""
        return self.weight_bits < 16

    @property
    def int_acts(self) -> bool:
        """Activations quantized to integers (the W4AX kernels' prologue)."""
        return self.act_bits < 16

    def __str__(self) -> str:
        return self.name


_NAMES = ("w16a16", "w4a16", "w4a8", "w4a4")
_KNOWN = {(16, 16), (4, 16), (4, 8), (4, 4)}
W16A16, W4A16, W4A8, W4A4 = Precision(16, 16), Precision(4, 16), Precision(4, 8), Precision(4, 4)
PRECISIONS = (W16A16, W4A16, W4A8, W4A4)
DRAFT_PRECISIONS = (W4A4, W4A8)


def parse_precision(name: str | Precision, allowed: tuple[Precision, ...] = PRECISIONS, what: str = "mode",
                    others: tuple[str, ...] = ()) -> Precision:
    """The :class:`Precision` named ``name`` (``"w4a8"``; a Precision passes through), which must be
    one of ``allowed``; otherwise ``ValueError`` naming ``what`` and listing the names ``others``
    (choices the caller handles itself) and ``allowed``'s."""
    found = name if isinstance(name, Precision) else next((p for p in allowed if p.name == name), None)
    if found is None or found not in allowed:
        raise ValueError(f"unknown {what} {name!r}; expected one of {(*others, *(p.name for p in allowed))}")
    return found
