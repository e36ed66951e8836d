"""The titles tests prove what the model's naming of a session does: naming is on here,
where the rest of the run turns it off (tests/conftest.py's ``titles_off``)."""

from __future__ import annotations

import pytest

from tests.conftest import AUTO_TITLE_ENV


@pytest.fixture(autouse=True)
def model_names_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Naming on (the default) for this test and the `kvchat` processes it starts."""
    monkeypatch.delenv(AUTO_TITLE_ENV, raising=False)
