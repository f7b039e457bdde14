"""Model-level laws: a tiny Llama-shaped decoder (``cacheidx.models.llama``) run through an
index gives the outputs it gives on the whole sequence, however the tokens are placed.

Every comparison is against the decoder on a ``whole`` index, which reads and keeps nothing.
"""

from __future__ import annotations

import numpy as np

from .. import build
from ..models.llama import Config, empty_pools, forward, random_params
from .laws import index, on
from .suite import Case, law

CFG = Config.tiny()
TOL = 1e-5  # float32 matmuls over different column counts reassociate


def run(params, tokens, ix, pools):
    return forward(params, CFG, tokens, ix, pools)


def setup(case: Case, slots: int, *, fill: float = np.nan):
    """Weights, and pools of ``slots`` rows filled with ``fill`` (NaN: a read that the laws
    say is zero but is not shows up)."""
    params = random_params(CFG, seed=0, xp=case.xp, device=case.device)
    pools = [(case.array(np.full(p.shape, fill, np.float32)),
              case.array(np.full(p.shape, fill, np.float32)))
             for p, _ in empty_pools(CFG, slots)]
    return params, pools


def tokens(case: Case, *rows: list[int]):
    return case.array(np.asarray(rows, np.int64))


def prompt(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, CFG.vocab, n).tolist()


def alone(case: Case, params, ids: list[int]) -> np.ndarray:
    """Logits of ``ids`` as one whole sequence."""
    ix = build.whole(1, len(ids), **on(case))
    logits, _ = case.call(run, params, tokens(case, ids), ix, setup(case, 1)[1], tol=TOL)
    return case.numpy(logits)[0]


def close(case: Case, got, want, what: str) -> None:
    got = case.numpy(got)
    assert np.isfinite(got).all(), f"{what}: non-finite outputs\n{got}"
    assert np.allclose(got, want, rtol=TOL, atol=TOL), (
        f"{what}: max difference {np.abs(got - want).max()}")


@law
def law_one_call_over_rows_equals_the_whole_sequence(case: Case) -> None:
    """A prompt run in one call over its own run of slots gives the whole sequence's logits."""
    ids = prompt(9)
    params, pools = setup(case, 9)
    logits, _ = case.call(run, params, tokens(case, ids), build.rows(9, [9], **on(case)), pools,
                          tol=TOL)
    close(case, case.numpy(logits)[0], alone(case, params, ids), "rows")


@law
def law_chunks_of_one_of_seven_then_two_and_all_at_once_agree(case: Case) -> None:
    """A prompt fed in chunks of 1, of 7 then 2, or all at once gives the same logits."""
    ids, want = prompt(9), None
    params, _ = setup(case, 9)
    want = alone(case, params, ids)
    table = [list(range(9))]
    for sizes in ([9], [7, 2], [1] * 9):
        _, pools = setup(case, 9)
        start, got = 0, []
        for n in sizes:
            ix = index(case, [list(range(start, start + n))], table)
            logits, pools = case.call(run, params, tokens(case, ids[start:start + n]), ix, pools,
                                      tol=TOL)
            got.append(case.numpy(logits)[0])
            start += n
        close(case, np.concatenate(got), want, f"chunks {sizes}")


@law
def law_any_injection_of_positions_into_slots_gives_the_same_outputs(case: Case) -> None:
    """Positions may sit at any distinct slots of a pool: a permuted page table gives the same
    logits as contiguous slots."""
    ids = prompt(9)
    params, pools = setup(case, 20)
    slots = np.random.default_rng(3).permutation(20)[:12]
    table = [slots.tolist()]
    for start, n in ((0, 5), (5, 4)):
        ix = index(case, [list(range(start, start + n))], table)
        logits, pools = case.call(run, params, tokens(case, ids[start:start + n]), ix, pools,
                                  tol=TOL)
        want = alone(case, params, ids)[start:start + n]
        close(case, case.numpy(logits)[0], want, f"chunk at {start}")


@law
def law_nan_in_every_slot_no_table_names_never_reaches_an_output(case: Case) -> None:
    """Pools full of NaN wherever no table names a slot (and in every slot not yet written)
    leave every output finite and exact."""
    ids = prompt(6)
    params, pools = setup(case, 16)
    ix = index(case, [list(range(6))], [[3, 9, 1, 12, 7, 4, -1, -1]])
    logits, _ = case.call(run, params, tokens(case, ids), ix, pools, tol=TOL)
    close(case, case.numpy(logits)[0], alone(case, params, ids), "logits")


@law
def law_two_sequences_share_a_prefix_written_once(case: Case) -> None:
    """A sequence whose table names another's prefix slots reads that prefix and computes only
    its own tokens, with the logits it has alone; the shared slots are not written again."""
    prefix = prompt(5, seed=4)
    a, b = prefix + prompt(3, seed=5), prefix + prompt(2, seed=6)
    params, pools = setup(case, 12)
    ix = index(case, [list(range(8))], [list(range(8))])
    _, pools = case.call(run, params, tokens(case, a), ix, pools, tol=TOL)
    before = [case.numpy(k)[:5].copy() for k, _ in pools]
    ix = index(case, [[5, 6]], [[0, 1, 2, 3, 4, 8, 9, -1]])
    logits, pools = case.call(run, params, tokens(case, b[5:]), ix, pools, tol=TOL)
    close(case, case.numpy(logits)[0], alone(case, params, b)[5:], "the second sequence's suffix")
    for (k, _), old in zip(pools, before):
        assert np.array_equal(case.numpy(k)[:5], old), "a shared prefix slot was written again"


@law
def law_lanes_of_one_token_naming_one_sequence_equal_one_lane(case: Case) -> None:
    """Three lanes of one token each, naming one sequence, give what one lane of three gives."""
    ids = prompt(6)
    params, pools = setup(case, 8)
    table = [list(range(8))]
    _, pools = case.call(run, params, tokens(case, ids[:3]), index(case, [[0, 1, 2]], table),
                         pools, tol=TOL)
    ix = index(case, [[3], [4], [5]], table, row=[0, 0, 0])
    logits, _ = case.call(run, params, tokens(case, *[[t] for t in ids[3:]]), ix, pools, tol=TOL)
    close(case, case.numpy(logits)[:, 0], alone(case, params, ids)[3:], "lanes")


@law
def law_a_ragged_batch_then_advance_equals_each_row_alone(case: Case) -> None:
    """A left-padded batch of prompts of different lengths, then one token per lane with
    advance, gives each prompt's logits alone."""
    p3, p5 = prompt(3, seed=7), prompt(5, seed=8)
    params, pools = setup(case, 16)
    ix = build.rows(8, [3, 5], **on(case))
    logits, pools = case.call(run, params, tokens(case, [0, 0] + p3, p5), ix, pools, tol=TOL)
    got = case.numpy(logits)
    close(case, got[0, 2:], alone(case, params, p3), "the short prompt")
    close(case, got[1], alone(case, params, p5), "the long prompt")
    nxt = [int(np.argmax(got[0, -1])), int(np.argmax(got[1, -1]))]
    logits, _ = case.call(run, params, tokens(case, [nxt[0]], [nxt[1]]), ix.advance(), pools,
                          tol=TOL)
    close(case, case.numpy(logits)[0, 0], alone(case, params, p3 + nxt[:1])[-1], "lane 0 next")
    close(case, case.numpy(logits)[1, 0], alone(case, params, p5 + nxt[1:])[-1], "lane 1 next")


@law
def law_a_lane_of_padding_is_finite_and_disturbs_nothing(case: Case) -> None:
    """A lane whose row is -1 beside a real one: the real lane's logits are its own, the
    padding lane's are finite."""
    ids = prompt(4)
    params, pools = setup(case, 8)
    ix = index(case, [[0, 1, 2, 3], [0, 1, 2, 3]], [list(range(8))], row=[0, -1])
    logits, _ = case.call(run, params, tokens(case, ids, ids[::-1]), ix, pools, tol=TOL)
    close(case, case.numpy(logits)[0], alone(case, params, ids), "the real lane")
    assert np.isfinite(case.numpy(logits)[1]).all(), "the padding lane is not finite"


@law
def law_greedy_generation_equals_recomputing_the_whole_sequence(case: Case) -> None:
    """Greedy decoding with advance gives the tokens (and logits) of recomputing the whole
    sequence at every step."""
    ids = prompt(4)
    params, pools = setup(case, 12)
    ix = build.rows(12, [4], **on(case))
    logits, pools = case.call(run, params, tokens(case, ids), ix, pools, tol=TOL)
    seq = list(ids)
    for _ in range(5):
        last = case.numpy(logits)[0, -1]
        want = alone(case, params, seq)[-1]
        close(case, last, want, f"step {len(seq)}")
        seq.append(int(np.argmax(want)))
        assert int(np.argmax(last)) == seq[-1], "greedy tokens differ"
        ix = ix.advance()
        logits, pools = case.call(run, params, tokens(case, [seq[-1]]), ix, pools, tol=TOL)


@law
def law_packing_gives_each_sequence_the_outputs_it_has_alone(case: Case) -> None:
    """Several sequences packed in one lane each get the logits they have alone."""
    a, b = prompt(3, seed=9), prompt(4, seed=10)
    params, pools = setup(case, 1)
    ix = build.packed(8, [[3, 4]], **on(case))
    logits, _ = case.call(run, params, tokens(case, [0] + a + b), ix, pools, tol=TOL)
    got = case.numpy(logits)[0]
    close(case, got[1:4], alone(case, params, a), "first sequence")
    close(case, got[4:], alone(case, params, b), "second sequence")


@law
def law_selecting_every_column_in_order_changes_no_output(case: Case) -> None:
    """A selection of all the columns, in order, for every token gives the logits of no
    selection: each token reads the columns it would read anyway."""
    ids = prompt(6)
    params, pools = setup(case, 8)
    ix = build.rows(8, [6], **on(case))
    cols = case.array(np.broadcast_to(np.arange(8), (1, 6, 8)).copy())
    logits, _ = case.call(run, params, tokens(case, ids), ix.select(cols), pools, tol=TOL)
    close(case, case.numpy(logits)[0], alone(case, params, ids), "select")


@law
def law_a_verified_draft_tree_equals_decoding_each_path(case: Case) -> None:
    """A tree of draft tokens verified in one call gives each token the logits of its path
    decoded one by one; keeping a path by naming its slots in the next table continues it."""
    ids, guess = prompt(4), prompt(4, seed=11)
    parent = [-1, 0, 0, 1]  # token 0 at 4; tokens 1, 2 at 5 (children of 0); token 3 at 6
    depth = [0, 1, 1, 2]
    sees = np.zeros((1, 4, 4), bool)
    for i in range(4):
        j = i
        while j >= 0:
            sees[0, i, j], j = True, parent[j]
    params, pools = setup(case, 16)
    table = list(range(4)) + [-1] * 8
    _, pools = case.call(run, params, tokens(case, ids), index(case, [[0, 1, 2, 3]], [table]),
                         pools, tol=TOL)
    draft = index(case, [[4 + d for d in depth]], [table]).draft(
        case.array([[12, 13, 14, 15]]), case.array(sees))
    logits, pools = case.call(run, params, tokens(case, guess), draft, pools, tol=TOL)
    got = case.numpy(logits)[0]
    for i in range(4):
        path, j = [], i
        while j >= 0:
            path.insert(0, guess[j])
            j = parent[j]
        close(case, got[i], alone(case, params, ids + path)[-1], f"draft token {i}")
    # keep the path 0 -> 1 -> 3: its slots go into the table at its positions
    kept = table[:4] + [12, 13, 15] + [-1] * 5
    nxt = int(np.argmax(got[3]))
    ix = index(case, [[7]], [kept[:7] + [6] + [-1] * 4])
    logits, _ = case.call(run, params, tokens(case, [nxt]), ix, pools, tol=TOL)
    path = ids + [guess[0], guess[1], guess[3], nxt]
    close(case, case.numpy(logits)[0, 0], alone(case, params, path)[-1], "after the kept path")
