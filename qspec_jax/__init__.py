"""qspec-jax: QSPEC speculative decoding (W4A4 drafts verified by W4A16) in JAX/Pallas."""

from qspec_jax.api import GenerationResult, Model, generate, load

__all__ = ["GenerationResult", "Model", "generate", "load"]
