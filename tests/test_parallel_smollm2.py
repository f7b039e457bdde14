"""SmolLM2-135M tensor-parallel over its 3 key-value heads gives one process's greedy tokens:
3 torch.distributed ranks (gloo, started by ``torchrun --standalone``), and one jax mesh of 3
CPU devices. Each run is ``python -m cacheidx.parallel.greedy`` under a timeout
(tests/processes.py). The law on the tiny decoder, fast, is in test_parallel.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from processes import processes, torchrun
from smollm2_support import smollm2_or_skip

from cacheidx import parallel

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers."]
NEW_TOKENS = 8
TIMEOUT = 240  # seconds, per run


def greedy(backend, k, ids, *extra, ranks=1, **env):
    """The lead rank's tokens of ``python -m cacheidx.parallel.greedy``."""
    e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
             OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    e.pop("XLA_FLAGS", None)
    e.update(env)
    args = ["-m", "cacheidx.parallel.greedy", "--backend", backend, "--tensor-parallel", str(k),
            "--max-new-tokens", str(NEW_TOKENS), "--ids", json.dumps(ids), "--json", *extra]
    if ranks > 1:
        run = torchrun(args, ranks, timeout=TIMEOUT, env=e)
    else:
        run = processes([sys.executable, *args], 1, timeout=TIMEOUT, env=e)
    lead = run.json(0)
    assert run.stdout[1:] == [""] * (ranks - 1)  # only the lead rank speaks
    assert lead["figures"]["tensor_parallel"] == k
    return lead["tokens"]


@pytest.fixture(scope="module")
def model():
    """(config, prompt ids, one process's tokens on torch)."""
    config, _, gguf = smollm2_or_skip()
    ids = [gguf.chat_ids(p) for p in PROMPTS]
    return config, ids, greedy("torch", 1, ids)


def test_smollm2_has_three_key_value_heads_and_nine_query_heads(model):
    config, ids, one = model
    assert (config.kv_heads, config.heads, config.hidden) == (3, 9, 1536)
    assert [len(t) for t in one] == [NEW_TOKENS] * len(PROMPTS)
    assert one[0][:7] == [504, 3575, 282, 4649, 314, 7042, 30]  # "The capital of France is Paris."


def test_three_torch_ranks_give_one_process_tokens(model):
    _, ids, one = model
    assert greedy("torch", 3, ids, ranks=3) == one


def test_a_jax_mesh_of_three_devices_gives_one_process_tokens(model):
    pytest.importorskip("jax", reason="the jax mesh needs JAX")
    _, ids, one = model
    assert greedy("jax", 3, ids, "--compile",
                  XLA_FLAGS="--xla_force_host_platform_device_count=3") == one


@pytest.mark.parametrize("k", [2, 4])
def test_ranks_that_do_not_divide_three_heads_are_a_clear_error(model, k):
    config, _, _ = model
    with pytest.raises(ValueError, match=f"the model's 3 key-value heads do not split over {k} "
                                         f"ranks"):
        parallel.split(config, k)
