"""Scheduler of the local engine: the request queue, continuous batching, pause/continue,
abort and weight swaps, all run by ONE background thread that owns the ModelRunner.

Other threads (the HTTP event loop) talk to it only through `Scheduler` methods, which
put commands on a thread-safe queue and return `concurrent.futures.Future`s; results
travel back through each `Request`'s lock-protected state and its `notify` callback.
Must not import FastAPI or the server module.

Loop, one iteration: run queued commands (a policy's adapter swap is applied right there,
touching only that policy's rows: `_swap_adapter`); apply a pending weight update once
nothing it must wait for is left; admit waiting requests (FIFO) up to `max_running`; prefill them
(grouped, left-padded) and sample their first token; one decode forward for the whole
running batch; retire finished rows. Nothing steps while paused.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from areal_service.cpu_share import CpuShare
from areal_service.sglang_protocol import (
    FinishReason,
    PauseMode,
    SamplingParams,
    UpdateWeightsResponse,
)
from areal_service.types import DEFAULT_POLICY
from engine.runner import (
    PREFILL_TOKEN_BUDGET,
    ModelRunner,
    SamplingSpec,
    WeightLoadError,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestView:
    """A consistent snapshot of a request's progress, taken by the HTTP side."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[float, int], ...], ...]
    finish: FinishReason | None
    weight_version: str
    finished_at: float | None


@dataclass(eq=False)
class Request:
    """One generation. The scheduler thread is the only writer of the mutable fields;
    readers use `snapshot()`. `notify` must be callable from any thread."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    """EOS ids plus `stop_token_ids`; empty when `ignore_eos`."""
    notify: Callable[[], None]
    top_logprobs_num: int = 0
    stream: bool = True
    """Notify on every token (streams); otherwise only when finished."""
    created_at: float = field(default_factory=time.perf_counter)
    weight_version: str = "default"
    """Version of the weights that produced the latest token (submit-time one before)."""
    lora: str | None = None
    """The LoRA adapter (policy) this request runs under; None: the default one."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[float, int], ...]] = field(default_factory=list)
    finish: FinishReason | None = None
    finished_at: float | None = None
    generator: torch.Generator | None = None
    num_retractions: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _spec: SamplingSpec | None = field(default=None, repr=False)
    _counts: Counter[int] = field(default_factory=Counter, repr=False)
    _counted: int = 0

    def snapshot(self) -> RequestView:
        with self._lock:
            return RequestView(
                output_ids=tuple(self.output_ids),
                logprobs=tuple(self.logprobs),
                top_logprobs=tuple(self.top_logprobs),
                finish=self.finish,
                weight_version=self.weight_version,
                finished_at=self.finished_at,
            )

    def spec(self) -> SamplingSpec:
        """This step's sampling knobs: built once; penalized requests add the counts of
        their output so far, kept incrementally (O(new tokens) a step, not O(output))."""
        p = self.params
        if self._spec is None:
            self._spec = SamplingSpec(
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                min_p=p.min_p,
                logit_bias=tuple((int(t), b) for t, b in (p.logit_bias or {}).items()),
                frequency_penalty=p.frequency_penalty,
                presence_penalty=p.presence_penalty,
            )
        if p.frequency_penalty == 0 and p.presence_penalty == 0:
            return self._spec
        self._counts.update(self.output_ids[self._counted :])
        self._counted = len(self.output_ids)
        return dataclasses.replace(self._spec, output_counts=tuple(self._counts.items()))


Receive = Callable[[torch.device, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""A distributed update's bucket receiver: (device, live state dict) -> tensors still to
load (see `engine/weight_groups.py`)."""


# ---- commands (HTTP thread -> scheduler thread) -------------------------------------------


@dataclass(frozen=True)
class _Command:
    future: Future = field(default_factory=Future, compare=False)


@dataclass(frozen=True)
class _Submit(_Command):
    request: Request | None = None


@dataclass(frozen=True)
class _Abort(_Command):
    rid: str = ""
    exact: bool = False
    abort_all: bool = False


@dataclass(frozen=True)
class _Pause(_Command):
    mode: PauseMode = "abort"


@dataclass(frozen=True)
class _Continue(_Command):
    pass


@dataclass(frozen=True)
class _UpdateWeights(_Command):
    model_path: str = ""
    weight_version: str | None = None
    lora_name: str | None = None
    """A named adapter (a policy's): only its rows' version changes."""
    flush_cache: bool = True
    abort_all_requests: bool = False
    receive: Receive | None = None
    """Distributed update: receives one bucket (blocking on the trainer's broadcast) in
    place of reading `model_path`; runs on the scheduler thread, between batches."""


@dataclass(frozen=True)
class _FlushCache(_Command):
    pass


@dataclass(frozen=True)
class _Stop(_Command):
    pass


@dataclass(frozen=True)
class _Score(_Command):
    ids: tuple[int, ...] = ()
    start: int = 1
    lora: str | None = None


class Scheduler:
    """Owns the engine thread. Construct, `start()`, then submit; `stop()` aborts what is
    left and joins the thread. The model loads inside the thread (`ready` is set after)."""

    def __init__(
        self,
        model_dir: str,
        *,
        device: str,
        dtype: str,
        max_running: int,
        weight_version: str,
        cpu_share_file: Path | None = None,
    ) -> None:
        self.model_path = model_dir
        self._cpu_share_file = cpu_share_file
        """Where this engine and the trainer share the cores (`ServiceConfig.cpu_share`)."""
        self.weight_version = weight_version
        self.adapter_versions: dict[str, str] = {}
        """The version of each named adapter (policy) loaded with `lora_name`."""
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.runner: ModelRunner | None = None
        self.paused: PauseMode | None = None
        self._tokenizer = None  # the thread's own copy, for stop strings (loaded with the model)
        self.decode_steps = 0
        self.generated_tokens = 0
        self.last_gen_throughput = 0.0
        self._device, self._dtype, self._max_running = device, dtype, max_running
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._admitted: list[Request] = []
        """Taken from the queue by the current step (for `_step`'s error barrier)."""
        # Pending weight updates, each with the requests it waits for (its "writer lock").
        self._updates: deque[tuple[_UpdateWeights, set[Request]]] = deque()
        self._stopping = False
        # Guards "accepting + put" against the thread's final drain: no command is left behind.
        self._send_lock = threading.Lock()
        self._accepting = True
        self._current: _Command | None = None
        self._handlers: dict[type, Callable] = {
            _Submit: self._on_submit,
            _Abort: self._on_abort,
            _Pause: self._on_pause,
            _Continue: self._on_continue,
            _UpdateWeights: self._on_update,
            _FlushCache: self._on_flush,
            _Stop: self._on_stop,
            _Score: self._on_score,
        }
        self._thread = threading.Thread(target=self._main, name="engine-scheduler", daemon=True)

    # ---- API for other threads -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every request, end the thread and wait for it."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: Request) -> Future:
        return self._send(_Submit(request=request))

    def abort(self, rid: str = "", *, exact: bool = False, abort_all: bool = False) -> Future:
        return self._send(_Abort(rid=rid, exact=exact, abort_all=abort_all))

    def pause(self, mode: PauseMode) -> Future:
        return self._send(_Pause(mode=mode))

    def resume(self) -> Future:
        return self._send(_Continue())

    def update_weights(
        self,
        model_path: str,
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all: bool,
        lora_name: str | None = None,
    ) -> Future:
        """Resolves to an UpdateWeightsResponse. Unpaused, it first waits for every request
        already submitted to finish (SGLang's writer lock); later ones queue behind it.
        `lora_name`: load the adapter at `model_path` under that name (a policy's; "default":
        the default policy's adapter and version), at once and for its rows only
        (`_swap_adapter`)."""
        return self._send(
            _UpdateWeights(
                model_path=model_path,
                weight_version=weight_version,
                flush_cache=flush_cache,
                abort_all_requests=abort_all,
                lora_name=lora_name,
            )
        )

    def update_weights_from_distributed(
        self, receive: Receive, *, weight_version: str | None, flush_cache: bool, abort_all: bool
    ) -> Future:
        """Like `update_weights`, but the tensors come from `receive(device, params)`
        (one bucket of the trainer's broadcast; it may write `params`, the live state
        dict, in place and returns the rest), called on this thread when the update is
        due: paused, at once; unpaused, after the requests present now finished."""
        return self._send(
            _UpdateWeights(
                model_path=self.model_path,
                weight_version=weight_version,
                flush_cache=flush_cache,
                abort_all_requests=abort_all,
                receive=receive,
            )
        )

    def score(self, ids: list[int], start: int, lora: str | None = None) -> Future:
        """Resolves to the prompt logprobs of `ids[start:]` (`ModelRunner.score`) and the
        version that scored them: run between two steps at once, also while paused."""
        return self._send(_Score(ids=tuple(ids), start=start, lora=lora))

    def flush_cache(self) -> Future:
        """Resolves to True when idle (KV freed), False when requests are in flight."""
        return self._send(_FlushCache())

    def counts(self) -> tuple[int, int, bool]:
        """(running, waiting, update_pending); racy reads, for info endpoints only."""
        return len(self._running), len(self._waiting), bool(self._updates)

    def _send(self, cmd: _Command) -> Future:
        with self._send_lock:
            if self._accepting and self._thread.is_alive():
                self._commands.put(cmd)
                return cmd.future
        cmd.future.set_exception(RuntimeError("the engine scheduler is not running"))
        return cmd.future

    # ---- the thread --------------------------------------------------------------------------

    def _main(self) -> None:
        # Crash barrier of the thread: record and log the error, then fail every waiter;
        # /health reports 503 from then on.
        cpu: CpuShare | None = None
        try:
            self.runner = ModelRunner(self.model_path, device=self._device, dtype=self._dtype)
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            # Threads are set per thread under OpenMP: the share is followed here, in the
            # thread that computes, with the thread count the server set as its floor.
            cpu = (
                CpuShare(self._cpu_share_file, "engine", share=torch.get_num_threads())
                if self._cpu_share_file is not None
                else None
            )
            self.ready.set()
            while not self._stopping:
                busy = self._has_work()
                if cpu is not None and not busy:
                    cpu.follow(False)  # before blocking: the trainer may take every core
                self._drain_commands(block=not busy)
                if not self._stopping:
                    if cpu is not None:
                        cpu.follow(self._has_work())
                    self._apply_ready_updates()
                    self._step()
        except BaseException as exc:
            self.error = exc
            logger.exception("engine scheduler crashed")
        finally:
            if cpu is not None:
                cpu.close()
            with self._send_lock:
                self._accepting = False
            self._abort_everything(FinishReason("abort", message="Engine stopped", status_code=503))
            self._fail_queued_commands()

    def _has_work(self) -> bool:
        if self._updates and (self.paused or not self._update_blocked()):
            return True
        return self.paused is None and bool(self._running or self._admissible())

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            self._current = cmd
            try:
                result = self._handlers[type(cmd)](cmd)
            except Exception as exc:  # this command fails; the engine keeps serving
                logger.exception("engine command %s failed", type(cmd).__name__)
                cmd.future.set_exception(exc)
                continue
            finally:
                self._current = None
            if result is not _DEFERRED:
                cmd.future.set_result(result)

    def _fail_queued_commands(self) -> None:
        if self._current is not None and not self._current.future.done():
            self._current.future.set_exception(RuntimeError("the engine scheduler crashed"))
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Submit) and cmd.request is not None:
                self._finish(
                    cmd.request, FinishReason("abort", message="Engine stopped", status_code=503)
                )
            cmd.future.set_exception(RuntimeError("the engine scheduler stopped"))
        for upd, _ in self._updates:
            upd.future.set_exception(RuntimeError("the engine scheduler stopped"))
        self._updates.clear()

    # ---- command handlers (scheduler thread) ---------------------------------------------------

    def _on_submit(self, cmd: _Submit) -> None:
        req = cmd.request
        assert req is not None
        req.weight_version = self._version_of(req)
        seed = req.params.sampling_seed
        req.generator = torch.Generator(device=self.runner.device).manual_seed(
            seed if seed is not None else random.getrandbits(63)
        )
        self._waiting.append(req)

    def _on_abort(self, cmd: _Abort) -> None:
        # SGLang: an rid that is not exactly in flight is ignored; one that is aborts every
        # request whose rid starts with it.
        live = [*self._running, *self._waiting]
        if not cmd.abort_all and not any(r.rid == cmd.rid for r in live):
            return

        def hit(r: Request) -> bool:
            return cmd.abort_all or (r.rid == cmd.rid if cmd.exact else r.rid.startswith(cmd.rid))

        self._abort_where(hit)

    def _on_pause(self, cmd: _Pause) -> None:
        if cmd.mode == "abort":
            self._abort_everything(FinishReason("abort", message="Aborted"))
        elif cmd.mode == "retract":
            self._retract_running()
        self.paused = cmd.mode
        logger.info("generation paused (%s)", cmd.mode)

    def _on_continue(self, cmd: _Continue) -> None:
        self.paused = None
        logger.info("generation continued")

    def _on_update(self, cmd: _UpdateWeights) -> object:
        if cmd.abort_all_requests:
            self._abort_everything(FinishReason("abort", message="Aborted"))
        if cmd.lora_name is not None and cmd.receive is None:
            return self._swap_adapter(cmd)  # at once: the other policies' rows go on
        self._updates.append((cmd, set(self._running) | set(self._waiting)))
        return _DEFERRED

    def _on_flush(self, cmd: _FlushCache) -> bool:
        if self._running or self._waiting:
            return False
        self.runner.reset_batch()
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def _on_score(self, cmd: _Score) -> tuple[list[float], str]:
        version = (
            self.weight_version if cmd.lora is None else self.adapter_versions.get(cmd.lora, "0")
        )
        return self.runner.score(list(cmd.ids), cmd.start, cmd.lora), version

    def _on_stop(self, cmd: _Stop) -> None:
        self._stopping = True

    # ---- weight updates -----------------------------------------------------------------------

    def _update_blocked(self) -> bool:
        """Unpaused, the first pending update waits for the requests present when it arrived."""
        barrier = self._updates[0][1]
        barrier.difference_update([r for r in barrier if r.finish is not None])
        return bool(barrier)

    def _apply_ready_updates(self) -> None:
        while self._updates and (self.paused or not self._update_blocked()):
            cmd, _ = self._updates.popleft()
            cmd.future.set_result(self._load(cmd))

    def _swap_adapter(self, cmd: _UpdateWeights) -> UpdateWeightsResponse:
        """One policy's adapter, loaded between two steps without pausing or waiting for
        anything: only the rows of that policy are touched. Its rows that already hold
        tokens (running, or retracted and waiting) end with a plain abort, which the
        gateway's interruptible generation resubmits (prompt + tokens so far): every
        round of a request then runs under one adapter version, and the resubmitted
        prefill recomputes the KV under the new one. So each token's logprob is exactly
        what its labelled version computes over the whole prefix (what the trainer
        recomputes), also for non-streamed requests, whose reply carries one version.
        Letting those rows continue would mix KV of the old adapter with tokens of the
        new. Rows not yet started simply start under the new adapter. The other
        policies' rows keep their KV, their batch slots and their versions: their B·A
        is another adapter's, which this swap does not write. A failed load touches no
        row (the served adapter stays)."""
        name = cmd.lora_name
        assert name is not None
        result = self._load(cmd)
        if not result.success:
            return result

        def mine(req: Request) -> bool:  # the default policy's rows name no adapter
            return (req.lora or DEFAULT_POLICY) == name

        swapped = FinishReason("abort", message=f"Aborted: adapter {name!r} swapped")
        for req in [r for r in self._waiting if mine(r) and r.output_ids]:
            self._waiting.remove(req)
            self._finish(req, swapped)
        keep = [i for i, r in enumerate(self._running) if not mine(r)]
        if len(keep) != len(self._running):
            for req in self._running:
                if mine(req):
                    self._finish(req, swapped)
            self.runner.keep(keep)
            self._running = [self._running[i] for i in keep]
        return result

    def _load(self, cmd: _UpdateWeights) -> UpdateWeightsResponse:
        started = time.perf_counter()
        source = "the trainer's broadcast" if cmd.receive else cmd.model_path
        try:
            if cmd.receive is not None:
                self.runner.load_named_tensors(
                    cmd.receive(self.runner.device, self.runner.model.state_dict())
                )
            else:
                # `lora_name` "default": the default policy's adapter, swapped alone.
                named = None if cmd.lora_name == DEFAULT_POLICY else cmd.lora_name
                self.runner.load_weights(cmd.model_path, adapter=named)
        except (WeightLoadError, KeyError, ValueError, RuntimeError) as exc:
            # RuntimeError: a broadcast that failed or timed out (the trainer went away).
            logger.warning("weight update from %s failed: %s", source, exc)
            return UpdateWeightsResponse(success=False, message=f"Failed to update weights: {exc}")
        if cmd.flush_cache and cmd.lora_name is None:
            # Only an in_place pause leaves rows running here. SGLang's flush would crash;
            # we retract them instead, so their KV is recomputed with the new weights.
            self._retract_running()
        message = "Succeeded to update model weights."
        if cmd.lora_name not in (None, DEFAULT_POLICY):  # the rest keep their versions
            if cmd.weight_version is not None:
                self.adapter_versions[cmd.lora_name] = cmd.weight_version
            logger.info(
                "loaded adapter %r from %s in %.2fs (version %s)",
                cmd.lora_name,
                source,
                time.perf_counter() - started,
                cmd.weight_version,
            )
            return UpdateWeightsResponse(success=True, message=message)
        self.model_path = cmd.model_path
        if cmd.weight_version is not None:
            self.weight_version = cmd.weight_version
            message += f" Weight version updated to {cmd.weight_version}."
        logger.info(
            "loaded weights from %s in %.2fs (version %s)",
            source,
            time.perf_counter() - started,
            self.weight_version,
        )
        return UpdateWeightsResponse(success=True, message=message)

    # ---- batching ----------------------------------------------------------------------------------

    def _version_of(self, req: Request) -> str:
        """The version a token of `req` is labelled with: its named adapter's (a policy
        whose adapter never arrived runs at its version 0, the base model), else the
        engine's."""
        if req.lora is None:
            return self.weight_version
        return self.adapter_versions.get(req.lora, "0")

    def _admissible(self) -> bool:
        if not self._waiting or len(self._running) >= self._max_running:
            return False
        # Behind a pending update, only the requests it waits for may start.
        return not self._updates or self._waiting[0] in self._updates[0][1]

    def _step(self) -> None:
        """One batch iteration. An unexpected error in it (a bug, a kernel failure) ends
        the requests of that batch with a 500 abort, frees their KV, and the engine goes
        on serving the queue: one bad batch never takes every later request down."""
        self._admitted = []
        try:
            self._iterate()
        except Exception as exc:
            batch = [*self._running, *(r for r in self._admitted if r.finish is None)]
            logger.exception("engine step failed; aborting its %d requests", len(batch))
            abort = FinishReason(
                "abort", message=f"engine error: {type(exc).__name__}: {exc}", status_code=500
            )
            for req in batch:
                self._finish(req, abort)
            self._running = []
            self.runner.reset_batch()

    def _iterate(self) -> None:
        if self.paused is not None:
            return
        admitted = self._admitted
        while self._admissible() and len(self._running) + len(admitted) < self._max_running:
            admitted.append(self._waiting.popleft())
        started = time.perf_counter()
        produced = self._prefill(admitted) if admitted else 0
        if self._running:
            produced += self._decode()
        if produced:
            self.generated_tokens += produced
            self.last_gen_throughput = produced / max(time.perf_counter() - started, 1e-9)

    def _prefill(self, admitted: list[Request]) -> int:
        todo = [r for r in admitted if not self._finished_before_start(r)]
        todo.sort(key=lambda r: len(r.prompt_ids) + len(r.output_ids))
        produced = 0
        while todo:
            group = [todo.pop(0)]
            while todo and (len(group) + 1) * _seq_len(todo[0]) <= PREFILL_TOKEN_BUDGET:
                group.append(todo.pop(0))
            # A retracted request re-prefills prompt + output: its KV is recomputed with the
            # current weights, and the next token comes from them.
            pre = self.runner.prefill(
                [r.prompt_ids + r.output_ids for r in group], [r.lora for r in group]
            )
            keep = self._sample_and_publish(group, pre.logits)
            self.runner.join(pre, keep)
            self._running.extend(group[i] for i in keep)
            produced += len(group)
        return produced

    def _finished_before_start(self, req: Request) -> bool:
        if len(req.output_ids) >= req.max_new_tokens:
            self._finish(req, FinishReason("length", length=req.max_new_tokens))
            return True
        return False

    def _decode(self) -> int:
        logits = self.runner.decode(
            [r.output_ids[-1] for r in self._running], [r.lora for r in self._running]
        )
        self.decode_steps += 1
        keep = self._sample_and_publish(self._running, logits)
        if len(keep) != len(self._running):
            self.runner.keep(keep)
            self._running = [self._running[i] for i in keep]
        return len(logits)

    def _sample_and_publish(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        """Sample a token per row, append it, finish what is done; returns rows still live."""
        res = self.runner.sample(
            logits,
            [r.spec() for r in reqs],
            [r.generator for r in reqs],
            [r.top_logprobs_num for r in reqs],
        )
        keep = []
        for row, req in enumerate(reqs):
            with req._lock:
                req.output_ids.append(res.tokens[row])
                req.logprobs.append(res.logprobs[row])
                req.top_logprobs.append(tuple(res.top_logprobs[row]))
                req.weight_version = self._version_of(req)
            finish = self._check_finish(req)
            if finish is None:
                keep.append(row)
                if req.stream:
                    req.notify()
            else:
                self._finish(req, finish)
        return keep

    def _check_finish(self, req: Request) -> FinishReason | None:
        """SGLang's order: length, then stop/EOS token, then stop strings."""
        last = req.output_ids[-1]
        if len(req.output_ids) >= req.max_new_tokens:
            return FinishReason("length", length=req.max_new_tokens)
        if last in req.stop_token_ids:
            return FinishReason("stop", matched=last)
        stops = req.params.stop_strings()
        if stops:
            # A stop string of c chars spans at most 4c byte-level tokens.
            window = 4 * max(len(s) for s in stops) + 2
            tail = self._tokenizer.decode(req.output_ids[-window:])
            for s in stops:
                if s in tail:
                    return FinishReason("stop", matched=s)
        return None

    # ---- finishing, aborting, retracting ---------------------------------------------------------

    def _finish(self, req: Request, reason: FinishReason) -> None:
        with req._lock:
            if req.finish is not None:
                return
            req.finish = reason
            req.finished_at = time.perf_counter()
        req.notify()

    def _abort_where(self, hit: Callable[[Request], bool]) -> None:
        for req in [r for r in self._waiting if hit(r)]:
            self._waiting.remove(req)
            self._finish(req, FinishReason("abort", message="Abort in waiting queue"))
        keep = [i for i, r in enumerate(self._running) if not hit(r)]
        if len(keep) != len(self._running):
            for req in self._running:
                if hit(req):
                    self._finish(req, FinishReason("abort", message="Aborted"))
            self.runner.keep(keep)
            self._running = [self._running[i] for i in keep]

    def _abort_everything(self, reason: FinishReason) -> None:
        for req in [*self._running, *self._waiting]:
            self._finish(req, reason)
        self._running, self._waiting = [], deque()
        if self.runner is not None:
            self.runner.reset_batch()

    def _retract_running(self) -> None:
        """Running rows go back to the front of the queue with their tokens; KV is freed."""
        for req in reversed(self._running):
            req.num_retractions += 1
            self._waiting.appendleft(req)
        self._running = []
        self.runner.reset_batch()


_DEFERRED = object()


def _seq_len(req: Request) -> int:
    return len(req.prompt_ids) + len(req.output_ids)
