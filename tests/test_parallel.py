"""Past one device: a rank's share of the tiny decoder, and the index under ``jax.distributed``
(2 processes x 2 CPU devices) and ``torch.distributed`` (gloo, 2 ranks) on loopback, each equal
to one process on one device.

The ranks run tests/ranks.py, started by tests/processes.py (``torchrun --standalone`` for
torch, plain processes for jax) under a timeout: a rank that fails ends the run at once, a run
that outlives its timeout is ended, and either fails the test with every rank's output.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ranks
from processes import RanksFailed, processes, torchrun

from cacheidx import parallel
from cacheidx.models.llama import Config, convert, empty_pools, forward

ROOT = Path(__file__).resolve().parent.parent
RANKS = str(Path(__file__).resolve().parent / "ranks.py")
TIMEOUT = 120  # seconds, per run: CI's 2 cores run the slowest in about 30


def close(got, want):
    """Equal within 1e-5, relative to the logits' size (they reach about 50 here)."""
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def env(**extra):
    e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.pop("XLA_FLAGS", None)
    e.update(extra)
    return e


# -- one rank's share ---------------------------------------------------------------------------

def test_split_gives_each_rank_a_kth_of_the_heads_and_hidden_units():
    c = Config.tiny(heads=8, kv_heads=4, dim=64, hidden=64)
    local = parallel.split(c, 4)
    assert (local.heads, local.kv_heads, local.hidden) == (2, 1, 16)
    assert (local.dim, local.head_dim, local.layers, local.vocab) == (64, 8, 2, 64)
    assert parallel.split(c, 1) == c


@pytest.mark.parametrize("k, what", [(2, "3 key-value heads"), (4, "3 key-value heads"),
                                     (9, "3 key-value heads")])
def test_split_raises_when_the_heads_do_not_divide(k, what):
    smollm2 = Config(vocab=49152, dim=576, layers=30, heads=9, kv_heads=3, hidden=1536,
                     head_dim=64)
    with pytest.raises(ValueError, match=f"cacheidx.parallel.split: the model's {what} do not "
                                         f"split over {k} ranks"):
        parallel.split(smollm2, k)
    assert parallel.split(smollm2, 3).kv_heads == 1


def test_split_and_shard_reject_a_rank_count_or_rank_out_of_range():
    c = Config.tiny()
    for k in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cacheidx.parallel.split: the number of ranks"):
            parallel.split(c, k)
    params = {"embed": np.zeros((4, 2)), "layers": [], "norm": np.zeros(2)}
    with pytest.raises(ValueError, match=r"cacheidx.parallel.shard: rank must be in range\(2\)"):
        parallel.shard(params, c, 2, 2)


def test_shard_cuts_projections_in_by_columns_and_out_by_rows():
    s = ranks.scenario()
    c, params = s["config"], s["params"]
    mine = parallel.shard(params, c, 1, 2)
    whole, half = params["layers"][0], mine["layers"][0]
    np.testing.assert_array_equal(half["wq"], whole["wq"][:, 32:])  # query heads 4 to 7
    np.testing.assert_array_equal(half["wk"], whole["wk"][:, 16:])  # their key-value heads 2, 3
    np.testing.assert_array_equal(half["wo"], whole["wo"][32:, :])
    np.testing.assert_array_equal(half["w_up"], whole["w_up"][:, 32:])
    np.testing.assert_array_equal(half["w_down"], whole["w_down"][32:, :])
    assert mine["embed"] is params["embed"] and half["attn_norm"] is whole["attn_norm"]


class Summing:
    """The ranks of one process as threads: ``reduce`` waits for every rank's part and returns
    their sum (in rank order, as every rank sees it)."""

    def __init__(self, k):
        self.parts, self.gate = [None] * k, threading.Barrier(k, timeout=60)

    def reduce_of(self, rank):
        def reduce(x):
            self.parts[rank] = x
            self.gate.wait()
            total = sum(self.parts[1:], self.parts[0])
            self.gate.wait()
            return total

        return reduce


@pytest.mark.parametrize("k", [1, 2, 4])
def test_ranks_summing_their_parts_equal_the_whole_model(k):
    """Prefill and 16 decode steps, paged, on NumPy: k ranks (threads) each with its share of
    the weights and of the key-value heads' pools, one index, give the whole model's logits."""
    s = ranks.scenario()
    c, params = s["config"], s["params"]
    want = ranks.decode(np, lambda p, t, i, pools: forward(p, c, t, i, pools), params,
                        empty_pools(c, s["slots"]))
    local, summing, got = parallel.split(c, k), Summing(k), [None] * k

    def rank(r):
        reduce = summing.reduce_of(r)
        try:
            got[r] = ranks.decode(np, lambda p, t, i, pools: forward(p, local, t, i, pools,
                                                                      reduce=reduce),
                                  parallel.shard(params, c, r, k), empty_pools(local, s["slots"]))
        except BaseException as e:  # the other ranks stop waiting for this one's parts
            summing.gate.abort()
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(k):
        assert isinstance(got[r], list), f"rank {r} raised {got[r]!r}"
        assert len(got[r]) == ranks.STEPS + 1
        for a, b in zip(got[r], want, strict=True):
            close(a, b)


def test_group_names_the_backends_it_serves():
    with pytest.raises(ValueError, match="cacheidx.parallel.group: tensor parallelism runs on "
                                         "torch or jax, not 'numpy'"):
        parallel.group("numpy", 2)


# -- ranks that fail or hang ---------------------------------------------------------------------

JAX_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}


def start(framework, mode, *, timeout=TIMEOUT):
    """Two ranks of ``tests/ranks.py MODE``: torchrun's for torch, plain processes for jax."""
    if framework == "torch":
        return torchrun([RANKS, mode], 2, timeout=timeout, env=env())
    return processes([sys.executable, RANKS, mode], 2, timeout=timeout, env=env(**JAX_ENV))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_rank_that_raises_inside_a_collective_fails_the_run_within_seconds(framework):
    """Rank 1 raises while rank 0 waits for it in a collective (gloo would wait 30 minutes)."""
    pytest.importorskip(framework, reason=f"this test runs ranks of {framework}")
    t0 = time.monotonic()
    with pytest.raises(RanksFailed, match=r"the run of 2 ranks failed \(exit code") as failed:
        start(framework, f"{framework}-raise")
    assert time.monotonic() - t0 < 60
    assert ranks.PLANTED in failed.value.ranks.stderr[1]
    assert "--- rank 1 stderr (end) ---\nTraceback" in str(failed.value)


def _running(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has ended, and waits only for its parent


def test_ranks_that_outlive_the_timeout_are_ended_and_their_output_named():
    # plain processes: torchrun's own start takes 2 to 6 s here, which a short timeout would
    # race (its path, SIGTERM to torchrun, which ends its ranks, is the same law)
    if not Path("/proc/self/stat").exists():
        pytest.skip("reads whether a rank still runs from /proc")
    t0 = time.monotonic()
    with pytest.raises(RanksFailed, match="2 ranks were still running after the timeout of "
                                          "2 s") as failed:
        processes([sys.executable, RANKS, "sleep"], 2, timeout=2, env=env())
    assert time.monotonic() - t0 < 20
    e = failed.value
    assert e.ranks.returncode is None
    pids = [e.ranks.json(r)["pid"] for r in range(2)]
    assert f'--- rank 1 stdout (end) ---\n{{"pid": {pids[1]}}}' in str(e)
    assert not any(_running(pid) for pid in pids)


# -- JAX: 2 processes x 2 devices ---------------------------------------------------------------

@pytest.fixture(scope="module")
def jax_ranks():
    pytest.importorskip("jax", reason="the jax.distributed test needs JAX")
    t0 = time.monotonic()
    run = start("jax", "jax-decode")
    print(f"jax.distributed run: {time.monotonic() - t0:.1f}s")
    return [run.json(r) for r in range(2)]


def test_jax_ranks_form_one_mesh_of_four_devices(jax_ranks):
    assert [(o["rank"], o["processes"], o["devices"], o["local_devices"]) for o in jax_ranks] \
        == [(0, 2, 4, 2), (1, 2, 4, 2)]


def test_jax_over_two_processes_equals_one_device(jax_ranks):
    import jax
    import jax.numpy as jnp

    s = ranks.scenario()
    c, params = s["config"], convert(s["params"], xp="jax")
    step = jax.jit(lambda p, t, i, pools: forward(p, c, t, i, pools))
    want = ranks.decode(jnp, step, params, empty_pools(c, s["slots"], like=params["embed"]))
    for out in jax_ranks:
        assert len(out["logits"]) == ranks.STEPS + 1
        for got, one in zip(out["logits"], want, strict=True):
            close(got, one)


def test_jax_pools_stay_cut_on_heads_and_the_index_whole_after_every_step(jax_ranks):
    calls = ranks.STEPS + 1
    for out in jax_ranks:
        assert out["pools_cut"] == [True] * calls
        # each process holds 2 of the 4 devices' shards: one key-value head of 4 each
        assert out["shard_shapes"] == [[[ranks.PAGES * ranks.PAGE, 1, 8]]] * calls
        assert out["index_whole"] == [True] * calls


def test_jax_each_process_compiles_one_program_per_shape(jax_ranks):
    # the prefill's program, then the decode step's, which all 16 steps share
    for out in jax_ranks:
        assert out["programs"] == [1] + [2] * ranks.STEPS


# -- PyTorch: 2 ranks of gloo --------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_ranks():
    pytest.importorskip("torch", reason="the torch.distributed test needs torch")
    t0 = time.monotonic()
    run = start("torch", "torch-decode")
    print(f"torch.distributed run (torchrun): {time.monotonic() - t0:.1f}s")
    return [run.json(r) for r in range(2)]


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_torch_tensor_parallel_equals_one_process(torch_ranks, mode):
    import torch

    s = ranks.scenario()
    c, params = s["config"], convert(s["params"], xp="torch")
    want = ranks.decode(torch, lambda p, t, i, pools: forward(p, c, t, i, pools), params,
                        empty_pools(c, s["slots"], like=params["embed"]),
                        host=lambda x: x.numpy())
    for out in torch_ranks:
        assert out["size"] == 2
        got = out[mode]
        assert len(got["logits"]) == ranks.STEPS + 1
        for a, b in zip(got["logits"], want, strict=True):
            close(a, b)
        # each rank holds half the key-value heads' pools, after every call
        assert got["pool_shapes"] == [[[ranks.PAGES * ranks.PAGE, 2, 8]]] * (ranks.STEPS + 1)


def test_torch_compiles_the_step_with_its_all_reduce_once_per_shape(torch_ranks):
    # fullgraph=True: a collective that broke the graph would have raised; 2 graphs, prefill
    # and decode, for 17 calls
    for out in torch_ranks:
        assert out["compiled"]["graphs"] == 2

