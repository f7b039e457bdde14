"""A tensor-parallel group: who the ranks are, how their parts are summed, where arrays live.

A step of the engine's shape, ``step(params, tokens, index, pools) -> (logits, pools)``
calling ``llama.forward(..., reduce=group.reduce)``, runs tensor-parallel as

    config, params = group.shard(config, host_params)   # this rank's config, placed weights
    pools = group.pools(config, slots)                  # each rank's key-value heads
    run = backend.jit(group.map(step))                  # or eager: group.map(step)
    logits, pools = run(params, group.place(tokens), index.to_device(group.replicated), pools)

- :class:`TorchGroup`: one process per rank (``torch.distributed``); ``reduce`` is the
  functional ``all_reduce``, which ``torch.compile(fullgraph=True)`` traces; ``map`` is the
  step itself, run by every rank on its own weights and pools.
- :class:`JaxGroup`: one program over a mesh (of one process's devices, or of every
  process's under ``jax.distributed``); ``map`` is ``jax.shard_map``, inside which the step
  sees one device's weights and pools and ``reduce`` is ``lax.psum``. The index and the tokens
  are replicated on the mesh, the pools cut on their key-value heads.

Every rank (device) reads the same index: positions and tables are tiny and replicated, the
pools never move.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..models import llama
from .tensor import cuts, shard, split

__all__ = ["JaxGroup", "TorchGroup", "group", "initialize"]


def _env_world() -> tuple[int, int, str]:
    """``(rank, world size, coordinator address)`` from torchrun's environment."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '')}"
    return rank, size, where


def initialize(backend: str) -> None:
    """Start ``backend``'s multi-process runtime from torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), unless it is started or there is one
    process: ``torch.distributed`` with gloo (nccl on CUDA), ``jax.distributed`` with gloo CPU
    collectives unless another implementation was chosen.

    Law: from then on an uncaught exception prints its traceback and ends the process at once
    (exit code 1). Left to the interpreter, ``jax.distributed`` would hold a failed rank in its
    shutdown barrier until every other rank arrived (minutes), and whatever watches the ranks
    for one that failed (torchrun, a job scheduler) would not see it."""
    rank, size, where = _env_world()
    if size == 1:
        return
    _exit_on_error()
    if backend == "torch":
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    elif backend == "jax":
        import jax

        if not getattr(jax.distributed, "is_initialized", lambda: False)():
            # a process-wide option, read when the CPU backend starts: set only where it is
            # unset (older JAX has no CPU collectives by default), never over the user's
            # choice (mpi, or JAX_CPU_COLLECTIVES_IMPLEMENTATION)
            if getattr(jax.config, "jax_cpu_collectives_implementation", None) in (None, "none"):
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator_address=where, num_processes=size,
                                       process_id=rank)
    else:
        raise ValueError(f"cacheidx.parallel.initialize: no multi-process runtime for "
                         f"backend {backend!r} (torch or jax)")


def _exit_on_error() -> None:
    import sys
    import traceback

    def _cacheidx_exit_on_error(kind, value, trace):
        # to the process's own stderr: torch.distributed's hook, which wraps this one, swaps
        # sys.stderr for a buffer it would print only after this hook returned
        traceback.print_exception(kind, value, trace, file=sys.__stderr__)
        sys.__stderr__.flush()
        sys.__stdout__.flush()
        os._exit(1)

    if getattr(sys.excepthook, "__name__", "") != _cacheidx_exit_on_error.__name__:
        sys.excepthook = _cacheidx_exit_on_error


def group(backend: str, k: int) -> TorchGroup | JaxGroup:
    """The group of ``k`` ranks for ``backend``, starting its runtime from torchrun's
    environment if needed: torch, the default process group (which must have ``k`` ranks);
    jax, a mesh of the first ``k`` devices (of every process under ``jax.distributed``).
    Raises ValueError on any other backend or when there are not ``k`` ranks."""
    initialize(backend)
    if backend == "torch":
        return TorchGroup(k=k)
    if backend == "jax":
        import jax

        devices = jax.devices()
        if len(devices) < k:
            raise ValueError(
                f"cacheidx.parallel.group: {k} ranks asked for but jax sees {len(devices)} "
                f"devices (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={k} "
                f"before jax starts, or run {k} processes)")
        return JaxGroup(devices[:k])
    raise ValueError(f"cacheidx.parallel.group: tensor parallelism runs on torch or jax, not "
                     f"{backend!r}")


class TorchGroup:
    """The ranks of a ``torch.distributed`` process group (the default one unless given),
    each a process holding a ``1/size`` part of the weights and pools."""

    def __init__(self, process_group: Any = None, *, k: int | None = None, device: Any = None):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError(
                "cacheidx.parallel.TorchGroup: torch.distributed is not initialised; run under "
                "torchrun and call cacheidx.parallel.initialize('torch') or "
                "torch.distributed.init_process_group first")
        self.process_group = process_group or dist.group.WORLD
        self.rank = dist.get_rank(self.process_group)
        self.size = dist.get_world_size(self.process_group)
        if k is not None and k != self.size:
            raise ValueError(f"cacheidx.parallel.TorchGroup: {k} ranks asked for but the "
                             f"process group has {self.size} (run torchrun --nproc-per-node {k})")
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        self.device = device
        self.lead = self.rank == 0  #: whether this process speaks for the group

    def reduce(self, x: Any) -> Any:
        """The sum of ``x`` over the ranks (functional: a new tensor, traceable)."""
        from torch.distributed._functional_collectives import all_reduce

        return all_reduce(x, "sum", self.process_group)

    def shard(self, config: llama.Config, params: dict) -> tuple[llama.Config, dict]:
        """This rank's config and weights (contiguous torch tensors on its device)."""
        import torch

        mine = shard(params, config, self.rank, self.size)
        placed = llama.convert(mine, xp="torch", device=self.device)
        return split(config, self.size), llama.tree_map(
            lambda w: w.contiguous() if isinstance(w, torch.Tensor) else w, placed)

    def pools(self, config: llama.Config, slots: int, like: Any, kv: str | None = None
              ) -> list:
        """This rank's pools, ``[slots, kv_heads, head_dim]`` of its split ``config``; ``kv``
        as :func:`cacheidx.models.llama.empty_pools` takes it (quantized pools)."""
        return llama.empty_pools(config, slots, like=like, kv=kv)

    def map(self, step: Any) -> Any:
        """Every rank runs ``step`` on its own parts."""
        return step

    def place(self, x: Any) -> Any:
        """``x`` (tokens) where the step reads it: on this rank's device."""
        return x if self.device is None else x.to(self.device)

    @property
    def replicated(self) -> Any:
        """Where an index goes: this rank's device (each rank holds it whole)."""
        import torch

        return self.device if self.device is not None else torch.device("cpu")

    def host(self, x: Any) -> np.ndarray:
        return x.detach().cpu().numpy()


class JaxGroup:
    """The devices of one mesh axis, each holding a ``1/size`` part of the weights and pools
    under ``jax.shard_map``; the mesh may span processes (``jax.distributed``)."""

    def __init__(self, devices: Any = None, *, mesh: Any = None, axis: str = "tp"):
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        if mesh is None:
            mesh = Mesh(np.array(jax.devices() if devices is None else list(devices)), (axis,))
        if axis not in mesh.shape:
            raise ValueError(f"cacheidx.parallel.JaxGroup: the mesh has no axis {axis!r} "
                             f"(it has {tuple(mesh.shape)})")
        self.mesh, self.axis = mesh, axis
        self.size = int(mesh.shape[axis])
        self.rank = jax.process_index()
        self.lead = self.rank == 0
        self.replicated = NamedSharding(mesh, PartitionSpec())
        #: a pool's placement: its key-value heads cut over the axis
        self.cut = NamedSharding(mesh, PartitionSpec(None, axis, None))

    def reduce(self, x: Any) -> Any:
        """The sum of ``x`` over the axis's devices (inside :meth:`map`)."""
        import jax

        return jax.lax.psum(x, self.axis)

    def _spec(self, axis: int | None) -> Any:
        from jax.sharding import PartitionSpec

        if axis is None:
            return PartitionSpec()
        return PartitionSpec(None, self.axis) if axis == 1 else PartitionSpec(self.axis, None)

    def shard(self, config: llama.Config, params: dict) -> tuple[llama.Config, dict]:
        """The config one device sees inside :meth:`map`, and the weights placed on the mesh:
        cut along the heads and hidden units, the rest replicated. Every process passes the
        same host weights."""
        import jax
        from jax.sharding import NamedSharding

        local = split(config, self.size)
        placed = llama.tree_map(lambda w, axis: jax.device_put(
            np.asarray(w), NamedSharding(self.mesh, self._spec(axis))), params, cuts(params))
        return local, placed

    def pools(self, config: llama.Config, slots: int, like: Any = None, kv: str | None = None
              ) -> list:
        """Pools of every device's key-value heads, ``[slots, size * kv_heads, head_dim]`` for
        one device's ``config``, cut on the heads. With ``kv`` (``"int8"``, ``"int4"``: as
        :func:`cacheidx.models.llama.empty_pools` takes it) each is a quantized pool, its
        codes and its scales cut on the heads alike."""
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        fn = "parallel.JaxGroup.pools"
        bits = llama.kv_bits(fn, kv)
        heads = self.size * config.kv_heads
        if bits is None:
            dtype = jnp.float32 if like is None else like.dtype
            shape = (slots, heads, config.head_dim)
            return [(jnp.zeros(shape, dtype, device=self.cut), jnp.zeros(shape, dtype,
                                                                         device=self.cut))
                    for _ in range(config.layers)]
        from ..quantized import Quantized

        if kv == "int4-turned":
            raise ValueError(f"cacheidx.{fn}: kv 'int4-turned' is not cut on the heads here "
                             f"(its scales and zero points are a third part): use 'int8' or "
                             f"'int4'")
        if bits == 4 and config.head_dim % 2:
            raise ValueError(f"cacheidx.{fn}: int4 packs two codes a byte, so head_dim must be "
                             f"even, got {config.head_dim}")
        code = jnp.int8 if bits == 8 else jnp.uint8
        width = config.head_dim if bits == 8 else config.head_dim // 2
        rows = NamedSharding(self.mesh, PartitionSpec(None, self.axis))

        def zeros() -> Quantized:
            return Quantized(jnp.zeros((slots, heads, width), code, device=self.cut),
                             jnp.zeros((slots, heads), jnp.float32, device=rows))

        return [(zeros(), zeros()) for _ in range(config.layers)]

    def _pool_specs(self, pools: list) -> list:
        """Each pool's cut on the heads, each part its own (a quantized pool's codes as a float
        pool's rows, its scales ``[slots, heads]``): a pool of any kind (:mod:`cacheidx.pools`)."""
        from jax.sharding import PartitionSpec

        from .. import pools as kinds

        def part(a: Any) -> Any:
            return self.cut.spec if a.ndim == 3 else PartitionSpec(None, self.axis)

        return [tuple(kinds.map(p, part) for p in pair) for pair in pools]

    def map(self, step: Any) -> Any:
        """``step(params, tokens, index, pools) -> (logits, pools)`` over the mesh: each device
        runs it on its part of the weights and pools, the tokens and index whole."""
        import jax
        from jax.sharding import PartitionSpec

        whole = PartitionSpec()

        # jax.shard_map from JAX 0.6; jax.experimental's before
        shard_map = getattr(jax, "shard_map", None)
        if shard_map is None:
            from jax.experimental.shard_map import shard_map

        def run(params: dict, tokens: Any, index: Any, pools: list) -> Any:
            specs = llama.tree_map(lambda _, axis: self._spec(axis), params, cuts(params))
            cut = self._pool_specs(pools)
            return shard_map(step, mesh=self.mesh, in_specs=(specs, whole, whole, cut),
                             out_specs=(whole, cut))(params, tokens, index, pools)

        return run

    def place(self, x: Any) -> Any:
        """``x`` (tokens) replicated on the mesh."""
        import jax

        return jax.device_put(x, self.replicated)

    def host(self, x: Any) -> np.ndarray:
        """A replicated array's value, read from this process's first copy."""
        return np.asarray(x.addressable_shards[0].data)
