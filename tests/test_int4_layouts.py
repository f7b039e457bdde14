"""benchmarks/int4_layouts.py's simulated layouts keep what their docstrings say (issue 38,
item 3): the figures in docs/performance.md rest on them.

The benchmark sets one thread for the process that imports it (``long_context``), so it is
imported in a subprocess of its own, once for the module; each law is read from what it
found."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="benchmarks/int4_layouts.py simulates layouts in torch")

ROOT = Path(__file__).resolve().parent.parent

CHECKS = r"""
import json, sys
sys.path.insert(0, "benchmarks")
import int4_layouts as L
import torch

F16 = torch.float16
g = torch.Generator().manual_seed(0)
x = torch.randn(5, 7, 3, 64, generator=g) * torch.linspace(0.1, 4, 64)
out = {}

# a function of the row alone: rows rounded together equal each rounded by itself
for name, f in {"clipped": lambda r: L.clipped(r, 16, F16),
                "clipped zp": lambda r: L.clipped(r, 16, F16, True),
                "widths": lambda r: L.widths(r, 32, 5, F16),
                "levels": lambda r: L.levels(r, 16, F16, L.LLOYD, True)}.items():
    whole = f(x)
    alone = torch.stack([f(x[i:i + 1])[0] for i in range(x.shape[0])])
    out[f"per row: {name}"] = bool(torch.equal(whole, alone))

# a shrink factor of 1 is among those tried: never further from the row than asym's
err = lambda a: (a - x).pow(2).reshape(*x.shape[:-1], -1, 16).sum(-1)
out["clipped no worse"] = bool((err(L.clipped(x, 16, F16)) <= err(L.asym(x, 16, F16))).all())
out["clipped zp no worse"] = bool(
    (err(L.clipped(x, 16, F16, True)) <= err(L.asym(x, 16, F16, True))).all())
# codes 0..15 of widths are asym's
out["widths 4 is asym"] = bool(torch.equal(L.widths(x, 32, 4, F16), L.asym(x, 32, F16)))
# each element one of the book's levels times its group's scale
y = L.levels(x, 16, F16, L.NF4, False).reshape(*x.shape[:-1], -1, 16)
s = x.reshape(*x.shape[:-1], -1, 16).abs().amax(-1, keepdim=True).to(F16).float()
out["levels on the book"] = bool(
    ((y / s)[..., None] - L.NF4).abs().amin(-1).max() < 1e-6)

# a constant of each layer, the same for RoPE's two channels of a pair, multiplied back
dim, kv, d, heads = 24, 3, 64, 9
p = {"attn_norm": torch.rand(dim, generator=g) + 0.5,
     "wk": torch.randn(dim, kv * d, generator=g), "wq": torch.randn(dim, heads * d, generator=g)}
config = type("C", (), {"kv_heads": kv, "head_dim": d})()
for name, fn in (("norm", L._keys_norm), ("balanced", L._keys_balanced)):
    t = fn(p, config)
    out[f"pairs share: {name}"] = bool(
        t.shape == (kv, d) and torch.equal(t[:, : d // 2], t[:, d // 2:]))
rows = torch.randn(4, kv, d, generator=g)
back = L.FromWeights(L._keys_norm, lambda r: r).at(p, config)(rows)
out["multiplied back"] = bool(torch.allclose(back, rows, rtol=1e-6, atol=0))

# the greedy share: tokens before each prompt's first departure, of all of ref's
out["kept"] = L.kept([[1, 2, 3, 4], [5, 6, 0, 8], [9, 9]], [[1, 2, 3, 4], [5, 6, 7, 8], [0, 9]])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def found() -> dict:
    done = subprocess.run([sys.executable, "-c", CHECKS], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["clipped", "clipped zp", "widths", "levels"])
def test_a_slots_round_trip_is_a_function_of_its_row_alone(found, name):
    assert found[f"per row: {name}"]


def test_the_shrink_search_is_never_further_from_the_row_than_its_full_range(found):
    assert found["clipped no worse"] and found["clipped zp no worse"]


def test_four_bit_widths_are_asyms_codes(found):
    assert found["widths 4 is asym"]


def test_a_codebooks_elements_are_its_levels_times_the_groups_scale(found):
    assert found["levels on the book"]


@pytest.mark.parametrize("name", ["norm", "balanced"])
def test_a_weights_constant_is_shared_by_ropes_two_channels_of_a_pair(found, name):
    assert found[f"pairs share: {name}"]


def test_a_weights_constant_is_multiplied_back(found):
    assert found["multiplied back"]


def test_the_greedy_share_counts_tokens_before_each_first_departure(found):
    # 4 of the first, 2 of the second, 0 of the third: 6 of 10
    assert found["kept"] == pytest.approx(6 / 10)
