"""Model runner of the local engine: one HF causal LM, the KV cache of the running batch,
batched prefill and decode, SGLang-convention sampling, and weight reloads from disk.

Owns every torch object of the engine and is NOT thread-safe: only the scheduler thread
calls it. Must not import the HTTP layer. Supports full-attention decoder LMs with
`sdpa` or `eager` attention (Qwen2/Llama family); sliding-window layers are not modelled.

KV layout: the running batch is one left-padded tensor pair per layer,
[rows, kv_heads, capacity, head_dim], with a `valid` mask over the filled columns and an
explicit next position id per row, so RoPE sees true positions despite the padding.
Costs: a decode step writes one new column in place (no copy of the old KV, unlike
DynamicLayer's torch.cat) and reads every filled column (padding included); the buffer
grows by doubling; a join or a leave copies the whole batch KV once and drops leading
columns that no row uses any more.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from areal_service.lora_adapter import is_adapter_dir
from engine.live_weights import copy_checked

if TYPE_CHECKING:
    from engine.lora import AdapterSlot

logger = logging.getLogger(__name__)

PREFILL_TOKEN_BUDGET = 8192
"""Most padded tokens (rows x longest row) in one prefill forward."""
_CAPACITY_STEP = 64


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword the model's `forward` takes its KV cache by: `cache` in transformers
    releases that renamed it (`past_key_values` is deprecated there, with a warning on
    every call, to be removed in 5.40), `past_key_values` before that and in models not yet
    renamed. Read from the signature (`deprecate_kwarg` keeps it): a model that takes
    neither by name would swallow the other one in `**kwargs` and run without the cache."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise ValueError(
        f"{type(model).__name__}.forward takes no `cache` or `past_key_values` "
        "argument: the local engine needs a KV cache"
    )


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class WeightLoadError(RuntimeError):
    """A checkpoint that cannot replace the served weights; the old weights stay."""


@dataclass(frozen=True)
class SamplingSpec:
    """Per-row sampling knobs (SGLang semantics: temperature < 1e-6 is greedy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) added to the logits before anything else."""
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    output_counts: tuple[tuple[int, int], ...] = ()
    """(token id, times generated so far): what the two penalties act on (OpenAI's rule:
    logit -= count * frequency_penalty + (count > 0) * presence_penalty)."""

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias) or (
            bool(self.output_counts) and (self.frequency_penalty != 0 or self.presence_penalty != 0)
        )


def adjust_logits(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """Logit bias and frequency/presence penalties per row (a copy; the input is kept).
    The reported logprob is then taken from the adjusted logits: the distribution the
    token was actually drawn from."""
    if not any(s.adjusts_logits for s in specs):
        return logits
    out = logits.clone()
    for row, spec in enumerate(specs):
        if spec.logit_bias:
            ids, bias = zip(*spec.logit_bias, strict=True)
            out[row, list(ids)] += torch.tensor(bias, dtype=out.dtype, device=out.device)
        if spec.output_counts and (spec.frequency_penalty or spec.presence_penalty):
            ids, counts = zip(*spec.output_counts, strict=True)
            c = torch.tensor(counts, dtype=out.dtype, device=out.device)
            out[row, list(ids)] -= c * spec.frequency_penalty + spec.presence_penalty
    return out


@dataclass(frozen=True)
class SampleResult:
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]]
    """Per row, the `top_n[row]` best (logprob, token id); empty lists when not asked."""


@dataclass(frozen=True)
class Prefill:
    """KV and last-position logits of freshly prefilled rows, not yet in the batch."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor
    next_pos: torch.Tensor
    logits: torch.Tensor


class _BufferLayer(DynamicLayer):
    """One layer's batch KV in a preallocated [rows, heads, capacity, dim] buffer. `update`
    writes new columns in place and returns views of the filled part."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.keys_buf, self.values_buf, self.length = keys, values, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self.keys_buf[:, :, : self.length]
        self.values = self.values_buf[:, :, : self.length]

    def update(  # noqa: ANN201 - signature of the transformers base class
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ):
        end = self.length + key_states.shape[-2]
        if end > self.keys_buf.shape[2]:
            self.keys_buf = _regrow(self.keys_buf, self.length, end)
            self.values_buf = _regrow(self.values_buf, self.length, end)
        self.keys_buf[:, :, self.length : end] = key_states
        self.values_buf[:, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


def _capacity(n: int) -> int:
    return (n // _CAPACITY_STEP + 2) * _CAPACITY_STEP


def _regrow(buf: torch.Tensor, filled: int, need: int) -> torch.Tensor:
    # Doubling keeps the amortised copy cost per decoded token O(1).
    new = buf.new_zeros(*buf.shape[:2], max(2 * buf.shape[2], _capacity(need)), buf.shape[3])
    new[:, :, :filled] = buf[:, :, :filled]
    return new


class ModelRunner:
    """Loads the model and runs prefill/decode for the scheduler's running batch.

    Invariant: row i of the batch KV belongs to the scheduler's running[i]; it holds every
    token of that sequence except the last sampled one, which is the next decode input.
    """

    def __init__(self, model_dir: Path | str, *, device: str = "auto", dtype: str = "auto") -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model_dir = Path(model_dir)
        self.config = AutoConfig.from_pretrained(self.model_dir)
        layer_types = set(
            getattr(self.config.get_text_config(), "layer_types", None) or ["full_attention"]
        )
        if layer_types != {"full_attention"}:
            raise ValueError(
                f"the local engine serves full-attention models only, got {sorted(layer_types)}"
            )
        self.model = self._load_model()
        self.model.eval()
        self._cache_kw = cache_keyword(self.model)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.eos_token_ids = eos_token_ids(self.model_dir, self.config)
        self._bool_mask = self.model.config._attn_implementation == "sdpa"
        self.forward_calls = 0
        self.prefill_forward_calls = 0
        self._adapter: AdapterSlot | None = None  # LoRA layers, once an adapter arrives
        self._layers: list[_BufferLayer] = []
        self._cache: Cache | None = None
        self._valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self._next_pos = torch.zeros(0, dtype=torch.long, device=self.device)
        logger.info("loaded %s on %s (%s)", self.model_dir, self.device, self.dtype)

    def _load_model(self) -> torch.nn.Module:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=self.dtype, attn_implementation="sdpa"
            )
        except ValueError:  # the architecture has no SDPA path; masks become additive floats
            model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=self.dtype, attn_implementation="eager"
            )
        return model.to(self.device)

    @property
    def batch_size(self) -> int:
        return int(self._valid.shape[0])

    @property
    def kv_columns(self) -> int:
        return int(self._valid.shape[1])

    # ---- forward passes ----------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, seqs: list[list[int]], adapters: list[str | None] | None = None) -> Prefill:
        """One forward over `seqs` (left-padded to the longest); logits at each last token.
        `adapters`: each row's LoRA adapter by name (None: the default one).

        Rows that repeat an earlier row (same tokens, same adapter) are computed once and
        copied: a GRPO group's samples arrive together with one prompt, so a group of 4
        costs one prompt's prefill instead of 4. Each copy samples on its own."""
        names = adapters or [None] * len(seqs)
        distinct: dict[tuple[tuple[int, ...], str | None], int] = {}
        slots = [
            distinct.setdefault((tuple(s), a), len(distinct))
            for s, a in zip(seqs, names, strict=True)
        ]
        if len(distinct) == len(seqs):
            return self._prefill_forward(seqs, adapters)
        pre = self._prefill_forward(
            [list(ids) for ids, _ in distinct],
            None if adapters is None else [a for _, a in distinct],
        )
        index = torch.tensor(slots, device=self.device)
        return Prefill(
            keys=[k.index_select(0, index) for k in pre.keys],
            values=[v.index_select(0, index) for v in pre.values],
            valid=pre.valid.index_select(0, index),
            next_pos=pre.next_pos.index_select(0, index),
            logits=pre.logits.index_select(0, index),
        )

    def _prefill_forward(
        self, seqs: list[list[int]], adapters: list[str | None] | None = None
    ) -> Prefill:
        self._select(adapters)
        lens = [len(s) for s in seqs]
        width = max(lens)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        ids = ids.to(self.device)
        cols = torch.arange(width, device=self.device)
        lens_t = torch.tensor(lens, device=self.device)
        valid = cols[None, :] >= (width - lens_t)[:, None]
        mask = pos = None
        if min(lens) != width:
            pos = (valid.long().cumsum(1) - 1).clamp(min=0)
            causal = cols[None, :] <= cols[:, None]
            # Pad queries may attend to themselves: a fully masked row would turn into NaN
            # and leak into the next layer's KV; their outputs are never read.
            allowed = (valid[:, None, :] & causal[None]) | torch.eye(
                width, dtype=torch.bool, device=self.device
            )
            mask = self._mask(allowed[:, None])
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        self.forward_calls += 1
        self.prefill_forward_calls += 1
        return Prefill(
            keys=[layer.keys for layer in cache.layers],
            values=[layer.values for layer in cache.layers],
            valid=valid,
            next_pos=lens_t,
            logits=out.logits[:, -1].float(),
        )

    @torch.inference_mode()
    def decode(self, tokens: list[int], adapters: list[str | None] | None = None) -> torch.Tensor:
        """One forward step of the whole batch; `tokens[i]` is row i's last sampled token
        and `adapters[i]` its LoRA adapter's name (None: the default one)."""
        if len(tokens) != self.batch_size or self._cache is None:
            raise ValueError(f"decode got {len(tokens)} tokens for a batch of {self.batch_size}")
        self._select(adapters)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        ones = torch.ones(self.batch_size, 1, dtype=torch.bool, device=self.device)
        valid = torch.cat([self._valid, ones], dim=1)
        out = self.model(
            input_ids=ids,
            attention_mask=self._mask(valid[:, None, None, :]),
            position_ids=self._next_pos[:, None],
            use_cache=True,
            **{self._cache_kw: self._cache},
        )
        self.forward_calls += 1
        self._valid = valid
        self._next_pos = self._next_pos + 1
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def score(self, ids: list[int], start: int, adapter: str | None = None) -> list[float]:
        """Teacher-forced logprobs of `ids[start:]`, each given everything before it
        (temperature 1): prompt logprobs, for the swap canary. A forward of its own (no
        batch KV is read or written), so it may run between any two steps, paused too."""
        self._select([adapter])
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=x, use_cache=False).logits[0, start - 1 : -1].float()
        self.forward_calls += 1
        logp = logits.log_softmax(-1).gather(-1, x[0, start:, None]).squeeze(-1)
        return [float(v) for v in logp.tolist()]

    def _select(self, adapters: list[str | None] | None) -> None:
        if self._adapter is not None:
            self._adapter.select(adapters)

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        if self._bool_mask:
            return allowed
        zeros = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return zeros.masked_fill(~allowed, torch.finfo(self.dtype).min)

    # ---- batch membership ----------------------------------------------------------------

    @torch.inference_mode()
    def join(self, pre: Prefill, rows: list[int]) -> None:
        """Append rows `rows` of a prefill to the end of the batch (one KV copy)."""
        if not rows:
            return
        idx = torch.tensor(rows, device=self.device)
        new_valid = pre.valid[idx]
        start = int(new_valid.any(0).long().argmax())
        new_valid = new_valid[:, start:]
        old_b, old_l = self._valid.shape
        new_b, new_l = new_valid.shape
        width = max(old_l, new_l)
        valid = torch.zeros(old_b + new_b, width, dtype=torch.bool, device=self.device)
        valid[:old_b, width - old_l :] = self._valid
        valid[old_b:, width - new_l :] = new_valid
        layers = []
        for i, (k_new, v_new) in enumerate(zip(pre.keys, pre.values, strict=True)):
            bufs = []
            for new, old in ((k_new, "keys"), (v_new, "values")):
                new = new[idx, :, start:]
                buf = new.new_zeros(old_b + new_b, new.shape[1], _capacity(width), new.shape[3])
                if old_b:
                    buf[:old_b, :, width - old_l : width] = getattr(self._layers[i], old)
                buf[old_b:, :, width - new_l : width] = new
                bufs.append(buf)
            layers.append(_BufferLayer(bufs[0], bufs[1], width))
        self._set(layers, valid, torch.cat([self._next_pos, pre.next_pos[idx]]))

    @torch.inference_mode()
    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order); trims columns no remaining row uses."""
        if rows == list(range(self.batch_size)):
            return
        if not rows:
            self.reset_batch()
            return
        idx = torch.tensor(rows, device=self.device)
        valid = self._valid[idx]
        start = int(valid.any(0).long().argmax())
        valid = valid[:, start:]
        layers = []
        for layer in self._layers:
            bufs = []
            for old in (layer.keys, layer.values):
                part = old[idx, :, start:]
                buf = part.new_zeros(*part.shape[:2], _capacity(part.shape[2]), part.shape[3])
                buf[:, :, : part.shape[2]] = part
                bufs.append(buf)
            layers.append(_BufferLayer(bufs[0], bufs[1], valid.shape[1]))
        self._set(layers, valid, self._next_pos[idx])

    def reset_batch(self) -> None:
        """Free the KV of every row (retract, abort, flush)."""
        self._set(
            [],
            torch.zeros(0, 0, dtype=torch.bool, device=self.device),
            torch.zeros(0, dtype=torch.long, device=self.device),
        )

    def _set(self, layers: list[_BufferLayer], valid: torch.Tensor, next_pos: torch.Tensor) -> None:
        self._layers, self._valid, self._next_pos = layers, valid, next_pos
        self._cache = Cache(layers=list(layers)) if layers else None

    # ---- sampling --------------------------------------------------------------------------

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        specs: list[SamplingSpec],
        generators: list[torch.Generator],
        top_n: list[int],
    ) -> SampleResult:
        """Sample one token per row. Reported logprob: log_softmax(logits / T) at the token
        (greedy: T = 1); top-p/top-k/min-p shape the draw but are not renormalised into it.
        Logit bias and penalties come first (`adjust_logits`)."""
        logits = adjust_logits(logits, specs)
        greedy = torch.tensor([s.greedy for s in specs], device=logits.device)
        temps = torch.tensor(
            [1.0 if s.greedy else s.temperature for s in specs], device=logits.device
        )[:, None]
        scaled = logits / temps
        logprobs = torch.log_softmax(scaled, dim=-1)
        probs = _truncate(scaled, specs).softmax(dim=-1)
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
        # Each row draws from its own generator, so a seeded request is reproducible
        # whatever else shares its batch.
        noise = torch.ones_like(probs)
        for row, (spec, gen) in enumerate(zip(specs, generators, strict=True)):
            if not spec.greedy:
                noise[row].exponential_(generator=gen)
        drawn = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        top: list[list[tuple[float, int]]] = [[] for _ in specs]
        if max(top_n, default=0) > 0:
            vals, ids = logprobs.topk(min(max(top_n), logprobs.shape[1]), dim=-1)
            for row, (v, i) in enumerate(zip(vals.tolist(), ids.tolist(), strict=True)):
                top[row] = list(zip(v[: top_n[row]], i[: top_n[row]], strict=True))
        return SampleResult(tokens=tokens.tolist(), logprobs=chosen.tolist(), top_logprobs=top)

    # ---- weights ---------------------------------------------------------------------------

    @torch.inference_mode()
    def load_weights(self, model_dir: Path | str, adapter: str | None = None) -> None:
        """Copy a same-architecture safetensors checkpoint into the live model, or serve a
        LoRA adapter directory (`engine/lora.py`), under the name `adapter` when given (a
        policy's; None: the default adapter). Every key and shape is checked before the
        first copy, so a failure leaves the old weights intact."""
        path = Path(model_dir)
        if is_adapter_dir(path):  # a LoRA policy: an adapter over the served base
            # imported here: peft costs ~1.3 s of start-up, paid only by LoRA runs
            from engine.lora import DEFAULT_ADAPTER, AdapterError, AdapterSlot

            if self._adapter is None:
                self._adapter = AdapterSlot()
            try:
                self._adapter.load(self.model, path, adapter or DEFAULT_ADAPTER)
            except AdapterError as exc:
                raise WeightLoadError(str(exc)) from exc
            if adapter is None:
                self.model_dir = path
            return
        if adapter is not None:
            raise WeightLoadError(
                f"{path} is not a LoRA adapter; adapter {adapter!r} takes adapter directories only"
            )
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            raise WeightLoadError(f"no *.safetensors files in {path}")
        try:
            config = AutoConfig.from_pretrained(path)
            state: dict[str, torch.Tensor] = {}
            for file in files:
                state.update(load_file(file, device=str(self.device)))
        except (OSError, ValueError, SafetensorError) as exc:
            raise WeightLoadError(f"cannot read {path}: {exc}") from exc
        if config.architectures != self.config.architectures:
            raise WeightLoadError(
                f"architecture {config.architectures} differs from the served {self.config.architectures}"
            )
        self._check_state(state)
        self.model.load_state_dict(state, strict=False)
        self.model_dir = path

    @torch.inference_mode()
    def load_named_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy received tensors (a bucket of a distributed update: any subset of the
        state dict) into the live model, cast to its dtype and device, exactly as a disk
        load casts. Every name and shape is checked before the first copy."""
        current = self.model.state_dict()
        unknown = sorted(set(tensors) - set(current))
        if unknown:
            raise WeightLoadError(f"unknown parameter names {unknown[:5]}")
        copy_checked(current, tensors, WeightLoadError)

    def _check_state(self, state: dict[str, torch.Tensor]) -> None:
        current = self.model.state_dict()
        tied = set(getattr(self.model, "_tied_weights_keys", None) or ())
        tied = tied if getattr(self.model.config, "tie_word_embeddings", False) else set()
        missing = set(current) - set(state) - tied
        unexpected = set(state) - set(current)
        if missing or unexpected:
            raise WeightLoadError(
                f"checkpoint keys differ: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        for name, tensor in state.items():
            if tensor.shape != current[name].shape:
                raise WeightLoadError(
                    f"{name}: shape {tuple(tensor.shape)} != served {tuple(current[name].shape)}"
                )


def _truncate(scaled: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p / min-p support to -inf (SGLang order:
    all three judged on the untruncated distribution). Skips the sort when no row needs it."""
    vocab = scaled.shape[1]
    need_k = any(0 < s.top_k < vocab for s in specs)
    need_p = any(s.top_p < 1.0 for s in specs)
    need_min_p = any(s.min_p > 0.0 for s in specs)
    if not (need_k or need_p or need_min_p):
        return scaled
    dev = scaled.device
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_k:
        k = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in specs], device=dev)
        remove |= torch.arange(vocab, device=dev)[None, :] >= k[:, None]
    if need_p:
        p = torch.tensor([s.top_p for s in specs], device=dev, dtype=sorted_probs.dtype)
        remove |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > p[:, None]
    if need_min_p:
        m = torch.tensor([s.min_p for s in specs], device=dev, dtype=sorted_probs.dtype)
        remove |= sorted_probs < sorted_probs[:, :1] * m[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)


def eos_token_ids(model_dir: Path, config: object) -> frozenset[int]:
    """EOS ids: the union of generation_config.json's and config.json's `eos_token_id`."""
    ids: set[int] = set()
    sources: list[object] = [getattr(config, "eos_token_id", None)]
    if (model_dir / "generation_config.json").exists():
        sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
