"""SmolLM2 for the model tests, or a skip that prints what is missing."""

import pytest


def smollm2_or_skip():
    """(config, params, gguf module), or a skip that prints which package is missing."""
    for module in ("gguf", "transformers", "accelerate", "torch"):
        pytest.importorskip(module, reason=f"the SmolLM2 comparison needs `{module}` installed")
    from cacheidx.models import gguf

    try:
        gguf.smollm2_path()
    except gguf.ModelMissing as e:
        pytest.skip(str(e))
    config, params = gguf.load_smollm2()
    return config, params, gguf
