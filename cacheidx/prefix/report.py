"""What a plan computes and holds, against computing every prompt alone and against the least
any processing order could compute.

The page-rounded minimum. Process the prompts one at a time in any order; a prompt may reuse
whole pages of a prefix it shares with a prompt processed before it, at most up to token
``len - 1`` (the spec's cap), and computes the rest. Let ``N`` be the set of distinct page
prefixes, ``t[: k * P]`` for ``1 <= k <= len(t) // P`` over all prompts (the nodes of the
page-rounded trie). Then every order computes at least

    ``minimum = P * |N|  +  sum(len % P)  +  P * (copies)``

tokens: each node at least once, by the first prompt that holds it; each prompt's partial
last page, which no one can lend whole; and, because of the cap, once more the last page of
every copy of a prompt whose length is a multiple of ``P`` (``copies`` counts those copies
after the first). The plan's sorted order reaches it: a node's holders are adjacent in order
and only the first (or a copy equal to the node) computes it. With ``dedupe``, a copy computes
nothing and the minimum drops to the distinct prompts' (``copies = 0``, and copies' partial
pages are not counted).
"""

from __future__ import annotations

import dataclasses

from .pages import simulate
from .plan import Plan

__all__ = ["Report", "minimum", "report"]


@dataclasses.dataclass(frozen=True)
class Report:
    """Tokens and pages for one plan (see :func:`report`)."""

    prompts: int
    distinct: int  #: prompts after removing exact copies
    page_size: int
    dedupe: bool
    tokens: int  #: computing every prompt alone
    computed: int  #: computing as planned
    minimum: int  #: the page-rounded minimum, for the plan's model (with or without dedupe)
    dedupe_saves: int  #: tokens dedupe=True computes fewer than the spec's plan
    pages_alone: int  #: pages holding every prompt alone
    pages: int  #: pages the plan allocates in all
    peak_keep: int  #: pages live at once at most, strategy "keep"
    peak_count: int  #: pages live at once at most, strategy "count"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_markdown(self) -> str:
        """The report as a two-column Markdown table."""
        share = self.computed / self.tokens if self.tokens else 0.0
        rows = [
            ("prompts (distinct)", f"{self.prompts:,} ({self.distinct:,})"),
            ("page size", f"{self.page_size}"),
            ("dedupe", "on" if self.dedupe else "off"),
            ("tokens, each prompt alone", f"{self.tokens:,}"),
            ("tokens, planned", f"{self.computed:,} ({share:.1%})"),
            ("tokens, page-rounded minimum", f"{self.minimum:,}"),
            (
                "tokens dedupe saves" if not self.dedupe else "tokens dedupe saved",
                f"{self.dedupe_saves:,}",
            ),
            ("pages, each prompt alone", f"{self.pages_alone:,}"),
            ("pages, planned", f"{self.pages:,}"),
            ("pages at peak, keep / count", f"{self.peak_keep:,} / {self.peak_count:,}"),
        ]
        lines = ["| | |", "|---|---:|"] + [f"| {a} | {b} |" for a, b in rows]
        return "\n".join(lines)

    __str__ = to_markdown


def minimum(plan: Plan) -> int:
    """The page-rounded minimum of the module docstring, from the plan's sorted order: in
    sorted order, a prompt adds to the trie the page prefixes it does not share with the
    previous one, ``len // P - lcp // P``."""
    P, lens, copy = plan.page_size, plan.lengths, plan.duplicate
    nodes = int((lens // P - plan.lcp // P).sum())
    if plan.dedupe:
        return P * nodes + int((lens % P)[~copy].sum())
    copies = int((copy & (lens % P == 0)).sum())
    return P * (nodes + copies) + int((lens % P).sum())


def report(plan: Plan) -> Report:
    """Tokens computed alone, planned and at the minimum, what dedupe saves, and pages at
    peak under both strategies (walking the plan: one loop over prompts)."""
    P, lens, copy = plan.page_size, plan.lengths, plan.duplicate
    # Under the spec a copy reuses all but its last page; under dedupe it computes nothing.
    saves = int((lens - (lens - 1) // P * P)[copy].sum())
    return Report(
        prompts=len(plan),
        distinct=int((~copy).sum()),
        page_size=P,
        dedupe=plan.dedupe,
        tokens=int(lens.sum()),
        computed=int(plan.computed.sum()),
        minimum=minimum(plan),
        dedupe_saves=saves,
        pages_alone=int(plan.npages.sum()),
        pages=plan.pages,
        peak_keep=simulate(plan, "keep").peak,
        peak_count=simulate(plan, "count").peak,
    )
