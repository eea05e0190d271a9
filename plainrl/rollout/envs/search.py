"""A search tool: BM25 over a list of documents (``bm25s``), and the index of a ``search``
task row's fictional world (:mod:`plainrl.data.world`), built once per world and process.

    index = world_index(row["world"])        # the corpus the question is about
    index.search("Where was Lema Ruma born?", k=3)
    # -> ["Lema Ruma was born in Selas.", "Lema Ruma works for Roligel.", ...]

BM25 is Okapi BM25 (Robertson & Zaragoza 2009) as ``bm25s`` implements it (Lucene's
variant, lowercased word tokens, English stopwords removed); Search-R1 (Jin et al. 2025)
retrieves with E5 or BM25 over Wikipedia, top 3 passages per query.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["BM25Index", "format_results", "world_index"]


class BM25Index:
    """BM25 ranking over ``documents`` (a sequence of strings, at least one).

    Raises:
        ValueError: no documents, or a document that is not a string.
    """

    def __init__(self, documents: Sequence[str]) -> None:
        import bm25s  # imported here: only search runs need it

        docs = list(documents)
        if not docs or not all(isinstance(d, str) for d in docs):
            raise ValueError("BM25Index: documents must be a non-empty list of strings")
        self.documents = docs
        self._tokenizer = bm25s.tokenization.Tokenizer(stopwords="en")
        tokens = self._tokenizer.tokenize(docs, show_progress=False, return_as="tuple")
        self._bm25 = bm25s.BM25()
        self._bm25.index(tokens, show_progress=False)

    def search(self, query: str, k: int = 3) -> list[str]:
        """The (at most) ``k`` documents that best match ``query``, best first; documents that
        share no word with the query are left out, so a query of stopwords or unknown words
        finds nothing ([]).

        Raises:
            TypeError / ValueError: ``query`` is not a string, ``k`` not a positive int.
        """
        if not isinstance(query, str):
            raise TypeError(f"search(query): query must be a string, got {type(query).__name__}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"search: k must be a positive integer, got {k!r}")
        ids = self._tokenizer.tokenize([query], update_vocab=False, show_progress=False, return_as="ids")
        k = min(k, len(self.documents))
        found, scores = self._bm25.retrieve(ids, k=k, show_progress=False, n_threads=1)
        return [self.documents[int(i)] for i, s in zip(found[0], scores[0]) if s > 0]


@functools.lru_cache(maxsize=16)
def _cached_index(spec: tuple[tuple[str, Any], ...]) -> BM25Index:
    from plainrl.data.world import make_world

    return BM25Index(make_world(**dict(spec)).documents)


def world_index(world: Mapping[str, Any]) -> BM25Index:
    """The BM25 index of the corpus of a ``search`` row's ``world`` column
    (``{"seed", "num_people", ...}``: :func:`plainrl.data.world.make_world`'s arguments),
    built on first use and kept for the process (training and held-out rows name two worlds).

    Raises:
        TypeError: ``world`` is not a mapping (a row of another task?).
        ValueError: arguments :func:`~plainrl.data.world.make_world` refuses.
    """
    if not isinstance(world, Mapping):
        raise TypeError(f"world_index: expected the row's 'world' column (a mapping, data.task: search), "
                        f"got {type(world).__name__}")
    return _cached_index(tuple(sorted(world.items())))


def format_results(documents: Sequence[str]) -> str:
    """Search results as the model reads them: one numbered line per document, or
    ``"No results."``."""
    if not documents:
        return "No results."
    return "\n".join(f"{i}. {d}" for i, d in enumerate(documents, 1))
