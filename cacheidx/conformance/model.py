"""Model-level laws: a tiny Llama-shaped decoder (``cacheidx.models.llama``) run through an
index gives the outputs it gives on the whole sequence, however the tokens are placed.

Every comparison is against the decoder on a ``whole`` index, which reads and keeps nothing,
through the spec's path (``extend`` then the materialised softmax; every call under test goes
through ``attend``): the reference logits of a sequence, computed once per run over twelve
left-padded tokens (the decoder is causal, so a sequence's logits hold those of each of its
prefixes). The laws share
one geometry, pools of ``SLOTS`` slots and tables ``WIDTH`` columns wide, so a compiled run
builds few programs. How close outputs must be is the run's numerical policy
(:mod:`cacheidx.conformance.precision`).
"""

from __future__ import annotations

import functools

import numpy as np

from .. import build
from ..models.llama import Config, empty_pools, forward, layer, random_params, tree_map
from .laws import index, on
from .suite import Case, agree, law

SLOTS = 24  #: pool slots of every law
WIDTH = 12  #: table columns of every law, and the reference's tokens
COLUMNS = list(range(WIDTH))  #: a table of contiguous slots


@functools.cache
def config(mantissa: int | None, attention: str = "attend") -> Config:
    return Config.tiny(matmul_mantissa=mantissa, attention=attention)


@functools.cache
def one_layer(mantissa: int | None):
    """The step a compiled law compiles: one decoder layer, traced once and run for both
    (regional compilation, as one compiles a served model's repeated block)."""
    cfg = config(mantissa)

    def step(p, x, cos, sin, ix, pools):
        return layer(p, cfg, x, cos, sin, ix, pools)

    return step


def call(case: Case, params, tokens, ix, pools):
    """``(logits, pools)`` of one call through ``ix``; in a compiled mode the layers run
    compiled too, and the two agree within the policy's tolerance."""
    cfg, tol = config(case.policy.emulate), case.policy.tol
    eager = forward(params, cfg, tokens, ix, pools)
    if not case.compiled:
        return eager
    compiled = forward(params, cfg, tokens, ix, pools,
                       each=case.jit(one_layer(case.policy.emulate)))
    agree(case, eager, compiled, what="the decoder", tol=tol)
    return compiled


def setup(case: Case, *, fill: float = np.nan):
    """Weights (made once per run), and pools of ``SLOTS`` rows filled with ``fill`` (NaN: a
    read that the laws say is zero but is not shows up)."""
    params = case.session.memo.get("params")
    if params is None:
        params = random_params(config(case.policy.emulate), seed=0, xp=case.xp,
                               device=case.device)
        # a served model's weights never change shape: symbolic shapes are the calls'
        params = case.session.memo["params"] = tree_map(case.backend.static_shape, params)
    pools = [(case.array(np.full(p.shape, fill, np.float32)),
              case.array(np.full(p.shape, fill, np.float32)))
             for p, _ in empty_pools(config(None), SLOTS)]
    return params, pools


def tokens(case: Case, *rows: list[int]):
    return case.array(np.asarray(rows, np.int64))


def prompt(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, config(None).vocab, n).tolist()


def alone(case: Case, params, ids: list[int]) -> np.ndarray:
    """Logits of ``ids`` as one whole sequence, computed eagerly through the spec's path
    (``extend``, then the materialised softmax under ``mask``), so that every law compares
    ``attend`` with it (the reference is no law of its own: a whole index's compiled reads are
    the index laws'), and kept for the run."""
    key = ("alone", tuple(ids))
    if key not in case.session.memo:
        assert len(ids) <= WIDTH, f"a reference of {len(ids)} tokens is past {WIDTH}"
        ix = build.whole(1, WIDTH, lens=[len(ids)], **on(case))
        padded = [0] * (WIDTH - len(ids)) + list(ids)
        logits, _ = forward(params, config(case.policy.emulate, "extend"),
                            tokens(case, padded), ix, setup(case)[1])
        case.session.memo[key] = case.numpy(logits)[0, WIDTH - len(ids):]
    return case.session.memo[key]


def close(case: Case, got, want, what: str) -> None:
    got, tol = case.numpy(got), case.policy.tol
    assert np.isfinite(got).all(), f"{what}: non-finite outputs\n{got}"
    assert np.allclose(got, want, rtol=tol, atol=tol), (
        f"{what}: max difference {np.abs(got - want).max()} (tolerance {tol:.3g}, "
        f"{case.policy.name} precision)")


def chunked(case: Case, params, ids: list[int], sizes: list[int], table: list[int], pools):
    """Logits of ``ids`` fed in calls of ``sizes`` tokens over ``table``, and the pools."""
    start, got = 0, []
    for n in sizes:
        ix = index(case, [list(range(start, start + n))], [table])
        logits, pools = call(case, params, tokens(case, ids[start:start + n]), ix, pools)
        got.append(case.numpy(logits)[0])
        start += n
    return np.concatenate(got), pools


@law
def law_one_call_over_rows_equals_the_whole_sequence(case: Case) -> None:
    """A prompt run in one call over its own run of slots gives the whole sequence's logits."""
    ids = prompt(9)
    params, pools = setup(case)
    logits, _ = call(case, params, tokens(case, ids), build.rows(WIDTH, [9], **on(case)), pools)
    close(case, case.numpy(logits)[0], alone(case, params, ids), "rows")


@law
def law_chunks_of_one_and_all_at_once_agree(case: Case) -> None:
    """A prompt fed in chunks of 1, of 1 then 8, or all at once gives the same logits."""
    ids = prompt(9)
    params, _ = setup(case)
    for sizes in ([9], [1, 8], [1] * 9):
        got, _ = chunked(case, params, ids, sizes, COLUMNS, setup(case)[1])
        close(case, got, alone(case, params, ids), f"chunks {sizes}")


@law
def law_any_injection_of_positions_into_slots_gives_the_same_outputs(case: Case) -> None:
    """Positions may sit at any distinct slots of a pool: a permuted page table gives the same
    logits as contiguous slots."""
    ids = prompt(9)
    params, pools = setup(case)
    table = np.random.default_rng(3).permutation(SLOTS)[:WIDTH].tolist()
    got, _ = chunked(case, params, ids, [1] * 9, table, pools)
    close(case, got, alone(case, params, ids), "a permuted table")


@law
def law_nan_in_every_slot_no_table_names_never_reaches_an_output(case: Case) -> None:
    """Pools full of NaN wherever no table names a slot (and in every slot not yet written)
    leave every output finite and exact."""
    ids = prompt(9)
    params, pools = setup(case)
    ix = index(case, [list(range(9))], [[3, 9, 1, 12, 7, 4, 20, 2, 15, -1, -1, -1]])
    logits, _ = call(case, params, tokens(case, ids), ix, pools)
    close(case, case.numpy(logits)[0], alone(case, params, ids), "logits")


@law
def law_two_sequences_share_a_prefix_written_once(case: Case) -> None:
    """A sequence whose table names another's prefix slots reads that prefix and computes only
    its own tokens, with the logits it has alone; the shared slots are not written again."""
    a = prompt(9)
    b = a[:8] + [(a[8] + 1) % config(None).vocab]
    params, pools = setup(case)
    _, pools = chunked(case, params, a, [9], COLUMNS, pools)
    before = [case.numpy(k)[:9].copy() for k, _ in pools]
    ix = index(case, [[8]], [COLUMNS[:8] + [12, -1, -1, -1]])
    logits, pools = call(case, params, tokens(case, b[8:]), ix, pools)
    close(case, case.numpy(logits)[0], alone(case, params, b)[8:], "the second sequence's token")
    for (k, _), old in zip(pools, before):
        assert np.array_equal(case.numpy(k)[:9], old), "a shared prefix slot was written again"


@law
def law_lanes_of_one_token_naming_one_sequence_equal_one_lane(case: Case) -> None:
    """Two lanes of one token each, naming one sequence, give what one lane of two gives."""
    ids = prompt(11)
    params, pools = setup(case)
    _, pools = chunked(case, params, ids, [9], COLUMNS, pools)
    ix = index(case, [[9], [10]], [COLUMNS], row=[0, 0])
    logits, _ = call(case, params, tokens(case, *[[t] for t in ids[9:]]), ix, pools)
    close(case, case.numpy(logits)[:, 0], alone(case, params, ids)[9:], "lanes")


@law
def law_a_ragged_batch_then_advance_equals_each_row_alone(case: Case) -> None:
    """A left-padded batch of prompts of different lengths, then one token per lane with
    advance, gives each prompt's logits alone."""
    p7, p9 = prompt(7, seed=7), prompt(9, seed=8)
    params, pools = setup(case)
    ix = build.rows(WIDTH, [7, 9], **on(case))
    logits, pools = call(case, params, tokens(case, [0, 0] + p7, p9), ix, pools)
    got = case.numpy(logits)
    nxt = [int(np.argmax(got[0, -1])), int(np.argmax(got[1, -1]))]
    logits, _ = call(case, params, tokens(case, [nxt[0]], [nxt[1]]), ix.advance(), pools)
    whole7, whole9 = alone(case, params, p7 + nxt[:1]), alone(case, params, p9 + nxt[1:])
    close(case, got[0, 2:], whole7[:-1], "the short prompt")
    close(case, got[1], whole9[:-1], "the long prompt")
    close(case, case.numpy(logits)[0, 0], whole7[-1], "lane 0 next")
    close(case, case.numpy(logits)[1, 0], whole9[-1], "lane 1 next")


@law
def law_a_lane_of_padding_is_finite_and_disturbs_nothing(case: Case) -> None:
    """A lane whose row is -1 beside a real one: the real lane's logits are its own, the
    padding lane's are finite."""
    ids = prompt(10)
    params, pools = setup(case)
    _, pools = chunked(case, params, ids, [9], COLUMNS, pools)
    ix = index(case, [[9], [10]], [COLUMNS], row=[0, -1])
    logits, _ = call(case, params, tokens(case, [ids[9]], [ids[3]]), ix, pools)
    close(case, case.numpy(logits)[0], alone(case, params, ids)[9:10], "the real lane")
    assert np.isfinite(case.numpy(logits)[1]).all(), "the padding lane is not finite"


@law
def law_greedy_generation_equals_recomputing_the_whole_sequence(case: Case) -> None:
    """Greedy decoding with advance gives the tokens (and logits) of recomputing the whole
    sequence at every step."""
    seq = prompt(9)
    params, pools = setup(case)
    ix = build.rows(WIDTH, [9], **on(case))
    logits, pools = call(case, params, tokens(case, seq), ix, pools)
    steps = [case.numpy(logits)[0, -1]]
    for _ in range(3):
        seq.append(int(np.argmax(steps[-1])))
        ix = ix.advance()
        logits, pools = call(case, params, tokens(case, [seq[-1]]), ix, pools)
        steps.append(case.numpy(logits)[0, -1])
    want = alone(case, params, seq)[8:]  # the logits that chose each token after the prompt
    for k, (got, expected) in enumerate(zip(steps, want)):
        close(case, got, expected, f"step {9 + k}")
    for k, token in enumerate(seq[9:]):  # a best token of the whole sequence's logits too
        w, tol = want[k], case.policy.tol
        assert w[token] >= w.max() - tol * (1 + abs(w.max())), (
            f"step {9 + k}: greedy chose {token}, the whole sequence {int(np.argmax(w))}")


@law
def law_packing_gives_each_sequence_the_outputs_it_has_alone(case: Case) -> None:
    """Several sequences packed in one lane each get the logits they have alone."""
    a, b = prompt(3, seed=9), prompt(5, seed=10)
    params, pools = setup(case)
    ix = build.packed(9, [[3, 5]], **on(case))
    logits, _ = call(case, params, tokens(case, [0] + a + b), ix, pools)
    got = case.numpy(logits)[0]
    close(case, got[1:4], alone(case, params, a), "first sequence")
    close(case, got[4:], alone(case, params, b), "second sequence")


@law
def law_selecting_every_column_in_order_changes_no_output(case: Case) -> None:
    """A selection of all the columns, in order, for every token gives the logits of no
    selection: each token reads the columns it would read anyway."""
    ids = prompt(9)
    params, pools = setup(case)
    ix = build.rows(WIDTH, [9], **on(case))
    cols = case.array(np.broadcast_to(np.arange(WIDTH), (1, 9, WIDTH)).copy())
    logits, _ = call(case, params, tokens(case, ids), ix.select(cols), pools)
    close(case, case.numpy(logits)[0], alone(case, params, ids), "select")


@law
def law_a_verified_draft_tree_equals_decoding_each_path(case: Case) -> None:
    """A tree of draft tokens verified in one call gives each token the logits of its path
    decoded one by one; keeping a path by naming its slots in the next table continues it."""
    ids, guess = prompt(7), prompt(4, seed=11)
    parent = [-1, 0, 0, 1]  # token 0 at 7; tokens 1, 2 at 8 (children of 0); token 3 at 9
    depth = [0, 1, 1, 2]
    sees = np.zeros((1, 4, 4), bool)
    for i in range(4):
        j = i
        while j >= 0:
            sees[0, i, j], j = True, parent[j]
    params, pools = setup(case)
    table = COLUMNS[:7] + [-1] * 5
    _, pools = chunked(case, params, ids, [1] * 7, table, pools)
    draft = index(case, [[7 + d for d in depth]], [table]).draft(
        case.array([[20, 21, 22, 23]]), case.array(sees))
    logits, pools = call(case, params, tokens(case, guess), draft, pools)
    got = case.numpy(logits)[0]
    # keep the path 0 -> 1 -> 3: its slots go into the table at its positions
    nxt = int(np.argmax(got[3]))
    ix = index(case, [[10]], [COLUMNS[:7] + [20, 21, 23, 11, -1]])
    after, _ = call(case, params, tokens(case, [nxt]), ix, pools)
    kept = alone(case, params, ids + [guess[0], guess[1], guess[3], nxt])
    other = alone(case, params, ids + [guess[0], guess[2]])
    for i, want in ((0, kept[7]), (1, kept[8]), (2, other[8]), (3, kept[9])):
        close(case, got[i], want, f"draft token {i}")
    close(case, case.numpy(after)[0, 0], kept[10], "after the kept path")
