"""``ci.check`` is a host-side debug check (issue 26, item 14): inside a compiled step it
either runs on the host or says it cannot, never dynamo's bare "Observed exception".

Under ``torch.compile`` it is a graph break run eagerly on the step's tensors (so a broken
table still raises the obligation it breaks); ``fullgraph=True`` allows no graph break, and
dynamo's error gives :data:`cacheidx.obligations.HOST_ONLY` as its reason; under ``jax.jit``
it raises ``TypeError(HOST_ONLY)``."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cacheidx as ci
from cacheidx.obligations import HOST_ONLY

BROKEN = "within a row a slot appears once"


def test_check_in_a_torch_step_runs_on_the_host():
    torch = pytest.importorskip("torch")

    def step(index, x):
        ci.check(index)
        return x + 1

    compiled = torch.compile(step, backend="eager")
    good = ci.rows(8, [3, 4], xp="torch")
    assert torch.equal(compiled(good, torch.zeros(2)), torch.ones(2))
    broken = ci.make(torch.tensor([[0, 1]]), torch.tensor([[3, 3, -1]]))
    with pytest.raises(ValueError, match=BROKEN):
        compiled(broken, torch.zeros(2))


def test_check_in_a_fullgraph_torch_step_says_it_is_host_side():
    torch = pytest.importorskip("torch")

    def whole_step(index, x):
        ci.check(index)
        return x + 1

    compiled = torch.compile(whole_step, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=re.escape(HOST_ONLY)):
        compiled(ci.rows(8, [3, 4], xp="torch"), torch.zeros(2))


def test_check_under_jax_jit_says_it_is_host_side():
    jax = pytest.importorskip("jax")

    def step(index, x):
        ci.check(index)
        return x + 1

    index = ci.rows(8, [3, 4], xp="jax")
    with pytest.raises(TypeError, match=re.escape(HOST_ONLY)):
        jax.jit(step)(index, np.zeros(2, np.float32))
