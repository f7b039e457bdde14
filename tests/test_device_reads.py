"""The law of :mod:`cacheidx.plan`: an eager decode step on a device backend copies nothing
from the device to the host except the sampled tokens.

Counted on the CPU, where every torch tensor and JAX array is made to stand for device memory:
torch's "lies in host memory" (``cacheidx.backends.torch._on_host``, which its adapter's
``on_host`` and its store and read plans ask) says no, so every path takes its device branch,
and every read of a value is counted: ``np.asarray``/``np.array``/``jax.device_get`` of a
backend array (``cacheidx.devices.to_host`` reads so), ``float()``, ``int()``, ``bool()``,
``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()`` of a tensor, and JAX's value of an array
(what its ``float``/``int``/``bool``/``tolist`` read through). JAX's transfer guard does not
fire on its CPU backend (a CPU array is host memory to it), so it is counted so too.

Each test failed before the plan was made from the host's own values (issue 36, item 1): every
eager attend then read each index tensor back to compare it with the plan's copy.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import numpy as np
import pytest

from cacheidx.conformance.pytest_plugin import backend_or_skip
from cacheidx.models import llama
from cacheidx.serve import Engine, LlamaModel, Request
from cacheidx.serve.step import Step


class Reads:
    """Device-to-host reads while :attr:`on` (one per outermost read: ``np.asarray`` of a
    tensor that reads through its ``__array__`` counts once), each ``(what, allowed)``."""

    def __init__(self) -> None:
        self.on = False
        self.allowed: list[object] = []  # arrays that may be read: the sampled tokens
        self.seen: list[tuple[str, bool]] = []
        self._depth = threading.local()

    def wrap(self, name: str, fn):
        reads = self

        def counted(*args, **kwargs):
            depth = getattr(reads._depth, "n", 0)
            if (reads.on and depth == 0 and args and _backend_array(args[0])
                    and not _compiling(sys._getframe(1))):
                reads.seen.append((name, any(args[0] is a for a in reads.allowed)))
            reads._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                reads._depth.n = depth

        return counted

    @property
    def forbidden(self) -> list[str]:
        return [name for name, allowed in self.seen if not allowed]


def _backend_array(x) -> bool:
    """A concrete torch tensor or JAX array (a tracer holds no value to read)."""
    torch, jax = sys.modules.get("torch"), sys.modules.get("jax")
    if torch is not None and isinstance(x, torch.Tensor):
        return True
    return jax is not None and isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _compiling(frame) -> bool:
    """Whether the read is JAX's own, compiling a program (its constants folded and lowered
    once per program, not once a step)."""
    return frame.f_globals.get("__name__", "").startswith(("jax.", "jaxlib."))


@contextlib.contextmanager
def counting(monkeypatch, lib):
    """Every device-to-host read of ``lib``'s arrays counted (see the module), its arrays
    standing for device memory."""
    reads = Reads()
    for name in ("asarray", "array"):
        monkeypatch.setattr(np, name, reads.wrap(f"np.{name}", getattr(np, name)))
    if lib == "torch":
        import torch

        from cacheidx.backends import torch as torch_backend

        monkeypatch.setattr(torch_backend, "_on_host", lambda *tensors: False)
        for name in ("__array__", "__bool__", "__float__", "__int__", "__index__", "item",
                     "tolist", "numpy", "cpu"):
            monkeypatch.setattr(torch.Tensor, name,
                                reads.wrap(f"Tensor.{name}", getattr(torch.Tensor, name)))
    else:
        import jax
        from jax._src import array

        value = array.ArrayImpl._value
        monkeypatch.setattr(array.ArrayImpl, "_value",
                            property(reads.wrap("Array._value", value.fget)))
        for name in ("item", "__array__"):
            monkeypatch.setattr(array.ArrayImpl, name,
                                reads.wrap(f"Array.{name}", getattr(array.ArrayImpl, name)))
        monkeypatch.setattr(jax, "device_get", reads.wrap("jax.device_get", jax.device_get))
    yield reads


def decode_reads(monkeypatch, lib, **options):
    """The reads of every eager decode call of an engine serving three requests (finishing at
    several steps, so that fresh indices and carried ones are both counted), and the
    tokens."""
    backend_or_skip(lib)
    config = llama.Config.tiny()
    model = LlamaModel(config, llama.random_params(config, seed=1))
    run = Step.run
    with counting(monkeypatch, lib) as reads:
        calls = [0]

        def counted(self, batch, table, version, *args, **kwargs):
            if batch.kind != "decode":
                return run(self, batch, table, version, *args, **kwargs)
            decode = self._decode

            def sampled(*a):
                out = decode(*a)
                reads.allowed.append(out[0])  # the sampled tokens
                return out

            self._decode, reads.on = sampled, True
            try:
                return run(self, batch, table, version, *args, **kwargs)
            finally:
                self._decode, reads.on = decode, False
                reads.allowed.clear()
                calls[0] += 1

        monkeypatch.setattr(Step, "run", counted)
        engine = Engine(model, backend=lib, page_size=8, pages=32, lanes=4, clock="steps",
                        **options)
        rng = np.random.default_rng(0)
        # a 70-token prompt the three share (past runs.SHARED columns: read once, JAX's
        # groups found on the host) and a few tokens of each's own
        system = rng.integers(0, 64, 70).tolist()
        requests = [Request(i, system + rng.integers(0, 64, 3 + 5 * i).tolist(), 12 - 3 * i)
                    for i in range(3)]
        results = sorted(engine.run(requests), key=lambda r: r.id)
    return reads, calls[0], [r.tokens for r in results]


@pytest.mark.parametrize("lib", ["torch", "jax"])
def test_an_eager_decode_step_reads_nothing_back_but_the_sampled_tokens(lib, monkeypatch):
    """Every decode call of the eager engine, a fresh index's and each carried one's: no read
    of a device array but of the tokens it sampled (one a call)."""
    reads, calls, _ = decode_reads(monkeypatch, lib)
    assert calls >= 8
    assert not reads.forbidden, (len(reads.forbidden), sorted(set(reads.forbidden)))
    assert sum(allowed for _, allowed in reads.seen) >= calls


def test_the_device_path_gives_the_hosts_tokens(monkeypatch):
    """The engine's tokens on torch with its tensors standing for device memory (every tile
    weighed carefully, the row kernels' stand-ins storing and reading) equal those with them in
    host memory."""
    _, _, device = decode_reads(monkeypatch, "torch")
    monkeypatch.undo()
    reads, _, host = decode_reads(monkeypatch, "torch")
    assert device == host


def _refill(lib):
    """A one-lane index over a device-standing table, attended once, and its inputs."""
    import cacheidx as ci

    backend_or_skip(lib)
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 5, 2, 8), dtype=np.float32))
               for _ in range(3))
    pools = [torch.from_numpy(rng.standard_normal((32, 2, 8), dtype=np.float32))
             for _ in range(2)]
    # positions 3 to 7: columns 0 to 2 are read from the pools, never stored by the call
    pos, tab = torch.arange(3, 8)[None, :], torch.arange(8)[None, :]
    return ci, ci.make(pos, tab), (q, k, v, *pools), pos, tab


def test_a_device_table_refilled_in_place_is_declared_by_its_writer(monkeypatch):
    """On a device the index never reads its table back: refilled in place, the writer says
    so (``cacheidx.plan.refilled``) and the call equals a fresh index's over the new table;
    the index's values are read once, the first time (``make`` was handed device arrays)."""
    from cacheidx.backends import torch as torch_backend

    monkeypatch.setattr(torch_backend, "_on_host", lambda *tensors: False)
    import torch

    ci, ix, call, pos, tab = _refill("torch")
    ix.attend(*call)
    before = ix.attend(*call)
    tab[0, :3] = torch.tensor([20, 21, 22])
    values = [pos.numpy().copy(), tab.numpy().copy()]  # the writer's own (not the index's)
    with counting(monkeypatch, "torch") as reads:
        reads.on = True
        untold = ix.attend(*call)  # the writer said nothing: the values the host knows
        ci.plan.refilled(ix, values)
        got = ix.attend(*call)
        reads.on = False
    assert not reads.forbidden, reads.forbidden
    want = ci.make(pos.clone(), tab.clone()).attend(*call)
    assert all(torch.equal(a, b) for a, b in zip(untold, before))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[0], before[0])


def test_refilled_and_advance_refuse_values_of_another_shape():
    """``cacheidx.plan.refilled`` takes one array per tensor, each of its shape;
    ``advance``'s ``host`` one per table given, of its shape, and only with ``table``: each
    else raises naming the function."""
    import cacheidx as ci

    ix = ci.rows(8, [3, 5])
    with pytest.raises(ValueError, match="cacheidx.plan.refilled: the index has 2 tensors"):
        ci.plan.refilled(ix, [np.zeros((2, 5))])
    with pytest.raises(ValueError, match="cacheidx.plan.refilled: tokens.table has shape"):
        ci.plan.refilled(ix, [np.zeros((2, 5)), np.zeros((2, 7))])
    with pytest.raises(ValueError, match="cacheidx.advance: host gives"):
        ix.advance(host=[np.zeros((2, 8))])
    table = np.arange(16).reshape(2, 8)
    with pytest.raises(ValueError, match="cacheidx.advance: host's values of table"):
        ix.advance(table=table, host=[np.zeros((2, 9))])
    with pytest.raises(ValueError, match="cacheidx.advance: host must hold"):
        ix.advance(table=table, host=[table, table])
