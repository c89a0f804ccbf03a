"""Checks that every relative link in README.md, docs/*.md and benchmarks/**/*.md resolves: the file exists and,
when the link names an anchor, the target Markdown file has that heading (GitHub's slugs) or an explicit
`<a id=...>` / `<a name=...>`.

    python -m benchmarks.check_links      # prints each broken link, exits 1 if there is one
"""
from __future__ import annotations

import functools
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")


def pages() -> list[pathlib.Path]:
    out = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    out += [p for p in sorted((ROOT / "benchmarks").rglob("*.md")) if "results" not in p.relative_to(ROOT).parts]
    return [p for p in out if p.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: pathlib.Path) -> frozenset[str]:
    text = _FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def broken_links(paths: list[pathlib.Path] | None = None) -> list[str]:
    problems = []
    for page in paths or pages():
        text = _CODE.sub("", _FENCE.sub("", page.read_text()))
        for m in _LINK.finditer(text):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where} (no such anchor)")
    return problems


def main() -> int:
    problems = broken_links()
    print("\n".join(problems) if problems else f"all relative links resolve ({len(pages())} pages)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
