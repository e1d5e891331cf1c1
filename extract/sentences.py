"""Sentences for `--unit sentence`: pysbd's rule-based English sentence boundary detection, with where each
sentence lies in the text found by string search (`sentence_spans`) instead of pysbd's regular expression
compiled afresh per sentence — the same sentences."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field


@dataclass
class SentenceSplitter:
    """pysbd's rule-based English sentence boundary detection (`segmenter_class`)."""

    _seg: object = field(default=None, repr=False)

    def __call__(self, text: str) -> list[str]:
        if self._seg is None:
            self._seg = segmenter_class()(language="en", clean=False)
        return [s.strip() for s in self._seg.segment(text) if s.strip()]


def sentence_spans(text: str, sentences: list[str]) -> list[tuple[int, int]]:
    """Where pysbd places each of its sentences in the text: the first match of the sentence followed by
    its whitespace (`re.escape(sentence) + r"\s*"`, matches found left to right without overlapping) that
    ends past the previous sentence's end; a sentence without one is left out.  Found by string search:
    pysbd compiles that expression afresh for every sentence, most of its time."""
    spans, prior = [], 0
    for sentence in sentences:
        found = None
        if not sentence:  # the expression matches empty strings: pysbd's own way
            found = next((m.span() for m in re.finditer(r"\s*", text) if m.end() > prior), None)
        else:
            pos = 0
            while (i := text.find(sentence, pos)) >= 0:
                j = i + len(sentence)
                while j < len(text) and text[j].isspace():  # what \s matches in a str pattern
                    j += 1
                if j > prior:
                    found = (i, j)
                    break
                pos = j  # the next match starts after this one
        if found is not None:
            spans.append(found)
            prior = found[1]
    return spans


@functools.cache
def segmenter_class():
    """pysbd's Segmenter with its sentences' character spans found by `sentence_spans`: the same
    sentences, without a regular expression compiled per sentence."""
    import pysbd
    from pysbd.utils import TextSpan

    class Segmenter(pysbd.Segmenter):
        def sentences_with_char_spans(self, sentences):
            text = self.original_text
            return [TextSpan(text[a:b], a, b) for a, b in sentence_spans(text, sentences)]

    return Segmenter
