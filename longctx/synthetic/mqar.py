"""Multi-query associative recall (MQAR) as documents: one token is one key.

Zoology's MQAR (Arora, Eyuboglu et al. 2023; ``shared/reference/mqar-facts.md``) with two
changes that make an example a document of a packed row:

- A document lists ``D`` key-value pairs ``k1 v1 ... kD vD`` and then queries every key once,
  at power-law gaps over ``query_slots`` two-token slots (Zoology's ``power_a``); an unused slot
  is filler. A query is the key followed by its value, so the document is an ordinary token
  stream: the value is the next token after its query key (the answer), and generating one
  token after the key is the suite's reading of it.
- Keys and values come from one shared pool for every document, so documents packed into one
  row bind the same key to other values: the leak a document mask removes shows as wrong
  answers. ``EOS`` ends every document.

The vocabulary: ``FILLER`` (0), ``EOS`` (1), ``num_keys`` keys, then ``num_values`` values.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from longctx.errors import LongctxError

FILLER, EOS = 0, 1
FIRST_KEY = 2
KIND = "mqar"  # the tokenizer kind of an MQAR corpus's manifest


@dataclasses.dataclass(frozen=True)
class MqarVocab:
    num_keys: int = 512
    num_values: int = 512

    def __post_init__(self) -> None:
        for name in ("num_keys", "num_values"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise LongctxError(f"MqarVocab.{name}={value!r}; expected an int >= 2")

    @property
    def first_value(self) -> int:
        return FIRST_KEY + self.num_keys

    @property
    def size(self) -> int:
        return self.first_value + self.num_values


@dataclasses.dataclass(frozen=True)
class MqarDocument:
    """One document's tokens (EOS last) and the positions of its query keys: the answer to the
    query at ``query_positions[i]`` is ``tokens[query_positions[i] + 1]``, and its key sits at
    ``key_positions[i]``."""

    tokens: np.ndarray  # int64 [n]
    query_positions: np.ndarray  # int64 [D]
    key_positions: np.ndarray  # int64 [D]

    @property
    def answers(self) -> np.ndarray:
        return self.tokens[self.query_positions + 1]

    @property
    def distances(self) -> np.ndarray:
        """How far back each query's key is (tokens from the key to the query)."""
        return self.query_positions - self.key_positions


def power_law_gaps(rng: np.random.Generator, slots: int, count: int, power_a: float) -> np.ndarray:
    """``count`` distinct slots in [0, slots), drawn with p(g) ∝ g^(power_a - 1), g = 1..slots
    (Zoology's gap distribution: power_a = 0.01 puts nearly all mass on short gaps)."""
    if count > slots:
        raise LongctxError(f"{count} queries do not fit {slots} query slots")
    if not (math.isfinite(power_a) and 0 < power_a <= 1):  # else NaN probabilities, unnamed
        raise LongctxError(f"power_a={power_a!r}; expected a value in (0, 1]")
    g = np.arange(1, slots + 1, dtype=np.float64)
    p = power_a * g ** (power_a - 1)
    return np.sort(rng.choice(slots, size=count, replace=False, p=p / p.sum()))


def mqar_document(
    rng: np.random.Generator,
    vocab: MqarVocab,
    num_pairs: int,
    query_slots: int,
    power_a: float = 0.01,
    lead_filler: int = 0,
) -> MqarDocument:
    """``num_pairs`` pairs, then ``lead_filler`` filler tokens, then ``query_slots`` two-token
    slots holding the queries (``lead_filler`` pushes every query further from its key: the
    length condition's distances)."""
    if not 1 <= num_pairs <= min(vocab.num_keys, vocab.num_values):
        raise LongctxError(
            f"num_pairs={num_pairs}; expected 1..{min(vocab.num_keys, vocab.num_values)}"
        )
    keys = FIRST_KEY + rng.choice(vocab.num_keys, size=num_pairs, replace=False)
    values = vocab.first_value + rng.choice(vocab.num_values, size=num_pairs, replace=False)
    head = np.empty(2 * num_pairs, dtype=np.int64)
    head[0::2], head[1::2] = keys, values
    queries = np.full(2 * query_slots, FILLER, dtype=np.int64)
    order = rng.permutation(num_pairs)
    slot = power_law_gaps(rng, query_slots, num_pairs, power_a)
    queries[2 * slot], queries[2 * slot + 1] = keys[order], values[order]
    tokens = np.concatenate([head, np.full(lead_filler, FILLER, np.int64), queries, [EOS]])
    query_positions = 2 * num_pairs + lead_filler + 2 * slot
    return MqarDocument(tokens, query_positions, 2 * order)


@dataclasses.dataclass(frozen=True)
class MqarSpec:
    """The training documents' distribution: ``num_pairs`` log-uniform in [min_pairs, max_pairs]
    (long-tailed lengths: many short documents, few long ones), ``slot_ratio`` query slots per
    pair, Zoology's power-law gaps."""

    vocab: MqarVocab = MqarVocab()
    min_pairs: int = 2
    max_pairs: int = 32
    slot_ratio: float = 1.5
    power_a: float = 0.01

    def __post_init__(self) -> None:
        for name, kind in (("min_pairs", int), ("max_pairs", int), ("slot_ratio", float),
                           ("power_a", float)):  # fmt: skip
            value = getattr(self, name)  # else float pairs crash the generator, a str compares
            if isinstance(value, bool) or not isinstance(value, int | np.integer | kind):
                raise LongctxError(f"MqarSpec.{name}={value!r}; expected {kind.__name__}")
        if (
            not 1
            <= self.min_pairs
            <= self.max_pairs
            <= min(self.vocab.num_keys, self.vocab.num_values)
        ):
            raise LongctxError(
                f"MqarSpec pairs [{self.min_pairs}, {self.max_pairs}]; expected "
                f"1 <= min_pairs <= max_pairs <= {min(self.vocab.num_keys, self.vocab.num_values)}"
            )
        if not (math.isfinite(self.slot_ratio) and self.slot_ratio >= 1):
            raise LongctxError(
                f"MqarSpec.slot_ratio={self.slot_ratio!r}; expected a finite value >= 1"
            )
        if not (math.isfinite(self.power_a) and 0 < self.power_a <= 1):
            raise LongctxError(f"MqarSpec.power_a={self.power_a!r}; expected a value in (0, 1]")

    def slots(self, num_pairs: int) -> int:
        return math.ceil(self.slot_ratio * num_pairs)

    def length(self, num_pairs: int) -> int:
        """Tokens of a document of ``num_pairs`` pairs, EOS included."""
        return 2 * num_pairs + 2 * self.slots(num_pairs) + 1

    @property
    def max_doc_len(self) -> int:
        """``Lmax_doc``: the longest training document."""
        return self.length(self.max_pairs)

    def num_pairs(self, rng: np.random.Generator) -> int:
        low, high = math.log(self.min_pairs), math.log(self.max_pairs + 1)
        return min(self.max_pairs, int(math.exp(rng.uniform(low, high))))

    def document(self, rng: np.random.Generator, lead_filler: int = 0) -> MqarDocument:
        d = self.num_pairs(rng)
        return mqar_document(rng, self.vocab, d, self.slots(d), self.power_a, lead_filler)


def tokenizer_spec(spec: MqarSpec) -> dict:
    """The manifest's tokenizer entry: what every id of the folder means."""
    return {
        "kind": KIND, "vocab_size": spec.vocab.size, "eos_id": EOS, "filler_id": FILLER,
        "num_keys": spec.vocab.num_keys, "num_values": spec.vocab.num_values,
    }  # fmt: skip


def spec_of(tokenizer: dict) -> MqarVocab:
    """The vocabulary a manifest's ``mqar`` tokenizer entry states."""
    if tokenizer.get("kind") != KIND:
        raise LongctxError(f"tokenizer {tokenizer!r} is not an MQAR vocabulary (kind {KIND!r})")
    return MqarVocab(tokenizer["num_keys"], tokenizer["num_values"])


def answer_keys(loss_tokens: str, tokenizer: dict) -> tuple[int, int] | None:
    """The key ids whose queries ``data.loss_tokens=answers`` scores, from the data's tokenizer
    entry: only an MQAR corpus says which tokens answer."""
    if loss_tokens == "all":
        return None
    if tokenizer.get("kind") != KIND:
        raise LongctxError(
            f"data.loss_tokens={loss_tokens!r} needs an MQAR corpus (python -m "
            f"longctx.data.mqar_corpus); the data's tokenizer is {tokenizer.get('kind')!r}"
        )
    vocab = spec_of(tokenizer)
    return FIRST_KEY, vocab.first_value
