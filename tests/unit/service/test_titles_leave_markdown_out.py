"""A title made from the first line leaves its Markdown out (model-free)."""

from __future__ import annotations

from kvchat.text import TITLE_WORDS, model_title, short_title
from tests.e2e.titles.test_titles import FIRST


def test_titles_leave_markdown_out() -> None:
    assert short_title(FIRST) == "Plan a trip to Japan in spring"
    assert short_title("See [the docs](https://x.example) and `code`") == "See the docs and code"
    assert short_title("snake_case_name stays") == "snake_case_name stays"
    assert model_title('"Title: Trip to Japan"') == "Trip to Japan"
    assert model_title("The cat. A creature of the night.") == "The cat"
    assert model_title("**Cats 101**\nand more") == "Cats 101"
    assert len(model_title("one two three four five six seven eight nine ten").split()) == (
        TITLE_WORDS
    )
    assert model_title("  \n") is None
