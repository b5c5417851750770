"""The character bound behind the prompt-length pre-check (`ChatTokenizer.chars_per_token`,
`min_prompt_tokens`): it holds on texts built to beat it (long pieces, added tokens,
whitespace runs, Hangul jamo that NFC joins, random Unicode), it is None for tokenizers
where text can vanish (stripping normalizers, whitespace-eating added tokens, removing
splits, WordPiece), and only message roles the template renders verbatim count."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers
from tokenizers import pre_tokenizers as pre

from gateway.chat_template import ChatTemplate
from gateway.large_prompts import refuse_overlong
from gateway.protocol import InvalidRequestError
from gateway.tokenizer import ChatTokenizer, RustTokenizer, max_chars_per_token


def _holds(tok: ChatTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert len(ids) * tok.chars_per_token >= len(text), (len(ids), len(text))


def test_tiny_tokenizer_has_a_bound_from_its_vocabulary(tok: ChatTokenizer):
    backend = tok.core.backend
    longest_piece = max(map(len, backend.get_vocab(with_added_tokens=False)))
    longest_added = max(len(t.encode()) for t in tok.core.added_tokens.values())
    assert tok.chars_per_token == 3 * max(longest_piece, longest_added)  # NFC: x3
    assert tok.rendered_roles == ("system", "user", "assistant", "tool")


def test_bound_holds_on_texts_built_to_beat_it(tok: ChatTokenizer):
    vocab = tok.core.backend.get_vocab(with_added_tokens=False)
    longest = max(vocab, key=len)
    pieces = sorted(vocab, key=len)[-50:]
    hangul = "\u1100\u1161\u11a8"  # L+V+T jamo: NFC makes one syllable of three
    texts = [
        " " * 5000,
        "\n" * 3000,
        "\t \n" * 1000,
        longest * 500,
        "".join(pieces) * 20,
        "".join(tok.core.added_tokens.values()) * 200,
        hangul * 2000,
        "e\u0301" * 2000,
        "\U0001f600" * 1000,
        "abc" * 3000,
    ]
    for text in texts:
        _holds(tok, text)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=400))
def test_bound_holds_on_random_text(tok: ChatTokenizer, text: str):
    _holds(tok, text)


def test_min_prompt_tokens_is_below_the_rendered_prompt(tok: ChatTokenizer):
    messages = [
        {"role": "system", "content": "s" * 500},
        {"role": "user", "content": "  hello world  " * 300},
        {"role": "assistant", "content": "<think>a</think>b" * 200},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "x y " * 400},
                {"type": "image_url", "image_url": {"url": "u"}},
            ],
        },
    ]
    least = tok.min_prompt_tokens(messages)
    chars = 500 + len(("  hello world  " * 300).strip()) + len(("x y " * 400).strip()) + 1
    assert least == -(-chars // tok.chars_per_token)  # of an assistant text: after </think>
    assert 0 < least <= len(tok.encode(tok.render(messages, None)))


def test_refuse_overlong_only_when_the_exact_check_would(tok: ChatTokenizer):
    messages = [{"role": "user", "content": "z" * (tok.chars_per_token * 100)}]
    assert tok.min_prompt_tokens(messages) == 100
    refuse_overlong(tok, messages, 101, param="messages")  # might fit: the exact check decides
    with pytest.raises(InvalidRequestError) as refused:
        refuse_overlong(tok, messages, 100, param="messages")  # 100 >= 100: exact check refuses too
    assert refused.value.code == "context_length_exceeded"
    assert "at least 100 tokens" in refused.value.message


def _backend(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def test_no_bound_where_text_can_vanish(tiny_model_dir: Path):
    assert max_chars_per_token(_backend(tiny_model_dir)) is not None
    stripping = _backend(tiny_model_dir)
    stripping.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])
    eating = _backend(tiny_model_dir)
    eating.add_tokens([AddedToken("<mask>", lstrip=True)])
    removing = _backend(tiny_model_dir)
    removing.pre_tokenizer = pre.Sequence(
        [pre.Split(Regex(r"\s+"), behavior="removed"), pre.ByteLevel(add_prefix_space=False)]
    )
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre.Whitespace()
    for backend in (stripping, eating, removing, wordpiece):
        assert max_chars_per_token(backend) is None


def test_roles_a_template_drops_do_not_count(tiny_model_dir: Path):
    drops_tools = (
        "{% for m in messages %}{% if m.role != 'tool' %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant\n"
    )
    tok = ChatTokenizer(RustTokenizer(_backend(tiny_model_dir), ChatTemplate(drops_tools, {})))
    assert tok.rendered_roles == ("system", "user", "assistant")
    tool_only = [{"role": "tool", "tool_call_id": "c", "content": "t" * 10_000}]
    assert tok.min_prompt_tokens(tool_only) == 0
