"""Grammar-constrained decoding through llama.cpp's own grammar sampler, on the tiny model's vocabulary
(a real llama_vocab, loaded vocab-only): the serving path equals the oracle with real grammar states,
JSON-schema sessions produce JSON, the grammar state survives a replay exactly, and a session whose
grammar cannot go on (or cannot compile, or cannot run here) says so."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.sampling import BatchSampler, RowContext, RowInput, RowStatus, Vocabulary, sample_row, sample_rows
from consumer.sampling.grammar import Grammar, GrammarInvalid, GrammarRefused, gbnf_of
from consumer.sampling.pieces import PRUNE_MIN
from dgrtools.tokenizer import Tokenizer
from schemas import Sampling
from tests.sampling_support import samplings
from tests.test_sampler_stage import Model, Session, serve

EOS = 2  # the tiny model's </s>: its end of generation
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                     "required": ["a", "b"]})


@pytest.fixture(scope="module")
def vocab(tiny_model_path: Path) -> Vocabulary:
    return Vocabulary.load(tiny_model_path)


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


def _chars(tok: Tokenizer, text: str) -> list[int]:
    """text as one token per character (the tokenizer would put SentencePiece's space in front)."""
    ids = {tok.piece(i): i for i in range(512)}
    return [ids[c] for c in text]


def test_the_tiny_vocabulary_marks_bos_special_and_eos_end_of_generation(vocab: Vocabulary) -> None:
    assert vocab.n_vocab == 512 and vocab.special.tolist() == [1] and vocab.eog.tolist() == [EOS] and vocab.grammars


def test_admitted_accept_and_refusal(vocab: Vocabulary, tok: Tokenizer) -> None:
    g = Grammar(vocab, 'root ::= "ab" [0-9]+')
    first = np.flatnonzero(g.admitted(np.arange(vocab.n_vocab)))
    assert first.size > 0 and all(tok.piece(int(t)) in ("a", "ab", "<0x61>") or tok.piece(int(t)).startswith("a")
                                  for t in first)
    assert not g.admits(EOS)  # not complete: the end of generation is refused
    with pytest.raises(GrammarRefused):
        g.accept(EOS)  # refused before llama.cpp sees it (it would abort the process)
    for t in _chars(tok, "ab1"):
        g.accept(t)
    assert g.admits(EOS) and g.accepted == 3
    g.close()
    with pytest.raises(GrammarInvalid):
        Grammar(vocab, "root ::= undefined-rule")
    with pytest.raises(GrammarInvalid):
        Grammar(Vocabulary.plain(512), 'root ::= "a"')
    with pytest.raises(GrammarInvalid):
        gbnf_of(Sampling(json_schema='{"type": "no-such-type", "$ref": "#/nowhere"}'))


class _AskedEveryId:
    """The oracle's view of a grammar: llama.cpp asked about every id (never along the piece tree)."""

    def __init__(self, g: Grammar) -> None:
        self.g = g

    def admitted(self, ids: np.ndarray) -> np.ndarray:
        return self.g.asked(ids)


@pytest.mark.parametrize("tree", [False, True], ids=["asked", "piece-tree"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_serving_path_equals_the_oracle_with_llama_grammars(tree: bool, data: st.DataObject, vocab: Vocabulary,
                                                            tok: Tokenizer) -> None:
    """The serving path (with the piece tree on every query: `tree`, whose walks Gemma's size would
    take) against the oracle asking llama.cpp about every id."""
    text = data.draw(st.sampled_from(["", '{"a', '{"a":1', '{"a":12,"b":tr', '{"a":-3,"b":false}']))
    g = Grammar(vocab, gbnf_of(Sampling(json_schema=SCHEMA)) or "")
    for t in _chars(tok, text):
        g.accept(t)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = (rng.gumbel(size=(2, vocab.n_vocab)) * 3).astype(np.float32)
    ctx = RowContext(np.array([1, 60, 61, *_chars(tok, text)], np.int32), prompt_end=3, stop_tokens=(EOS,))
    rows = [RowInput(data.draw(samplings(vocab.n_vocab)), data.draw(st.integers(0, 1000)), ctx, g) for _ in range(2)]
    assert vocab.piece_tree(wait=True) is not None
    with mock.patch("consumer.sampling.grammar.PRUNE_MIN", 1 if tree else PRUNE_MIN):
        got = sample_rows(logits, rows, vocab)
    for r, inp in enumerate(rows):
        want = sample_row(logits[r], inp.sampling, inp.position, context=ctx, vocab=vocab, grammar=_AskedEveryId(g))
        assert (int(got.tokens[r]), int(got.status[r])) == (want[0], want[1])


def _json_session(i: int, **kw: object) -> Session:
    s = Sampling(temperature=1.0, seed=i, json_schema=SCHEMA, **kw)  # type: ignore[arg-type]
    return Session(f"j{i}", [1, 40 + i, 50 + i], s, max_tokens=40, stop=(EOS,))


def test_json_schema_sessions_produce_json_alone_batched_and_replayed(vocab: Vocabulary, tok: Tokenizer) -> None:
    model = Model(vocab.n_vocab, seed=2, scale=1.0)
    sessions = [_json_session(i) for i in range(4)]
    alone = []
    for s in sessions:
        c = Session(s.sid, s.prompt, s.sampling, s.max_tokens, s.stop)
        serve(BatchSampler(vocab), model, [c], slots=[0], chunk=2, starts=[0])
        alone.append(c.tokens)
    finished = 0
    for toks in alone:
        assert all(t != 1 for t in toks)  # <s> is special: never sampled
        if toks and toks[-1] == EOS:
            finished += 1
            value = json.loads(tok.decode(toks[:-1]))
            assert isinstance(value["a"], int) and isinstance(value["b"], bool)
    assert finished >= 2
    batched = [Session(s.sid, s.prompt, s.sampling, s.max_tokens, s.stop) for s in sessions]
    serve(BatchSampler(vocab, threads=2), model, batched, slots=[3, 1, 0, 2], chunk=3, starts=[0, 1, 0, 2])
    assert [s.tokens for s in batched] == alone
    replayed = [Session(s.sid, s.prompt, s.sampling, s.max_tokens, s.stop) for s in sessions]
    serve(BatchSampler(vocab), model, replayed, slots=[0, 1, 2, 3], chunk=2, starts=[0] * 4,
          replay_after={s.sid: 5 for s in sessions}, replay_slot={s.sid: 4 + i for i, s in enumerate(sessions)})
    assert [s.tokens for s in replayed] == alone


def test_a_grammar_that_admits_nothing_ends_the_session(vocab: Vocabulary, tok: Tokenizer) -> None:
    model = Model(vocab.n_vocab, seed=1)
    # "ab" then only the end of generation, which the session bans: nothing is admissible after "ab".
    s = Session("e", [1, 60], Sampling(grammar='root ::= "ab"', banned_token_ids=(EOS,)), max_tokens=10)
    serve(BatchSampler(vocab), model, [s], slots=[0], chunk=4, starts=[0])
    assert tok.decode(s.tokens) == "ab" and s.status[-1] == RowStatus.GRAMMAR_END
    # min_tokens holds back the end of generation the complete grammar needs: the same end
    m = Session("m", [1, 60], Sampling(grammar='root ::= "ab"', min_tokens=8), max_tokens=10, stop=(EOS,))
    serve(BatchSampler(vocab), model, [m], slots=[0], chunk=4, starts=[0])
    assert m.status[-1] == RowStatus.GRAMMAR_END
    done = Session("d", [1, 60], Sampling(grammar='root ::= "ab"'), max_tokens=10, stop=(EOS,))
    serve(BatchSampler(vocab), model, [done], slots=[0], chunk=4, starts=[0])
    assert done.tokens[-1] == EOS and tok.decode(done.tokens[:-1]) == "ab"


def test_a_grammar_that_cannot_compile_or_run_says_so(vocab: Vocabulary) -> None:
    model = Model(vocab.n_vocab, seed=1)
    bad = Session("b", [1, 60], Sampling(grammar="root ::= nowhere"))
    serve(BatchSampler(vocab), model, [bad], slots=[0], chunk=4, starts=[0])
    assert bad.status == [RowStatus.GRAMMAR_INVALID] and bad.tokens == []
    here = Session("u", [1, 60], Sampling(grammar='root ::= "a"'))
    serve(BatchSampler(vocab.n_vocab), model, [here], slots=[0], chunk=4, starts=[0])
    assert here.status == [RowStatus.GRAMMAR_UNSUPPORTED]
    sampler = BatchSampler(vocab)
    assert sampler.check(Sampling(json_schema=SCHEMA)) == RowStatus.OK
    assert sampler.check(Sampling(grammar="root ::= nowhere")) == RowStatus.GRAMMAR_INVALID
    assert BatchSampler(512).check(Sampling(grammar='root ::= "a"')) == RowStatus.GRAMMAR_UNSUPPORTED
    assert sampler.check(Sampling()) == RowStatus.OK


def test_gemma_vocabulary_and_a_json_grammar_at_its_size(gemma_model_path: Path) -> None:
    """DGR_SLOW=1: Gemma's token types as docs/sampling.md states them, and the serving path equal to the
    oracle under a JSON-schema grammar at a 262,144-token vocabulary (the grammar asked about prefixes)."""
    voc = Vocabulary.load(gemma_model_path)
    assert voc.n_vocab == 262_144 and voc.special.size == 6247 and voc.eog.tolist() == [1, 106, 212]
    assert {0, 2, 3, 4, 105, 6, 262_143} <= set(voc.special.tolist())
    assert not {5, 107, 255_999, 256_000} & set(voc.special.tolist())  # USER_DEFINED: text to the vocabulary
    g = Grammar(voc, gbnf_of(Sampling(json_schema=SCHEMA)) or "")
    rng = np.random.default_rng(5)
    logits = (rng.gumbel(size=(3, voc.n_vocab)) * 2).astype(np.float32)
    brace = int(np.flatnonzero(g.admitted(np.arange(voc.n_vocab)))[0])
    logits[0, brace] = 50.0  # a model that follows the grammar: its best token is admitted
    rows = [RowInput(Sampling(), 1, None, g), RowInput(Sampling(temperature=0.8, top_k=40, seed=2), 2, None, g),
            RowInput(Sampling(temperature=0.8, top_p=0.95, seed=3), 3, None, g)]
    got = sample_rows(logits, rows, voc)
    for r, inp in enumerate(rows):
        assert (int(got.tokens[r]), int(got.status[r])) == sample_row(logits[r], inp.sampling, inp.position,
                                                                      vocab=voc, grammar=g)
