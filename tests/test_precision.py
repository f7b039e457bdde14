"""The model laws' numerical policy: products as imprecise as TF32 still pass the suite, and a
planted index bug (one wrong slot) still fails it."""

from __future__ import annotations

import numpy as np
import pytest

import cacheidx as ci
from cacheidx.attention import runplan
from cacheidx.conformance import LAWS, model
from cacheidx.conformance.precision import GROWTH, Precision
from cacheidx.conformance.runner import run_job
from cacheidx.conformance.suite import Case, Session, compiler_for
from cacheidx.models.llama import matmul

MODEL_LAWS = [law for law in LAWS if law.fn.__module__ == model.__name__]


def rounded(x: np.ndarray, bits: int) -> np.ndarray:
    """float32 ``x`` rounded to nearest with ``bits`` mantissa bits, bit by bit."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    drop = 23 - bits
    u = (u + (1 << (drop - 1))) >> drop << drop
    return u.astype(np.uint32).view(np.float32)


def test_tf32_products_round_their_inputs_to_ten_mantissa_bits():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((5, 7)) * 10.0 ** rng.integers(-3, 4, (5, 7))).astype(np.float32)
    b = rng.standard_normal((7, 3)).astype(np.float32)
    want = rounded(a, 10) @ rounded(b, 10)
    assert np.array_equal(matmul(a, b, 10), want)
    assert np.array_equal(matmul(a, b, None), a @ b)
    assert not np.array_equal(matmul(a, b, 10), a @ b)
    wide = a.astype(np.float64)  # a float64 product keeps 52 bits but rounds to 10 as well
    want_wide = rounded(a, 10).astype(np.float64) @ rounded(b, 10).astype(np.float64)
    assert np.array_equal(matmul(wide, b.astype(np.float64), 10), want_wide)


def test_the_tolerance_follows_the_mantissa_bits():
    assert Precision.highest().tol == GROWTH * 2.0**-23
    assert Precision.emulated(10).tol == GROWTH * 2.0**-10
    numpy = ci.backends.get("numpy")
    assert Precision.named("default", numpy, None).mantissa == 23  # NumPy multiplies in float32
    with pytest.raises(ValueError, match="no precision policy 'fp8'"):
        Precision.named("fp8", numpy, None)


def tf32_case(name: str, mode: str = "eager") -> Case:
    backend = ci.backends.get(name)
    backend.forget()
    return Case(backend, backend.devices()[0], mode=mode,
                session=Session(policy=Precision.emulated(10),
                                compiler=compiler_for(backend, mode, "aot_eager")))


@pytest.mark.parametrize("name,mode", [("numpy", "eager"), ("torch", "compiled")])
def test_the_model_laws_hold_with_tf32_products(name, mode):
    pytest.importorskip(name, reason=f"{name} is not installed")
    case = tf32_case(name, mode)
    with case.backend.many_programs():
        for law in MODEL_LAWS:
            law(Case(case.backend, case.device, mode=mode, session=case.session))


@pytest.fixture
def one_wrong_slot(monkeypatch):
    """NumPy's reads take, for the first column they read, the neighbouring slot. Every read
    goes through the backend's read plan: attend's views of runs of slots and the paged kernel
    (which walks the table itself) are left out."""
    from cacheidx.attention import native

    monkeypatch.setattr(runplan, "MOST_RUNS", -1)
    monkeypatch.setattr(native, "paged", lambda *args: None)
    cls = type(ci.backends.get("numpy"))
    plan = cls.read_plan

    def planted(self, slots, ok, n):
        xp = self.xp
        first = xp.argmax(xp.astype(ok, xp.int8))
        wrong = xp.arange(slots.shape[0], dtype=slots.dtype) == xp.astype(first, slots.dtype)
        return plan(self, xp.where(wrong, (slots + 1) % n, slots), ok, n)

    monkeypatch.setattr(cls, "read_plan", planted)


def test_a_wrong_slot_fails_the_model_laws_under_tf32(one_wrong_slot):
    case = tf32_case("numpy")
    failed = []
    for law in MODEL_LAWS:
        try:
            law(Case(case.backend, case.device, session=case.session))
        except AssertionError as e:
            failed.append((law.name, str(e)))
    reading = [law.name for law in MODEL_LAWS if "packing" not in law.name]  # packed reads no pool
    assert [name for name, _ in failed] == reading, failed
    differences = [float(e.split("max difference ")[1].split()[0]) for _, e in failed
                   if "max difference" in e]
    assert min(differences) > 10 * Precision.emulated(10).tol, differences


def test_a_wrong_slot_fails_the_index_laws_whatever_the_policy(one_wrong_slot):
    job = run_job("numpy", "cpu", ["eager"], precision="tf32")
    laws = job["modes"]["eager"]["laws"]
    assert laws["column_is_position"] != "pass"
    assert job["precision"]["policy"] == "emulated" and job["precision"]["matmul_mantissa"] == 10


def test_the_report_records_the_policy_per_device():
    job = run_job("numpy", "cpu", ["eager"])
    assert job["precision"] == {"policy": "highest", "matmul_mantissa": 23,
                                "model_tolerance": GROWTH * 2.0**-23,
                                "device_default_mantissa": 23, "index_laws": "bit for bit"}
    assert all(outcome == "pass" for outcome in job["modes"]["eager"]["laws"].values())
