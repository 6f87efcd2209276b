"""`--dtype auto` (the default) end to end: the kernels measured fastest still answer right."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_disaggregated import chat, chat_ids

from mooncake_server.model_assets import default_cache_dir
from mooncake_testkit.launcher import Cluster, start_cluster

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def auto_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """`--role all --dtype auto` with a kernel cache of its own (the converted model shared), so
    one engine times the kernels and the other reads its choice, as on a first start."""
    cache = tmp_path_factory.mktemp("cache")
    (cache / "models").symlink_to(default_cache_dir() / "models")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOONCAKE_CACHE_DIR", str(cache))
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
