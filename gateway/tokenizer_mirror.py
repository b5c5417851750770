"""The fenced part of the tokenizer loader: what it copies from transformers, kept apart so
that a transformers release that moves these rules changes one file.

It mirrors transformers 5's `AutoTokenizer.from_pretrained(dir)` (pyproject: `transformers>=5.0,<6`),
as far as a tokenizer loaded from `tokenizer.json` by the Rust `tokenizers` library needs:

- which class `AutoTokenizer` picks (`auto_tokenizer_class`): `tokenization_auto`'s
  `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS` with each type's `TOKENIZER_MAPPING_NAMES`
  class (`HUB_CLASS_OVERRIDES`), the names that resolve to `TokenizersBackend`
  (`GENERIC_CLASSES`), the Mistral types that depend on `mistral_common`;
- what the Qwen classes rebuild in `__init__` (`CLASS_PIPELINES`: their `PRETOKENIZE_REGEX`
  and keyword defaults);
- how `from_pretrained` resolves added and special tokens from tokenizer_config.json /
  special_tokens_map.json and registers them (`set_up_backend`), with
  `PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES` (`NAMED_SPECIAL_TOKENS`);
- `clean_up_tokenization` and when decode applies it.

The tables were taken from the transformers 5 releases before 5.25 (5.25 dropped
`camembertv2-base` from the hub-class table); `tests/unit/test_gateway_tokenizer.py`
pins them to the installed transformers and compares the whole built backend with
transformers' own on real checkpoint layouts. Nothing here imports transformers.
Everything that is the project's own (the hot path's caches, decoding streams, the
per-token bound, the transformers fallback) stays in `gateway/tokenizer.py`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers as pre

NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""transformers' `SPECIAL_TOKENS_ATTRIBUTES`: each set one is a chat-template variable."""


def transformers_reason(path: Path) -> str | None:
    """Why checkpoint `path`'s tokenizer must be loaded by transformers (which imports
    torch), or None when the Rust loader reproduces it: what `load_tokenizer_core`
    decides, from the files alone, for start-up checks made before any process starts
    (tokenizer.json is parsed only for a class whose rebuild needs BPE)."""
    reason, class_name = loader_choice(path, read_json(path / "tokenizer_config.json"))
    if reason is None and class_name in CLASS_PIPELINES and not _tokenizer_json_is_bpe(path):
        return non_bpe_reason(class_name)
    return reason


def loader_choice(path: Path, config: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(why transformers must load it, or None; the class transformers would pick) as far
    as the JSON beside tokenizer.json tells; the BPE check is the caller's."""
    if not (path / "tokenizer.json").is_file():
        return "no tokenizer.json", None
    auto_map = config.get("auto_map")
    if isinstance(auto_map, list) or isinstance(auto_map, dict) and "AutoTokenizer" in auto_map:
        return "custom tokenizer code (auto_map)", None
    class_name = auto_tokenizer_class(path, config, read_json(path / "config.json"))
    if class_name not in GENERIC_CLASSES and class_name not in CLASS_PIPELINES:
        return f"tokenizer class {class_name}", class_name
    return None, class_name


def non_bpe_reason(class_name: str | None) -> str:
    return f"{class_name} over a non-BPE tokenizer.json"


def _tokenizer_json_is_bpe(path: Path) -> bool:
    """Whether tokenizer.json's model is BPE (the class pipelines rebuild BPE only)."""
    model = read_json(path / "tokenizer.json").get("model")
    if not isinstance(model, Mapping):
        return False
    return bool(model.get("type", "BPE" if "merges" in model else None) == "BPE")


GENERIC_CLASSES = {"TokenizersBackend", "PreTrainedTokenizer", "PythonBackend", "BloomTokenizer"}
"""Names (less "Fast") transformers resolves to `TokenizersBackend`: tokenizer.json as saved."""
HUB_CLASS_OVERRIDES = {
    "qwen2": "Qwen2Tokenizer",
    "qwen3_5": "Qwen3_5Tokenizer",
    "qwen3_5_moe": "Qwen3_5Tokenizer",
    "qwen3_5_moe_text": "Qwen3_5Tokenizer",
    "qwen4_exp": "Qwen3_5Tokenizer",
    "hyperclovax_vision_v2": "GPT2Tokenizer",
    "siglip2": "Siglip2Tokenizer",
    **dict.fromkeys(
        (
            "arctic",
            "camembertv2-base",
            "chatlm",
            "cohere_asr",
            "ernie4_5",
            "ernie4_5_moe",
            "fuyu",
            "h2ovl_chat",
            "hyperclovax",
            "hyperclovax_vlm",
            "internlm2",
            "internlm3",
            "iquestcoder",
            "jamba",
            "llava",
            "llava_next",
            "minicpm3",
            "minicpmv",
            "minimax_m2",
            "modernbert",
            "modernbert-decoder",
            "molmo",
            "molmo2",
            "nemotron",
            "nvfp4",
            "opencua",
            "openvla",
            "paddleocr_vl",
            "phi3",
            "phi3_v",
            "phimoe",
            "smolvlm",
            "step3_vl",
            "vipllava",
        ),
        "TokenizersBackend",
    ),
}
"""transformers 5's `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS` with each model type's
registered class, which wins over the checkpoint's `tokenizer_class` (a test pins this
table to the installed transformers)."""
MISTRAL_TYPES = {
    "mistral",
    "mistral3",
    "mistral_large4",
    "mixtral",
    "ministral",
    "ministral3",
    "pixtral",
    "voxtral",
}
"""Model types whose class depends on whether `mistral_common` is installed."""


def auto_tokenizer_class(
    path: Path, config: Mapping[str, Any], model_config: Mapping[str, Any]
) -> str | None:
    """The class (name less "Fast") `AutoTokenizer.from_pretrained(path)` instantiates,
    by transformers 5's rules as far as they separate "tokenizer.json as saved" from a
    model-specific class; None where only transformers' own tables can tell."""
    hub: str | None = config.get("tokenizer_class") or model_config.get("tokenizer_class")
    model_type: str = model_config.get("model_type") or ""  # "": matches no table
    if model_type in MISTRAL_TYPES:
        return None
    if hub is None:  # transformers maps the model type; known here for the overrides only
        return HUB_CLASS_OVERRIDES.get(model_type)
    if model_type in HUB_CLASS_OVERRIDES:
        return HUB_CLASS_OVERRIDES[model_type]
    hub = hub.removesuffix("Fast")
    if hub == "LlamaTokenizer" and '"ByteLevel"' in (path / "tokenizer.json").read_text(
        encoding="utf-8"
    ):  # Llama-3-style byte-level BPE under a Llama class name
        return "TokenizersBackend"
    return hub


@dataclass(frozen=True, slots=True)
class ClassPipeline:
    """What a transformers byte-level BPE class builds in `__init__` in place of
    tokenizer.json's normalizer, pre-tokenizer, decoder and BPE options (the saved vocab,
    merges and post-processor are kept), plus its special-token defaults."""

    split_regex: str
    readds_special_tokens: bool
    defaults: Mapping[str, str | None] = field(
        default_factory=lambda: {
            "unk_token": "<|endoftext|>",
            "bos_token": None,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
        }
    )

    def apply(self, backend: Tokenizer, *, add_prefix_space: bool) -> None:
        model = backend.model
        model.dropout, model.unk_token, model.fuse_unk = None, None, False
        model.continuing_subword_prefix, model.end_of_word_suffix = "", ""
        model.byte_fallback, model.ignore_merges = False, False
        backend.decoder = decoders.ByteLevel()
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre.Sequence(
            [
                pre.Split(Regex(self.split_regex), behavior="isolated", invert=False),
                pre.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )


CLASS_PIPELINES = {
    "Qwen2Tokenizer": ClassPipeline(
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
        readds_special_tokens=True,
    ),
    "Qwen3_5Tokenizer": ClassPipeline(
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
        readds_special_tokens=False,
    ),
}
"""transformers' `Qwen2Tokenizer` / `Qwen3_5Tokenizer` (`PRETOKENIZE_REGEX`, defaults)."""


def set_up_backend(
    backend: Tokenizer, path: Path, config: Mapping[str, Any], pipeline: ClassPipeline | None
) -> tuple[dict[str, str], bool]:
    """Set up `backend` (loaded from `path/tokenizer.json`) as `TokenizersBackend`, or the
    class `pipeline` stands for, does from the same files (`config`: tokenizer_config.json).
    Returns (the named special tokens, the chat template's variables; whether decode runs
    transformers' WordPiece-era clean-up)."""
    named, extra, added = _special_tokens(
        config, path, backend, pipeline.defaults if pipeline else {}
    )
    if pipeline is not None:
        pipeline.apply(backend, add_prefix_space=bool(config.get("add_prefix_space")))
    backend.no_truncation()  # transformers' encode() runs without truncation/padding
    backend.no_padding()
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    _register_tokens(backend, named, extra, added, rebuilt=pipeline is not None)
    if pipeline is not None and pipeline.readds_special_tokens:
        every = dict.fromkeys(str(t) for t in [*named.values(), *extra])
        backend.add_tokens([AddedToken(t, special=True) for t in every])
    # transformers skips the WordPiece-era clean-up for BPE unless forced.
    clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
        not isinstance(backend.model, models.BPE)
        or bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        )
    )
    return {k: str(v) for k, v in named.items()}, clean_up


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _as_token(value: str | AddedToken | dict[str, Any]) -> str | AddedToken:
    """A token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return AddedToken(**{k: v for k, v in value.items() if k != "__type"})
    return value


def _special_tokens(
    config: Mapping[str, Any], path: Path, backend: Tokenizer, defaults: Mapping[str, str | None]
) -> tuple[dict[str, str | AddedToken], list[str | AddedToken], list[AddedToken]]:
    """(named special tokens incl. model-specific `*_token` keys, extra special tokens, the
    added tokens to register in id order), resolved from the config files and the freshly
    loaded tokenizer.json (`backend`) as transformers' `from_pretrained` resolves them."""
    cfg = dict(config)
    if "additional_special_tokens" in cfg and not cfg.get("extra_special_tokens"):
        cfg["extra_special_tokens"] = cfg.pop("additional_special_tokens")
    if "added_tokens_decoder" in cfg:
        added = {
            int(i): AddedToken(**{k: v for k, v in t.items() if k != "__type"})
            for i, t in cfg["added_tokens_decoder"].items()
        }
    else:  # legacy layout: special_tokens_map.json overrides; tokenizer.json's added tokens
        for key, value in read_json(path / "special_tokens_map.json").items():
            if key == "extra_special_tokens" and isinstance(value, list):
                merged = list(cfg.get("extra_special_tokens") or [])
                for tok in value:
                    tok = AddedToken(**tok, special=True) if isinstance(tok, dict) else tok
                    if tok not in merged:
                        merged.append(tok)
                value = merged
            elif isinstance(value, dict):
                value = AddedToken(
                    **{k: v for k, v in value.items() if k not in ("special", "__type")},
                    special=True,
                )
            cfg[key] = value
        if "additional_special_tokens" in cfg and "extra_special_tokens" not in cfg:
            cfg["extra_special_tokens"] = cfg.pop("additional_special_tokens")
        added = dict(backend.get_added_tokens_decoder())
    for key, value in defaults.items():  # the class's keyword defaults
        cfg.setdefault(key, value)
    if backend.padding is not None:
        cfg.setdefault("pad_token", backend.padding["pad_token"])
    by_content = {t.content: t for t in added.values()}
    named: dict[str, str | AddedToken] = {}
    for key in NAMED_SPECIAL_TOKENS:
        if cfg.get(key) is not None:
            token = _as_token(cfg[key])
            named[key] = by_content.get(str(token), token)
    for key, value in cfg.items():  # model-specific named tokens (image_token, ...)
        if (
            key.endswith("_token")
            and key not in NAMED_SPECIAL_TOKENS
            and (
                isinstance(value, str | AddedToken)
                or isinstance(value, dict)
                and value.get("__type") == "AddedToken"
            )
        ):
            named[key] = _as_token(value)
    extra = cfg.get("extra_special_tokens") or []
    if isinstance(extra, dict):
        named.update({k: _as_token(v) for k, v in extra.items()})
        extra = []
    return named, [_as_token(t) for t in extra], [added[i] for i in sorted(added)]


def _register_tokens(
    backend: Tokenizer,
    named: Mapping[str, str | AddedToken],
    extra: Sequence[str | AddedToken],
    added: Sequence[AddedToken],
    *,
    rebuilt: bool,
) -> None:
    """Add the config's added tokens, then each named/extra special token not yet there,
    in `TokenizersBackend.__init__`'s order and with its flags (re-adding a token updates
    its flags). A `rebuilt` class starts from a backend without added tokens."""
    to_add: list[str | AddedToken] = list(added)
    encoder = set() if rebuilt else {t.content for t in backend.get_added_tokens_decoder().values()}
    encoder.update(str(t) for t in to_add)
    for token in [*named.values(), *extra]:
        if str(token) not in encoder and token not in to_add:
            to_add.append(token)
    named_strs = {str(t) for t in named.values()}
    tokens: list[AddedToken] = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named_strs:
            token.special = True
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization` (WordPiece-era spaces before punctuation)."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )
