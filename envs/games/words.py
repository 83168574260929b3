"""The built-in Wordle vocabulary: common English five-letter words.

Hand-picked, lower-case, unique and sorted, so secret draws and the expert's tie-breaks are
the same on every machine. ``WordleEnv`` draws its secret from ``WORDS`` and, with
``require_known_word=True``, accepts only guesses from it.
"""

from __future__ import annotations

__all__ = ["WORDS", "words_of_length"]

_WORD_TEXT = """
abbey about above abuse actor acute admit adopt adult after again agent agree ahead alarm album
alert alike alive allow alone along alter among anger angle angry apart apple apply arena argue
arise array aside asset audio avoid award aware badly baker basic beach began begin being below
bench birth black blade blame blank blast blind block blood board boost booth bound brain brand
bread break breed brief bring broad broke brown build built buyer cable camel carry catch cause
chain chair chart chase cheap check chest chief child china chose civil claim class clean clear
click clock close coach coast could count court cover craft crane crash cream crime cross crowd
crown curve cycle daily dance dated dealt death debut delay depth doing doubt dozen draft drama
drawn dream dress drink drive drove dying eager early earth eerie eight elite empty enemy enjoy
enter entry equal error event every exact exist extra faith false fault fiber field fifth fifty
fight final first fixed flash fleet floor fluid focus force forth forty forum found frame frank
fraud fresh front fruit fully funny fuzzy geese giant given glass globe going grace grade grand
grant grass great green gross group grown guard guess guest guide happy heart heavy hello hence
horse hotel house human ideal image index inner input issue jazzy joint judge kayak known label
large laser later laugh layer learn lease least leave legal level light limit llama local logic
loose lower lucky lunch madam major maker march match maybe mayor meant media metal might minor
minus mixed model money month moral motor mount mouse mouth movie mummy music needs never newly
night noise north noted novel nurse occur ocean offer often order other ought paint panel paper
party peace phase phone photo piece pilot pitch place plain plane plant plate point pound power
press price pride prime print prior prize proof proud prove puppy queen quick quiet quite radio
raise range rapid ratio reach ready refer right rival river robin roses rough round route royal
rural scale scene scope score sense serve seven shall shape share sharp sheet shelf shell shift
shiny shirt shock shoot short shown sight since sixth sixty skill sleep slide small smart smile
smoke solid solve sorry sound south space spare speak speed spend spent split spoke sport staff
stage stake stand start state steam steel stick still stock stone stood store storm story strip
stuck study stuff style sugar suite super sweep sweet table taken taste tasty teach teeth thank
theft their theme there these thick thing think third those three threw throw tight times tired
title today topic total touch tough tower track trade train treat trend trial tried tries truck
truly trust truth twice under undue union unity until upper upset urban usage usual valid value
video virus visit vital vivid voice waste watch water wheel where which while white whole whose
woman women world worry worse worst worth would wound write wrong wrote yield young youth
"""
"""The words, whitespace-separated and packed into lines (shorter than one per line)."""

WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


def words_of_length(length: int) -> tuple[str, ...]:
    """The built-in words with exactly ``length`` letters (in ``WORDS`` order)."""
    return tuple(word for word in WORDS if len(word) == length)
