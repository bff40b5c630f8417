"""RULER's 13 tasks (NVIDIA/RULER ``scripts/synthetic.yaml``) under RULER's names, with its
templates and answer prefixes verbatim (``scripts/data/synthetic/constants.py``).

Differences from RULER's own generator, each for a stated reason, are listed point by point in
docs/effective-length.md: lengths are exact (the last unit is cut), the needle at the
instance's depth is the one asked, whitespace between units follows the separator of each
haystack (RULER: " " or "\\n").
"""

from __future__ import annotations

import dataclasses
import random
import string

import numpy as np

from longctx.synthetic.haystacks import NOISE, NoiseHaystack
from longctx.synthetic.layout import Draw, Layout, grid_depth, random_depth
from longctx.synthetic.pieces import DoesNotFit, Encoder, TaskInputError, cat, listing
from longctx.synthetic.words import common_words, distinct, draw

# RULER's strings, verbatim
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are "
    "all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = (
    " The special magic {type_needle_v} for {query} mentioned in the provided text are"
)
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
    "above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
    "variables are assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most "
    "common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. {context}\nQuestion: Do not provide any "
    "explanation. Please ignore the dots '....'. What are the three most frequently appeared "
    "words in the above coded text?"
)
FWE_ANSWER_PREFIX = (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not "
    "output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the "
    "question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
DOCUMENT_PROMPT = "Document {i}:\n{document}"

TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
VT_CHAINS, VT_HOPS = 1, 4
CWE_FREQ_CW, CWE_FREQ_UCW, CWE_NUM_CW = 30, 3, 10
CWE_SHORT = (6, 1)  # RULER's counts below 4096 tokens
CWE_EXAMPLE, CWE_EXAMPLE_SHORT = (40, 10, 3), (20, 3, 1)  # its worked example: words, counts
FWE_ALPHA, FWE_WORDLEN, FWE_VOCAB_PER = 2.0, 6, 50

_MARK = "\x00"  # where the context goes


def prompt_parts(enc: Encoder, text: str, sep: str) -> tuple[np.ndarray, np.ndarray]:
    """(head, question) tokens of a formatted template + answer prefix around ``_MARK``. Every
    context piece carries the separator in front, so the head loses a trailing one."""
    head, question = text.split(_MARK)
    if sep and head.endswith(sep):
        head = head[: -len(sep)]
    return enc(head), enc(question)


def niah_prompt(num_values: int, num_queries: int) -> tuple[str, bool]:
    """RULER's niah template + answer prefix, made singular when queries x values = 1 (as
    niah.py does), and whether it was."""
    text = NIAH_TEMPLATE + NIAH_ANSWER_PREFIX
    single = num_values * num_queries == 1
    if single:
        text = text.replace("Some", "A").replace("are all", "is").replace("are", "is")
        text = text.replace("answers", "answer")
    return text, single


@dataclasses.dataclass(frozen=True)
class Niah:
    haystack: str  # noise, essay or needle
    key: str  # words or uuids
    value: str  # numbers or uuids
    keys: int = 1
    values: int = 1
    queries: int = 1

    @property
    def sep(self) -> str:  # RULER joins noise and needle haystacks with "\n", essays with " "
        return " " if self.haystack == "essay" else "\n"

    def __call__(self, d: Draw) -> Layout:
        rng, enc = d.rng, d.enc
        keys = distinct(rng, self.key, self.keys)
        values = [distinct(rng, self.value, self.values) for _ in keys]
        asked = rng.sample(range(self.keys), self.queries)
        inserts, placed = [], {}
        for i, key in enumerate(keys):
            for j, value in enumerate(values[i]):
                depth = grid_depth(d.depth) if (i, j) == (asked[0], 0) else random_depth(rng)
                placed[(i, j)] = (depth, len(inserts))
                needle = NEEDLE.format(type_needle_v=self.value, key=key, value=_MARK)
                before, after = needle.split(_MARK)  # "... is: ", "."
                before = before.removesuffix(" ")  # the value carries its space
                inserts.append((depth, cat(enc(self.sep + before), enc(f" {value}"), enc(after))))
        # the references: the asked keys' values, each key's in the order they appear
        refs = [
            values[i][j] for i in asked for j in sorted(range(self.values), key=lambda j: placed[(i, j)])
        ]  # fmt: skip
        names = [keys[i] for i in asked]
        query = ", ".join(names[:-1]) + ", and " + names[-1] if len(names) > 1 else names[0]
        text, single = niah_prompt(self.values, self.queries)
        type_v = self.value[:-1] if single else self.value
        head, question = prompt_parts(
            enc, text.format(type_needle_v=type_v, context=_MARK, query=query), self.sep
        )
        return Layout(
            question=question, answer=listing(enc, refs), answer_text=", ".join(refs),
            references=tuple(refs), inserts=inserts, head=head,
            units=self._units(d, frozenset(keys)),
        )  # fmt: skip

    def _units(self, d: Draw, keys: frozenset[str]):
        if self.haystack == "noise":
            return NoiseHaystack().units(d.enc, d.rng, self.sep)
        if self.haystack == "needle":
            return self._needle_units(d, keys)
        if d.haystack is None:
            raise TaskInputError("an essay task needs a haystack (haystack=None); pass 'books'")
        return d.haystack.units(d.enc, d.rng, self.sep)

    def _needle_units(self, d: Draw, keys: frozenset[str]):
        """RULER's needle haystack: needles of the same form, with other keys."""
        while True:
            key = draw(d.rng, self.key)
            if key not in keys:
                value = draw(d.rng, self.value)
                yield d.enc(
                    self.sep + NEEDLE.format(type_needle_v=self.value, key=key, value=value)
                )


VT_EXAMPLE_TOKENS, VT_EXAMPLE_VALUE = 500, "12345"  # RULER's worked example: its length, value


def vt_example(rng: random.Random, enc: Encoder) -> str:
    """RULER's worked vt example, which precedes every vt prompt: a chain of five 3-letter
    variables holding 12345 among as many noise lines (in steps of 5) as fit 500 tokens with
    the 30 generated, then its answer and a blank line (RULER's ``sys_vartrack_w_noise_random``
    at ``max_seq_length=500``; its ``randomize_icl`` draws fresh names, as here)."""
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=3))
        if name not in names:
            names.append(name)
    chain = [f"VAR {names[0]} = {VT_EXAMPLE_VALUE}"]
    chain += [f"VAR {names[j]} = VAR {names[j - 1]} " for j in range(1, VT_HOPS + 1)]
    seed = rng.random()

    def example(noises: int) -> str:
        lines = [NOISE + "\n"] * noises
        places = sorted(random.Random(seed).choices(range(noises + 1), k=len(chain)))
        for j, (at, piece) in enumerate(zip(places, chain, strict=True)):
            lines.insert(at + j, piece)
        context = " ".join(lines).replace(". \n", ".\n")
        text = VT_TEMPLATE + VT_ANSWER_PREFIX
        text = text.format(context=context, query=VT_EXAMPLE_VALUE, num_v=len(names))
        return f"{text} {' '.join(names)}\n\n"

    fits = lambda n: len(enc(example(n))) + TOKENS_TO_GENERATE["vt"] <= VT_EXAMPLE_TOKENS  # noqa: E731
    noises = 0
    while fits(noises + 5):
        noises += 5
    return example(noises)


def variable_tracking(d: Draw) -> Layout:
    """RULER's worked example, then one chain of 5 variables (4 hops) in RULER's noise:
    ``VAR ABCDE = 12345``, then ``VAR FGHIJ = VAR ABCDE `` for each hop, in order, the first at
    the instance's depth."""
    rng, enc = d.rng, d.enc
    example = vt_example(rng, enc)
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99998))  # RULER: np.random.randint(10000, 99999)
    first = grid_depth(d.depth)
    later = sorted(random_depth(rng) for _ in range(VT_HOPS))
    depths = [first] + [max(first, x) for x in later]
    pieces = [cat(enc(" VAR "), enc(names[0]), enc(" = "), enc(value))]
    pieces += [
        cat(enc(" VAR "), enc(names[j]), enc(" = VAR "), enc(names[j - 1]), enc(" "))
        for j in range(1, VT_HOPS + 1)
    ]
    text = (VT_TEMPLATE + VT_ANSWER_PREFIX).format(context=_MARK, query=value, num_v=len(names))
    head, question = prompt_parts(enc, example + text, " ")
    answer = cat(*[p for j, n in enumerate(names) for p in ([enc(" ")] if j else []) + [enc(n)]])
    return Layout(
        question=question, answer=answer, answer_text=" ".join(names), references=tuple(names),
        inserts=list(zip(depths, pieces, strict=True)), head=head,
        units=NoiseHaystack(end="\n").units(enc, rng, " "),
    )  # fmt: skip


def common_words_extraction(d: Draw) -> Layout:
    """RULER's numbered word list: 10 words ``freq_cw`` times each, the others ``freq_ucw``
    times (6 and 1 below 4096 tokens), as many words as the length holds: the vocabulary grows
    with the length. The list's tail is cut at the exact length with new words (once each)."""
    rng, enc = d.rng, d.enc
    words = list(common_words())
    rng.shuffle(words)
    short = d.length < 4096
    freq_cw, freq_ucw = CWE_SHORT if short else (CWE_FREQ_CW, CWE_FREQ_UCW)
    template = CWE_TEMPLATE + CWE_ANSWER_PREFIX
    head, question = prompt_parts(
        enc, cwe_example(rng, short) + template.replace("{context}", _MARK), " "
    )
    room = d.budget - len(head) - len(question)
    number = lambda i: enc("1.") if i == 1 else enc(f" {i}.")  # noqa: E731
    word_cost = np.cumsum([0] + [len(enc(f" {w}")) for w in words])
    number_cost = _prefix_costs(number, max(room, 0))

    def cost(n: int) -> int:
        entries = CWE_NUM_CW * freq_cw + (n - CWE_NUM_CW) * freq_ucw
        if entries >= len(number_cost):
            return room + 1
        common = word_cost[CWE_NUM_CW] * freq_cw
        return int(
            number_cost[entries] + common + (word_cost[n] - word_cost[CWE_NUM_CW]) * freq_ucw
        )

    n = _largest(cost, room, CWE_NUM_CW + 1, len(words))
    common = words[:CWE_NUM_CW]
    items = common * freq_cw + words[CWE_NUM_CW:n] * freq_ucw
    rng.shuffle(items)

    def units():
        for i, word in enumerate(items + words[n:], start=1):
            yield cat(number(i), enc(f" {word}"))

    answer = cat(*[p for i, w in enumerate(common, 1) for p in (enc(f" {i}."), enc(f" {w}"))])
    return Layout(
        question=question, answer=answer,
        answer_text=" ".join(f"{i}. {w}" for i, w in enumerate(common, 1)),
        references=tuple(common), head=head, units=units(),
    )  # fmt: skip


def cwe_example(rng: random.Random, short: bool) -> str:
    """RULER's worked cwe example, which precedes every cwe prompt: 20 words (3 and 1 times)
    below 4096 tokens, else 40 (10 and 3 times), the template and its numbered answer."""
    count, freq_cw, freq_ucw = CWE_EXAMPLE_SHORT if short else CWE_EXAMPLE
    sample = rng.sample(common_words(), count)
    items = sample[:CWE_NUM_CW] * freq_cw + sample[CWE_NUM_CW:] * freq_ucw
    rng.shuffle(items)
    numbered = lambda ws: " ".join(f"{i}. {w}" for i, w in enumerate(ws, 1))  # noqa: E731
    text = (CWE_TEMPLATE + CWE_ANSWER_PREFIX).format(context=numbered(items))
    return f"{text} {numbered(sample[:CWE_NUM_CW])}\n"


def freq_words_extraction(d: Draw) -> Layout:
    """RULER's coded text: (L - tokens_to_generate) // 50 coded words of 6 letters with Zipf
    counts (alpha 2); the most frequent is the noise '...'; ranks 2-4 are asked. The tail is
    cut at the exact length with more '...'."""
    rng, enc = d.rng, d.enc
    size = d.budget // FWE_VOCAB_PER
    if size < 5:
        raise DoesNotFit(f"its vocabulary ({d.budget} // {FWE_VOCAB_PER}) is under 5 words")
    vocab: list[str] = []
    while len(vocab) < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=FWE_WORDLEN))
        if word not in vocab:
            vocab.append(word)
    vocab.sort()
    rng.shuffle(vocab)
    vocab[0] = "..."
    head, question = prompt_parts(
        enc, (FWE_TEMPLATE + FWE_ANSWER_PREFIX).replace("{context}", _MARK), " "
    )
    room = d.budget - len(head) - len(question)
    sizes = np.array([len(enc(f" {w}")) for w in vocab])
    zipf = np.arange(1, size + 1, dtype=np.float64) ** -FWE_ALPHA / _zeta(FWE_ALPHA)
    counts = lambda n: (n * zipf).astype(int)  # noqa: E731
    n = _largest(lambda n: int(counts(n) @ sizes), room, 1, 4 * room + 8)
    c = counts(n)
    if not c[1] > c[2] > c[3] > c[4]:
        raise DoesNotFit("its coded text is too short for distinct counts at ranks 2-4")
    items = [w for w, k in zip(vocab, c, strict=True) for _ in range(k)]
    rng.shuffle(items)

    def units():
        yield from (enc(f" {w}") for w in items)
        while True:
            yield enc(" ...")

    top = vocab[1:4]
    return Layout(
        question=question, answer=listing(enc, top), answer_text=", ".join(top),
        references=tuple(top), head=head, units=units(),
    )  # fmt: skip


def qa(dataset: str):
    """RULER's qa: the question's documents among distractors, as many as fit, shuffled,
    each ``Document i:\\n...``; ``dataset``: squad (qa_1) or hotpotqa (qa_2)."""

    def build(d: Draw) -> Layout:
        data = (d.qa or {}).get(dataset)
        if data is None:
            raise TaskInputError(f"qa ({dataset}) needs --qa-data DIR with {dataset}.json")
        rng, enc = d.rng, d.enc
        item = data.questions[rng.randrange(len(data.questions))]
        more = [i for i in item.more if i not in item.context]
        rng.shuffle(more)
        others = [i for i in range(len(data.documents)) if i not in item.context and i not in more]
        rng.shuffle(others)
        candidates = list(item.context) + more + others
        text = (QA_TEMPLATE + QA_ANSWER_PREFIX).replace("{context}", _MARK).format(query=item.query)
        head, question = prompt_parts(enc, text, "\n\n")
        room = d.budget - len(head) - len(question)
        label = lambda i: enc("\n\n" + DOCUMENT_PROMPT.format(i=i, document=""))  # noqa: E731
        costs = np.cumsum([0] + [len(enc(data.documents[j])) for j in candidates])
        labels = _prefix_costs(label, len(candidates))
        n = _largest(lambda n: int(costs[n] + labels[n]), room, len(item.context), len(candidates))
        chosen, rest = candidates[:n], candidates[n:]
        rng.shuffle(chosen)

        def units():
            for i, j in enumerate(chosen + rest, start=1):
                yield cat(label(i), enc(data.documents[j]))

        return Layout(
            question=question, answer=enc(f" {item.outputs[0]}"), answer_text=item.outputs[0],
            references=tuple(item.outputs), head=head, units=units(),
        )  # fmt: skip

    return build


def _prefix_costs(piece, count: int) -> np.ndarray:
    """[0, len(piece(1)), len(piece(1)) + len(piece(2)), ...] up to ``count`` pieces."""
    return np.cumsum([0] + [len(piece(i)) for i in range(1, count + 1)])


def _largest(cost, room: int, low: int, high: int) -> int:
    """The largest n in [low, high] with cost(n) <= room (cost grows with n)."""
    if high < low or cost(low) > room:
        raise DoesNotFit(f"its smallest content ({low}) does not fit in {room} context tokens")
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if cost(mid) <= room else (low, mid - 1)
    return low


def _zeta(alpha: float, terms: int = 100_000) -> float:
    """Riemann zeta by its partial sum plus the integral tail (exact to ~1e-15 for alpha 2)."""
    k = np.arange(1, terms + 1, dtype=np.float64)
    return float(np.sum(k**-alpha) + terms ** (1 - alpha) / (alpha - 1) - terms**-alpha / 2)


NIAH = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", keys=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", values=4),
    "niah_multiquery": Niah("essay", "words", "numbers", keys=4, queries=4),
}
