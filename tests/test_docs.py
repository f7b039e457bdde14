"""The documentation builds with ``mkdocs build --strict`` (every link, every API reference and
the generated law list resolve), and ``benchmarks/run_all.py`` writes a performance page from a
real run.

Needs the ``docs`` extra: ``pip install -e ".[docs]"``; without mkdocs the build test is skipped
with its reason printed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_build_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ,
                                           "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    site = tmp_path / "site"
    laws = (site / "conformance" / "index.html").read_text()
    assert "column_is_position" in laws  # the law list generated from cacheidx.conformance
    assert 'id="cacheidx.index.CacheIndex.extend"' in (site / "api" / "index.html").read_text()
    assert (site / "variants" / "draft-tree" / "index.html").exists()


FAKE = """
import argparse, json
p = argparse.ArgumentParser(); p.add_argument("--json"); a = p.parse_args()
rows = [{"case": "decode", "batch": 2, "seq": 1, "extend_ms": 1.5, "baseline_ms": 2.0}]
print("| case | extend (ms) |"); print("|---|---|"); print("| decode | 1.5 |")
json.dump({"rows": rows}, open(a.json, "w"))
"""


def test_run_all_writes_a_page_of_real_figures(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "extend.py").write_text(FAKE)
    (bench / "broken.py").write_text("raise SystemExit('no figures today')")
    page = tmp_path / "docs" / "performance.md"
    page.parent.mkdir()
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--dir",
                          str(bench), "--out", str(page)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr  # broken.py failed
    assert "[1/7] extend.py" in out.stdout  # progress: 6 known benchmarks and broken.py
    text = page.read_text()
    assert "## Machine" in text and "date (UTC)" in text
    assert "| decode | 1.5 |" in text  # the benchmark's own table
    assert "`benchmarks/prefix.py` is not in this checkout" in text
    assert "**This benchmark failed**" in text and "no figures today" in text
    pngs = list((page.parent / "img").glob("extend-*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)
    assert f"img/{pngs[0].name}" in text


def test_a_missing_benchmark_is_said_missing():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import run_all

    text = run_all.page([("decode.py", "decoding", None)], quick=False)
    assert "`benchmarks/decode.py` is not in this checkout: not measured." in text
    failed = {"rc": 2, "seconds": 1.0, "output": ["boom"], "data": None, "command": "x"}
    assert "**This benchmark failed**" in run_all.page([("x.py", "x", failed)], quick=False)


def test_run_all_only_measures_again_and_keeps_the_other_sections(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "extend.py").write_text(FAKE)
    (bench / "prefix.py").write_text(FAKE.replace("1.5 |", "2.5 |"))
    page = tmp_path / "docs" / "performance.md"
    page.parent.mkdir()

    def run_all(*extra):
        return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"),
                               "--dir", str(bench), "--out", str(page), *extra], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    assert run_all().returncode == 0
    (bench / "extend.py").write_text(FAKE.replace("1.5 |", "9.5 |"))
    (bench / "prefix.py").write_text(FAKE.replace("1.5 |", "7.5 |"))
    out = run_all("--only", "prefix.py")
    assert out.returncode == 0, out.stdout + out.stderr
    text = page.read_text()
    assert "| decode | 1.5 |" in text and "| decode | 9.5 |" not in text  # extend.py kept
    assert "| decode | 7.5 |" in text  # prefix.py measured again
    assert text.index("## extend.py") < text.index("## prefix.py")
    assert text.count("python benchmarks/run_all.py") == 1
    # a name without ".py" is the benchmark's; one that names none fails and writes nothing
    (bench / "prefix.py").write_text(FAKE.replace("1.5 |", "3.5 |"))
    assert run_all("--only", "prefix").returncode == 0
    assert "| decode | 3.5 |" in page.read_text()
    before = page.read_text()
    out = run_all("--only", "nosuch")
    assert out.returncode == 2 and "no benchmark named 'nosuch.py'" in out.stderr, out.stderr
    assert page.read_text() == before


def test_only_keeps_a_section_the_summary_has_no_row_for():
    # a section written into the page without its summary row (by hand, or by an older layout)
    # was dropped by the next `--only` run: its figures lost
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import run_all

    old = ("# Performance\n\n## Summary\n\n| benchmark | what | outcome | seconds |\n"
           "|---|---|---|---:|\n\n## paged_reads.py\n\nPaged reads.\n\n"
           "| lanes | ratio |\n|---|---|\n| 8 | 1.22x |\n")
    kept = run_all.sections(old)
    assert kept["paged_reads.py"][0] is None and "1.22x" in kept["paged_reads.py"][1]
    text = run_all.page([("paged_reads.py", "Paged reads", "left out")], quick=False, kept=kept)
    assert "| 8 | 1.22x |" in text
    assert "| `paged_reads.py` | Paged reads | kept from an earlier run | |" in text
