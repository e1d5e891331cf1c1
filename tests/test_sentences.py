"""The sentence splitter of `--unit sentence` (extract/sentences.py): a real one, and pysbd's own sentences."""

from __future__ import annotations

import re

import reference as ref
from extract.sentences import SentenceSplitter, sentence_spans


def test_sentence_splitter_is_a_real_one():
    split = SentenceSplitter()
    assert split("Dr. Smith went to Washington. He arrived at 3 p.m. on Monday! Did he stay?") == [
        "Dr. Smith went to Washington.", "He arrived at 3 p.m. on Monday!", "Did he stay?"]


def test_sentence_spans_are_pysbds_own(sources):
    """The splitter finds pysbd's sentences in the text by string search instead of pysbd's regular
    expression per sentence: the same spans (start, end, text) as pysbd's own method on the test corpus
    and on texts made to trip it — a sentence repeated (an earlier match ends before the previous
    sentence: the next one is taken), Unicode whitespace after a sentence, a sentence pysbd altered so
    that it is not in the text (left out), an empty one; and `\s` matches exactly what `isspace` does."""
    import pysbd

    assert all(bool(re.match(r"\s", chr(c))) == chr(c).isspace() for c in range(0x110000))
    theirs = pysbd.Segmenter(language="en", clean=False)
    texts = [*ref.source_texts(sources["alpha"]), "Hi. Hi. Hi.  Hi.", "Go.\u00a0Now.\u2003 Then.\n\nStop.",
             "1. One item. 2. Two items.\n3) Three.", "He said \"wait...\" and left. Then? Yes!", "Ab. Ab.Ab. Ab",
             "Dr. Smith went to Washington D.C. yesterday. He arrived at 3 p.m. on Monday!", "   ", "x"]
    for text in texts:
        sents = theirs.processor(text).process()
        theirs.original_text = text
        want = [(t.start, t.end, t.sent) for t in theirs.sentences_with_char_spans(sents)]
        assert [(a, b, text[a:b]) for a, b in sentence_spans(text, sents)] == want, text
        assert SentenceSplitter()(text) == [s.strip() for s in theirs.segment(text) if s.strip()]
    text = "One. Two. One. Two."
    for sents in (["One.", "Two.", "One.", "Two."], ["Two.", "One."], ["Three.", "One."], ["", "One."], ["One.", ""]):
        theirs.original_text = text
        want = [(t.start, t.end) for t in theirs.sentences_with_char_spans(sents)]
        assert sentence_spans(text, sents) == want, sents
