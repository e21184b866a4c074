"""Make a JSONL search corpus: from ARPO's search cache (real web snippets) or synthetic facts.

    python -m tools.search.build_corpus --from-arpo-cache $ARPO_DATA/search_cache/search_cache.json \
        --out outputs/search/corpus.jsonl
    python -m tools.search.build_corpus --synthetic 5000 --out outputs/search/synthetic.jsonl

The synthetic corpus is for offline smoke runs and benchmarks: fact-like sentences about invented
entities, so a query naming an entity has exactly one best document.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from tools.search.bm25 import Document, write_jsonl_corpus

_SYLLABLES = ["ka", "lo", "mi", "ra", "ten", "vor", "zul", "pen", "dri", "sto", "qua", "bel", "nix", "orm", "thal"]
_KINDS = ["city", "river", "composer", "mountain", "novel", "chemist", "island", "painter", "empire", "language"]
_COUNTRIES = ["Norvania", "Estaria", "Kelmora", "Duvany", "Pellisar", "Ostrelia", "Marundi", "Quessa"]
_FILLER = ("known for its history archive museum festival trade bridge school music industry harbor library "
           "market cathedral railway university theatre garden fortress").split()


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()


def synthetic_documents(n: int, seed: int = 0) -> list[Document]:
    """``n`` documents, each about one uniquely named entity (names are unique within the corpus)."""
    rng = random.Random(seed)
    names: set[str] = set()
    docs = []
    while len(docs) < n:
        name = _name(rng)
        if name in names:
            continue
        names.add(name)
        kind, country = rng.choice(_KINDS), rng.choice(_COUNTRIES)
        year = rng.randint(1000, 2020)
        filler = " ".join(rng.choice(_FILLER) for _ in range(rng.randint(8, 30)))
        text = (f"{name} is a {kind} in {country}, first recorded in {year}. "
                f"It is {filler}. The {kind} {name} has {rng.randint(2, 900)} notable features.")
        docs.append(Document(id=str(len(docs)), title=name, text=text, url=f"https://example.org/{name.lower()}"))
    return docs


def arpo_cache_documents(cache_path: str | Path) -> list[Document]:
    from tools.search.arpo_cache import cache_documents, load_arpo_cache

    return cache_documents(load_arpo_cache(cache_path))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a JSONL search corpus.")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-arpo-cache", metavar="PATH", help="ARPO search_cache.json: one document per page")
    src.add_argument("--synthetic", type=int, metavar="N", help="N synthetic fact documents")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    docs = arpo_cache_documents(args.from_arpo_cache) if args.from_arpo_cache else \
        synthetic_documents(args.synthetic, args.seed)
    n = write_jsonl_corpus(docs, args.out)
    print(f"wrote {n} documents to {args.out}")


if __name__ == "__main__":
    main()
