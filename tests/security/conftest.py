"""Fixtures of the security tests: the default model's real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The default model's real tokenizer (chat template included)."""
    from transformers import AutoTokenizer

    from mooncake_server.model_assets import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None))
