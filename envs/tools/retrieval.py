"""Multi-hop questions over a local document set: ``tools/retrieval-v0``.

The built-in corpus is an encyclopedia of fictional companies, people and cities generated
from ``corpus_seed`` (so no model knows the answers): each company page names its founder
and headquarters city, each person page a birth year and birthplace, each city page a
population and country. Questions need two hops ("In which year was the founder of Velmora
Systems born?"), so the model must ``search``, ``read`` one page, then search again.

Search is BM25 over titles and text, in-process. Users bring their own corpus with
``documents=`` (JSONL of ``{"id", "title", "text"}``) and questions with ``dataset=``
(JSONL of ``{"question", "answer"}``, optional ``"docs"``: the ids the oracle should read).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from envhub.core import function_tool
from envhub.parsing import format_tool_call
from envs.datasets import Task, TaskSet
from envs.tools.answers import name_matches, normalise, number, number_matches
from envs.tools.base import ToolEnv, ToolError

__all__ = ["Bm25Index", "RetrievalEnv", "build_corpus"]

_SYLLABLES = [
    "ka",
    "vel",
    "mor",
    "ta",
    "ri",
    "sen",
    "dra",
    "lo",
    "quin",
    "ber",
    "an",
    "tho",
    "zel",
    "mi",
    "ora",
    "gal",
    "ven",
    "ix",
    "du",
    "pra",
]
_SUFFIX = ["Systems", "Labs", "Works", "Dynamics", "Foods", "Textiles", "Motors", "Optics"]
_COUNTRIES = ["Norvania", "Estrelia", "Kalmar Union", "Ostravia", "Seluria"]
_WORD = re.compile(r"[a-z0-9]+")


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _name(rng: np.random.Generator, parts: int) -> str:
    return "".join(str(s) for s in rng.choice(_SYLLABLES, size=parts)).capitalize()


def build_corpus(
    seed: int, *, companies: int = 40
) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """Documents and the facts behind them, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    used: set[str] = set()

    def unique(make: Any) -> str:
        while True:
            value = make()
            if value not in used:
                used.add(value)
                return value

    cities: list[dict[str, Any]] = [
        {
            "name": unique(lambda: _name(rng, 3)),
            "population": int(rng.integers(20, 2_000)) * 1_000 + int(rng.integers(0, 999)),
            "country": str(rng.choice(_COUNTRIES)),
        }
        for _ in range(companies // 2)
    ]
    people: list[dict[str, Any]] = []
    firms: list[dict[str, Any]] = []
    for _ in range(companies):
        person = {
            "name": f"{unique(lambda: _name(rng, 2))} {_name(rng, 3)}",
            "born": int(rng.integers(1930, 1995)),
            "birthplace": cities[int(rng.integers(len(cities)))]["name"],
        }
        firm = {
            "name": f"{unique(lambda: _name(rng, 3))} {rng.choice(_SUFFIX)}",
            "founder": person["name"],
            "founded": person["born"] + int(rng.integers(22, 50)),
            "hq": cities[int(rng.integers(len(cities)))]["name"],
        }
        people.append(person)
        firms.append(firm)
    documents: list[dict[str, str]] = []
    for firm in firms:
        documents.append(
            {
                "id": f"company:{firm['name'].lower().replace(' ', '-')}",
                "title": firm["name"],
                "text": (
                    f"{firm['name']} is a company founded in {firm['founded']} "
                    f"by {firm['founder']}. Its headquarters are in {firm['hq']}. "
                    "It is known for its products and its staff."
                ),
            }
        )
    for person in people:
        documents.append(
            {
                "id": f"person:{person['name'].lower().replace(' ', '-')}",
                "title": person["name"],
                "text": (
                    f"{person['name']} (born {person['born']} in {person['birthplace']}) "
                    "is an entrepreneur and founder."
                ),
            }
        )
    for city in cities:
        documents.append(
            {
                "id": f"city:{city['name'].lower()}",
                "title": city["name"],
                "text": (
                    f"{city['name']} is a city in {city['country']} "
                    f"with a population of {city['population']}."
                ),
            }
        )
    facts = {
        "firms": firms,
        "people": {p["name"]: p for p in people},
        "cities": {c["name"]: c for c in cities},
    }
    return documents, [facts]


class Bm25Index:
    """BM25 ranking over a small in-memory document set (k1=1.5, b=0.75)."""

    def __init__(self, documents: list[dict[str, str]]) -> None:
        self.documents = documents
        self.by_id = {doc["id"]: doc for doc in documents}
        self._terms = [
            Counter(_tokens(doc["title"] + " " + doc["title"] + " " + doc["text"]))
            for doc in documents
        ]
        self._lengths = [sum(terms.values()) for terms in self._terms]
        self._average = sum(self._lengths) / max(1, len(self._lengths))
        frequency: Counter[str] = Counter()
        for terms in self._terms:
            frequency.update(terms.keys())
        n = len(documents)
        self._idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in frequency.items()}

    def search(self, query: str, k: int = 3) -> list[dict[str, str]]:
        words = _tokens(query)
        scored = []
        for index, terms in enumerate(self._terms):
            score = 0.0
            for word in words:
                tf = terms.get(word, 0)
                if tf:
                    score += (
                        self._idf[word]
                        * tf
                        * 2.5
                        / (tf + 1.5 * (0.25 + 0.75 * self._lengths[index] / self._average))
                    )
            if score > 0:
                scored.append((-score, index))
        return [self.documents[index] for _, index in sorted(scored)[:k]]


class RetrievalEnv(ToolEnv):
    """Two-hop questions over a local encyclopedia, answered with ``search`` and ``read``."""

    tool_schemas: ClassVar[list[dict[str, Any]]] = [
        function_tool(
            "search",
            "Search the encyclopedia; returns the id, title and first sentence of the best pages.",
            {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "k": {"type": "integer", "description": "pages to return (1-5)"},
                },
                "required": ["query"],
            },
        ),
        function_tool(
            "read",
            "Return the full text of one page by its id.",
            {
                "type": "object",
                "properties": {"doc_id": {"type": "string"}},
                "required": ["doc_id"],
            },
        ),
    ]
    required_fields = ("question", "answer")
    intro = (
        "Answer the question using the encyclopedia tools. The facts are only in the encyclopedia."
    )

    def __init__(
        self,
        *,
        corpus_seed: int = 0,
        documents: str | list[dict[str, str]] | None = None,
        **options: Any,
    ) -> None:
        if documents is None:
            docs, facts = build_corpus(corpus_seed)
            self._facts = facts[0]
        else:
            docs = (
                list(TaskSet.from_jsonl(documents, required=("id", "title", "text")))
                if isinstance(documents, (str, Path))
                else list(documents)
            )
            self._facts = {}
        self.corpus_seed = corpus_seed
        self.documents = [
            {"id": str(d["id"]), "title": str(d["title"]), "text": str(d["text"])} for d in docs
        ]
        self.index = Bm25Index(self.documents)
        self._candidates: frozenset[str] | None = None
        super().__init__(**options)

    def builtin_tasks(self) -> list[Task]:
        if not self._facts:
            raise ToolError("a custom documents= corpus needs a dataset= of questions")
        tasks = []
        for i, firm in enumerate(self._facts["firms"]):
            founder = self._facts["people"][firm["founder"]]
            hq = self._facts["cities"][firm["hq"]]
            birthplace = self._facts["cities"][founder["birthplace"]]
            company_doc = f"company:{firm['name'].lower().replace(' ', '-')}"
            person_doc = f"person:{founder['name'].lower().replace(' ', '-')}"
            variants = [
                (
                    f"In which year was the founder of {firm['name']} born?",
                    founder["born"],
                    [firm["name"], founder["name"]],
                    [company_doc, person_doc],
                ),
                (
                    (
                        f"What is the population of the city where {firm['name']} "
                        "has its headquarters?"
                    ),
                    hq["population"],
                    [firm["name"], hq["name"]],
                    [company_doc, f"city:{hq['name'].lower()}"],
                ),
                (
                    f"In which country was the founder of {firm['name']} born?",
                    birthplace["country"],
                    [firm["name"], founder["name"], birthplace["name"]],
                    [company_doc, person_doc, f"city:{birthplace['name'].lower()}"],
                ),
            ]
            for j, (question, answer, queries, docs) in enumerate(variants):
                tasks.append(
                    {
                        "id": f"doc-{i:02d}-{j}",
                        "question": question,
                        "answer": str(answer),
                        "queries": queries,
                        "docs": docs,
                    }
                )
        return tasks

    def start(self, task: Task) -> str:
        return str(task["question"])

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if name == "search":
            k = int(arguments.get("k", 3))
            if not 1 <= k <= 5:
                raise ToolError(f"k={k} is out of range; use 1 to 5")
            hits = self.index.search(arguments["query"], k)
            if not hits:
                return "No pages match. Try other words (names work best)."
            return "\n".join(
                f"[{d['id']}] {d['title']}: {d['text'].split('. ')[0].rstrip('.')}." for d in hits
            )
        doc = self.index.by_id.get(arguments["doc_id"].strip().strip("[]"))
        if doc is None:
            raise ToolError(
                f"no page with id {arguments['doc_id']!r}; "
                "use an id from a search result, like 'company:...'"
            )
        return f"{doc['title']}\n{doc['text']}"

    def grade(self, answer: str) -> float:
        """1.0 for the expected answer alone or in a sentence ("The founder was born in
        1953."), 0.0 for a hedge that names more than one candidate of the kind asked
        ("1953 1954 1955", every country at once): a number question takes exactly one number
        besides those the question states, a name question no other answer of the task set
        and few words beyond the question's (``envs.tools.answers``)."""
        expected = str(self.task["answer"])
        target = number(expected)
        if target is not None:
            return 1.0 if number_matches(answer, target, stated=self.question) else 0.0
        if len(self._beyond_question(answer, expected)) >= 3 * len(normalise(expected)) + 20:
            return 0.0  # a long list of names the rival set may not hold
        return 1.0 if name_matches(answer, expected, self._candidate_answers()) else 0.0

    def _beyond_question(self, answer: str, expected: str) -> str:
        """The words of ``answer`` that neither the question nor the expected answer holds: a
        sentence that restates the question adds almost none, a list of candidates many."""
        known = set(_tokens(self.question)) | set(_tokens(expected))
        return " ".join(word for word in _tokens(normalise(answer)) if word not in known)

    def _candidate_answers(self) -> frozenset[str]:
        """Every non-numeric answer of the task set (and the built-in countries): what a hedge
        would list to cover a name question. Computed once per env."""
        if self._candidates is None:
            answers = {normalise(str(task["answer"])) for task in self.tasks}
            if self._facts:
                answers |= {normalise(country) for country in _COUNTRIES}
            self._candidates = frozenset(a for a in answers if a and number(a) is None)
        return self._candidates

    def plan(self) -> list[str]:
        steps: list[str] = []
        for query, doc in zip(self.task.get("queries", []), self.task.get("docs", [])):
            steps.append(format_tool_call("search", {"query": query}))
            steps.append(format_tool_call("read", {"doc_id": doc}))
        if not steps:
            steps = [format_tool_call("read", {"doc_id": doc}) for doc in self.task.get("docs", [])]
        return [*steps, f"<answer>{self.task['answer']}</answer>"]

    def random_call(self, np_random: np.random.Generator) -> str:
        doc = self.documents[int(np_random.integers(len(self.documents)))]
        if np_random.random() < 0.5:
            return format_tool_call(
                "search", {"query": str(np_random.choice(_tokens(doc["text"])))}
            )
        return format_tool_call("read", {"doc_id": doc["id"]})
