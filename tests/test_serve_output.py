"""Streamed text: the replica's incremental detokenizer against decoding each whole sequence."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from taps_ray.models.target import load_tokenizer
from taps_ray.serve.output import ChoiceStream, IncrementalText, TextOutput

TEXT = ("Sums: 12 + 30 = 42. Café, naïve, Ελληνικά, 日本語のテキスト, emoji 🚀🎉 and   spaces.\n"
        "Second line\twith a tab; «quotes» — dashes… The answer is 42. ") * 3


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer (Metaspace: words carry a leading "▁"; decoding, as Llama-2's tokenizer.json
    does, turns them into spaces, joins the tokens and strips the first space) trained here on TEXT: decoding a window then differs from the same tokens inside the whole."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>")


TOKENIZERS = {"smollm2-byte-bpe": load_tokenizer, "sentencepiece-like": _sentencepiece_like}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def output(request: pytest.FixtureRequest) -> TextOutput:
    tokenizer = TOKENIZERS[request.param]()
    return TextOutput(tokenizer, [tokenizer.eos_token_id])


def _chunks(tokens: list[int], seed: int) -> list[list[int]]:
    """The tokens as a decode loop streams them: 1 to 4 per step (accepted drafts come several at once)."""
    rng, chunks, start = random.Random(seed), [], 0
    while start < len(tokens):
        size = rng.randint(1, 4)
        chunks.append(tokens[start : start + size])
        start += size
    return chunks


def test_the_window_tokenizer_really_strips_a_first_space():
    """Not vacuous: decoding a sentencepiece window alone loses the space that the whole sequence keeps."""
    output = TextOutput(_sentencepiece_like(), [])
    tokens = output.tokenizer.encode("Second line with a tab", add_special_tokens=False)
    pieces = output.tokenizer.convert_ids_to_tokens(tokens)
    word = next(i for i, piece in enumerate(pieces) if i > 0 and piece.startswith("▁") and len(piece) > 1)
    whole, tail = output.decode(tokens), output.decode(tokens[word:])
    assert not tail.startswith(" ") and whole.endswith(" " + tail)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_text_is_always_the_whole_decode_so_far(output: TextOutput, seed: int):
    tokens = output.tokenizer.encode(TEXT, add_special_tokens=False)
    if seed % 2:  # byte tokens of multi-byte characters, and ids in no particular order
        tokens = random.Random(seed).sample(range(output.tokenizer.vocab_size), 120) + tokens
    incremental, seen = IncrementalText(output), []
    partial = 0
    for chunk in _chunks(tokens, seed):
        incremental.add(chunk)
        seen += chunk
        whole = output.text(seen)
        assert whole.startswith(incremental.text)
        if not whole.endswith("\ufffd"):
            assert incremental.text == whole
        else:
            partial += 1
    assert incremental.text == output.text(tokens) and len(incremental.text) > 100
    if output.tokenizer.vocab_size > 1000:  # byte-level BPE: the emoji and CJK characters span several tokens
        assert partial > 0


def test_a_final_stop_token_is_left_out_as_in_the_whole_text(output: TextOutput):
    stop = output.tokenizer.eos_token_id
    tokens = output.tokenizer.encode("The answer is 42.", add_special_tokens=False)
    incremental = IncrementalText(output)
    incremental.add(tokens)
    incremental.add([stop])
    assert incremental.text == output.text([*tokens, stop]) == output.decode(tokens)


def test_each_step_decodes_a_window_not_the_sequence(output: TextOutput):
    """O(1) per token: the tokens decoded for one step do not grow with the sequence (the whole sequence decoded
    at every step made a 2,048-token stream quadratic)."""
    decoded: list[int] = []
    decode = output.decode

    def counting(tokens: list[int]) -> str:
        decoded.append(len(tokens))
        return decode(tokens)

    tokens = output.tokenizer.encode(TEXT * 4, add_special_tokens=False)
    incremental = IncrementalText(output)
    output.decode = counting
    try:
        for token in tokens:
            incremental.add([token])
    finally:
        del output.decode
    assert len(tokens) > 300 and incremental.text == output.text(tokens)
    assert max(decoded) <= 12  # a character's bytes plus the window's previous tokens


@pytest.mark.parametrize("stops", [[], ["The answer"], ["tab;", "\n"]])
def test_streamed_pieces_concatenate_to_the_returned_text(output: TextOutput, stops: list[str]):
    tokens = output.tokenizer.encode(TEXT, add_special_tokens=False)
    stream, pieces = ChoiceStream(output, stops), []
    for chunk in _chunks(tokens, 7):
        pieces.append(stream.add(chunk, []))
    result = SimpleNamespace(generation=SimpleNamespace(tokens=tokens, finished_by="length"))
    rest, finish = stream.close(result)
    text, _ = output.finish(result, stops)
    assert "".join(pieces) + rest == text and finish == ("stop" if stops else "length")
    assert sum(1 for p in pieces if p) > 3  # streamed as it decoded, not all at the end


def _whole_decode_cut(output: TextOutput, tokens: list[int], stops: list[str]) -> int | None:
    """The reference: the fewest tokens whose whole text holds a stop string."""
    return next((keep for keep in range(1, len(tokens) + 1) if any(s in output.text(tokens[:keep]) for s in stops)),
                None)


@pytest.mark.parametrize("stops", [["🎉"], ["日本語"], ["The answer"], ["never in the text"]])
def test_the_engine_stop_rule_cuts_where_the_whole_text_first_holds_a_stop(output: TextOutput, stops: list[str]):
    tokens = output.tokenizer.encode(TEXT, add_special_tokens=False)
    want = _whole_decode_cut(output, tokens, stops)
    rule, seen, got = output.stop_rule(stops), [], None
    for chunk in _chunks(tokens, 3):
        seen += chunk
        got = rule(seen, len(chunk))
        if got is not None:
            break
    assert got == want
    assert (want is None) == (stops == ["never in the text"])


def test_the_stop_rule_decodes_a_window_per_step_and_follows_a_new_sequence(output: TextOutput):
    decoded: list[int] = []
    decode = output.decode
    output.decode = lambda tokens: (decoded.append(len(tokens)), decode(tokens))[1]
    try:
        tokens = output.tokenizer.encode(TEXT * 4, add_special_tokens=False)
        rule = output.stop_rule(["never in the text"])
        assert all(rule(tokens[: i + 1], 1) is None for i in range(len(tokens)))
        assert len(tokens) > 300 and max(decoded) <= 12
        again = output.tokenizer.encode("The answer is 42.", add_special_tokens=False)
        stop = output.stop_rule(["is 42"])
        assert stop(tokens[:10], 10) is None  # one sequence, then the rule sees another: it starts again
        assert stop(again, len(again)) == _whole_decode_cut(output, again, ["is 42"]) is not None
    finally:
        del output.decode
