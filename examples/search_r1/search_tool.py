"""The recipe's search tool: BM25 (the ``bm25s`` library) over the local corpus that ``build_task.py`` writes.

Give it to a run with ``--tools search_tool:search`` (this folder on ``PYTHONPATH``). The corpus is
``data/corpus.jsonl`` beside this file, or the JSONL file named by ``$SEARCH_R1_CORPUS`` (rows ``{"title", "text"}``,
the title optional); it is indexed once per process, on the first call, and every rollout worker thread shares the
index. A passage is indexed with its title before its text, so a query naming a passage's subject ranks that passage
above the ones that merely mention it (title boosting, as search engines weigh a page's title).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from pathlib import Path

import bm25s

from relax.rollout.agentic.tools import ToolError

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "corpus.jsonl"
TOP_K = 3
MAX_QUERY_CHARS = 200  # a query is a few words; a runaway turn must not become a huge tokenisation job


class CorpusIndex:
    """A BM25 index over a list of passages; ``search`` returns the passages that share a term with the query, best
    first (passages with no term in common score 0 and are never returned: they would be noise to the model)."""

    def __init__(self, passages: list[str], titles: list[str] | None = None):
        if not passages:
            raise ValueError("the search corpus is empty")
        self.passages = passages
        indexed = [f"{title} {text}" for title, text in zip(titles, passages)] if titles else passages
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(indexed, stopwords=None, show_progress=False), show_progress=False)
        self._lock = threading.Lock()  # bm25s keeps per-call state in the retriever; one query at a time

    def search(self, query: str, k: int = TOP_K) -> list[str]:
        tokens = bm25s.tokenize([query], stopwords=None, show_progress=False)
        if not tokens.vocab:  # nothing indexable in the query (only punctuation, say)
            return []
        with self._lock:
            ids, scores = self.retriever.retrieve(tokens, k=min(k, len(self.passages)), show_progress=False)
        return [self.passages[int(i)] for i, score in zip(ids[0], scores[0]) if score > 0]


def read_corpus(path: Path) -> tuple[list[str], list[str]]:
    """The passages of a JSONL corpus and their titles ("" where a row has none), in file order; a bad row fails
    naming the file and the line."""
    passages, titles = [], []
    with open(path, encoding="utf-8") as rows:
        for number, line in enumerate(rows, start=1):
            try:
                row = json.loads(line)
                text = row["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{number}: expected a JSON object with a 'text' field ({err})") from None
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{path}:{number}: field 'text' must be a non-empty string")
            title = row.get("title", "")
            if not isinstance(title, str):
                raise ValueError(f"{path}:{number}: field 'title' must be a string")
            passages.append(text)
            titles.append(title)
    return passages, titles


@functools.cache
def corpus_index(path: str) -> CorpusIndex:
    passages, titles = read_corpus(Path(path))
    return CorpusIndex(passages, titles)


_index_lock = threading.Lock()  # the first calls arrive together from the rollout's threads: build the index once


def format_results(passages: list[str]) -> str:
    """Numbered passages, one per line: short, since a character-level model reads every character."""
    return "\n".join(f"{rank}. {text}" for rank, text in enumerate(passages, start=1)) or "no results"


def search(query: str) -> str:
    """Search the local corpus and return the best passages.

    Args:
        query: the words to look up, for example a name
    """
    if not isinstance(query, str) or not query.strip():
        raise ToolError("search: 'query' must be non-empty text")
    if len(query) > MAX_QUERY_CHARS:
        raise ToolError(f"search: the query has {len(query)} characters; at most {MAX_QUERY_CHARS}")
    with _index_lock:
        index = corpus_index(os.environ.get("SEARCH_R1_CORPUS", str(DEFAULT_CORPUS)))
    return format_results(index.search(query))
