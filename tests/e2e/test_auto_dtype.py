"""`--dtype auto` (the default) end to end: the kernels measured fastest still answer right."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_disaggregated import PROMPTS, chat, chat_ids

from mooncake_testkit.launcher import Cluster, start_cluster

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def auto_cluster() -> Iterator[Cluster]:
    """`--role all --dtype auto`: one engine times the kernels, the other reads its choice."""
    cluster = start_cluster("all", ["--dtype", "auto"])
    yield cluster
    cluster.stop()


def test_readme_question_gets_the_float32_answer(auto_cluster, tokenizer, hf_greedy) -> None:
    """What a new user asks first: int8/bf16 rounding must not change a plain factual answer."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = hf_greedy(chat_ids(tokenizer, messages), 32)
    resp = chat(auto_cluster, messages, 32)
    assert resp["choices"][0]["message"]["content"] == tokenizer.decode(
        expected, skip_special_tokens=True)


@pytest.mark.parametrize("name,messages,max_tokens", PROMPTS, ids=[p[0] for p in PROMPTS])
def test_answers_start_as_float32_answers_do(auto_cluster, tokenizer, hf_greedy, name, messages,
                                            max_tokens) -> None:
    """Rounding may move a late token (a near tie); the opening tokens are the model's own."""
    resp = chat(auto_cluster, messages, max_tokens)
    expected = hf_greedy(chat_ids(tokenizer, messages), max_tokens)
    assert resp["choices"][0]["token_ids"][:3] == expected[:3]
