"""The laws of sampling (:mod:`cacheidx.serve.sampling`) and of the engine's samples: drawn
frequencies are the filtered softmax (a chi-square test at a stated p, fixed seeds), each
filter keeps what its law says, penalties and log-probabilities against float64 references,
stop strings across tokens, samples that diverge from their first token, and a seeded
request's tokens the same alone and beside 7 others. Issue 37's huge ``n`` too: refused alone,
within seconds, through the engine and the command.

Everything runs the tiny Llama on NumPy (the engine's seeded tokens on torch and JAX too;
the conformance suite checks the law on every backend and compile mode).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from deadline import within
from serving import alone
from test_serve_failures import serve

import cacheidx as ci
from cacheidx.models import llama
from cacheidx.serve import MOST_SAMPLES, Engine, LlamaModel, Request, Sampling
from cacheidx.serve import sampling as sp

XP = ci.backends.get("numpy").xp  #: the engine's NumPy namespace (the array API's)
P_FLAKE = 1e-6  #: the chance a right sampler fails the chi-square test
DRAWS = 20_000


def chi2_sf(x: float, df: int) -> float:
    """The chi-square survival function, by the series of the lower incomplete gamma."""
    a, z = df / 2, x / 2
    term = total = 1.0 / a
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= z / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(a * math.log(z) - z - math.lgamma(a)) * total)


def filtered(z, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Law 3's distribution, in float64, by hand: the kept tokens' softmax."""
    s = np.asarray(z, np.float64) / temperature
    order = np.argsort(-s, kind="stable")
    p = np.exp(s - s.max())
    keep = np.ones(s.size, bool)
    if top_k:
        keep[order[top_k:]] = False
    pk = np.where(keep, p, 0) / p[keep].sum()
    mass = np.cumsum(pk[order]) - pk[order]
    if top_p < 1:
        keep[order[mass >= top_p]] = False
    keep &= p >= min_p * p.max()
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def draws(z, n=DRAWS, seed=7, **kw):
    """``n`` tokens of logits ``z`` under ``kw``, one lane per step (``n`` keys)."""
    lanes = n
    d = sp.Draw(np.full(lanes, kw.get("temperature", 1.0), np.float32),
                np.full(lanes, kw.get("top_k", 0), np.int32),
                np.full(lanes, kw.get("top_p", 1.0), np.float32),
                np.full(lanes, kw.get("min_p", 0.0), np.float32),
                sp.lane_key(np.full(lanes, seed, np.uint64), np.zeros(lanes, np.int32),
                            np.arange(lanes, dtype=np.int32)))
    logits = np.broadcast_to(np.asarray(z, np.float32), (lanes, len(z)))
    return np.asarray(sp.choose(XP, logits, d))


Z = [2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0, -2.0, -4.0]
FILTERS = [dict(), dict(temperature=0.7), dict(top_k=4), dict(top_p=0.8),
           dict(min_p=0.2), dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05)]


@pytest.mark.parametrize("kw", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items())
                         or "plain")
def test_sampled_frequencies_are_the_filtered_softmax(kw):
    """Law 3 (and law 1's Gumbel-max): 20,000 draws of fixed logits, a chi-square test over
    the kept tokens at p = 1e-6, and no token outside them ever drawn."""
    p = filtered(Z, **kw)
    got = np.bincount(draws(Z, **kw), minlength=len(Z))
    assert got[p == 0].sum() == 0, (got, p)
    kept = p > 0
    expect = DRAWS * p[kept]
    stat = float(((got[kept] - expect) ** 2 / expect).sum())
    if kept.sum() > 1:
        assert chi2_sf(stat, int(kept.sum()) - 1) > P_FLAKE, (stat, got, expect)


def test_the_chi_square_tail_is_right():
    """The test's own survival function, at two values a table gives."""
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=2e-4)
    assert chi2_sf(18.307, 10) == pytest.approx(0.05, abs=2e-4)


def test_top_k_top_p_and_min_p_keep_what_their_law_says():
    """Law 3 on ties and edges: top_k keeps its k (ties at the cut all), top_p keeps the token
    that crosses it, top_p=1 every token, min_p those at least min_p of the largest."""
    assert set(draws(Z, 4000, top_k=3)) == {0, 1, 2}
    assert set(draws([1.0, 1.0, 1.0, 0.0], 4000, top_k=2)) == {0, 1, 2}  # a tie at the cut
    first = float(filtered(Z)[0])
    assert set(draws(Z, 4000, top_p=first + 0.01)) == {0, 1}  # token 1 crosses: kept
    assert set(draws(Z, 4000, top_p=first)) == {0}
    assert set(draws(Z, 4000, min_p=math.exp(-1.05))) == {0, 1, 2}


def test_a_draw_without_rank_filters_chooses_what_the_sorted_path_chooses():
    """Law 3's cut with ``top_k`` 0 and ``top_p`` 1 keeps every token: the draw that says no
    rank filter (``None``, no sort) chooses the same tokens, min_p and greedy lanes too."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((64, 40)).astype(np.float32) * 3
    t = np.where(np.arange(64) % 5 == 0, 0, 0.5 + np.arange(64) / 32).astype(np.float32)
    m = np.where(np.arange(64) % 3 == 0, 0.1, 0.0).astype(np.float32)
    key = sp.lane_key(np.arange(64, dtype=np.uint64), np.zeros(64, np.int32),
                      np.arange(64, dtype=np.int32))
    sorted_ = sp.Draw(t, np.zeros(64, np.int32), np.ones(64, np.float32), m, key)
    plain = sp.Draw(t, None, None, m, key)
    assert (np.asarray(sp.choose(XP, logits, sorted_)).tolist()
            == np.asarray(sp.choose(XP, logits, plain)).tolist())


def test_temperature_zero_is_the_argmax_bit_for_bit():
    """Law 2: a greedy lane beside hot ones is the argmax of its logits, ties to the first."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 50)).astype(np.float32)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1
    d = sp.Draw(np.asarray([0, 1, 0, 2, 0, 0.5], np.float32), np.zeros(6, np.int32),
                np.ones(6, np.float32), np.zeros(6, np.float32),
                sp.lane_key(np.arange(6, dtype=np.uint64), np.zeros(6, np.int32),
                            np.zeros(6, np.int32)))
    got = np.asarray(sp.choose(XP, logits, d))
    greedy = [0, 2, 4]
    assert got[greedy].tolist() == np.argmax(logits, axis=-1)[greedy].tolist()
    assert got[0] == 7


def test_penalties_are_openais():
    """Law 4: ``z - frequency * count - presence * (count > 0)``, of the sample's own
    tokens; a greedy lane with them takes the penalised argmax."""
    class Lane:
        request = Request("a", [1], 4, sampling=Sampling(presence_penalty=0.5,
                                                        frequency_penalty=0.25))
        sample = 0

        class result:
            tokens = [3, 3, 5]

    d = sp.draw([Lane()], 2, 8)
    expect = np.zeros(8, np.float32)
    expect[3], expect[5] = -(0.25 * 2 + 0.5), -(0.25 + 0.5)
    assert d.bias[0].tolist() == expect.tolist() and not d.bias[1].any()
    z = np.asarray([[0, 0, 0, 1.0, 0, 0.7, 0, 0.9]] * 2, np.float32)
    assert int(np.asarray(sp.choose(XP, z, d))[0]) == 7


def test_penalty_counts_are_sparse_and_read_each_token_once():
    """Law 4's counts kept on the lane (``Counts``): one entry per distinct token, the new
    tokens alone read at each draw, and the bias each draw the dense reference's (the counts
    of every token so far, ids past the vocabulary left out)."""
    class Lane:
        request = Request("a", [1], 4, sampling=Sampling(presence_penalty=0.5,
                                                        frequency_penalty=0.25))
        sample = 0
        counts = None

        class result:
            tokens: list = []

    lane, vocab = Lane(), 16
    lane.result.tokens = []
    rng = np.random.default_rng(5)
    for step in range(60):
        lane.result.tokens.append(int(rng.integers(0, vocab + 2)))  # some past the vocabulary
        d = sp.draw([lane], 1, vocab)
        ids = np.asarray(lane.result.tokens)
        c = np.bincount(ids[ids < vocab], minlength=vocab).astype(np.float32)
        expect = -(np.float32(0.25) * c + np.float32(0.5) * (c > 0))
        assert d.bias[0].tolist() == expect.tolist(), step
        assert lane.counts.seen == step + 1
    assert len(lane.counts.times) == len(set(lane.result.tokens))  # sparse: seen ids alone


def test_the_key_is_the_seed_sample_and_step_alone():
    """Law 1: keys differ with each of the three, and equal for equal ones (64-bit seeds)."""
    keys = sp.lane_key(np.asarray([0, 1, 2**63 + 1, 1, 1], np.uint64),
                       np.asarray([0, 0, 0, 1, 0], np.int32), np.asarray([0, 0, 0, 0, 1], np.int32))
    assert len(set(keys.tolist())) == 5
    assert sp.lane_key(np.asarray([1], np.uint64), [0], [0]).tolist() == keys[1:2].tolist()
    u = np.asarray(sp.uniform(XP, keys, 1000))
    assert u.dtype == np.float32 and 0 < u.min() and u.max() < 1


def test_bad_sampling_fields_name_the_field_and_the_request():
    with pytest.raises(ValueError, match=r"Request 'r': top_p must be in \(0, 1\], got 0.0"):
        Request("r", [1], sampling={"top_p": 0})
    with pytest.raises(ValueError, match=r"Sampling: temperature must be in \[0, inf\]"):
        Sampling(temperature=float("nan"))
    with pytest.raises(TypeError, match=r"Request 'r': sampling has no field 'best_of'"):
        Request("r", [1], sampling={"best_of": 2})
    with pytest.raises(TypeError, match=r"Sampling: top_k must be an integer, got 2.5"):
        Sampling(top_k=2.5)
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\], got 21"):
        Sampling(logprobs=21)
    assert Sampling(temperature=1.0).seed is not None  # drawn, kept: the result redraws


# -- stop strings (law 6) ------------------------------------------------------------------------
def test_cut_and_safe():
    assert sp.cut("hello world", ["wor", "lo"]) == ("hel", True)
    assert sp.cut("hello", ["xy"]) == ("hello", False)
    assert sp.safe("answer: ab", ["abc"]) == len("answer: ")  # "ab" may begin "abc"
    assert sp.safe("answer: x", ["abc"]) == len("answer: x")
    assert sp.safe("caf\ufffd", []) == 3  # half a character the next token may complete


# -- the engine ------------------------------------------------------------------------------------
CONFIG = llama.Config.tiny()
PARAMS = llama.random_params(CONFIG, seed=11)
MODEL = LlamaModel(CONFIG, PARAMS)
PROMPTS = [np.random.default_rng(k).integers(0, 64, 3 + 2 * k).tolist() for k in range(8)]
HOT = Sampling(temperature=30.0, seed=42)  # the tiny random model's logits are sharp


def run(requests, backend="numpy", **kw):
    kw = {"pages": 64, "page_size": 4, "lanes": 8, "clock": "steps", **kw}
    return Engine(MODEL, backend=backend, **kw).run(requests)


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_a_seeded_request_gets_its_tokens_alone_and_beside_seven_others(backend):
    """Law 1 through the engine: the same tokens alone, and third of 8 requests of other
    prompts, lengths and samplings; and the same on every backend."""
    pytest.importorskip(backend) if backend != "numpy" else None
    (a,) = run([Request("a", PROMPTS[0], 8, sampling=HOT)], backend)
    others = [Request(f"o{k}", p, 2 + k, sampling=Sampling(temperature=1.0 + k, seed=k,
                                                            top_k=k, presence_penalty=0.1))
              for k, p in enumerate(PROMPTS[1:])]
    beside = run(others[:2] + [Request("a", PROMPTS[0], 8, sampling=HOT)] + others[2:], backend)
    assert beside[2].tokens == a.tokens
    assert a.tokens == [39, 35, 2, 13, 47, 29, 61, 29]  # every backend's, the same
    assert len(set(a.tokens)) > 4  # sampled, not the greedy answer
    assert a.finish_reason == "length"


def test_temperature_zero_requests_are_the_greedy_engines():
    """Law 2: sampling=None, temperature 0, and a greedy lane beside sampled ones give the
    greedy tokens; an all-greedy batch runs the greedy programs alone."""
    greedy, _ = alone(CONFIG, PARAMS, PROMPTS[3], 6)
    e = Engine(MODEL, pages=64, page_size=4, lanes=8, clock="steps")
    plain, zero, mixed, hot = e.run([Request("p", PROMPTS[3], 6),
                                     Request("z", PROMPTS[3], 6, sampling=Sampling()),
                                     Request("m", PROMPTS[3], 6, sampling={"temperature": 0}),
                                     Request("h", PROMPTS[1], 6, sampling=HOT)])
    assert plain.tokens == zero.tokens == mixed.tokens == greedy
    assert hot.tokens != alone(CONFIG, PARAMS, PROMPTS[1], 6)[0]


def test_samples_diverge_from_their_first_token():
    """``n`` samples draw with their sample numbers: sample 0 is the request of one, the
    others differ from it at their first token; greedy samples stay equal."""
    (one,) = run([Request("a", PROMPTS[5], 4, sampling=HOT)])
    (four,) = run([Request("a", PROMPTS[5], 4, n=4, sampling=HOT)])
    assert four.tokens[0] == one.tokens
    assert len({t[0] for t in four.tokens}) == 4
    assert four.finish_reason == ["length"] * 4
    (greedy,) = run([Request("g", PROMPTS[5], 4, n=3)])
    assert greedy.tokens == [alone(CONFIG, PARAMS, PROMPTS[5], 4)[0]] * 3


def test_log_probabilities_are_the_models_own_in_float64():
    """Law 5: each token's log-probability and its top 3, against the float64 log-softmax of
    the logits a whole, alone computation gives, before the temperature and the filters."""
    (r,) = run([Request("a", PROMPTS[2], 3, sampling=Sampling(temperature=30.0, seed=1,
                                                              top_k=5, logprobs=3))])
    seq = list(PROMPTS[2])
    assert len(r.logprobs) == 3
    for token, lp in zip(r.tokens, r.logprobs):
        _, logits = alone(CONFIG, PARAMS, seq, 1)
        x = logits.astype(np.float64)
        ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
        assert lp.token == token and lp.logprob == pytest.approx(ref[token], abs=1e-4)
        best = np.argsort(-ref, kind="stable")[:3]
        assert [t for t, _ in lp.top] == best.tolist()
        assert [v for _, v in lp.top] == pytest.approx(ref[best], abs=1e-4)
        seq.append(token)
    assert json.dumps(r.as_json()["logprobs"])  # JSON as the command writes it


def letters(ids):
    return "".join(chr(97 + t % 26) for t in ids)


def test_a_stop_string_across_tokens_ends_the_sample_and_is_cut():
    """Law 6: with a detokenizer, a stop string spanning two tokens' text ends the sample at
    the token that completes it, and its text is cut before it; without a detokenizer, stop
    strings are never found."""
    e = Engine(MODEL, pages=64, page_size=4, lanes=8, clock="steps", detokenize=letters)
    (free,) = e.run([Request("f", PROMPTS[4], 10, sampling=HOT)])
    text = letters(free.tokens)
    at = next(i for i in range(1, 9) if text[i:i + 2] not in text[:i + 1])
    stop = text[at:at + 2]  # token at's letter and token at + 1's
    hot = dataclasses.replace(HOT, stop=("zzzz", stop))
    r, beside = e.run([Request("s", PROMPTS[4], 10, sampling=hot),
                       Request("f", PROMPTS[4], 10, sampling=HOT)])
    assert r.tokens == free.tokens[:at + 2] and r.finish_reason == "stop"
    assert r.text == text[:at]
    assert beside.tokens == free.tokens and beside.text == text
    assert free.finish_reason == "length"
    (blind,) = run([Request("s", PROMPTS[4], 10, sampling=hot)])
    assert blind.tokens == free.tokens and blind.text is None


# -- issue 37: a huge n ----------------------------------------------------------------------------
def test_a_huge_n_fails_alone_within_seconds_beside_a_good_request():
    """n = 10**12 beside a good request: the good one is served, the big one fails alone,
    its result naming it and the bound, nothing made of its n."""
    with within(30):
        good, big = run([Request("good", PROMPTS[1], 4), Request("big", PROMPTS[1], 4,
                                                                 n=10**12)])
    assert good.error is None and good.tokens == alone(CONFIG, PARAMS, PROMPTS[1], 4)[0]
    assert big.error == (f"request 'big' asks for n={10**12} samples; the engine serves at "
                         f"most {MOST_SAMPLES} a request")
    assert big.tokens == []


def test_a_huge_n_fails_its_line_alone_in_the_command():
    lines = [json.dumps({"id": "good", "prompt_ids": [1, 2, 3]}),
             json.dumps({"id": "big", "prompt_ids": [1, 2, 3], "n": 10**12})]
    status, out, err = serve(["--max-new-tokens", "2", "--json"], lines)
    assert status == 1
    got = {r["id"]: r for r in json.loads(out)["requests"]}
    assert "error" not in got["good"] and len(got["good"]["tokens"]) == 2
    assert got["big"]["error"] == (f"FILE line 2: request 'big' asks for n={10**12} samples; "
                                   f"the engine serves at most {MOST_SAMPLES} a request")


def test_samples_are_queued_once_and_made_as_they_start():
    """n = 128 samples of one token through 8 lanes: one queue entry throughout, and the
    request's result holds only the samples started so far until it ends."""
    e = Engine(MODEL, pages=256, page_size=4, lanes=8, clock="steps")
    e.submit(Request("many", PROMPTS[0], 1, n=MOST_SAMPLES, sampling=HOT))
    entries, started = [], []
    while e.busy:
        done = e.step()
        entries.append(len(e.scheduler.admission))
        started.append(len(e.scheduler.waiting[0].tokens) if e.scheduler.waiting else None)
    (r,) = done
    assert max(entries) == 1 and len(r.tokens) == MOST_SAMPLES
    assert started[0] is not None and started[0] < MOST_SAMPLES
    assert len({t[0] for t in r.tokens}) > 20  # of 64 tokens at temperature 30


def test_the_command_takes_sampling_fields():
    """A JSON line's sampling fields (``Sampling``'s names) reach its request: a seeded line
    gives the same tokens twice, a bad field fails its line alone."""
    line = {"prompt_ids": PROMPTS[0][:5], "temperature": 30.0, "seed": 42, "top_k": 50,
            "logprobs": 1}
    lines = [json.dumps(dict(line, id="a")), json.dumps(dict(line, id="b")),
             json.dumps(dict(line, id="bad", top_p=2))]
    status, out, _ = serve(["--max-new-tokens", "3", "--json"], lines)
    got = {r["id"]: r for r in json.loads(out)["requests"]}
    assert status == 1 and got["a"]["tokens"] == got["b"]["tokens"]
    assert len(got["a"]["logprobs"]) == 3
    assert "top_p must be in (0, 1], got 2.0" in got["bad"]["error"]
