"""LLM-as-judge: a model grades a transcript, through any ``InferenceEngine``.

The judge renders ``prompt`` (``{transcript}`` and ``{env_id}`` are filled in) with the judge
model's chat template, generates greedily, and reads the grade from the reply: the first
number (clamped to [0, 1]), or ``yes``/``no``. An unreadable reply scores ``default``.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

from trainer.rewards.verifiers import EpisodeView
from trainer.strategies.base import GenerationRequest, InferenceEngine

__all__ = ["DEFAULT_PROMPT", "LLMJudge", "parse_grade"]

DEFAULT_PROMPT = (
    "Grade how well the assistant solved the task in this conversation from {env_id}. "
    "Reply with a number between 0 and 1.\n\n{transcript}"
)
_GRADE = re.compile(r"\b(yes|no)\b|([01](?:\.\d+)?|\.\d+)", re.IGNORECASE)
_ids = itertools.count()


def parse_grade(reply: str, default: float = 0.0) -> float:
    """The grade in ``reply``: first number clamped to [0, 1], or yes=1 / no=0; else ``default``."""
    match = _GRADE.search(reply)
    if match is None:
        return default
    if match.group(1):
        return 1.0 if match.group(1).lower() == "yes" else 0.0
    return min(1.0, max(0.0, float(match.group(2))))


class LLMJudge:
    """Scores episodes by asking ``engine`` (whose tokenizer is ``tokenizer``)."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: Any,
        *,
        prompt: str = DEFAULT_PROMPT,
        max_new_tokens: int = 8,
        default: float = 0.0,
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.prompt, self.max_new_tokens, self.default = prompt, max_new_tokens, default

    def request(self, episode: EpisodeView) -> GenerationRequest:
        transcript = "\n".join(f"{m['role']}: {m['content']}" for m in episode.messages)
        text = self.prompt.format(transcript=transcript, env_id=episode.env_id)
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return GenerationRequest(
            f"judge{next(_ids)}",
            list(self.tokenizer.encode(ids, add_special_tokens=False)),
            self.max_new_tokens,
            temperature=0.0,
        )

    def grade(self, token_ids: list[int]) -> float:
        return parse_grade(self.tokenizer.decode(token_ids, skip_special_tokens=True), self.default)

    async def score(self, episode: EpisodeView) -> float:
        result = await self.engine.generate(self.request(episode))
        return self.grade(result.token_ids)
