"""Retrieval before generation: a BM25 index (``bm25s``) of a local folder of documents,
built at start-up; a request's best passages go into its prompt as a system message.

Documents (``.md`` and ``.txt``, recursively) are cut into passages of about
``passage_words`` words along paragraph boundaries.  Words are stemmed (Snowball's
English stemmer, ``PyStemmer``), so "refund" finds "refunds".  A query is the
conversation's last user message.  Only passages that share a term with it are used
(BM25 score > 0).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from sluicegate.pipeline_settings import RetrieveSettings

logger = logging.getLogger(__name__)

SUFFIXES = (".md", ".txt")


@dataclass(slots=True, frozen=True)
class Passage:
    source: str
    text: str


@dataclass(slots=True, frozen=True)
class Retrieved:
    passages: list[Passage]
    seconds: float

    @property
    def sources(self) -> list[str]:
        """Distinct sources, best first."""
        return list(dict.fromkeys(p.source for p in self.passages))


def split_passages(source: str, text: str, words: int) -> list[Passage]:
    """Whole paragraphs joined up to about ``words`` words; a longer paragraph is cut."""
    out: list[Passage] = []
    current: list[str] = []
    for paragraph in text.split("\n\n"):
        tokens = paragraph.split()
        if current and len(current) + len(tokens) > words:
            out.append(Passage(source, " ".join(current)))
            current = []
        while len(current) + len(tokens) > words:
            cut = words - len(current)
            out.append(Passage(source, " ".join(current + tokens[:cut])))
            current, tokens = [], tokens[cut:]
        current.extend(tokens)
    if current:
        out.append(Passage(source, " ".join(current)))
    return out


class Retriever:
    """An in-memory BM25 index over a folder's passages; read-only after start-up."""

    def __init__(self, settings: RetrieveSettings) -> None:
        self.settings = settings
        root = settings.documents
        self.passages: list[Passage] = []
        for path in sorted(p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()):
            text = path.read_text(encoding="utf-8", errors="replace")
            source = str(path.relative_to(root))
            self.passages.extend(split_passages(source, text, settings.passage_words))
        if not self.passages:
            raise ValueError(f"no .md or .txt documents under {root}")
        started = time.perf_counter()
        # Imported here: a server without retrieval does not pay for them at start-up.
        import bm25s
        import Stemmer

        self._bm25s: Any = bm25s
        self.stemmer = Stemmer.Stemmer("english")
        self.index = bm25s.BM25()
        corpus = bm25s.tokenize(
            [p.text for p in self.passages],
            stopwords="en",
            stemmer=self.stemmer,
            show_progress=False,
        )
        self.index.index(corpus, show_progress=False)
        logger.info(
            "indexed %d passages from %s in %.2f s",
            len(self.passages),
            root,
            time.perf_counter() - started,
        )

    def retrieve(self, query: str) -> Retrieved:
        started = time.perf_counter()
        tokens = self._bm25s.tokenize(
            [query], stopwords="en", stemmer=self.stemmer, return_ids=False, show_progress=False
        )
        if not tokens or not tokens[0]:
            return Retrieved([], time.perf_counter() - started)
        k = min(self.settings.top_k, len(self.passages))
        ids, scores = self.index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        chosen: list[Passage] = []
        budget = self.settings.max_context_chars
        for index, score in zip(ids[0], scores[0], strict=True):
            passage = self.passages[int(index)]
            if score <= 0 or len(passage.text) > budget:
                continue
            budget -= len(passage.text)
            chosen.append(passage)
        return Retrieved(chosen, time.perf_counter() - started)

    def context_message(self, retrieved: Retrieved) -> str | None:
        """The system message that carries the passages (None: nothing matched)."""
        if not retrieved.passages:
            return None
        body = "\n\n".join(f"[{p.source}]\n{p.text}" for p in retrieved.passages)
        return f"{self.settings.instructions}\n\n{body}"
