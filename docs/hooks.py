"""MkDocs hook: pages that say ``<!-- laws -->`` get the conformance suite's laws, read from
``cacheidx.conformance.LAWS`` at build time, so the list never drifts from the code."""

from __future__ import annotations

import inspect


def _laws() -> str:
    from cacheidx.conformance import LAWS

    lines = ["| law | what it checks | runs |", "|---|---|---|"]
    for law in LAWS:
        doc = inspect.cleandoc(law.fn.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        doc = doc.replace("|", "\\|")
        runs = ("eagerly" if law.eager_only else "compiled" if law.compiled_only
                else "eagerly and compiled")
        lines.append(f"| `{law.name}` | {doc} | {runs} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **kwargs) -> str:
    if "<!-- laws -->" in markdown:
        markdown = markdown.replace("<!-- laws -->", _laws())
    return markdown
