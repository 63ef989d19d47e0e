"""Opt-in (DGR_SLOW=1): the playground at / driven in headless Chromium (Debian's `chromium`) against a started
redis-server, tiny-model consumer and `dgr serve`: a streamed answer and its usage appear on the page.
Also Gemma's chat through `dgr serve`: its own turn format, never ChatML."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import redis

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from dgrtools.localredis import LocalRedis, free_port  # noqa: E402
from dgrtools.process import ConsumerProcess  # noqa: E402
from gateway.stack import ServeProcess  # noqa: E402
from tests.browser_support import page_when  # noqa: E402

pytestmark = pytest.mark.slow


def _slow() -> None:
    if os.environ.get("DGR_SLOW") != "1":
        pytest.skip("opt-in: DGR_SLOW=1")


def test_playground_streams_an_answer_in_chromium(redis_server: LocalRedis, tiny_model_path: Path,
                                                  tmp_path: Path) -> None:
    _slow()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium (apt-get install chromium)")
    redis.Redis.from_url(redis_server.url).flushall()
    with ConsumerProcess(redis_server.url, "w-play", f"tiny={tiny_model_path}", tmp_path, slots=2, threads=1), \
            ServeProcess(redis_server.url, [f"tiny={tiny_model_path}"], free_port(), tmp_path) as serve:
        dom = page_when(browser, f"{serve.url}/?q=hello&max=8", "document.querySelector('#answer-1[data-done]')",
                        tmp_path / "profile")
    answer = re.search(r'<div class="turn assistant" id="answer-1" data-done="1">(.*?)</div>', dom, re.S)
    assert answer is not None, dom[-2000:]
    assert re.search(r"completion (\d+)", dom) and int(re.search(r"completion (\d+)", dom).group(1)) >= 1
    assert '<option value="tiny">tiny</option>' in dom


def test_gemma_chat_is_gemma_turns(redis_server: LocalRedis, gemma_model_path: Path, tmp_path: Path) -> None:
    redis.Redis.from_url(redis_server.url).flushall()
    with ConsumerProcess(redis_server.url, "w-gemma", f"gemma={gemma_model_path}", tmp_path, slots=1, threads=2), \
            ServeProcess(redis_server.url, [f"gemma={gemma_model_path}"], free_port(), tmp_path) as serve:
        assert "built-in 'gemma'" in httpx.get(serve.url + "/v1/models").json()["data"][0]["chat_template"]
        r = httpx.post(serve.url + "/v1/chat/completions", timeout=300, json={
            "model": "gemma", "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}).json()
    text = r["choices"][0]["message"]["content"]
    assert "<|im_start|>" not in text and "<|im_end|>" not in text and "<start_of_turn>" not in text
    assert r["usage"]["prompt_tokens"] == 16  # <bos><start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n
