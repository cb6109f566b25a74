"""Write a small, real, unbalanced instruction set (prompt / response / task) derived from the
embedded debmix_mini corpus: WordNet glosses ("Define ..."), Jargon File and Devil's Dictionary
entries ("What does ... mean to a hacker / a satirist?") and passage continuations (Bible, Austen,
Shakespeare). Used by the CluSTER test and as an example for recipes/cluster_sft.yaml.

    python scripts/make_instructions.py tests/data/instructions.jsonl --per-task 120,30,60
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

BUILTIN = Path(__file__).resolve().parents[1] / "ccexp" / "data" / "builtin" / "debmix_mini.jsonl.gz"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--per-task", default="120,30,60", help="records for define,explain,continue")
    args = ap.parse_args()
    n_define, n_explain, n_continue = map(int, args.per_task.split(","))
    rows = [json.loads(line) for line in gzip.open(BUILTIN, "rt", encoding="utf-8")]
    out = []
    for r in rows:
        text, domain = r["text"], r["domain"]
        if domain == "lexicon.wordnet" and ": " in text and sum(o["task"] == "define" for o in out) < n_define:
            term, gloss = text.split(": ", 1)
            out.append({"id": r["id"], "task": "define", "prompt": f"Define the word \"{term}\".\nAnswer:",
                        "response": f" {gloss}"})
        elif domain in ("glossary.jargon", "satire.devils_dict") and sum(o["task"] == "explain" for o in out) < n_explain:
            head, _, body = text.partition("\n")
            word = head.split(",")[0].split("\n")[0].strip()
            if body.strip() and word:
                out.append({"id": r["id"], "task": "explain", "prompt": f"Explain the term \"{word}\".\nAnswer:",
                            "response": " " + " ".join(body.split())})
        elif (domain in ("scripture.web_bible", "fiction.austen", "drama.shakespeare")
              and sum(o["task"] == "continue" for o in out) < n_continue and len(text.split()) >= 12):
            words = text.split()
            half = len(words) // 2
            out.append({"id": r["id"], "task": "continue", "prompt": "Continue the passage: " + " ".join(words[:half]),
                        "response": " " + " ".join(words[half:])})
    Path(args.out).write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in out), encoding="utf-8")
    print(f"wrote {len(out)} instructions to {args.out}")


if __name__ == "__main__":
    main()
