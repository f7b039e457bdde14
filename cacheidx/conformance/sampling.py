"""The engine's sampling law (:mod:`cacheidx.sampling`'s laws 1 and 2, the engine's choice)
on every backend and mode: a sampled token is a function of the lane's logits, seed, sample
number and step alone, whatever else is in the batch; temperature 0 is the argmax.

One small case (a vocabulary of 64, lanes of fixed logits and draws): the token of each lane
is computed by NumPy here (the reference, the array API's NumPy), and each backend must give
the same tokens in a batch of 8 lanes (the 4 lanes and the same 4 in another order, beside
each other), in that batch reversed, and, eagerly, for a lane alone (but on JAX, where a
new shape is a compile). A compiled mode compiles the batch once (2 to 3 s on torch, 1 s on
JAX, on this 2-core machine), its tokens equal to eager's bit for bit.
"""

from __future__ import annotations

import numpy as np

from .. import backends, sampling
from .suite import Case, law

VOCAB = 64
#: per lane: temperature, top_k, top_p, min_p, seed, sample, step (lane 3 greedy)
LANES = [(1.0, 0, 1.0, 0.0, 7, 0, 0), (0.7, 8, 0.9, 0.0, 2**63 + 5, 3, 11),
         (2.0, 0, 0.8, 0.05, 123, 1, 2), (0.0, 0, 1.0, 0.0, 9, 0, 4)]
ORDER = [0, 1, 2, 3, 2, 0, 3, 1]  #: the batch: every lane twice, the second time in another order


def _case() -> tuple[np.ndarray, list[np.ndarray]]:
    """The batch's logits ``[8, VOCAB]`` and its draw's host arrays."""
    logits = np.random.default_rng(39).standard_normal((len(LANES), VOCAB)).astype(np.float32)
    logits[3, 5] = logits[3, 9] = logits[3].max() + 1  # a tie: the argmax takes the first
    t, k, p, m, seed, sample, step = (np.asarray([LANES[b][f] for b in ORDER])
                                      for f in range(7))
    return logits[ORDER], [t.astype(np.float32), k.astype(np.int32), p.astype(np.float32),
                           m.astype(np.float32),
                           sampling.lane_key(seed.astype(np.uint64), sample, step)]


def _reference() -> np.ndarray:
    logits, d = _case()
    return np.asarray(sampling.choose(backends.get("numpy").xp, logits, sampling.Draw(*d)))


_EAGER: dict = {}


def _eager(case: Case):
    """The batch's step as the engine runs it eagerly (its step's law 9): one program where the
    library compiles each eager operation apart (JAX), its operations elsewhere; made once per
    backend and device, so every mode's run shares its programs."""
    key = (case.name, repr(case.device))
    if key not in _EAGER:
        xp, device = case.xp, case.device

        def step(lg, t, k, p, m, key):
            return sampling.choose(xp, lg, sampling.Draw(t, k, p, m, key), device=device)

        step.__name__ = "sampling.choose"
        _EAGER[key] = case.backend.one_program(step)
    return _EAGER[key]


@law
def law_a_sampled_token_is_its_seed_sample_and_steps_whatever_the_batch(case: Case) -> None:
    """Each lane's token is the reference's (NumPy's) on this backend and mode, beside other
    lanes in any order and (eagerly) alone; temperature 0 is the argmax, ties to the first."""
    logits, d = _case()
    xp, be = case.xp, case.backend

    def arrays(rows):
        return ([be.from_host(logits[rows], xp.float32, case.device)]
                + [be.from_host(a[rows], getattr(xp, a.dtype.name), case.device) for a in d])

    eager = _eager(case)
    want = case.session.memo.setdefault("sampling", None)
    if want is None:
        want = case.session.memo["sampling"] = _reference()
    got = case.numpy(case.call(eager, *arrays(slice(None))))
    assert got.tolist() == want.tolist(), (got.tolist(), want.tolist())
    assert got[3] == 5 and got[6] == 5  # the greedy lane: the first of the tie
    flipped = case.numpy(eager(*arrays(list(range(len(ORDER))[::-1]))))  # reversed
    assert flipped.tolist() == want[::-1].tolist(), (flipped.tolist(), want.tolist())
    # alone, eagerly, where a new shape compiles nothing (JAX would compile one: its engine
    # test, tests/test_sampling.py, runs a request alone and beside 7 others)
    for b in () if case.compiled or case.name == "jax" else (2, 7):
        alone = case.numpy(eager(*arrays(slice(b, b + 1))))
        assert alone.tolist() == [want[b]], (b, alone.tolist(), want[b])
    for b, lane in enumerate(ORDER):  # every copy of a lane, wherever it sits, alike
        first = ORDER.index(lane)
        assert got[b] == got[first], (b, first, got.tolist())
