"""A compiled step's room for shapes is its own (``TorchBackend.jit_step``): steps made of one
nested function, as the engine makes one per served model, never spend each other's room,
however many a process makes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the compiled steps are torch's")

from cacheidx import backends  # noqa: E402


def _step(scale: float):
    def step(x, y):  # one code object for every scale, as serve.step's nested steps
        return x * scale + y

    return step


def test_steps_of_one_nested_function_each_keep_their_own_room():
    """Twelve steps of one nested function, each given room for one shape (dynamo's limit,
    8 a step, would be spent by the ninth if their programs counted together): each compiles
    and gives its own value."""
    backend = backends.get("torch")
    x, y = torch.ones(3), torch.zeros(3)
    for k in range(12):
        step = backend.jit_step(_step(float(k)), programs=1, compiler="eager")
        assert torch.equal(step(x, y), torch.full((3,), float(k))), k
