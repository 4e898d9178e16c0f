"""qspec-jax: QSPEC speculative decoding (W4A4 drafts verified by W4A16) in JAX/Pallas."""

from qspec_jax.api import GenerationResult, Model, StreamUpdate, generate, load, stream_generate

__all__ = ["GenerationResult", "Model", "StreamUpdate", "generate", "load", "stream_generate"]
