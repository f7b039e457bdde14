"""The paged kernel (:mod:`cacheidx.attention.paged`) keeps attention's law 2 on a decode step:
its output is softmax attention over ``extend``'s seen under ``mask``, against the float64
reference, on random paged tables (pages in any order, a partial last page, lanes sharing a
prefix's pages, windows, padding lanes, sinks, grouped heads), for every pool it reads
(float32, float16, bfloat16, int8, int4; token- and head-major), on NumPy and torch, over one
thread and two; and it leaves the call to the core where the law's values need the core's
care (a value that is not finite) or a gradient is asked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cacheidx as ci
from cacheidx import quantized, turned
from cacheidx.attention import layout, native, paged, runs
from cacheidx.attention.softmax import reference

PAGE, KV, G, D = 16, 3, 3, 64


def kernel_or_skip():
    if native.kernel() is None:
        pytest.skip("no C compiler builds the CPU kernel here")


def lib_or_skip(lib: str):
    if lib == "torch":
        return pytest.importorskip("torch")
    return None


def paged_table(rng, lanes: int, width: int, shared: int = 0) -> np.ndarray:
    """``[lanes, width]`` slots: each lane's pages drawn in a random order from one pool, the
    first ``shared`` columns' pages the same for every lane."""
    per = -(-width // PAGE)
    common = -(-shared // PAGE)
    order = rng.permutation(common + lanes * per)
    table = np.zeros((lanes, per * PAGE), np.int64)
    for b in range(lanes):
        mine = np.r_[order[:common], order[common + b * per:common + (b + 1) * per]][:per]
        table[b] = (mine[:, None] * PAGE + np.arange(PAGE)[None, :]).reshape(-1)
    return table[:, :width]


def used(monkeypatch) -> list[bool]:
    """Whether each call offered to the paged kernel went through it."""
    calls: list[bool] = []
    real = native.paged

    def spy(*args):
        got = real(*args)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(native, "paged", spy)
    return calls


def step(lib: str, rng, lens, *, kind="float32", window=None, shared=0, sinks=False,
         order="head", width=None, group=16):
    """A decode step's arguments: ``(index, q, k, v, kpool, vpool, sinks)``, the pools holding
    random rows at every slot, lane ``b`` at position ``lens[b] - 1`` (-1: padding)."""
    torch = lib_or_skip(lib)
    lanes = len(lens)
    width = width or max(max(lens), 1) + PAGE // 2
    table = paged_table(rng, lanes, width, shared)
    n = int(table.max()) + 1 + PAGE
    pos = (np.asarray(lens) - 1)[:, None]
    conv = (lambda a: torch.as_tensor(a)) if torch else (lambda a: a)
    index = ci.make(conv(pos), conv(table))
    if window is not None:
        index = index.window(window)
    xp = index.backend.xp
    f32 = np.float32

    def rows(*shape):
        return rng.standard_normal(shape).astype(f32)

    def pool(x):
        if kind in ("int8", "int4", "turned"):
            if kind == "turned":
                empty = turned.zeros(n, KV, D, group=group, xp=lib, layout=order)
            else:
                empty = quantized.zeros(n, KV, D, bits=8 if kind == "int8" else 4, xp=lib,
                                        layout=order)
            everyone = ci.make(conv(np.zeros((1, n), np.int64) + np.arange(n)[None, :]),
                               conv(np.arange(n)[None, :]))
            return everyone.extend(xp.asarray(conv(x[None])), empty, donate=True)[1]
        p = layout.zeros(xp, n, KV, D, dtype=getattr(xp, kind), layout=order)
        if torch:
            p.copy_(torch.as_tensor(x).to(p.dtype))
        else:
            p[...] = x.astype(p.dtype)
        return p

    kp, vp = pool(rows(n, KV, D)), pool(rows(n, KV, D))
    dt = getattr(xp, kind) if kind not in ("int8", "int4", "turned") else xp.float32
    q = xp.asarray(conv(rows(lanes, 1, KV * G, D)))
    k, v = (xp.astype(xp.asarray(conv(rows(lanes, 1, KV, D))), dt) for _ in range(2))
    s = xp.asarray(conv(rows(KV * G))) if sinks else None
    return index, q, k, v, kp, vp, s


def check(index, q, k, v, kp, vp, s, *, atol=2e-5):
    out = index.attend(q, k, v, kp, vp, sinks=s)[0]
    seen_k, _ = index.extend(k, kp)
    seen_v, _ = index.extend(v, vp)
    f64 = [np.asarray(_host(a), dtype=np.float64) for a in (q, seen_k, seen_v)]
    want = reference(*f64, np.asarray(_host(index.mask())),
                     sinks=None if s is None else np.asarray(_host(s), np.float64))
    np.testing.assert_allclose(np.asarray(_host(out), np.float64), want, rtol=1e-4,
                               atol=atol)
    return out


def _host(x):
    return x.float().numpy() if hasattr(x, "numpy") and hasattr(x, "float") else np.asarray(x)


LIBS = ["numpy", "torch"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("seed", range(3))
def test_paged_decode_equals_the_reference_on_random_tables(lib, seed, monkeypatch):
    """Pages in any order, partial last pages, a padding lane and a lane of one token."""
    kernel_or_skip()
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in rng.integers(1, 300, 5)] + [-0, 1]
    calls = used(monkeypatch)
    check(*step(lib, rng, lens))
    assert calls == [True], "the step went through the paged kernel"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("order", ["head", "token"])
def test_paged_decode_equals_the_reference_for_every_pool_it_reads(lib, kind, order,
                                                                   monkeypatch):
    kernel_or_skip()
    if lib == "numpy" and kind == "bfloat16":
        pytest.skip("NumPy has no bfloat16")
    rng = np.random.default_rng(7)
    calls = used(monkeypatch)
    index, q, k, v, kp, vp, s = step(lib, rng, [90, 17, 200], kind=kind, order=order)
    out = check(index, q, k, v, kp, vp, s, atol=2e-5 if kind == "float32" else 4e-3)
    assert calls == [True]
    assert out.dtype == q.dtype


@pytest.mark.parametrize("lib", LIBS)
def test_paged_decode_under_a_window_with_sinks(lib, monkeypatch):
    kernel_or_skip()
    calls = used(monkeypatch)
    check(*step(lib, np.random.default_rng(3), [250, 40, 7], window=33, sinks=True))
    assert calls == [True]


@pytest.mark.parametrize("lib", LIBS)
def test_lanes_sharing_a_prefix_are_read_once_by_the_core_or_by_the_kernel_apart(
        lib, monkeypatch):
    """Lanes whose tables share a prefix's pages: the core reads it once for them (the paged
    step declines before reading), and the kernel then reads each lane's own columns alone
    (past the prefix, in one call); within :func:`~cacheidx.attention.runs.unshared`, the
    kernel reads each lane's whole. Both equal the reference."""
    kernel_or_skip()
    read = []  # the most columns a lane read in each call the kernel took
    real = native.paged
    monkeypatch.setattr(native, "paged", lambda q, table, start, stop, *pools: read.append(
        int(np.max(stop - start))) or real(q, table, start, stop, *pools))
    lens = [300, 290, 310]
    args = step(lib, np.random.default_rng(4), lens, shared=256)
    check(*args)
    assert read == [max(lens) - 256], "the kernel read more than the lanes' own columns"
    args = step(lib, np.random.default_rng(4), lens, shared=256)
    with runs.unshared():
        check(*args)
    assert read[1:] == [max(lens)]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize(("group", "order", "shared"), [(16, "token", 0), (64, "head", 0),
                                                        (16, "head", 256), (32, "token", 256)])
def test_paged_decode_reads_turned_pools_as_their_rows(lib, group, order, shared, monkeypatch):
    """Turned pools (:mod:`cacheidx.turned`): the kernel reads each row's codes above their
    zero points, a scale a group (T3's first half, bit for bit), the query turned before the
    call and the output after it; the answer is the reference's over the rows the pools
    stand for (``extend``'s seen), to float32's rounding, a prefix shared or not."""
    kernel_or_skip()
    calls = used(monkeypatch)
    args = step(lib, np.random.default_rng(4), [300, 290, 310], shared=shared, kind="turned",
                group=group, order=order)
    check(*args, atol=2e-5)
    assert calls and all(calls), "the step went through the paged kernel"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize(("group", "order", "lens"), [
    (16, "head", [300, 290, 310]), (64, "token", [300, 290, 310, 305, 295, 300])])
def test_a_shared_run_of_turned_slots_is_read_by_the_kernel(lib, group, order, lens,
                                                             monkeypatch):
    """Turned pools under a shared prefix: the core reads the prefix once for the lanes sharing
    it, pages every one of their queries sees whole, and those go through the kernel (its paged
    entry over their slots in order, the lanes' rows stacked as one lane's queries, at most
    ``ROWS`` a call: one call for 3 lanes of 3 rows, two for 6), as the lanes' own columns do;
    the answer is the reference's over the rows the pools stand for."""
    kernel_or_skip()
    lanes: list[int] = []
    real = native.paged

    def spy(q, *rest):
        got = real(q, *rest)
        lanes.append(int(q.shape[0]) if got is not None else 0)
        return got

    monkeypatch.setattr(native, "paged", spy)
    check(*step(lib, np.random.default_rng(6), lens, shared=256, kind="turned", group=group,
                order=order), atol=2e-5)
    calls = -(-len(lens) * G // native.ROWS)
    assert 0 not in lanes and lanes.count(1) == calls and len(lens) in lanes, (
        f"the kernel's calls (lanes a call; 0: refused): {lanes}")


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("shared", [0, 256])
def test_the_kernel_refuses_pools_of_a_kind_it_does_not_read(lib, shared, monkeypatch):
    """A kind whose :class:`~cacheidx.pools.Kind` does not name the paged entry: every entry
    of the kernel refuses it by its kind (its parts alone would pass for int4 codes with one
    scale a token), and the core's answer equals the reference, a prefix shared or not."""
    kernel_or_skip()
    monkeypatch.setattr(type(ci.pools.kind(turned.zeros(1, 1, 2, group=2))), "kernel",
                        frozenset())
    calls = used(monkeypatch)
    check(*step(lib, np.random.default_rng(4), [300, 290, 310], shared=shared, kind="turned"),
          atol=4e-3)
    assert not any(calls), "the kernel read a kind it does not name"


@pytest.mark.parametrize("threads", [1, 2])
def test_paged_decode_is_the_same_over_one_thread_and_two(threads, monkeypatch):
    """Lanes x kv heads split over the threads the call is given: the same bits. Where the
    kernel links OpenMP, its threads are torch's intra-op pool (a process holds one
    ``libgomp.so.1``), never a second pool beside it that would spin on the same cores."""
    torch = pytest.importorskip("torch")
    kernel_or_skip()
    monkeypatch.setattr(native.pages, "THREADED", 0)
    kept = torch.get_num_threads()
    outs = []
    try:
        for t in (1, threads):
            torch.set_num_threads(t)
            outs.append(check(*step("torch", np.random.default_rng(5), [400, 30, 260, 128])))
    finally:
        torch.set_num_threads(kept)
    assert torch.equal(outs[0], outs[1])
    maps = Path("/proc/self/maps")
    if maps.exists():  # Linux: the libraries the process loaded
        gomps = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
        assert len(gomps) <= 1, gomps


@pytest.mark.parametrize("lib", LIBS)
def test_a_value_that_is_not_finite_is_weighed_by_the_core(lib, monkeypatch):
    """A seen NaN value: the kernel refuses the state, and the core makes that lane's outputs
    at its kv head NaN, the other lanes' as the reference."""
    kernel_or_skip()
    calls = used(monkeypatch)
    index, q, k, v, kp, vp, s = step(lib, np.random.default_rng(6), [50, 60])
    slot = int(np.asarray(_host(index.table))[1, 10])
    kp, vp = kp, vp
    vp[slot, 1, 3] = float("nan")
    out = np.asarray(_host(index.attend(q, k, v, kp, vp)[0]))
    assert calls == [False], "the kernel refused the state"
    assert np.isnan(out[1, 0, G:2 * G]).all() and np.isfinite(out[0]).all()
    assert np.isfinite(out[1, 0, :G]).all()


def test_the_paged_kernel_declines_where_a_gradient_is_asked(monkeypatch):
    torch = pytest.importorskip("torch")
    kernel_or_skip()
    calls = used(monkeypatch)
    index, q, k, v, kp, vp, s = step("torch", np.random.default_rng(8), [40, 70])
    q = q.clone().requires_grad_(True)
    out = index.attend(q, k, v, kp, vp)[0]
    assert out.requires_grad and calls == []
    with torch.no_grad():
        index.attend(q, k, v, kp, vp)
    assert calls == [True]


def test_a_lane_with_a_hole_is_left_to_the_core():
    """A seen column whose slot is -1 (a hole): the plan refuses, the core reads it as zero."""
    kernel_or_skip()
    table = paged_table(np.random.default_rng(9), 2, 64)
    table[0, 5] = -1
    index = ci.make(np.array([[40], [50]]), table)
    assert paged.plan(index, int(table.max()) + 1, KV * G, True) is None


def test_the_kernel_reads_no_slot_past_a_lanes_last_column():
    """The table's last lane ends 5 columns past a multiple of 16, the table's last byte just
    before a page the process may not read (Linux): a read of the slots past that column ends
    the process. The kernel takes 16 columns at a time, and its source read all 16 slots
    (builds so far dropped the read past the end; nothing made them)."""
    kernel_or_skip()
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "mprotect") or not hasattr(mmap, "PROT_READ"):
        pytest.skip("no mprotect here to guard the table's end")
    lanes, width = 2, 37
    rng = np.random.default_rng(11)
    want = paged_table(rng, lanes, width)
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert libc.mprotect(ctypes.c_void_p(base + page), page, 0) == 0  # PROT_NONE
    try:
        table = np.frombuffer(region, np.int64, lanes * width,
                              page - lanes * width * 8).reshape(lanes, width)
        table[...] = want
        n = int(want.max()) + 1
        q = rng.standard_normal((lanes, KV, G, D)).astype(np.float32)
        k, v = (rng.standard_normal((n, KV, D)).astype(np.float32) for _ in range(2))
        start, stop = np.zeros(lanes, np.int64), np.full(lanes, width, np.int64)
        m, l, acc = native.paged(q, table, start, stop, k, v)
        f64 = [x.astype(np.float64) for x in (q.reshape(lanes, 1, KV * G, D), k[want], v[want])]
        want_out = reference(*f64, np.ones((lanes, 1, width), bool), scale=1.0)  # q is scaled
        np.testing.assert_allclose((acc / l[..., None]).reshape(lanes, 1, KV * G, D), want_out,
                                   rtol=1e-4, atol=1e-5)
    finally:
        del table
        libc.mprotect(ctypes.c_void_p(base + page), page, mmap.PROT_READ | mmap.PROT_WRITE)
        region.close()
