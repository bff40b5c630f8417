"""Corpus haystacks for the synthetic tasks: the sentences of a prepared folder's documents.

    resolve_haystack("books")     # the embedded corpus's held-out books (what the suite reads)
    resolve_haystack("embedded")  # its training chapters (what the synthesizer reads)
    resolve_haystack("noise")     # the legacy filler sentences (no corpus)
    resolve_haystack(DIR)         # any prepared folder's train split

A corpus haystack decodes its documents with the folder's own tokenizer, joins them and hands
their whitespace-normalised sentences to the tasks (longctx.synthetic.haystacks.TextHaystack),
which encode them with the scoring tokenizer and insert needles between them. The held-out
books take the role of RULER's Paul Graham essays, since nothing is downloaded.
"""

from __future__ import annotations

import functools
from pathlib import Path

from longctx.synthetic.haystacks import FillerHaystack, TextHaystack, Units
from longctx.synthetic.pieces import TaskInputError


class CorpusHaystack(Units):
    """The sentences of ``folder``'s ``split`` (read on first use), from an offset drawn from
    the instance's rng."""

    def __init__(self, folder: str | Path, split: str = "train", name: str | None = None) -> None:
        self.folder, self.split = Path(folder), split
        self.name = name or str(folder)
        if not self.folder.is_dir():
            raise TaskInputError(
                f"haystack folder does not exist ({self.folder}); expected a prepared folder "
                "(python -m longctx.data.prepare), 'books', 'embedded' or 'noise'"
            )
        self._text: TextHaystack | None = None

    def text(self) -> TextHaystack:
        if self._text is None:
            from longctx.data.shards import ShardSet
            from longctx.data.tokenizer import load_tokenizer

            docs = ShardSet(self.folder, self.split)
            own = load_tokenizer(docs.manifest.tokenizer)
            bodies = [own.decode(docs.document(i)[:-1]) for i in range(docs.num_documents)]
            try:
                self._text = TextHaystack("\n\n".join(bodies), self.name)
            except ValueError:
                raise TaskInputError(
                    f"haystack {self.name} holds no text in its {self.split} split; use another"
                ) from None
        return self._text

    def units(self, enc, rng, sep: str):
        return self.text().units(enc, rng, sep)


def resolve_haystack(spec, cache_dir: str | None = None):
    """'books' (the embedded held-out books: no training row holds them), 'embedded' (the
    embedded corpus's training chapters: for training documents), 'noise' (the legacy filler),
    a prepared folder, or a haystack object (returned as is)."""
    if not isinstance(spec, str | Path):
        return spec
    return _resolve(str(spec), cache_dir)


@functools.lru_cache(maxsize=16)
def _resolve(spec: str, cache_dir: str | None):
    """One haystack object per name and cache folder: a corpus is decoded once per process."""
    from longctx.data.corpus import default_corpus_dir, long_documents_dir

    if str(spec) == "noise":
        return FillerHaystack()
    if str(spec) == "books":
        return CorpusHaystack(long_documents_dir(cache_dir), "train", name="books")
    if str(spec) == "embedded":
        return CorpusHaystack(default_corpus_dir(cache_dir), "train", name="embedded")
    return CorpusHaystack(Path(spec), "train")
