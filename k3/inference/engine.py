"""The inference engine (SPEC §7): continuous batching over one hybrid page pool with KDA-aware prefix reuse.

``Engine`` is a thin facade over three parts, as in vLLM v1 and SGLang:
- ``Scheduler`` (scheduler.py): admission, pages, prefix lookups, the step's plan as plain data;
- ``ModelRunner`` (runner.py): device buffers, the forward, CUDA graphs, sampling; the only device-aware part;
- ``OutputProcessor`` (output.py): detokenisation, stop strings, events.
Each ``step()``: plan = scheduler.schedule(); runner.launch(plan); the output processor turns the sampled tokens
into events and says which requests are complete; scheduler.update(plan). Before it, images waiting to be
prefilled go a bounded number of FLOPs further through the vision tower (a prompt's prefill waits at an image until
its features are ready, while the other sequences run). With asynchronous scheduling (on by
default on CUDA, as in vLLM v1) the results read in a step are the PREVIOUS step's: the host plans and launches
step n+1 while the device still runs step n, and a sequence's next decode takes its token from the device. A
sequence that step n finishes has run one step too many (its extra token is dropped, its pages freed). ``submit`` + ``start``
run the same loop on a thread. If a step raises, every open request ends with FinishEvent("error") saying why,
``failed`` holds the reason, and later submissions are refused with it: nothing hangs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from ..model.params import count_parameters
from .api import FinishEvent, GenerationRequest, SamplingParams
from .output import OutputProcessor, RequestHandle
from .pacing import StepPacer
from .pool import HostPool, PageLayout, PagePool
from .prefix import PrefixCache
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerConfig, Sequence

__all__ = ["Engine", "EngineConfig", "EngineFailed", "RequestHandle"]


DECODE_PROMPT_TOKENS = 16  # under CUDA graphs a decode step is ~1 ms, an eager prefill forward ~40-80 ms of host work
MIN_IMAGE_STEP_FLOPS = 4e9  # a tiny text model's chunk costs less than a step's fixed host work: tens of ms on a CPU


@dataclass(frozen=True)
class EngineConfig:
    num_pages: int = 512  # device pages, each page_tokens tokens of MLA latents (KDA states take whole pages)
    page_tokens: int = 1024  # a multiple of hash_block
    hash_block: int = 512  # prefix-hash granularity: a prefix is reusable at any multiple of it
    checkpoint_every: int = 4  # a KDA checkpoint every this many hash blocks (and at each prompt's last full one)
    host_pages: int = 0  # the prefix cache's write-back tier in CPU memory (pages); 0 = off
    prefill_chunk: int = 2048  # most tokens of one sequence's prompt per step
    step_tokens: int = 4096  # most tokens per step: decodes + prefill chunks
    max_batch: int = 64  # most running sequences
    max_context: int | None = None  # default: the model's max_position_embeddings, capped by the pool
    long_prompt: int = 32768  # prompts this long form the long class (per-class admission)
    long_share: float = 0.5  # of the prefill budget and of the pages, while short requests wait
    prefix_cache: bool = True
    dtype: torch.dtype | None = None  # cache dtype; default: the model's
    cuda_graphs: bool | None = None  # default: on for CUDA with a bf16 model
    compile: bool | None = None  # torch.compile the decode forward; default: with CUDA graphs
    fuse_projections: bool = True  # one matmul per layer input (K3ForCausalLM.fuse_projections)
    async_scheduling: bool | None = None  # plan step n+1 while the device runs step n; default: on for CUDA
    # a prompt remainder of at most this many tokens (a short prompt, the tokens after a prefix hit) is fed one token
    # per step through the decode path instead of an eager prefill forward; default: 16 with CUDA graphs, else 0
    decode_prompt_tokens: int | None = None
    # the most vision-tower FLOPs one step spends encoding images (the tower runs in pieces between steps, so a large
    # image does not hold the other sequences back for the whole tower); default: what one prefill chunk of the text
    # model costs (2 x active parameters x prefill_chunk), at least MIN_IMAGE_STEP_FLOPS
    image_step_flops: float | None = None
    # while any sequence decodes, prompt chunks shrink so a step takes about this long (k3.inference.pacing)
    decode_step_target_s: float = 0.25

    def __post_init__(self):
        for name in ("num_pages", "page_tokens", "hash_block", "checkpoint_every", "prefill_chunk", "step_tokens",
                     "max_batch", "long_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_prompt_tokens is not None and self.decode_prompt_tokens < 0:
            raise ValueError(f"EngineConfig.decode_prompt_tokens must be >= 0, got {self.decode_prompt_tokens}")
        if not self.decode_step_target_s > 0:
            raise ValueError(f"EngineConfig.decode_step_target_s must be > 0, got {self.decode_step_target_s}")
        if self.image_step_flops is not None and not self.image_step_flops > 0:
            raise ValueError(f"EngineConfig.image_step_flops must be > 0, got {self.image_step_flops}")
        if self.host_pages < 0:
            raise ValueError(f"EngineConfig.host_pages must be >= 0, got {self.host_pages}")
        if not 0 < self.long_share <= 1:
            raise ValueError(f"EngineConfig.long_share must be in (0, 1], got {self.long_share}")
        if self.step_tokens < self.max_batch:
            raise ValueError(f"EngineConfig.step_tokens ({self.step_tokens}) must be >= max_batch "
                             f"({self.max_batch}): every running sequence decodes one token per step")


class EngineFailed(RuntimeError):
    """The engine's loop died; the message says why. Restart the engine (the server reports it on /health)."""


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(), model_name: str = "k3"):
        from ..data.tokenizer import eos_id

        mc = model.config
        n_tok = tokenizer.get_vocab_size(with_added_tokens=True)
        if n_tok > mc.vocab_size:
            raise ValueError(f"the tokenizer has {n_tok:,} tokens but the model's vocabulary has {mc.vocab_size:,}: "
                             "its ids past the model's would crash generation; use the tokenizer the model was "
                             "trained with")
        self.model, self.tokenizer, self.cfg, self.model_name = model.eval(), tokenizer, config, model_name
        if config.fuse_projections:
            model.fuse_projections()
        self.device = next(model.parameters()).device
        self.layout = PageLayout.from_config(mc, config.page_tokens, config.dtype or next(model.parameters()).dtype)
        self.pool = PagePool(self.layout, config.num_pages, self.device)
        host = HostPool(self.layout.page_bytes, config.host_pages, pin=self.device.type == "cuda")
        self.prefix = (PrefixCache(self.pool, config.hash_block, config.checkpoint_every, host)
                       if config.prefix_cache else None)
        self.max_context = self._context_limit(mc)
        self.runner = ModelRunner(self.model, self.pool, self.max_context, config.max_batch, config.cuda_graphs,
                                  config.compile)
        feed = config.decode_prompt_tokens
        feed = (DECODE_PROMPT_TOKENS if self.runner.use_graphs else 0) if feed is None else feed
        self.scheduler = Scheduler(self.pool, self.prefix, SchedulerConfig(
            config.step_tokens, config.prefill_chunk, config.max_batch, config.long_prompt, config.long_share,
            decode_prompt_tokens=feed), config.hash_block, image_ready=self.runner.images.ready)
        self.pacer = StepPacer(config.decode_step_target_s, config.prefill_chunk)
        self.image_step_flops = config.image_step_flops or max(
            MIN_IMAGE_STEP_FLOPS, 2.0 * count_parameters(mc)["active"] * config.prefill_chunk)
        self.output = OutputProcessor(tokenizer, eos_id(tokenizer), self.max_context)
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self._in_flight = None  # (plan, StepResult) of the launched step whose results are not read yet
        self.seqs: dict[str, Sequence] = {}
        self.failed: str | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        # called on the loop's thread after every step (and after a failure): a server hands the step's events on
        # in one batch (k3.serve.backend)
        self.after_step = None

    def _context_limit(self, mc) -> int:
        """The longest sequence this engine can hold: the model's limit, capped by what one sequence can have of
        the pool (all pages but the scratch page and its own KDA pages)."""
        limit = self.cfg.max_context or mc.max_position_embeddings
        if self.layout.n_mla:
            room = (self.pool.usable - self.layout.kda_pages) * self.layout.page_tokens
            if room < 1:
                raise ValueError(f"num_pages={self.cfg.num_pages} leaves no room for one sequence: its KDA state takes "
                                 f"{self.layout.kda_pages} pages; use more pages")
            limit = min(limit, room)
        elif self.pool.usable < self.layout.kda_pages:
            raise ValueError(f"num_pages={self.cfg.num_pages} cannot hold one sequence's KDA state "
                             f"({self.layout.kda_pages} pages + the scratch page)")
        return limit

    # ---- requests -----------------------------------------------------------------------------------------
    def submit(self, req: GenerationRequest, events=None) -> RequestHandle:
        """Queue ``req``; its TokenEvents and FinishEvent are ``put`` on ``events`` (default: the handle's own queue,
        which iterating the handle reads), from the thread that runs the steps."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        want = req.params.max_tokens or 1
        if n + want > self.max_context:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({want}) exceeds this engine's context limit of "
                             f"{self.max_context} tokens (the model's limit or what the page pool holds for one "
                             "sequence: more --num-pages raises it)")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            bad = next(t for t in req.prompt_ids if not 0 <= t < vocab)
            raise ValueError(f"prompt token id {bad} is outside the model's vocabulary [0, {vocab})")
        if req.images:
            self._check_images(req)
        seed = req.params.seed if req.params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        max_tokens = req.params.max_tokens or self.max_context - n
        with self._lock:
            if self.failed:  # checked under the lock the loop fails under: a request queued now would never finish
                raise EngineFailed(f"the engine failed and serves no more requests: {self.failed}")
            arrival = self.scheduler.next_arrival()
            rid = req.request_id or f"req-{arrival}"
            if rid in self.seqs:
                raise ValueError(f"request id {rid!r} is already in use")
            handle = RequestHandle(self, rid, events)
            seq = Sequence(rid, req, seed, max_tokens, arrival, n >= self.cfg.long_prompt)
            self.seqs[rid] = seq
            self.output.open(seq, handle)
            self.scheduler.add(seq)
        self._wake.set()
        return handle

    def _check_images(self, req: GenerationRequest) -> None:
        """Images need a vision tower, and each its own run of placeholder tokens of the right length, in order."""
        if not hasattr(self.model, "encode_images"):
            raise ValueError("this model has no vision tower: it cannot take images; serve a multimodal checkpoint "
                             "(K3ForConditionalGeneration) or send text only")
        placeholder, merge = self.model.media_placeholder_token_id, self.model.vision_config.merge
        end = 0
        for k, im in enumerate(req.images):
            h, w = im.grid
            if im.length != h * w // merge or im.pixels.shape[0] != h * w:
                raise ValueError(f"image {k}: {im.length} placeholders and {im.pixels.shape[0]} patches do not fit its "
                                 f"grid of {h} x {w} patches ({h * w // merge} placeholders, {h * w} patches)")
            if im.start < end or im.start + im.length > len(req.prompt_ids):
                raise ValueError(f"image {k}: its placeholders [{im.start}, {im.start + im.length}) overlap the "
                                 f"previous image or run past the prompt ({len(req.prompt_ids)} tokens)")
            if any(t != placeholder for t in req.prompt_ids[im.start: im.start + im.length]):
                raise ValueError(f"image {k}: prompt_ids[{im.start}:{im.start + im.length}] must all be the media "
                                 f"placeholder token {placeholder}")
            end = im.start + im.length

    def abort(self, rid: str) -> None:
        with self._lock:
            seq = self.seqs.get(rid)
            if seq is not None and not seq.finished:
                seq.aborted = True
        self._wake.set()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[FinishEvent]:
        """Blocking helper without a thread: run steps until every prompt is done."""
        ps = params if isinstance(params, list) else [params] * len(prompts)
        handles = [self.submit(GenerationRequest(tuple(p), q)) for p, q in zip(prompts, ps)]
        seqs = [self.seqs[h.id] for h in handles]
        while any(not s.finished for s in seqs):
            self.step()
        return [list(h)[-1] for h in handles]

    def stats(self) -> dict:
        """Queue and cache occupancy (the server's /health reports it)."""
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "pages_in_use": self.pool.pages_in_use, "pages_total": self.pool.usable,
                "prefix_checkpoints": self.prefix.num_checkpoints if self.prefix else 0,
                "host_pages_in_use": self.prefix.host_pages_in_use if self.prefix else 0,
                "preemptions": self.scheduler.preemptions, "max_context": self.max_context,
                "cuda_graphs": self.runner.use_graphs}

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    # ---- the loop -----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the loop thread and end every open request with FinishEvent("abort")."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with self._lock:
            for seq in list(self.seqs.values()):
                self._finish(seq, "abort")
        self._in_flight = None
        self.runner.close()

    def _loop(self) -> None:
        while not self._stop:
            if not self.has_work:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - any failure ends every open request, never a hang
                self._fail(e)
                return
            finally:
                if self.after_step is not None:
                    self.after_step()

    def warmup(self, progress=None) -> float:
        """Compile and capture everything the steps will use (every CUDA-graph bucket and sampler variant, the
        prefill shapes that autotune) before the first request, so no request waits for it; ``progress(text)`` hears
        what it is doing. Returns the seconds it took. Touches only the pool's scratch page."""
        t0 = time.perf_counter()
        with self._lock:
            self.runner.warmup(self.cfg.prefill_chunk, self.cfg.step_tokens, progress)
        return time.perf_counter() - t0

    def _fail(self, e: Exception) -> None:
        self.failed = f"{type(e).__name__}: {e}"
        with self._lock:
            for seq in list(self.seqs.values()):
                self._finish(seq, "error", self.failed)

    @torch.no_grad()
    def step(self) -> None:
        """Plan and launch one step, deliver the tokens of the step before it (asynchronous scheduling) or of this
        one, then advance the launched step's sequences. First, images waiting to be prefilled are encoded by at
        most about ``image_step_flops`` (``ImageFeatures.encode``)."""
        with self._lock:
            images = self.scheduler.images_to_encode()
        if images:
            self.runner.images.encode(images, self.image_step_flops)
        t0 = time.perf_counter()
        with self._lock:
            for seq in [s for s in self.seqs.values() if s.aborted]:
                self._finish(seq, "abort")
            self.scheduler.prefill_cap = self.pacer.cap()
            plan = self.scheduler.schedule()
            if plan.empty and self._in_flight is None and self.scheduler.waiting and not self.scheduler.running:
                seq = self.scheduler.waiting[0]  # nothing runs and it cannot start: say so rather than spin
                self._finish(seq, "error", f"request {seq.id} cannot be scheduled: the page pool has "
                                           f"{self.pool.available} pages available")
        launched = None
        if not plan.empty:
            result = self.runner.launch(plan)
            for it in [*plan.prefill, *plan.decode]:
                if it.sample is not None:
                    self.seqs[it.seq_id].in_flight += 1
            launched = (plan, result)
        if not self.async_scheduling:
            if launched is not None:
                with self._lock:
                    self.scheduler.update(plan, self.seqs)  # before delivery can finish (and unlist) a sequence
                self._deliver(launched[1].wait())
                self.pacer.observe(sum(len(it.tokens) for it in plan.prefill), time.perf_counter() - t0)
            return
        ready, self._in_flight = self._in_flight, launched
        if ready is not None:
            self._deliver(ready[1].wait())  # first: the tokens this plan fed from the device are then known
            # the wait took about the device time of the step before: time it with that step's prompt tokens
            self.pacer.observe(sum(len(it.tokens) for it in ready[0].prefill), time.perf_counter() - t0)
        if launched is not None:
            with self._lock:
                self.scheduler.update(plan, self.seqs)

    def _deliver(self, sampled) -> None:
        with self._lock:
            for sid, s in sampled.items():
                seq = self.seqs.get(sid)
                if seq is None or seq.finished:
                    continue  # aborted, or finished by an earlier token: this one was computed too many
                seq.in_flight -= 1
                reason = self.output.deliver(seq, s)
                if reason is not None:
                    self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.finished:
            return
        self.scheduler.finish(seq)
        self.runner.release(seq.id)
        self.seqs.pop(seq.id, None)
        self.output.finish(seq, reason, error)
