"""A kind of pool plugs in through :mod:`cacheidx.pools` alone: the readers (the index's store
and read, attention's tiles, runs and paths, torch's operator) never name it.

The kind here is made up for the test: rows kept as floats divided by their largest magnitude,
and that magnitude, one per row (two parts, slot axis 0 each). A call through it is the call
through a float pool holding what it gives back (``pools.stands_for``), as law Q2 says of the
quantized kind."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pytest

import cacheidx as ci
from cacheidx import pools
from cacheidx.attention.softmax import reference


class Scaled(NamedTuple):
    rows: Any  #: [slots, kv, d], each row over its largest magnitude
    scales: Any  #: [slots, kv]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.rows.shape)

    @property
    def ndim(self) -> int:
        return 3


class _ScaledKind:
    name = "test-scaled"
    cast = False
    kernel = frozenset()

    def parts(self, pool):
        return tuple(pool)

    def remade(self, parts):
        return Scaled(*parts)

    def check(self, fn, name, pool, backend):
        for part in pool:
            if not backend.same_library(part):
                raise TypeError(f"cacheidx.{fn}: {name} of another library")

    def takes(self, fn, name, values, pool, xp):
        if values.dtype != pool.rows.dtype:
            raise TypeError(f"cacheidx.{fn}: {name} are {values.dtype}")

    def encode(self, pool, values, xp):
        top = xp.max(xp.abs(values), axis=-1)
        s = xp.where(top > 0, top, xp.ones((), dtype=top.dtype))
        return values / s[..., None], s

    def decode(self, read, xp):
        return read.rows * read.scales[..., None]

    def factors(self, read, dtype, xp):
        return xp.astype(read.rows, dtype), read.scales


pools.register(Scaled, _ScaledKind())
HEADS, KV, D, SLOTS = 4, 2, 8, 16


def _arrays(backend):
    ix = ci.rows(8, [3, 4], xp=backend.name)
    xp = ix.backend.xp
    rng = np.random.default_rng(0)

    def a(*shape):
        return backend.from_host(rng.standard_normal(shape).astype(np.float32), None, None)

    def empty():
        return Scaled(xp.zeros((SLOTS, KV, D), dtype=xp.float32),
                      xp.zeros((SLOTS, KV), dtype=xp.float32))

    return ix, a(2, 4, HEADS, D), a(2, 4, KV, D), a(2, 4, KV, D), empty(), empty()


def test_a_registered_kind_is_found_and_an_array_is_a_float_pool(backend):
    ix, q, k, v, kpool, vpool = _arrays(backend)
    assert pools.kind(kpool).name == "test-scaled"
    assert pools.kind(k) is pools.FLOATS
    assert pools.named("test-scaled") is pools.kind(kpool)
    with pytest.raises(ValueError, match="cacheidx.pools.named"):
        pools.named("no such kind")


def test_extend_through_a_new_kind_stores_its_parts_and_reads_what_they_stand_for(backend):
    ix, q, k, v, kpool, vpool = _arrays(backend)
    seen, kept = ix.extend(k, kpool)
    assert isinstance(kept, Scaled)
    floats = pools.stands_for(kpool, k, ix.backend.xp)
    np.testing.assert_allclose(ci.devices.to_host(seen),
                               ci.devices.to_host(ix.extend(floats, _floats(ix, kpool))[0]),
                               rtol=1e-6, atol=1e-6)


def _floats(ix, pool):
    return ix.backend.xp.zeros(pool.shape, dtype=ix.backend.xp.float32)


@pytest.mark.parametrize("compiled", [False, True])
def test_attend_through_a_new_kind_is_softmax_over_extends_seen(backend, compiled):
    """Law 2 over the made-up kind (and law 1: its parts hold what extend stores), eagerly
    and, on torch, through the compiled operator, which carries the kind by its name."""
    if compiled and backend.name != "torch":
        pytest.skip(f"the compiled operator is torch's (backend {backend.name})")
    ix, q, k, v, kpool, vpool = _arrays(backend)

    def step(ix, q, k, v, kpool, vpool):
        return ix.attend(q, k, v, kpool, vpool)

    run = backend.jit(step) if compiled else step
    out, kept, vkept = run(ix, q, k, v, kpool, vpool)
    seen_k, want_k = ix.extend(k, kpool)
    seen_v, want_v = ix.extend(v, vpool)
    host = ci.devices.to_host
    for got, want in zip((*kept, *vkept), (*want_k, *want_v), strict=True):
        np.testing.assert_array_equal(host(got), host(want))
    want = reference(host(q), host(seen_k), host(seen_v), host(ix.mask()))
    np.testing.assert_allclose(host(out), want, rtol=1e-5, atol=1e-5)


def test_a_decode_step_through_a_new_kind_is_softmax_over_extends_seen(backend):
    """A decode step (where a CPU kernel may read the pools itself) over the made-up kind: the
    kernels read only kinds they know, and the law holds."""
    ix, q, k, v, kpool, vpool = _arrays(backend)
    _, kpool, vpool = ix.attend(q, k, v, kpool, vpool)
    nxt = ix.advance()
    q, k, v = q[:, :1, ...], k[:, :1, ...], v[:, :1, ...]
    out, _, _ = nxt.attend(q, k, v, kpool, vpool)
    seen_k, _ = nxt.extend(k, kpool)
    seen_v, _ = nxt.extend(v, vpool)
    host = ci.devices.to_host
    want = reference(host(q), host(seen_k), host(seen_v), host(nxt.mask()))
    np.testing.assert_allclose(host(out), want, rtol=1e-5, atol=1e-5)


def test_no_reader_tells_a_kind_of_pool_apart():
    """Outside the kinds' own modules (and the law suite, which checks what a quantized pool
    holds) nothing asks ``isinstance(x, Quantized)``: a reader asks the pool's kind."""
    import ast
    import pathlib

    root = pathlib.Path(ci.__file__).parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in ("pools.py", "quantized.py") or rel.startswith("conformance/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
                    and len(node.args) == 2 and "Quantized" in ast.unparse(node.args[1])):
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)
