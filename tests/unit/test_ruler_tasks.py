"""RULER's 13 tasks as longctx.synthetic generates them: templates verbatim, exact lengths under
the byte tokenizer and a BPE, needles between sentences, answer tokens equal to the needle's,
the vt chain, cwe/fwe counts, the qa folders, determinism, skips that are said, and the rule
that data/ never imports eval/."""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from export_helpers import make_user_tokenizer
from helpers import CACHE_DIR

from longctx.data import ByteTokenizer
from longctx.data.tokenizer import HFTokenizer
from longctx.eval.ruler import (
    RulerInputError,
    make_instance,
    make_instances,
    plan_instances,
    tokens_digest,
)
from longctx.synthetic import haystacks, ruler
from longctx.synthetic.layout import DEPTHS, grid_depth
from longctx.synthetic.qa import load_qa_folder
from longctx.synthetic.tasks import RULER_TASKS
from longctx.synthetic.words import common_words, wordlist

ROOT = Path(__file__).resolve().parents[2]
QA = ROOT / "tests" / "fixtures" / "ruler_qa"
BYTE = ByteTokenizer()
NOT_QA = [t for t in RULER_TASKS if not t.startswith("qa")]

# RULER's strings as reference/ruler-facts.md quotes them (NVIDIA/RULER constants.py, niah.py)
FACTS = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
        "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are "
        "all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    ),
    "vt": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text."
        "\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the "
        "text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
        "variables are assigned the value {query}, they are: ",
    ),
    "cwe": (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most "
        "common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
    ),
    "fwe": (
        "Read the following coded text and track the frequency of each coded word. Find the "
        "three most frequently appeared coded words. {context}\nQuestion: Do not provide any "
        "explanation. Please ignore the dots '....'. What are the three most frequently "
        "appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not "
        "output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer "
        "the question based on the given documents. Only give me the answer and do not output "
        "any other words.\n\nQuestion: {query}",
        " Answer:",
    ),
}
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


def family(task: str) -> str:
    return "niah" if task.startswith("niah") else task.split("_")[0]


def text(tok, ids) -> str:
    return tok.decode(np.asarray(ids))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return HFTokenizer(make_user_tokenizer(tmp_path_factory.mktemp("bpe") / "tok"))


@pytest.fixture(scope="module")
def byte_instances():
    return make_instances(BYTE, NOT_QA[:9] + ["fwe"], [1024, 2048], [0.0, 0.5, 1.0], 2,
                          haystack="books", cache_dir=str(CACHE_DIR))  # fmt: skip


# ------------------------------------------------------------------------------ templates
def test_the_templates_and_needle_are_rulers_verbatim():
    ours = {
        "niah": (ruler.NIAH_TEMPLATE, ruler.NIAH_ANSWER_PREFIX),
        "vt": (ruler.VT_TEMPLATE, ruler.VT_ANSWER_PREFIX),
        "cwe": (ruler.CWE_TEMPLATE, ruler.CWE_ANSWER_PREFIX),
        "fwe": (ruler.FWE_TEMPLATE, ruler.FWE_ANSWER_PREFIX),
        "qa": (ruler.QA_TEMPLATE, ruler.QA_ANSWER_PREFIX),
    }
    assert ours == FACTS
    assert ruler.NEEDLE == NEEDLE and haystacks.NOISE == NOISE
    assert ruler.TOKENS_TO_GENERATE == TOKENS_TO_GENERATE
    assert list(DEPTHS) == [int(d) for d in np.round(np.linspace(0, 100, 40))]
    assert grid_depth(0.5) in (0.49, 0.51) and grid_depth(0.0) == 0.0 and grid_depth(1.0) == 1.0


def test_every_prompt_is_the_template_around_its_context(byte_instances):
    for i in byte_instances:
        prompt = text(BYTE, i.prompt)
        template, prefix = FACTS[family(i.task)]
        if family(i.task) == "niah":
            single = i.task.startswith("niah_single") or i.task.startswith("niah_multikey")
            kind = "uuid" if i.task in ("niah_single_3", "niah_multikey_3") else "number"
            if single:  # niah.py's singular rewrite
                template = template + prefix
                for a, b in (("Some", "A"), ("are all", "is"), ("are", "is")):
                    template = template.replace(a, b)
                template, prefix = template.split(" The special", 1)
                prefix = " The special" + prefix
            else:
                kind += "s"
            template, prefix = (t.replace("{type_needle_v}", kind) for t in (template, prefix))
        head, tail = template.split("{context}")
        pattern = re.escape(head.rstrip("\n ")) + r"[\s\S]*" + re.escape(tail + prefix)
        pattern = re.sub(r"\\\{(query|num_v)\\\}", ".+?", pattern)
        if i.task in ("vt", "cwe"):  # RULER's worked example (the same template) comes first
            first = head.split(".")[0]
            assert prompt.startswith(first) and prompt.count(first) == 2, i.task
            pattern = r"[\s\S]*" + pattern
        assert re.fullmatch(pattern, prompt), (i.task, prompt[:300], prompt[-300:])
        if i.task.startswith("niah_single") or i.task.startswith("niah_multikey"):
            assert prompt.startswith("A special magic") and " is hidden within " in prompt
        if i.task in ("niah_multivalue", "niah_multiquery"):
            assert prompt.startswith("Some special magic numbers are hidden within")


# ----------------------------------------------------------------------------- lengths
@pytest.mark.parametrize("length", [1024, 1500, 2048])
def test_lengths_are_exact_under_the_byte_tokenizer_and_a_bpe(length, bpe):
    for tok in (BYTE, bpe):
        plan = plan_instances(tok, None, [length], [0.0, 0.5, 1.0], 1, haystack="books",
                              cache_dir=str(CACHE_DIR), qa_data=QA)  # fmt: skip
        assert {i.task for i in plan.instances} >= {"niah_single_1", "niah_multikey_3", "vt"}
        for i in plan.instances:
            ttg = TOKENS_TO_GENERATE[family(i.task)]
            assert i.tokens_to_generate == ttg
            assert len(i.prompt) == length - max(ttg, i.answer_len)  # both fit the length
            assert len(i.tokens) == len(i.prompt) + i.answer_len <= length
            assert i.tokens.dtype == np.int64 and i.prompt.dtype == np.int64
            assert i.metric == ("string_match_part" if i.task.startswith("qa") else
                                "string_match_all")  # fmt: skip
            labels = i.labels()
            assert len(labels) == len(i.tokens) - 1
            assert np.array_equal(labels[-i.answer_len :], i.tokens[-i.answer_len :])


# ------------------------------------------------------------------ needles and answers
def test_needles_sit_between_sentences(byte_instances):
    for i in byte_instances:
        if not i.task.startswith("niah"):
            continue
        prompt = text(BYTE, i.prompt)
        starts = [m.start() for m in re.finditer(r"One of the special magic", prompt)]
        assert starts
        for at in starts:
            before = prompt[:at].rstrip(" \n")
            assert before.endswith((".", "?", "!", "afterwards")), (i.task, prompt[at - 80 : at])


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_the_asked_needle_sits_at_its_depth_in_the_noise(depth):
    i = make_instance("niah_single_1", BYTE, 4096, depth, seed=3)
    context = text(BYTE, i.prompt).split("afterwards.\n", 1)[1].split("\nWhat is")[0]
    lines = context.split("\n")
    at = next(k for k, line in enumerate(lines) if line.startswith("One of the special"))
    whole = len(lines) - 2  # the needle and the cut last line are not whole units
    assert at == int(whole * grid_depth(depth))
    assert all(line == NOISE for line in lines[:at] + lines[at + 1 : -1])


def test_the_answer_tokens_equal_the_needles_under_any_tokenizer(bpe):
    for tok in (BYTE, bpe):
        for task in ("niah_single_1", "niah_single_3", "niah_multikey_3", "niah_multivalue",
                     "niah_multiquery", "vt", "fwe"):  # fmt: skip
            i = make_instance(task, tok, 2048, 0.5, seed=1, haystack="books",
                              cache_dir=str(CACHE_DIR))  # fmt: skip
            prompt, answer = list(i.prompt), list(i.tokens[-i.answer_len :])
            for ref in i.references:
                piece = list(tok.encode(ref if task == "vt" else f" {ref}"))
                assert _contains(prompt, piece) and _contains(answer, piece), (task, ref)
            assert text(tok, answer).strip() == i.answer
            assert all(r.lower() in i.answer.lower() for r in i.references)  # string_match_all


def _contains(seq: list, piece: list) -> bool:
    return any(seq[k : k + len(piece)] == piece for k in range(len(seq) - len(piece) + 1))


def test_values_keys_and_needles_have_rulers_forms():
    i = make_instance("niah_single_1", BYTE, 2048, 0.5, seed=0)
    (value,) = i.references
    assert re.fullmatch(r"[1-9]\d{6}", value) and 1_000_000 <= int(value) <= 9_999_999
    prompt = text(BYTE, i.prompt)
    key = re.search(r"What is the special magic number for (\S+) mentioned", prompt).group(1)
    cuts = [k for k, c in enumerate(key) if c == "-"]
    adjectives, nouns = wordlist("adjectivelist.txt"), wordlist("nounlist.txt")
    assert any(key[:k] in adjectives and key[k + 1 :] in nouns for k in cuts)
    assert f"One of the special magic numbers for {key} is: {value}." in prompt
    u = make_instance("niah_single_3", BYTE, 2048, 0.5, seed=0, haystack="books",
                      cache_dir=str(CACHE_DIR)).references[0]  # fmt: skip
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", u)


@pytest.mark.parametrize("task", ["niah_multikey_2", "niah_multikey_3"])
def test_the_needle_haystack_is_made_of_needles_with_other_keys(task):
    i = make_instance(task, BYTE, 4096, 0.5, seed=0)
    prompt = text(BYTE, i.prompt)
    context = prompt.split("afterwards.\n", 1)[1].split("\nWhat is")[0].split("\n")[:-1]
    kind = "numbers" if task.endswith("2") else "uuids"
    needle = re.compile(rf"One of the special magic {kind} for (\S+) is: (\S+)\.")
    matches = [needle.fullmatch(line) for line in context]
    assert len(context) > 20 and all(matches)
    keys = Counter(m.group(1) for m in matches)
    asked = re.search(r"special magic \w+ for (\S+) mentioned", prompt).group(1)
    assert keys[asked] == 1 and i.references == (matches[[m.group(1) for m in matches]
                                                  .index(asked)].group(2),)  # fmt: skip


def test_multi_key_value_and_query_tasks():
    k = make_instance("niah_multikey_1", BYTE, 2048, 0.5, 0, haystack="noise")
    assert text(BYTE, k.prompt).count("One of the special magic numbers for") == 4
    v = make_instance("niah_multivalue", BYTE, 2048, 0.5, 0, haystack="noise")
    prompt = text(BYTE, v.prompt)
    key = re.search(r"numbers for (\S+) mentioned", prompt).group(1)
    found = re.findall(rf"numbers for {re.escape(key)} is: (\d+)\.", prompt)
    assert len(v.references) == 4 and list(v.references) == found  # in order of appearance
    q = make_instance("niah_multiquery", BYTE, 2048, 0.5, 0, haystack="noise")
    prompt = text(BYTE, q.prompt)
    keys = re.search(r"numbers for (.+?) mentioned in the provided text\?", prompt).group(1)
    keys = keys.replace(", and ", ", ").split(", ")
    assert len(keys) == 4 and ", and " in prompt
    assert [re.search(rf"for {re.escape(k)} is: (\d+)\.", prompt).group(1) for k in keys] == list(
        q.references
    )


# ---------------------------------------------------------------------------------- vt
def test_vt_and_cwe_open_with_rulers_worked_example():
    vt = text(BYTE, make_instance("vt", BYTE, 2048, 0.5, 0).prompt)
    example, _ = vt.split("\n\nMemorize and track", 1)
    names = re.findall(r"VAR ([A-Z]{3}) = ", example)
    assert len(names) == 5 and "VAR " + names[0] + " = 12345" in example
    assert example.endswith("they are:  " + " ".join(names))  # RULER: input + " " + answer
    assert len(example) + 30 <= 500  # sized to 500 tokens with the 30 generated
    cwe = text(BYTE, make_instance("cwe", BYTE, 2048, 0.5, 0).prompt)
    example = cwe.split("\nBelow is a numbered list", 1)[0]
    listed = re.findall(r"\d+\. (\S+)", example.split("most often.\n", 1)[1].split("\n")[0])
    answer = re.findall(r"\d+\. (\S+)", example.rsplit("are:", 1)[1])
    counts = Counter(listed)
    assert len(listed) == 10 * 3 + 10 * 1 and len(answer) == 10  # below 4096: 20 words, 3 / 1
    assert all(counts[w] == 3 for w in answer)


def test_vt_is_one_chain_of_five_variables_and_four_hops():
    for seed in range(3):
        i = make_instance("vt", BYTE, 2048, 0.3, seed)
        prompt = text(BYTE, i.prompt)
        (first,) = re.findall(r"VAR ([A-Z]{5}) = (\d{5})", prompt)
        hops = re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5}) ", prompt)
        assert len(hops) == 4 and len(i.references) == 5
        chain = [first[0]] + [h[0] for h in hops]
        assert [h[1] for h in hops] == chain[:-1]  # each hop names the one before it
        assert list(i.references) == chain and i.answer == " ".join(chain)
        assert f"5 variables are assigned the value {first[1]}, they are: " in prompt
        assert f"Find all variables that are assigned the value {first[1]} in" in prompt
        assert prompt.index(f"VAR {chain[0]} =") < prompt.index(f"VAR {chain[1]} =")


# --------------------------------------------------------------------------------- cwe
def _cwe_list(i) -> list[str]:
    body = text(BYTE, i.prompt).rsplit("most often.\n", 1)[1].split("\nQuestion:")[0]
    body = re.sub(r" \d+\.?$", "", body)  # a cut entry's number
    return [w for w in re.split(r"(?:^| )\d+\. ", body) if w]  # a few words hold a space


@pytest.mark.parametrize("length, common, uncommon", [(2048, 6, 1), (3000, 6, 1), (8192, 30, 3)])
def test_cwe_counts(length, common, uncommon):
    i = make_instance("cwe", BYTE, length, 0.5, seed=0)
    *words, last = _cwe_list(i)
    words += [last.strip()] if last.strip() in i.references else []  # else it may be cut
    counts = Counter(words)
    assert len(i.references) == 10 and all(counts[w] == common for w in i.references)
    others = [c for w, c in counts.items() if w not in i.references]
    assert others and max(others) <= uncommon
    assert set(counts) <= set(common_words())
    numbers = [int(n) for n in re.findall(r"(?:^| )(\d+)\. ", text(BYTE, i.prompt).rsplit(
        "most often.\n", 1)[1])]  # fmt: skip
    assert numbers == list(range(1, len(numbers) + 1))


def test_cwe_vocabulary_grows_with_the_length():
    sizes = [len(set(_cwe_list(make_instance("cwe", BYTE, n, 0.5, 0)))) for n in (8192, 16384)]
    assert sizes[1] > 1.8 * sizes[0]


# --------------------------------------------------------------------------------- fwe
@pytest.mark.parametrize("length", [1024, 4096])
def test_fwe_counts_and_vocabulary(length):
    i = make_instance("fwe", BYTE, length, 0.5, seed=0)
    prompt = text(BYTE, i.prompt)
    body = prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0].split(" ")[:-1]
    counts = Counter(body)
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and ranked[1:4] == list(i.references)
    c = [counts[w] for w in ranked]
    assert c[1] > c[2] > c[3] > c[4]
    assert len(counts) <= (length - 50) // 50 and all(len(w) == 6 for w in ranked[1:])


# ---------------------------------------------------------------------------------- qa
def test_qa_reads_rulers_squad_and_hotpotqa_forms():
    data = load_qa_folder(QA)
    squad, hotpot = data["squad"], data["hotpotqa"]
    assert len(squad.questions) == 14  # the impossible question is dropped, as RULER does
    assert squad.questions[0].outputs == ("on the island of Pharos", "the island of Pharos")
    assert len(hotpot.questions) == 2 and hotpot.questions[0].outputs == ("Vltava",)
    assert any(d.startswith("Vltava\nThe Vltava is the longest") for d in hotpot.documents)
    for task, tok_len in (("qa_1", 1024), ("qa_2", 2048)):
        i = make_instance(task, BYTE, tok_len, 0.5, seed=0, qa_data=QA)
        prompt = text(BYTE, i.prompt)
        assert prompt.startswith(FACTS["qa"][0].split("{context}")[0] + "Document 1:\n")
        assert "\n\nDocument 2:\n" in prompt and prompt.endswith(" Answer:")
        question = prompt.rsplit("Question: ", 1)[1].removesuffix(" Answer:")
        data_set = squad if task == "qa_1" else hotpot
        item = next(q for q in data_set.questions if q.query == question)
        assert i.references == item.outputs and i.metric == "string_match_part"
        for doc in item.context:  # the question's own documents are in the prompt
            assert data_set.documents[doc] in prompt


def test_a_qa_folder_in_the_wrong_form_is_one_line(tmp_path):
    with pytest.raises(RulerInputError, match=r"^--qa-data is not a folder"):
        load_qa_folder(tmp_path / "missing")
    with pytest.raises(RulerInputError, match=r"^--qa-data holds neither squad.json"):
        load_qa_folder(tmp_path)
    (tmp_path / "squad.json").write_text(json.dumps({"data": [{"paragraphs": [{"qas": []}]}]}))
    with pytest.raises(RulerInputError, match=r"is not in SQuAD 2.0's JSON form \(KeyError") as e:
        load_qa_folder(tmp_path)
    assert "\n" not in str(e.value)
    (tmp_path / "squad.json").unlink()
    (tmp_path / "hotpotqa.json").write_text(json.dumps({"question": "q"}))
    with pytest.raises(RulerInputError, match=r"is not in HotpotQA's JSON form"):
        load_qa_folder(tmp_path)


@pytest.mark.parametrize("answer", ["", "   \n", None, 7])
def test_a_qa_answer_that_is_not_text_is_refused_naming_the_question(tmp_path, answer):
    """An empty reference is contained in every prediction (qa_1 scored 1.00 for a 2-step
    model), and a null one became the reference "None": refused, naming the question id."""
    import shutil

    for name in ("squad.json", "hotpotqa.json"):
        folder = tmp_path / name.split(".")[0]
        folder.mkdir()
        raw = json.loads((QA / name).read_text())
        if name == "squad.json":
            question = raw["data"][0]["paragraphs"][0]["qas"][0]
            question["answers"][1]["text"] = answer
        else:
            question = raw[0]
            question["answer"] = answer
        (folder / name).write_text(json.dumps(raw))
        qid = question.get("id", question.get("_id"))
        said = re.escape(f"question '{qid}' has the answer {answer!r}; expected every answer")
        with pytest.raises(RulerInputError, match=said) as e:
            load_qa_folder(folder)
        assert "\n" not in str(e.value) and str(folder / name) in str(e.value)
        shutil.copy(QA / name, folder / name)
        load_qa_folder(folder)


def test_a_qa_file_nested_too_deep_is_one_line(tmp_path):
    (tmp_path / "squad.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(RulerInputError, match=r"not in SQuAD 2.0's JSON form \(RecursionError"):
        load_qa_folder(tmp_path)


# ------------------------------------------------------------------- skips and refusals
def test_a_length_too_short_is_skipped_and_said():
    plan = plan_instances(BYTE, None, [512, 2048], [0.5], 1, haystack="noise")
    skipped = {(s["task"], s["length"]) for s in plan.skipped}
    assert ("cwe", 512) in skipped and ("niah_single_1", 512) not in skipped
    assert ("qa_1", None) in skipped and ("qa_2", None) in skipped  # no --qa-data
    said = plan.describe()
    assert "skipped cwe at length 512: cwe length=512 is too short" in said
    assert "skipped qa_1 at every length: no --qa-data folder" in said
    assert said.startswith("ran: niah_single_1,")
    with pytest.raises(RulerInputError, match=r"^no instance fits: lengths \[100\]"):
        plan_instances(BYTE, None, [100], [0.5], 1, haystack="noise")
    with pytest.raises(RulerInputError, match=r"^niah_multivalue length=300 is too short"):
        make_instance("niah_multivalue", BYTE, 300, 0.5, 0, haystack="noise")
    with pytest.raises(RulerInputError, match=r"^unknown task \('niah_single'\); expected"):
        make_instances(BYTE, "niah_single_1,niah_single", [1024])
    with pytest.raises(RulerInputError, match=r"^qa_1 needs RULER's squad.json"):
        make_instance("qa_1", BYTE, 1024, 0.5, 0)


def test_a_length_past_the_material_is_skipped_and_said():
    plan = plan_instances(BYTE, ["qa_1", "niah_single_1"], [2048, 8192], [0.5], 1, qa_data=QA)
    (skip,) = plan.skipped
    assert (skip["task"], skip["length"]) == ("qa_1", 8192)
    assert "qa_1 length=8192 is too long for its material" in skip["reason"]
    assert {(i.task, i.length) for i in plan.instances} == {
        ("qa_1", 2048),
        ("niah_single_1", 2048),
        ("niah_single_1", 8192),
    }


def test_the_suites_settings_refuse_qa_without_its_data_and_a_bad_folder(tmp_path):
    from longctx.eval.ruler.suite import SuiteSettings

    default = SuiteSettings(lengths=[1024])
    default.check(None, "--lengths")  # the defaults: qa is skipped and said later, not refused
    assert default.tasks == list(RULER_TASKS)
    with pytest.raises(RulerInputError, match=r"^qa_1, qa_2 need --qa-data DIR"):
        SuiteSettings(tasks="niah_single_1,qa_1,qa_2").check(None, "--lengths")
    with pytest.raises(RulerInputError, match=r"^--qa-data holds neither squad.json"):
        SuiteSettings(tasks=["qa_1"], qa_data=str(tmp_path)).check(None, "--lengths")
    SuiteSettings(tasks=["qa_1"], qa_data=str(QA)).check(None, "--lengths")


# --------------------------------------------------------------------------- determinism
def test_the_same_seed_gives_the_same_tokens():
    def draw(seed):
        return make_instances(BYTE, NOT_QA, [2048], [0.25, 0.75], 1, seed, "books",
                              str(CACHE_DIR))  # fmt: skip

    first = draw(0)
    assert tokens_digest(first) == tokens_digest(draw(0))
    other = draw(1)
    assert all(not np.array_equal(a.tokens, b.tokens) for a, b in zip(first, other, strict=True))


# ------------------------------------------------------------------------ dependencies
def test_data_and_synthetic_never_import_eval():
    for package in ("data", "synthetic"):
        for path in (ROOT / "longctx" / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = (
                    [a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                )  # fmt: skip
                assert not any(n.startswith("longctx.eval") for n in names), (path, names)
                if package == "synthetic":  # below data/ too
                    assert not any(n.startswith("longctx.data") for n in names), (path, names)
