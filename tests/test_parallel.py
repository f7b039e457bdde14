"""Past one device: a rank's share of the tiny decoder, the launcher's deadline, and the index
under ``jax.distributed`` (2 processes x 2 CPU devices) and ``torch.distributed`` (gloo, 2
ranks) on loopback, each equal to one process on one device.

The ranks run tests/ranks.py, started by ``cacheidx.parallel.launch``: every rank that fails
ends the launch at once, and nothing outlives its deadline.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ranks

from cacheidx import parallel
from cacheidx.models.llama import Config, convert, empty_pools, forward

ROOT = Path(__file__).resolve().parent.parent
RANKS = str(Path(__file__).resolve().parent / "ranks.py")
DEADLINE = 120  # seconds, per launch: CI's 2 cores run the slowest launch in about 30


def close(got, want):
    """Equal within 1e-5, relative to the logits' size (they reach about 50 here)."""
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def env(**extra):
    e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.pop("XLA_FLAGS", None)
    e.update(extra)
    return e


def rank_outputs(results):
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]


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


# -- the launcher -------------------------------------------------------------------------------

PRINT_ENV = ("import json, os; print(json.dumps({k: os.environ[k] for k in ('RANK', "
             "'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')}))")


def test_launch_gives_each_rank_torchruns_environment_and_one_free_port():
    results = parallel.launch([sys.executable, "-c", PRINT_ENV], 3, deadline=60)
    seen = rank_outputs(results)
    assert [r.returncode for r in results] == [0, 0, 0]
    assert [s["RANK"] for s in seen] == ["0", "1", "2"] == [s["LOCAL_RANK"] for s in seen]
    assert {s["WORLD_SIZE"] for s in seen} == {"3"}
    assert {s["MASTER_ADDR"] for s in seen} == {"127.0.0.1"}
    assert len({s["MASTER_PORT"] for s in seen}) == 1 and int(seen[0]["MASTER_PORT"]) > 0


HANG_OR_RAISE = ("import os, sys, time\n"
                 "if os.environ['RANK'] == '1':\n"
                 "    print('rank 1 is about to fail', file=sys.stderr)\n"
                 "    raise SystemExit('planted failure on rank 1')\n"
                 "time.sleep(600)\n")


def test_a_rank_that_fails_ends_every_rank_at_once_and_is_named():
    t0 = time.monotonic()
    with pytest.raises(parallel.RankFailed) as failed:
        parallel.launch([sys.executable, "-c", HANG_OR_RAISE], 3, deadline=300)
    assert time.monotonic() - t0 < 30  # the sleeping ranks were ended, not waited for
    e = failed.value
    assert e.rank == 1
    assert "rank 1 of 3 failed (exit code 1)" in str(e)
    assert "planted failure on rank 1" in str(e)
    assert [r.returncode for r in e.results] == [None, 1, None]  # None: ended by the launcher


def test_the_deadline_ends_ranks_that_hang():
    t0 = time.monotonic()
    with pytest.raises(parallel.RankFailed, match=r"ranks \[0, 1\] of 2 were still running at "
                                                  r"the deadline of 2s") as failed:
        parallel.launch([sys.executable, "-c", "import time; time.sleep(600)"], 2, deadline=2)
    assert time.monotonic() - t0 < 20
    assert failed.value.rank is None


def test_launch_rejects_a_command_string_and_no_ranks():
    with pytest.raises(TypeError, match="cacheidx.parallel.launch: argv must be a non-empty"):
        parallel.launch("python -c pass", 2)
    with pytest.raises(ValueError, match="cacheidx.parallel.launch: ranks must be a positive"):
        parallel.launch([sys.executable, "-c", "pass"], 0)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_rank_that_raises_inside_a_collective_fails_the_launch_within_seconds(framework):
    """Rank 1 raises while rank 0 waits for it in a collective (gloo would wait 30 minutes)."""
    pytest.importorskip(framework, reason=f"this test runs ranks of {framework}")
    t0 = time.monotonic()
    with pytest.raises(parallel.RankFailed) as failed:
        parallel.launch([sys.executable, RANKS, f"{framework}-raise"], 2, deadline=DEADLINE,
                        env=env(XLA_FLAGS="--xla_force_host_platform_device_count=2",
                                JAX_PLATFORMS="cpu"))
    assert time.monotonic() - t0 < 60
    assert failed.value.rank == 1, str(failed.value)
    assert ranks.PLANTED in str(failed.value)


# -- JAX: 2 processes x 2 devices ---------------------------------------------------------------

@pytest.fixture(scope="module")
def jax_ranks():
    pytest.importorskip("jax", reason="the jax.distributed test needs JAX")
    t0 = time.monotonic()
    results = parallel.launch([sys.executable, RANKS, "jax-decode"], 2, deadline=DEADLINE,
                              env=env(XLA_FLAGS="--xla_force_host_platform_device_count=2",
                                      JAX_PLATFORMS="cpu"))
    print(f"jax.distributed launch: {time.monotonic() - t0:.1f}s")
    return rank_outputs(results)


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
    results = parallel.launch([sys.executable, RANKS, "torch-decode"], 2, deadline=DEADLINE,
                              env=env())
    print(f"torch.distributed launch: {time.monotonic() - t0:.1f}s")
    return rank_outputs(results)


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
        assert out["eager"]["graphs"] == 0
        assert out["compiled"]["graphs"] == 2

