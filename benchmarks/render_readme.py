"""Assembles benchmarks/README.md from a short header and the per-capability sections in sections/."""
from __future__ import annotations

import pathlib

HERE = pathlib.Path(__file__).resolve().parent
ORDER = ["altmin", "data", "clipping", "seqrec", "selection", "meta"]
HEADER = """# jdp benchmarks

Every script writes `results/<name>.json` with the command, git commit, device, library versions and
the rows behind each table (and a PNG where a picture helps). Run them from the repository root with
`PYTHONPATH=. python -m benchmarks.<script>`; each section names its commands. Speed is always reported
as ratios against a baseline measured in the same process (machines are noisy); absolute numbers
here come from a 2-core CPU that was shared with other jobs while they ran, unless a section says
otherwise. Paper numbers are shown beside ours where the papers give them, including where we fall
short.

Sections: """


def main() -> None:
    present = [n for n in ORDER if (HERE / "sections" / f"{n}.md").exists()]
    present += sorted(p.stem for p in (HERE / "sections").glob("*.md") if p.stem not in ORDER)
    body = [HEADER + ", ".join(f"[{n}](#{n})" for n in present) + ".\n"]
    for name in present:
        text = (HERE / "sections" / f"{name}.md").read_text().strip()
        body.append(f'<a id="{name}"></a>\n\n{text}\n')
    (HERE / "README.md").write_text("\n".join(body))
    print("wrote", HERE / "README.md")


if __name__ == "__main__":
    main()
