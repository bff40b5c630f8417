"""RULER's qa data: a local folder with ``squad.json`` (qa_1) and/or ``hotpotqa.json`` (qa_2),
in the forms RULER's qa.py reads (nothing is downloaded):

- ``squad.json``: SQuAD 2.0's form, ``{"data": [{"paragraphs": [{"context": str, "qas":
  [{"question": str, "answers": [{"text": str}], "is_impossible": bool}]}]}]}``; an answerable
  question's documents are its paragraph, and the other paragraphs of its article come first
  among the distractors;
- ``hotpotqa.json``: HotpotQA's form, ``[{"question": str, "answer": str, "context": [[title,
  [sentence, ...]], ...]}]``; a document is ``title\\nsentences joined``, and all of a question's
  paragraphs are its documents.

The documents are de-duplicated and sorted, as RULER does.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from longctx.errors import LongctxError
from longctx.synthetic.pieces import TaskInputError

FILES = {"squad": "squad.json", "hotpotqa": "hotpotqa.json"}


@dataclasses.dataclass(frozen=True)
class Question:
    query: str
    outputs: tuple[str, ...]
    context: tuple[int, ...]  # the documents that hold the answer
    more: tuple[int, ...] = ()  # distractors drawn first (SQuAD: the same article)


@dataclasses.dataclass(frozen=True)
class QAData:
    name: str
    questions: tuple[Question, ...]
    documents: tuple[str, ...]


def load_qa_folder(folder: str | Path) -> dict[str, QAData]:
    """The datasets of ``folder`` by name (squad, hotpotqa); a one-line error on a bad folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TaskInputError(
            f"--qa-data is not a folder ({folder}); expected a folder with squad.json and/or "
            "hotpotqa.json in RULER's SQuAD / HotpotQA JSON form"
        )
    found = {name: folder / f for name, f in FILES.items() if (folder / f).is_file()}
    if not found:
        raise TaskInputError(
            f"--qa-data holds neither squad.json nor hotpotqa.json ({folder}); add them in "
            "RULER's SQuAD / HotpotQA JSON form"
        )
    return {name: _read(name, path) for name, path in found.items()}


class _BadAnswer(LongctxError):
    """A reference answer that is not non-empty text."""


def _answer(value, question_id) -> str:
    """A reference answer as text: null, non-text, empty or whitespace-only refused (an empty
    reference is contained in every prediction, so it scored 100%; null became "None")."""
    if not isinstance(value, str) or not value.strip():
        raise _BadAnswer(f"question {question_id!r} has the answer {value!r}")
    return value


def _read(name: str, path: Path) -> QAData:
    try:
        raw = json.loads(path.read_text("utf-8"))
        data = _squad(raw) if name == "squad" else _hotpotqa(raw)
    except _BadAnswer as err:
        raise TaskInputError(
            f"--qa-data {path}: {err}; expected every answer to be non-empty text (an empty one "
            "is contained in every prediction and would score 100%)"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        form = "SQuAD 2.0" if name == "squad" else "HotpotQA"
        raise TaskInputError(
            f"--qa-data {path} is not in {form}'s JSON form ({type(err).__name__}: {err}); "
            "see longctx.synthetic.qa for the fields read"
        ) from None
    if not data.questions:
        raise TaskInputError(f"--qa-data {path} holds no answerable question; add some")
    return data


def _squad(raw: dict) -> QAData:
    paragraphs = [p for article in raw["data"] for p in article["paragraphs"]]
    documents = sorted({str(p["context"]) for p in paragraphs})
    index = {c: i for i, c in enumerate(documents)}
    questions = []
    for article in raw["data"]:
        same = [index[p["context"]] for p in article["paragraphs"]]
        for p in article["paragraphs"]:
            own = index[p["context"]]
            for q in p["qas"]:
                if not q["is_impossible"]:
                    qid = q.get("id", q["question"])
                    outputs = tuple(_answer(a["text"], qid) for a in q["answers"])
                    if not outputs:
                        raise ValueError(f"question {qid!r} has no answer")
                    more = tuple(i for i in same if i != own)
                    questions.append(Question(str(q["question"]), outputs, (own,), more))
    return QAData("squad", tuple(questions), tuple(documents))


def _hotpotqa(raw: list) -> QAData:
    if not isinstance(raw, list):
        raise TypeError("expected a list of questions")
    text = lambda title, sentences: f"{title}\n{''.join(sentences)}"  # noqa: E731
    documents = sorted({text(t, s) for item in raw for t, s in item["context"]})
    index = {c: i for i, c in enumerate(documents)}
    questions = tuple(
        Question(
            str(item["question"]),
            (_answer(item["answer"], item.get("_id", n)),),
            tuple(index[text(t, s)] for t, s in item["context"]),
        )  # fmt: skip
        for n, item in enumerate(raw)
    )
    return QAData("hotpotqa", questions, tuple(documents))
