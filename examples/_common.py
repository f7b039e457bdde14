"""What every example shares: the ``--backend`` flag, the tiny Llama with random weights, arrays
in the chosen library, and a small record of the checks an example makes.

Each example's ``main(argv)`` returns a :class:`Checks`; it raises ``AssertionError`` at the first
check that fails, so ``python examples/NAME.py`` exits non-zero when the library is wrong.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout runs too

import cacheidx as ci  # noqa: E402
from cacheidx.models import llama  # noqa: E402

BACKENDS = ("numpy", "torch", "jax")


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--backend", choices=BACKENDS, default="numpy",
                   help="the array library the model and the index run on (default numpy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")
    return p


class Env:
    """The model and the array library of one run."""

    def __init__(self, backend: str, *, seed: int = 0, **config):
        # an untied output head: with random weights a tied one mostly repeats its input token
        config.setdefault("tied", False)
        self.name = backend
        self.backend = ci.backends.get(backend)
        self.xp = self.backend.xp
        info = getattr(self.xp, "__array_namespace_info__", None)
        # int64 where the library has it enabled (JAX without x64 uses int32)
        self.int = info().default_dtypes()["integral"] if info else self.xp.int64
        self.cfg = llama.Config.tiny(**config)
        self.params = llama.random_params(self.cfg, seed=seed, xp=backend)
        self.reference = llama.random_params(self.cfg, seed=seed)  # the same weights, NumPy
        self.rng = np.random.default_rng(seed + 1)
        self._steps: dict = {}

    # -- arrays ---------------------------------------------------------------------------
    def ints(self, a) -> object:
        return self.xp.asarray(np.asarray(a, dtype=np.int64), dtype=self.int)

    def bools(self, a) -> object:
        return self.xp.asarray(np.asarray(a, dtype=bool))

    @staticmethod
    def numpy(x) -> np.ndarray:
        if hasattr(x, "detach"):  # torch
            x = x.detach().cpu()
        return np.asarray(x)

    # -- the model ------------------------------------------------------------------------
    def pools(self, slots: int):
        return llama.empty_pools(self.cfg, slots, like=self.params["embed"])

    def forward(self, tokens, index, pools, *, last: bool = False):
        """``llama.forward`` on token ids given as NumPy (or lists); logits come back as NumPy.

        On JAX the step is compiled with ``jax.jit``: the index is an ordinary (pytree)
        argument, so one program serves every position and table of the same shapes."""
        step = self._steps.get(last)
        if step is None:
            def step(params, tokens, index, pools, cfg=self.cfg, last=last):
                return llama.forward(params, cfg, tokens, index, pools, last=last)

            step = self._steps[last] = self.compile(step)
        logits, pools = step(self.params, self.ints(tokens), index, pools)
        return self.numpy(logits), pools

    def compile(self, fn):
        """``fn`` compiled with ``jax.jit`` on JAX (an index is a pytree argument); else
        ``fn`` itself."""
        return self.backend.jit(fn) if self.name == "jax" else fn

    def alone(self, tokens) -> np.ndarray:
        """Logits ``[n, vocab]`` of one sequence computed alone with no cache, eagerly on NumPy
        whatever the backend (the same weights): the reference every example compares with."""
        tokens = np.asarray([list(tokens)], dtype=np.int64)
        index = ci.whole(1, tokens.shape[1], xp="numpy")
        logits, _ = llama.forward(self.reference, self.cfg, tokens, index,
                                  llama.empty_pools(self.cfg, 1))
        return logits[0]

    def prompt(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(1, self.cfg.vocab, size=n)]


class Checks:
    """Prints each check as it is made and keeps it; raises at the first that fails."""

    def __init__(self, title: str):
        self.title = title
        self.results: dict[str, bool] = {}
        self.values: dict[str, object] = {}
        self._start = time.perf_counter()
        print(title)

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        ok = bool(ok)
        self.results[what] = ok
        print(f"  [{'ok' if ok else 'FAIL'}] {what}" + (f"  ({detail})" if detail else ""))
        if not ok:
            raise AssertionError(f"{self.title}: {what} {detail}")

    def close(self, what: str, got, want, *, atol: float = 2e-4) -> None:
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        err = float(np.max(np.abs(got - want))) if got.size else 0.0
        self.check(what, got.shape == want.shape and err <= atol,
                   f"max |difference| {err:.1e}, shape {got.shape}")

    def equal(self, what: str, got, want) -> None:
        got, want = np.asarray(got), np.asarray(want)
        self.check(what, got.shape == want.shape and np.array_equal(got, want),
                   f"{got.tolist()}" if got.size <= 12 else f"shape {got.shape}")

    def note(self, key: str, value) -> None:
        self.values[key] = value

    @property
    def ok(self) -> bool:
        return all(self.results.values())

    def done(self) -> Checks:
        print(f"{len(self.results)} checks passed in {time.perf_counter() - self._start:.1f} s")
        return self


def greedy_alone(env: Env, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy decoding with no cache: the whole sequence again at every step. Returns the new
    tokens and the logits ``[steps, vocab]`` that chose them."""
    seq, chosen = list(prompt), []
    for _ in range(steps):
        last = env.alone(seq)[-1]
        chosen.append(last)
        seq.append(int(np.argmax(last)))
    return seq[len(prompt):], np.stack(chosen)


def paged_slots(pages: np.ndarray, page_size: int, width: int) -> np.ndarray:
    """A table of slots ``[rows, width]`` from a page table ``[rows, npages]``: column ``j`` is
    slot ``page * P + j % P`` of page ``pages[:, j // P]``, -1 where that page is -1."""
    j = np.arange(width)
    k = np.minimum(j // page_size, pages.shape[1] - 1)
    page = np.where(j // page_size < pages.shape[1], pages[:, k], -1)
    return np.where(page >= 0, page * page_size + j % page_size, -1)
