"""Asking a grammar along the vocabulary's piece tree (consumer/sampling/pieces.py) gives exactly
llama.cpp's verdicts for every id, in every grammar state reached by accepting admitted tokens (byte
tokens and partial UTF-8 sequences included), and skips the ids under a refused piece. The tree itself
against a prefix-closed judge drawn by hypothesis; then against llama.cpp on the tiny vocabulary (and on
Gemma's 262,144 ids with DGR_SLOW=1)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.sampling import Vocabulary
from consumer.sampling.grammar import Grammar, gbnf_of
from consumer.sampling.pieces import PieceTree
from schemas import Sampling

# ---- the tree against a prefix-closed judge ----------------------------------------------------------

ALPHABET = ["a", "b", " ", "é", "\u4e2d", "\"", "\0"]
raw_pieces = st.one_of(
    st.none(),
    st.lists(st.sampled_from(ALPHABET), max_size=5).map(lambda cs: "".join(cs).encode()),
    st.binary(max_size=3),  # invalid UTF-8 often: byte tokens
)


def _judge(targets: list[str], wild: dict[int, bool], pieces: list[bytes | None]
           ) -> Callable[[npt.NDArray[np.intp]], npt.NDArray[np.bool_]]:
    """A grammar whose language is the prefixes of targets (closed under prefixes, as llama.cpp's
    verdicts are on valid pieces); pieces outside the tree get arbitrary verdicts."""

    def verdict(i: int) -> bool:
        raw = pieces[i]
        if raw is None:
            return wild.get(i, False)
        raw = raw.split(b"\0", 1)[0]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return wild.get(i, True)
        return bool(text) and any(t.startswith(text) for t in targets)

    return lambda ids: np.array([verdict(int(i)) for i in ids], np.bool_)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(raw_pieces, min_size=1, max_size=40),
       targets=st.lists(st.lists(st.sampled_from(ALPHABET), max_size=6).map("".join), max_size=3),
       wild=st.dictionaries(st.integers(0, 39), st.booleans()), data=st.data())
def test_tree_verdicts_equal_asking_every_id(pieces: list[bytes | None], targets: list[str],
                                             wild: dict[int, bool], data: st.DataObject) -> None:
    tree = PieceTree.from_pieces(pieces)
    judge = _judge(targets, wild, pieces)
    ids = np.array(data.draw(st.lists(st.integers(0, len(pieces) - 1), unique=True, min_size=1)), np.intp)
    asked: list[int] = []

    def ask(level: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        asked.extend(level.tolist())
        return judge(level)

    got = tree.admitted(ids, ask)
    assert got.tolist() == judge(ids).tolist()
    assert len(asked) == len(set(asked))  # each id asked once
    refused = {i for i in asked if not judge(np.array([i], np.intp))[0]}
    assert not any(int(tree.parent[i]) in refused for i in asked)  # nothing asked under a refused piece


def test_parents_are_longest_prefixes_and_duplicates_hang_under_the_first() -> None:
    pieces = [b"a", b"ab", b"abc", b"ab", None, b"\xe4", b"\xe4\xb8\xad", b"", b"ab\0zz", "é".encode()]
    tree = PieceTree.from_pieces(pieces)
    assert tree.parent.tolist() == [-1, 0, 1, 1, -1, -1, -1, -1, 1, -1]
    assert tree.depth.tolist() == [0, 1, 2, 2, 0, 0, 0, 0, 2, 0]


# ---- against llama.cpp -------------------------------------------------------------------------------

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                       "n": {"type": "integer"}}, "required": ["name", "n"]})
GRAMMARS = [
    gbnf_of(Sampling(json_schema=SCHEMA)),
    'root ::= "ab" [0-9]+ ("." [a-z]+)?',
    'root ::= [^"\\\\]* "\\"" [ \\t]* "}"',
    'root ::= ([\\u00e0-\\u00ff] | [\\u4e00-\\u9fff] | "x")+ "."',  # multi-byte code points: byte tokens may start them
    'root ::= [a-c]* | "the" " " [a-z]+',
]


def _walk(vocab: Vocabulary, tree: PieceTree, gbnf: str, seed: int, steps: int) -> int:
    """Accept random admitted tokens, checking the tree's verdicts on every id at every state; the ids
    asked over the walk."""
    rng = np.random.default_rng(seed)
    g = Grammar(vocab, gbnf)
    every = np.arange(vocab.n_vocab, dtype=np.intp)
    asked = 0
    try:
        for _ in range(steps):
            direct = g.asked(every)

            def ask(ids: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
                nonlocal asked
                asked += int(ids.shape[0])
                return g.asked(ids)

            assert tree.admitted(every, ask).tolist() == direct.tolist()
            ok = np.flatnonzero(direct)
            ok = ok[~np.isin(ok, vocab.eog)]
            if ok.size == 0:
                break
            g.accept(int(rng.choice(ok)))
    finally:
        g.close()
    return asked


@pytest.mark.parametrize("gbnf", GRAMMARS)
def test_tree_equals_llama_cpp_on_the_tiny_vocabulary(tiny_model_path: Path, gbnf: str) -> None:
    vocab = Vocabulary.load(tiny_model_path)
    tree = vocab.piece_tree(wait=True)
    assert tree is not None and tree.size == vocab.n_vocab
    for seed in range(8):
        _walk(vocab, tree, gbnf, seed, steps=12)


@pytest.mark.skipif(os.environ.get("DGR_SLOW") != "1", reason="Gemma's vocabulary: DGR_SLOW=1")
def test_tree_equals_llama_cpp_on_gemmas_vocabulary_and_asks_far_less() -> None:
    from consumer.runtime import resolve_model

    vocab = Vocabulary.load(resolve_model("gemma"))
    tree = vocab.piece_tree(wait=True)
    assert tree is not None
    asked = sum(_walk(vocab, tree, GRAMMARS[0], seed, steps=10) for seed in range(3))
    assert asked < 0.25 * 30 * vocab.n_vocab  # the JSON grammar's structure admits few first characters


def test_a_sampler_closed_right_after_its_first_grammar_waits_for_the_tree(tiny_model_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The tree is built on a thread from the engine's vocab: closing the sampler (before the worker frees
    the engine) waits for it, so no build outlives the vocab it reads (a build made slow here)."""
    import time

    from consumer.sampling import BatchSampler

    build = PieceTree.from_pieces.__func__  # type: ignore[attr-defined]

    def slow(cls: type[PieceTree], pieces: list[bytes | None]) -> PieceTree:
        time.sleep(0.3)
        return build(cls, pieces)  # type: ignore[no-any-return]

    monkeypatch.setattr(PieceTree, "from_pieces", classmethod(slow))
    vocab = Vocabulary.load(tiny_model_path)
    sampler = BatchSampler(vocab)
    Grammar(vocab, GRAMMARS[1]).close()  # starts the build
    sampler.close()
    thread = vocab.__dict__["_piece_tree"]["thread"]
    assert not thread.is_alive() and vocab.piece_tree() is not None


def test_a_tree_that_cannot_be_built_is_logged_and_grammars_ask_every_id(tiny_model_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    def broken(cls: type[PieceTree], pieces: list[bytes | None]) -> PieceTree:
        raise RuntimeError("no tree")

    monkeypatch.setattr(PieceTree, "from_pieces", classmethod(broken))
    vocab = Vocabulary.load(tiny_model_path)
    with caplog.at_level("ERROR", logger="dgr.sampler"):
        assert vocab.piece_tree(wait=True) is None
    assert "piece tree could not be built" in caplog.text
    g = Grammar(vocab, GRAMMARS[1])
    every = np.arange(vocab.n_vocab, dtype=np.intp)
    assert g.admitted(every).tolist() == g.asked(every).tolist()
    g.close()
