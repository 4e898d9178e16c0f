"""qspec-jax: QSPEC speculative decoding (W4A4 drafts verified by W4A16) in JAX/Pallas."""
