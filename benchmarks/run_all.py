"""Run every benchmark in this folder and write ``docs/performance.md`` with tables and PNG plots.

Each benchmark present (``extend.py``, ``extend_jax.py``, ``extend_torch.py``, ``prefix.py``,
``decode.py``, ``serve.py``, then any other ``*.py`` here) runs in its own process with
``--json``; its printed Markdown tables and plots drawn from its JSON go into the page, with the
machine and the date. A benchmark that is missing or fails is said so on the page. Nothing on
the page is typed by hand.

    python benchmarks/run_all.py [--quick] [--only NAME ...] [--timeout S] [--out PATH]

``--quick`` passes ``--quick`` to the benchmarks that take it (a smoke run of tiny sizes).
``--only NAME ...`` runs those benchmarks (``extend.py`` or ``extend``) and keeps the other
sections of the page as they were, each saying when it was measured; a name that is no
benchmark here is an error, and the page is left as it was.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KNOWN = ["extend.py", "extend_jax.py", "extend_torch.py", "prefix.py", "decode.py", "serve.py"]


def benchmarks(where: Path = HERE) -> list[tuple[str, str, bool]]:
    """(file name, title, present) for the known benchmarks, then any other in ``where``; the
    title is the first paragraph of the benchmark's own docstring."""
    others = sorted(p.name for p in where.glob("*.py") if p.name not in KNOWN
                    and p.name != Path(__file__).name and not p.name.startswith("_"))
    return [(n, title(where / n), (where / n).exists()) for n in KNOWN + others]


def title(script: Path) -> str:
    import ast

    try:
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    except (OSError, SyntaxError):
        return script.stem
    first = " ".join(doc.strip().split("\n\n")[0].split())  # the first paragraph
    return first.replace("``", "`").rstrip(".:") if first else script.stem


def machine() -> list[tuple[str, str]]:
    rows = [("date (UTC)", datetime.datetime.now(datetime.timezone.utc)
             .strftime("%Y-%m-%d %H:%M")),
            ("platform", platform.platform()),
            ("processor", _cpu_name() or platform.machine()),
            ("CPU cores", str(os.cpu_count())),
            ("python", platform.python_version())]
    for mod in ("numpy", "torch", "jax", "cupy"):
        try:
            m = __import__(mod)
            rows.append((mod, getattr(m, "__version__", "?")))
        except Exception:
            pass
    try:
        import torch

        if torch.cuda.is_available():
            rows.append(("GPU", torch.cuda.get_device_name(0)))
    except Exception:
        pass
    return rows


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run(name: str, args, tmp: Path) -> dict:
    """Run one benchmark, streaming its output; returns what happened."""
    script = args.dir / name
    out = tmp / (script.stem + ".json")
    cmd = [sys.executable, str(script), "--json", str(out)]
    if args.quick and "--quick" in script.read_text():
        cmd.append("--quick")
    shown = " ".join(["python", f"benchmarks/{name}", "--json", "PATH"] + cmd[4:])
    start = time.perf_counter()
    lines: list[str] = []
    # stderr (progress bars, warnings) goes to a file: only what a benchmark prints reaches
    # the page, and the file's tail when it fails
    err = open(tmp / (script.stem + ".stderr"), "w+")
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                                text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            print(f"    {line.rstrip()}", flush=True)
            if time.perf_counter() - start > args.timeout:
                proc.kill()
                lines.append(f"(killed after {args.timeout} s)")
                break
        rc = proc.wait()
    except OSError as e:
        rc, lines = -1, [str(e)]
    seconds = time.perf_counter() - start
    err.seek(0)
    if rc != 0:
        lines += err.read().splitlines()[-20:]
    err.close()
    data = None
    if rc == 0 and out.exists():
        try:
            data = json.loads(out.read_text())
        except ValueError as e:
            rc, lines = -1, lines + [f"unreadable JSON: {e}"]
    elif rc == 0:
        rc, lines = -1, lines + ["the benchmark wrote no JSON"]
    return {"rc": rc, "seconds": seconds, "output": lines, "data": data, "command": shown}


# -- the page ----------------------------------------------------------------------------
def tables_of(output: list[str]) -> str:
    """The Markdown the benchmark printed: its tables and the lines around them."""
    return "\n".join(line for line in output if not line.startswith("    ")).strip()


def json_tables(data) -> str:
    """Tables drawn from a benchmark's JSON alone (when it printed none)."""
    if not isinstance(data, dict):
        return f"```\n{json.dumps(data, indent=1)[:4000]}\n```"
    parts = []
    flat = [(k, v) for k, v in data.items() if not isinstance(v, dict | list)]
    if flat:
        parts.append(kv_table(flat))
    for k, v in data.items():
        if isinstance(v, dict):
            parts.append(f"**{k}**\n\n" + kv_table(list(v.items())))
        elif isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            cols = list(dict.fromkeys(c for r in v for c in r))
            lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in v]
            parts.append(f"**{k}**\n\n" + "\n".join(lines))
    return "\n\n".join(parts)


def kv_table(items) -> str:
    return "\n".join(["| | |", "|---|---|"] + [f"| {k} | {fmt(v)} |" for k, v in items])


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict | list):
        return json.dumps(v)[:80]
    return str(v)


def label(row: dict) -> str:
    """A bar's name: the case or layout, then its shape or pool size, as the row holds them."""
    name = str(row.get("case", row.get("layout", "")))
    if "log2_slots" in row or "slots_log2" in row:
        name += f"\n2^{row.get('log2_slots', row.get('slots_log2'))} slots"
    elif "batch" in row and "seq" in row:
        name += f"\n{row['batch']} x {row['seq']}"
    return name


def plots(stem: str, data, img: Path) -> list[str]:
    """PNG plots of what a benchmark's JSON holds; the image paths, relative to docs/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    if not isinstance(data, dict):
        return made
    rows = data.get("rows")

    def save(fig, name):
        path = img / f"{stem}-{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(f"img/{path.name}")

    if isinstance(rows, list) and rows and {"extend_ms", "baseline_ms"} <= set(rows[0]):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        cases = [label(r) for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["extend_ms"] for r in rows], 0.4, label="extend")
        ax.bar([i + 0.2 for i in x], [r["baseline_ms"] for r in rows], 0.4,
               label="hand-written")
        ax.set_xticks(list(x), cases)
        ax.set_ylabel("ms (best of runs)")
        ax.set_title(f"{stem}: extend against a hand-written scatter + gather")
        ax.legend()
        save(fig, "vs-baseline")
    if (isinstance(rows, list) and rows and "extend_ms" in rows[0]
            and len({r.get("log2_slots") for r in rows}) > 1):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for layout in dict.fromkeys(r.get("layout", "") for r in rows):
            pts = sorted((r["log2_slots"], r["extend_ms"], r["baseline_ms"]) for r in rows
                         if r.get("layout", "") == layout)
            xs = [2 ** p for p, _, _ in pts]
            ax.plot(xs, [e for _, e, _ in pts], marker="o", label=f"extend, {layout}")
            ax.plot(xs, [b for _, _, b in pts], marker="x", ls="--",
                    label=f"hand-written, {layout}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pool slots")
        ax.set_ylabel("ms per step")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{stem}: cost against pool slots (donated)")
        ax.legend(fontsize=7)
        save(fig, "slots")
    if isinstance(rows, list) and rows and {"slots_log2", "min_ms"} <= set(rows[0]):
        fig, ax = plt.subplots(figsize=(6.5, 3.6))
        series: dict[tuple, list] = {}
        for r in rows:
            key = tuple(r.get(k) for k in ("what", "mode", "layout") if k in r)
            series.setdefault(key, []).append((r["slots_log2"], r["min_ms"]))
        for key, pts in series.items():
            pts.sort()
            ax.plot([2 ** p for p, _ in pts], [t for _, t in pts], marker="o",
                    label=" ".join(str(k) for k in key))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("pool slots")
        ax.set_ylabel("ms per step (fastest round)")
        ax.set_title(f"{stem}: cost against pool slots")
        ax.legend(fontsize=7)
        save(fig, "slots")
    loads = data.get("workloads")
    if isinstance(loads, list) and loads and {"workload", "run", "computed"} <= set(loads[0]):
        names = list(dict.fromkeys(r["workload"] for r in loads))
        fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), squeeze=False)
        for ax, name in zip(axes[0], names):
            rows = [r for r in loads if r["workload"] == name]
            ax.barh([r["run"] for r in rows], [r["computed"] for r in rows], color="#3070b0")
            ax.invert_yaxis()
            ax.set_xlabel("prompt tokens computed")
            ax.set_title(name)
            ax.tick_params(axis="y", labelsize=7)
        fig.suptitle(f"{stem}: the prefix cache against no cache, LRU and the ideal")
        save(fig, "tokens")
    decode = data.get("decode")
    if isinstance(decode, list) and decode and {"context", "engine", "tokens_per_s"} <= set(
            decode[0]):
        models = list(dict.fromkeys(r.get("model", "") for r in decode))
        fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 3.8),
                                 squeeze=False)
        for ax, model in zip(axes[0], models):
            mine = [r for r in decode if r.get("model", "") == model]
            batch = mine[0].get("lanes", data.get("batch", 8))  # a row may say its lanes
            for engine in dict.fromkeys(r["engine"] for r in mine):
                pts = sorted((r["context"], r["tokens_per_s"]) for r in mine
                             if r["engine"] == engine)
                ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=engine,
                        ls="--" if engine.startswith("transformers") else "-")
            floor = sorted({(r["context"], r["floor_ms"]) for r in mine if r.get("floor_ms")})
            if floor:
                ax.plot([c for c, _ in floor],
                        [batch * 1e3 / f for _, f in floor],
                        color="#999999", ls=":", label="memory-bandwidth bound")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens in each lane's cache")
            ax.set_ylabel(f"decode tokens/s (batch {batch})")
            ax.set_title(model.split(" (")[0] or f"{stem}: decode against context", fontsize=9)
            ax.legend(fontsize=7)
        save(fig, "decode")
    prefill = data.get("prefill")
    if isinstance(prefill, list) and prefill and {"tokens", "backend", "peak_mb"} <= set(
            prefill[0]):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        names = list(dict.fromkeys(r["backend"] for r in prefill))
        sizes = sorted({r["tokens"] for r in prefill})
        width = 0.8 / (len(names) + 1)
        for k, name in enumerate(names):
            got = {r["tokens"]: r["peak_mb"] for r in prefill if r["backend"] == name}
            ax.bar([i + k * width for i in range(len(sizes))],
                   [got.get(n, 0) for n in sizes], width, label=f"attend, {name}")
        scores = {r["tokens"]: r["scores_mb"] for r in prefill}
        ax.bar([i + len(names) * width for i in range(len(sizes))],
               [scores[n] for n in sizes], width, color="#bbbbbb", label="the scores alone")
        ax.set_xticks([i + width * len(names) / 2 for i in range(len(sizes))],
                      [f"{n:,} tokens" for n in sizes])
        ax.set_yscale("log")
        ax.set_ylabel("MB beyond inputs and pools")
        ax.set_title(f"{stem}: one layer's prefill, peak memory")
        ax.legend(fontsize=7)
        save(fig, "prefill")
    per_m = data.get("per_m")
    if isinstance(per_m, list) and per_m and {"m", "reuse", "no_reuse", "block_aligned"} <= set(
            per_m[0]):
        fig, ax = plt.subplots(figsize=(6, 3.4))
        ms = [r["m"] for r in per_m]
        for key, name, style in (("no_reuse", "no reuse", dict(ls=":", marker="o")),
                                 ("block_aligned", "block-aligned at m (one checkpoint a "
                                  "request)", dict(ls="--", marker="o")),
                                 ("reuse", "hybrid, snapshots every m and junctions",
                                  dict(ls="-", marker="o", lw=4, alpha=0.6)),
                                 ("attention_only", "attention only (pages of 16)",
                                  dict(ls="-", marker="x", color="black", lw=1))):
            if key in per_m[0]:
                ax.plot(ms, [r[key] for r in per_m], label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("m (positions a snapshot block)")
        ax.set_ylabel("prompt tokens computed")
        ax.set_title(f"{stem}: a multi-turn chat's prompt tokens, per m")
        ax.legend(fontsize=7)
        save(fig, "tokens")
    if isinstance(rows, list) and rows and {"server", "clients", "ttft_ms", "itl_ms"} <= set(
            rows[0]):
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
        for server in dict.fromkeys(r["server"] for r in rows):
            mine = sorted((r for r in rows if r["server"] == server), key=lambda r: r["clients"])
            xs = [r["clients"] for r in mine]
            style = dict(marker="o", ls="--" if server.startswith("transformers") else "-")
            line, = axes[0].plot(xs, [r["requests_per_s"] for r in mine], label=server, **style)
            for ax, key in ((axes[1], "ttft_ms"), (axes[2], "itl_ms")):
                ax.plot(xs, [r[key][0] for r in mine], color=line.get_color(), **style)
                ax.fill_between(xs, [r[key][0] for r in mine], [r[key][1] for r in mine],
                                color=line.get_color(), alpha=0.15)
        for ax, what in zip(axes, ("requests/s", "time to first token (ms), p50 to p99",
                                   "inter-token latency (ms), p50 to p99")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["clients"] for r in rows}),
                          [str(c) for c in sorted({r["clients"] for r in rows})])
            ax.set_xlabel("concurrent streaming clients")
            ax.set_title(what, fontsize=9)
        axes[1].set_yscale("log")
        axes[2].set_yscale("log")
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{stem}: {data.get('model', '')}, multi-turn chat", fontsize=10)
        save(fig, "latency")
    report = data.get("report")
    if isinstance(report, dict) and {"tokens", "computed", "minimum"} <= set(report):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        names = ["each prompt alone", "planned", "page-rounded minimum"]
        vals = [report["tokens"], report["computed"], report["minimum"]]
        ax.bar(names, vals, color=["#999999", "#3070b0", "#70a0d0"])
        ax.set_ylabel("tokens computed")
        ax.set_title(f"prefix planner: {report.get('prompts', '?')} prompts, "
                     f"page size {report.get('page_size', '?')}")
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:,}", ha="center", va="bottom", fontsize=8)
        save(fig, "tokens")
    return made


def page(results: list, quick: bool, kept: dict | None = None) -> str:
    """The page: the machine, a summary row and a section per benchmark. ``kept`` maps a
    benchmark left out of this run (``--only``) to its summary row and section as the page
    had them, each dated by the run that measured it."""
    kept = kept or {}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    out = ["# Performance", "",
           "Generated by `python benchmarks/run_all.py`: every figure below comes from a run "
           "of it on this machine, and each section says which run (`--only NAME` measures "
           "some benchmarks again and keeps the others' sections). Rerun it to measure yours.",
           "", "## Machine", "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in machine()]
    out += ["", "## Summary", "", "| benchmark | what it measures | outcome | seconds |",
            "|---|---|---|---:|"]
    for name, title, r in results:
        if r == "left out" and name in kept and kept[name][0]:
            out.append(kept[name][0])
            continue
        if r == "left out" and name in kept:  # a section the page had without a summary row
            out.append(f"| `{name}` | {title} | kept from an earlier run | |")
            continue
        status = ("not present" if r is None else "not run" if r == "left out"
                  else "ok" if r["rc"] == 0 else f"failed (exit {r['rc']})")
        secs = f"{r['seconds']:.1f}" if isinstance(r, dict) else ""
        out.append(f"| `{name}` | {title} | {status} | {secs} |")
    for name, title, r in results:
        if r == "left out" and name in kept:
            out += ["", kept[name][1].rstrip("\n")]
            continue
        out += ["", f"## {name}", "", title + ("" if title[-1:] in ".?!" else "."), ""]
        if r is None:
            out.append(f"`benchmarks/{name}` is not in this checkout: not measured.")
            continue
        if r == "left out":
            out.append("Not measured by this run (`--only`), and the page had no figures.")
            continue
        out += [f"`{r['command']}`, {stamp} UTC" + (" (`--quick`)" if quick else ""), ""]
        if r["rc"] != 0:
            out += ["**This benchmark failed**; the end of its output:", "", "```"]
            out += r["output"][-20:] + ["```"]
            continue
        printed = tables_of(r["output"])
        out.append(printed if "|" in printed else json_tables(r["data"]))
        for path in r.get("plots", []):
            out += ["", f"![{name}]({path})"]
    return "\n".join(out) + "\n"


def sections(text: str) -> dict:
    """A page's summary row and section per benchmark: ``{name: (row, section)}``; a section
    the summary has no row for is kept too (its row ``None``), so that ``--only`` never drops
    figures written by hand or by an earlier page's layout."""
    rows = {line.split("`")[1]: line for line in text.splitlines()
            if line.startswith("| `") and line.count("`") >= 2}
    found = {}
    for chunk in text.split("\n## ")[1:]:
        name = chunk.split("\n", 1)[0].strip()
        if name not in ("Machine", "Summary"):
            found[name] = (rows.get(name), "## " + chunk.rstrip("\n"))
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--quick", action="store_true", help="pass --quick where a benchmark takes it")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="run only these (extend.py, or extend)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per benchmark")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "performance.md")
    p.add_argument("--dir", type=Path, default=HERE, help="where the benchmarks are")
    args = p.parse_args(argv)
    img = args.out.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    every = benchmarks(args.dir)
    if args.only:  # a name with or without ".py"; one that names nothing fails, page untouched
        names = [b[0] for b in every]
        args.only = [n if n.endswith(".py") else f"{n}.py" for n in args.only]
        unknown = [n for n in args.only if n not in names]
        if unknown:
            p.error(f"argument --only: no benchmark named {unknown[0]!r} in {args.dir}; "
                    f"there are {', '.join(names)}")
    todo = [b for b in every if not args.only or b[0] in args.only]
    kept = sections(args.out.read_text()) if args.only and args.out.exists() else {}
    # the benchmarks --only leaves out: their sections as the page had them, if it had them
    results = [(name, title, "left out") for name, title, _ in every if name not in
               {t[0] for t in todo}] if args.only else []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, title, present) in enumerate(todo, 1):
            if not present:
                print(f"[{i}/{len(todo)}] {name}: not present, skipped", flush=True)
                results.append((name, title, None))
                continue
            print(f"[{i}/{len(todo)}] {name}: {title}", flush=True)
            r = run(name, args, Path(tmp))
            print(f"[{i}/{len(todo)}] {name}: "
                  f"{'ok' if r['rc'] == 0 else 'FAILED'} in {r['seconds']:.1f} s", flush=True)
            if r["rc"] == 0:
                try:
                    r["plots"] = plots(Path(name).stem, r["data"], img)
                except Exception as e:  # a plot never loses the figures
                    r["output"].append(f"(plots failed: {e})")
            results.append((name, title, r))
    order = {name: i for i, (name, _, _) in enumerate(every)}
    results.sort(key=lambda r: order[r[0]])
    args.out.write_text(page(results, args.quick, kept))
    print(f"wrote {args.out}")
    return 0 if all(not isinstance(r, dict) or r["rc"] == 0 for _, _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
