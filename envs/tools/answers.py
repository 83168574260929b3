"""Reading a final answer: the one normaliser and the matching rules every ``tools/`` grader uses.

Models write a right answer in many forms: ``**Sales**``, ``$\\boxed{Sales}$``, ``$96,859``,
``96859 dollars``, ``The founder was born in 1935.``. ``normalise`` reduces each to the text a
grader compares; the rules then decide what counts as giving the answer:

``number_matches``
    Every number in the answer, apart from those the question itself states (``7 employees
    were hired after 2015`` restates 2015), is the expected value: exactly one value, so
    ``1935 1936 1937`` scores nothing.
``name_matches``
    The expected name as whole words (``Sales department``), and no rival name (another answer
    of the same kind) outside it: ``Sales or Research`` scores nothing.

A candidate the answer denies is not given: ``not Finance``, ``it isn't 1935`` and ``neither 5
nor 6`` give nothing, while ``Finance, not Sales`` commits to Finance (``_affirmed``).

So a grader accepts the common forms of one answer and refuses an answer that lists several
candidates: hedging never pays more than committing to one.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterable

__all__ = ["name_matches", "normalise", "number", "number_matches", "numbers"]

_WRAPPER = re.compile(r"\\(?:boxed|text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")
"""A LaTeX wrapper around the answer (``\\boxed{42}``, ``\\text{Sales}``): its content stays."""
_EMPHASIS = re.compile(r"(?<!\w)[*_`~]+(?=\S)|(?<=\S)[*_`~]+(?!\w)")
"""Markdown emphasis and code marks that open or close a word (``**x**``, ``_x_``, `` `x` ``);
a mark between words or digits (``2 * 3``, ``snake_case``) stays."""
_CURRENCY = re.compile(r"[$€£¥]")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
"""A comma followed by exactly three digits (``1,234``; not ``1,4`` nor ``1,2345``)."""
_EDGES = " .,;:!?\"'()[]{}"
_LEADING = re.compile(r"^(?:[ ,;:!?\"'()\[\]{}]|\.(?!\d))+")
"""``_EDGES`` at the start, except a dot that begins a number (``.5``)."""
_UNIT_POWER = re.compile(r"(?<=[^\W\d_])[²³](?![⁰¹²³⁴⁵⁶⁷⁸⁹])")
"""The power of a unit (``km²``, ``m³``): one superscript 2 or 3 right after a letter, not a
value (every other superscript digit is read as a digit)."""
_NUMBER = re.compile(r"(?<!\d)(?<!\d\.)-?(?:\d+(?:\.\d+)?|\.\d+)(?:e[-+]?\d+)?")
"""A number, ``.5`` included; it does not start inside another (``1.2.3`` is 1.2, not also 3)
but may follow dots that end a sentence or trail off (``...14`` is 0.14: a value, not nothing)."""


def normalise(text: str) -> str:
    """``text`` as graders compare it: LaTeX wrappers, markdown emphasis, currency signs and
    thousands commas removed, blanks collapsed, lower case, surrounding punctuation dropped.
    Digits are read in any script (Unicode NFKC: ``¹⁹³⁶``, ``１９３６`` and ``⑦`` are digits;
    a unit's power such as ``km²`` is dropped) and ``−`` (U+2212) is a minus sign, so a value
    cannot hide from ``numbers`` in an unusual form."""
    text = unicodedata.normalize("NFKC", _UNIT_POWER.sub("", text)).replace("\u2212", "-")
    text = "".join(_digit(char) for char in text)
    previous = None
    while previous != text:  # \\boxed{\\text{x}}
        previous, text = text, _WRAPPER.sub(r"\1", text)
    text = _CURRENCY.sub("", text)
    text = _EMPHASIS.sub("", text)
    text = _THOUSANDS.sub("", text)
    return _LEADING.sub("", " ".join(text.split()).lower().rstrip(_EDGES))


_WORD = r"[\w'’]+(?:\.\d+)*"
"""A word of a normalised line, a decimal number included (``42.5``)."""
_DENIAL = re.compile(
    r"(?<!\w)(?:not|never|neither|nor|cannot|\w+n['’]t)"
    rf"(?: (?!but\b|rather\b|instead\b|it\b|its\b|it['’]s\b){_WORD}){{1,3}}"
)
"""A negation and what it denies: up to three words of its clause, which punctuation, a line's
end or ``but``/``rather``/``it`` ends (``not the finance department``; ``not sales: finance``
and ``not sales but finance`` deny only sales)."""
_NAME = "zqz{}zqz"
"""A known name while denials are read: one word, whatever words it holds."""


def _affirmed(text: str, names: Iterable[str] = ()) -> str:
    """``normalise(text)``, line by line, without what it denies (``_DENIAL``). ``names``
    (normalised) are read as one word each, longest first, so a negation inside one (``never
    let me go``) denies nothing and a denied one goes whole."""
    known = sorted({name for name in names if name}, key=len, reverse=True)
    lines = []
    for line in text.splitlines() or [""]:
        line = normalise(line)
        for index, name in enumerate(known):
            line = re.sub(_whole(name), _NAME.format(index), line)
        line = _DENIAL.sub(" ", line)
        lines.append(re.sub(_NAME.format(r"(\d+)"), lambda m: known[int(m.group(1))], line))
    return " ".join(lines)


def _digit(char: str) -> str:
    """``char``, or the ASCII digit of a digit NFKC leaves alone (Ethiopic ``፫``): ``float``
    reads decimal digits of any script, but not these."""
    value = unicodedata.digit(char, None)
    return str(value) if value is not None and not char.isdecimal() else char


def numbers(text: str) -> list[float]:
    """The numbers in ``text``, in order, read after ``normalise`` (``$1,234.50`` -> 1234.5)."""
    return [float(found) for found in _NUMBER.findall(normalise(text))]


def number(text: str) -> float | None:
    """The value of ``text`` when it is one number and nothing else (``"96,859"``), else None."""
    found = normalise(text)
    return float(found) if _NUMBER.fullmatch(found) else None


def number_matches(
    answer: str, expected: float, *, stated: str = "", tolerance: float = 0.0
) -> bool:
    """Whether ``answer`` gives ``expected`` and no other value: every number in it, except
    those ``stated`` (the question) holds, is within ``tolerance`` of ``expected`` (and
    relatively within 1e-9, so ``96859.0`` is ``96859``)."""

    def close(value: float) -> bool:
        return math.isclose(value, expected, rel_tol=1e-9, abs_tol=tolerance)

    restated = {value for value in numbers(stated) if not close(value)}
    given = [float(n) for n in _NUMBER.findall(_affirmed(answer))]
    given = [value for value in given if value not in restated]
    return bool(given) and all(close(value) for value in given)


def _whole(text: str) -> str:
    """A pattern matching ``text`` as whole words (not inside a longer word or number)."""
    return rf"(?<!\w){re.escape(text)}(?!\w)"


def name_matches(answer: str, expected: str, rivals: Iterable[str]) -> bool:
    """Whether ``answer`` names ``expected`` (as whole words, after ``normalise``) and none of
    ``rivals`` besides: the other answers a hedge would list; what it denies counts for neither
    (``_affirmed``). A rival inside the expected name is no rival (``Kalmar`` in
    ``Kalmar Union``)."""
    wanted = normalise(expected)
    others = {normalise(rival) for rival in rivals} - {wanted, ""}
    given = _affirmed(answer, [wanted, *others])
    if not wanted or not re.search(_whole(wanted), given):
        return False
    rest = re.sub(_whole(wanted), " ", given)
    return not any(re.search(_whole(rival), rest) for rival in others)
