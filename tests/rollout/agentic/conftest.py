"""The agentic tests' real engine and tokenizer: the tiny workspace's model, loaded once per test module."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from relax.backends.inference.embedded import EmbeddedEngine


@pytest.fixture(scope="module")
def tokenizer(tiny_workspace):
    return AutoTokenizer.from_pretrained(tiny_workspace / "model")


@pytest.fixture(scope="module")
def engine(tiny_workspace) -> EmbeddedEngine:
    return EmbeddedEngine.from_pretrained(str(tiny_workspace / "model"))
