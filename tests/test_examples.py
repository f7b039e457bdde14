"""Every example runs and its checks hold: on NumPy all of them, from the command line once, and
on torch and JAX the ones that exercise a draft and a shared cache (the slow backends eagerly).

Each example's ``main(argv)`` makes its checks as it goes and raises at the first that fails;
the tests also read back what it checked.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = ["greedy_paged", "chunked_prefill", "forked_beam", "speculative_tree", "mixed_window",
         "packed_batch", "prefix_prefill"]


def example(name: str):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def run(name: str, *argv: str):
    checks = example(name).main(list(argv))
    assert checks.ok and checks.results, f"{name}: {checks.results}"
    return checks


def test_every_example_is_tested():
    found = sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_"))
    assert found == sorted(NAMES)


def test_greedy_paged_decoding_equals_each_prompt_alone():
    c = run("greedy_paged", "--backend", "numpy")
    assert sum("tokens equal decoding it alone" in k for k in c.results) == 3
    assert all(len(t) == 6 for t in c.values["tokens"])


def test_chunks_equal_the_whole_prompt_and_fill_the_same_pools():
    c = run("chunked_prefill", "--backend", "numpy", "--chunk", "5")
    assert "pools after the chunks equal pools after one call" in c.results


def test_forked_beams_share_the_prompt_and_score_as_alone():
    c = run("forked_beam", "--backend", "numpy")
    assert len(c.values["beams"]) == 3
    assert "the prompt's slots were written once, by the prefill" in c.results


def test_a_verified_draft_tree_keeps_the_greedy_path():
    c = run("speculative_tree", "--backend", "numpy")
    assert len(c.values["accepted"]) == 3  # root, g1, g2; g3 is the bonus
    assert "the next call over the kept path equals decoding one by one" in c.results


def test_sliding_and_full_layers_share_the_pools():
    c = run("mixed_window", "--backend", "numpy")
    assert "the window changes the outputs (against all layers full)" in c.results


def test_a_packed_batch_equals_each_sequence_alone():
    c = run("packed_batch", "--backend", "numpy")
    assert sum("logits equal the sequence alone" in k for k in c.results) == 7


@pytest.mark.parametrize("schedule", [True, False], ids=["schedule", "tables"])
def test_prefix_shared_prefill_computes_less_and_equals_each_prompt_alone(schedule):
    """The waves (from cacheidx.prefix.schedule, or the plan's tables) compute fewer tokens
    than the prompts hold, and each of the 7 prompts' last logits and greedy tokens equal the
    prompt's alone."""
    c = run("prefix_prefill", "--backend", "numpy", *([] if schedule else ["--no-schedule"]))
    source = "cacheidx.prefix.schedule" if schedule else "plan.tables()"
    assert f"waves from {source}" in c.title, c.title
    assert c.values["computed"] < sum(len(q) for q in example("prefix_prefill").prompts_of(
        example("_common").Env("numpy")))
    assert sum("last logits equal the prompt alone" in k for k in c.results) == 7
    assert sum("decoding from the shared cache equals decoding it alone" in k
               for k in c.results) == 7


def test_an_example_runs_from_the_command_line():
    out = subprocess.run([sys.executable, str(EXAMPLES / "speculative_tree.py"), "--backend",
                          "numpy"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[FAIL]" not in out.stdout and "11 checks passed" in out.stdout


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize("name", ["speculative_tree", "prefix_prefill"])
def test_examples_on_other_backends(name, backend):
    pytest.importorskip(backend, reason=f"{backend} is not installed")
    run(name, "--backend", backend)
