"""Masking the values a step opened in everything the agent records or returns.

A sealed value is opened for one call only, yet the service may say it back: in an error body
(``422 {"detail": "iban DE89... is blocked"}``), in a validation message that quotes its input, in an
output field the workflow did not mark. Whatever the agent answers goes to ``inbox``, the event log, the
state store, the API and the CLI, and whatever it logs goes to its log file; so every one of those paths
passes through the one :class:`Redactor` built from the values the step opened.

Which forms are masked: the value itself and the forms it takes inside text a service or a library
wrote -- JSON-escaped (once or twice, ASCII-only or not), Python's ``repr`` (pydantic quotes inputs that
way) and URL-encoded (an HTTP error names its URL). A structured value (a dict or list) is masked leaf by
leaf; a number by its decimal text.

Short values are left alone: a value of fewer than :data:`MIN_LENGTH` characters occurs by chance in
ordinary text -- a status code, a count, a currency -- so masking it would garble every message the step
answers, and a value that short has so few possibilities that masking it hides next to nothing. Output
fields the workflow marks sensitive are sealed whatever their length; mark a short secret's field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote, quote_plus

import orjson

from eventstore.masking import masking
from schemas.messages import StepResult
from schemas.sealed import is_sealed

__all__ = ["MASK", "MIN_LENGTH", "Redactor", "redacting"]

MASK = "[sealed]"
#: Values shorter than this are not masked (see the module docstring for why).
MIN_LENGTH = 4


def _leaves(value: Any) -> Iterator[str]:
    """The text of each scalar inside ``value``: a structured value is masked by its parts."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, str):
        yield value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield str(value)


def _escaped(text: str) -> set[str]:
    """``text`` as it stands inside a JSON string, with non-ASCII characters kept or escaped."""
    return {orjson.dumps(text).decode()[1:-1], json.dumps(text)[1:-1]}


def _forms(text: str) -> set[str]:
    """``text`` as it may appear inside what a service, a library or a log line wrote around it."""
    once = _escaped(text)
    twice = {form for escaped in once for form in _escaped(escaped)}
    return {text, *once, *twice, repr(text)[1:-1], quote(text, safe=""), quote_plus(text)}


class Redactor:
    """Masks the values one step opened; built once per attempt, immutable, safe to share between threads."""

    def __init__(self, opened: Iterable[Any] = ()) -> None:
        needles = {form for value in opened for leaf in _leaves(value) if len(leaf) >= MIN_LENGTH
                   for form in _forms(leaf)}
        # Longest first: where one value contains another, the whole of the longer one is masked.
        ordered = sorted(needles, key=lambda needle: (-len(needle), needle))
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def __bool__(self) -> bool:
        return self._pattern is not None

    def text(self, text: str) -> str:
        """``text`` with every occurrence of an opened value masked."""
        return text if self._pattern is None else self._pattern.sub(MASK, text)

    def value(self, value: Any) -> Any:
        """``value`` with every string (and number) inside it masked where it holds an opened value; sealed
        envelopes are left as they are (their ciphertext holds nothing to mask)."""
        if self._pattern is None or is_sealed(value):
            return value
        if isinstance(value, dict):
            return {name: self.value(item) for name, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(item) for item in value]
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            shown = str(value)
            return value if self.text(shown) == shown else MASK
        return value

    def result(self, result: StepResult) -> StepResult:
        """``result`` with its error text and output masked: what goes back to the scheduler, and from there
        to the event log, the state store, the API and the CLI."""
        if self._pattern is None:
            return result
        return result.model_copy(update={"error": None if result.error is None else self.text(result.error),
                                         "output": None if result.output is None else self.value(result.output)})


@contextmanager
def redacting(redactor: Redactor) -> Iterator[Redactor]:
    """Mask ``redactor``'s values in every log line written in this context (this thread, this attempt)."""
    with masking(redactor.value if redactor else None):
        yield redactor
