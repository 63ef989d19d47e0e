"""gateway/text.py against oracles: the incremental detokenizer's chunks join to the decoded whole and never end
inside a UTF-8 character; stop strings are never released and the text released is the text cut at the first
stop; the chat templates render the turn formats documented in docs/serve.md."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dgrtools.tokenizer import Tokenizer
from gateway.text import TEMPLATES, ChatTemplate, Detokenizer, StopStrings, choose_template


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path) -> Tokenizer:
    return Tokenizer(tiny_model_path, "llama")


def test_detokenizer_chunks_join_to_the_whole(tok: Tokenizer) -> None:
    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    def check(tokens: list[int]) -> None:
        d = Detokenizer(tok)
        chunks = [d.push(t) for t in tokens] + [d.flush()]
        whole = b"".join(tok.piece_bytes(t) for t in tokens).decode("utf-8", errors="replace")
        assert "".join(chunks) == whole

    check()


def test_kept_pieces_are_llama_cpps(tok: Tokenizer) -> None:
    """The pieces the tokenizer keeps once asked are the bytes llama.cpp gives, asked first or again."""
    for _ in range(2):
        assert [tok.piece_bytes(t) for t in range(tok.vocab_size)] == [
            tok._impl.piece_bytes(t) for t in range(tok.vocab_size)]


def test_a_character_split_over_byte_tokens_is_sent_whole(tok: Tokenizer) -> None:
    ids = tok.encode("é€😀", add_bos=False)  # the tiny vocabulary spells these in byte tokens
    d = Detokenizer(tok)
    chunks = [d.push(t) for t in ids]
    assert "".join(chunks) + d.flush() == " é€😀"  # SentencePiece's space prefix
    assert all("\ufffd" not in c for c in chunks)


@settings(max_examples=400, deadline=None)
@given(st.text("abc", max_size=30), st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3),
       st.lists(st.integers(1, 5), max_size=30))
def test_stop_strings_are_held_back(text: str, stops: list[str], cuts: list[int]) -> None:
    s = StopStrings(tuple(stops))
    out, at, hit = [], 0, False
    for n in [*cuts, len(text)]:
        piece, at = text[at:at + n], at + n
        sent, hit = s.feed(piece)
        out.append(sent)
        if hit:
            break
    if not hit:
        out.append(s.flush())
    hits = [(i + len(x), i) for x in stops if (i := text.find(x)) >= 0]  # the first completed, fed char by char
    want = text[:min(hits)[1]] if hits else text
    assert "".join(out) == want and hit == bool(hits)


def test_templates_render_the_documented_turns() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert ChatTemplate(TEMPLATES["gemma"], "").render(msgs) == \
        "<start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n"
    assert ChatTemplate(TEMPLATES["tiny"], "").render(msgs) == "system: S\nuser: U\nassistant:"
    assert choose_template({"general.architecture": "gemma3"}, None).source.startswith("built-in 'gemma'")
    assert choose_template({"general.architecture": "llama"}, None) is None  # never a silent ChatML
    own = choose_template({"tokenizer.chat_template": "{{ messages[0].content }}"}, None)
    assert own.render(msgs) == "S"


def test_the_sandbox_refuses_a_hostile_template() -> None:
    from jinja2.exceptions import SecurityError

    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", "")
    with pytest.raises(SecurityError):
        evil.render([{"role": "user", "content": "x"}])


def test_a_template_is_compiled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling costs about 4 ms and a short chat's render 0.05 (docs/benchmarks.md): once per template, not per
    request."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    compiled = []
    real = ImmutableSandboxedEnvironment.from_string

    def counting(self: ImmutableSandboxedEnvironment, source: str, *a: object, **kw: object) -> object:
        compiled.append(source)
        return real(self, source, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ImmutableSandboxedEnvironment, "from_string", counting)
    t = ChatTemplate(TEMPLATES["gemma"], "test")
    outs = {t.render([{"role": "user", "content": f"hi {i}"}]) for i in range(5)}
    assert len(outs) == 5 and len(compiled) == 1
