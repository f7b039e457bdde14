"""A packed training batch: several sequences one after another in each lane, no padding
between them, each seeing only itself.

``cacheidx.packed(seq, lens)`` restarts the positions at every sequence, and ``mask`` lets a
token see the tokens of its own sequence at or before it (token j is of token i's sequence when
``j - p_j == i - p_i``): the block-diagonal causal mask of packed fine-tuning (FlashAttention's
varlen ``cu_seqlens``, FlexAttention's document mask), with the rotary positions restarting too.
Nothing is read from or kept in a cache, so any pools pass through unchanged.

Checks: every sequence's logits equal the sequence alone; the next-token loss of the packed
batch equals the loss over the sequences one by one; two different packings of the same shape
have the same structure, so one compiled program serves both.

    python examples/packed_batch.py --backend numpy|torch|jax
"""

from __future__ import annotations

import numpy as np
from _common import Checks, Env, parser

import cacheidx as ci

SEQ = 16
PACKING = [[5, 7, 3], [9, 6], [16], [4]]  # sequence lengths, lane by lane


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    lse = np.log(np.exp(x).sum(-1))
    return lse - np.take_along_axis(x, targets[..., None], -1)[..., 0]


def main(argv=None) -> Checks:
    args = parser(__doc__).parse_args(argv)
    env = Env(args.backend, seed=args.seed)
    checks = Checks(f"a packed training batch of {SEQ}-token lanes ({args.backend})")
    seqs = [[env.prompt(n) for n in lane] for lane in PACKING]
    tokens = np.zeros((len(PACKING), SEQ), np.int64)
    for b, lane in enumerate(seqs):
        flat = [t for s in lane for t in s]
        tokens[b, SEQ - len(flat):] = flat  # left padded, as packed places them
    index = ci.packed(SEQ, PACKING, xp=args.backend)
    print(f"  {index}, positions of lane 0: {env.numpy(index.positions())[0].tolist()}")
    logits, _ = env.forward(tokens, index, env.pools(1))

    losses, packed_losses = [], []
    for b, lane in enumerate(seqs):
        start = SEQ - sum(len(s) for s in lane)
        for s in lane:
            got = logits[b, start:start + len(s)]
            want = env.alone(s)
            checks.close(f"lane {b}, {len(s)} tokens at {start}: logits equal the sequence "
                         "alone", got, want)
            # the next-token loss inside one sequence: never across a boundary
            losses.append(cross_entropy(want[:-1], np.asarray(s[1:])))
            packed_losses.append(cross_entropy(got[:-1], np.asarray(s[1:])))
            start += len(s)
    alone, packed = np.concatenate(losses).mean(), np.concatenate(packed_losses).mean()
    checks.close("the packed batch's loss equals the sequences' loss one by one", packed, alone,
                 atol=1e-5)
    other = ci.packed(SEQ, [[16], [2, 2, 2], [8, 8], [1, 15]], xp=args.backend)
    checks.check("another packing has the same structure: one compiled program serves both",
                 other.structure == index.structure)
    m = env.numpy(ci.packed(6, [[2, 3]], xp=args.backend).mask())[0].astype(int)
    print("  mask of one lane packing sequences of 2 and 3 tokens after one pad:\n"
          + "\n".join("    " + " ".join(map(str, r)) for r in m))
    checks.note("loss", float(packed))
    return checks.done()


if __name__ == "__main__":
    main()
