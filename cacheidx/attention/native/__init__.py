"""On the CPU, attention's online softmax over quantized runs and paged pools by a small C
kernel (``kernel.c``), compiled when cacheidx is installed: codes cast to floats in
registers, never in memory (attention's law 6 for quantized pools, where the bytes are the
cost), and a lane's pages read where they lie.

A decode step over quantized pools is the bytes of its codes: a quarter (8 bits) or an eighth
(4 bits) of a float pool's. The array libraries cannot read them so: a product takes floats,
so the core casts each chunk of codes to a float copy first (docs/attention.md has the
figures). Its one entry, :func:`paged` (:mod:`.pages`), computes what
:meth:`~cacheidx.attention.softmax.Online.add` computes, per kv head and query row the running
maximum ``m``, the sum ``l`` of ``exp(z - m)`` and the weighted values ``acc``, which
:meth:`~cacheidx.attention.softmax.Online.merge` folds into the lane's state: every lane and
kv head in one call over the threads it is given, each lane's columns read through its row of
the table (pages in any order, rows fetched ahead), float32, float16, bfloat16, int8, int4 and
turned 4-bit pools, the grouped query heads of a kv head weighed together so that each key and
value row is read once for all of them. :mod:`cacheidx.attention.paged` calls it for a whole
decode step; :mod:`cacheidx.attention.runs` for the runs of quantized slots every query of a
block sees (their slots one after another as one lane's row, the lanes under a shared prefix
stacked as its queries).

The law it keeps is the core's, within the attention law's tolerance (docs/attention.md): its
exponential is a polynomial (a few ulps of ``expf``, exactly zero below ``-87``); its sums are
partial sums in one order, compiled without reassociation or contraction, so they are the
same bits on every machine and every vector width (``kernel.c`` says how). NaN is never
computed through it: it refuses a call whose queries or scales are not finite, a score NaN or
``+inf``, or a state not finite at the end (a value that is not), which the core then weighs
as its laws say. A score of ``-inf`` (a product that overflowed) weighs nothing, as
:class:`~cacheidx.attention.softmax.Online` weighs it: a query whose scores are all ``-inf``
has ``m = -inf``, ``l = 0``, ``acc = 0``, never ``exp(-inf - -inf)``.

It computes values, not gradients: with no backward of its own, it declines (the core's
products, which autograd follows, read the call) wherever torch's grad mode is on and an input
requires grad. On torch the paged entry is also the operator ``cacheidx::paged``
(:mod:`.op`), with a fake implementation, which ``torch.compile`` traces and
``torch.library.opcheck`` checks.

Where it was not built (no C compiler at install time), or its build fails its check, or
``CACHEIDX_NATIVE=0``, :func:`kernel` is ``None`` (said once, as a warning, but for the last)
and the core's products read the runs and the pools (:mod:`.found`).
"""

from __future__ import annotations

from .found import kernel, off
from .memory import grad_asked
from .pages import ROWS, THREADED, paged, threads

__all__ = ["ROWS", "THREADED", "grad_asked", "kernel", "off", "paged", "threads"]
