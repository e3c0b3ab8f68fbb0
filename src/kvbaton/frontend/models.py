"""The models a frontend serves, followed from the workers' model cards in discovery.

Invariants: a model is listed from the moment its tokenizer is loaded and at least one of its
cards lives, until `worker_wait_s` after its last card vanished (the worker stopped or died: the
card dies with the worker's lease) with none back. A request goes to a live instance that
registered a card of its model; while there is none, it waits for one up to `worker_wait_s`
(a worker that `serve` restarts), then fails with a 503; the
tokenizer comes from the worker's directory when this machine can read it, else from the
worker's `tokenizer_files` endpoint.

Disaggregation: cards of role "prefill" do not serve a model by themselves; while one of a
served model lives, its requests are prefilled there (the PrefillRouter) and decoded on the
model's other workers, unless the uncached part of the prompt is short enough to prefill on
the decode worker."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbaton.frontend.canary import Canary
from kvbaton.frontend.choices import Fork
from kvbaton.frontend.errors import OpenAIError, bad_request, no_workers
from kvbaton.frontend.migration import WorkerSilentError, migrating
from kvbaton.frontend.openai_types import NvExt
from kvbaton.frontend.settings import BusyThresholds, CanarySettings, MigrationSettings
from kvbaton.frontend.shedding import LoadMonitor, admit
from kvbaton.llm.hashing import block_extra_keys, reusable_blocks
from kvbaton.llm.model_cards import model_cards_prefix, parse_model_card_key
from kvbaton.llm.tokenizer import Tokenizer, preload
from kvbaton.protocols.llm import EngineOutput, ModelCard, PreprocessedRequest
from kvbaton.router import (
    PrefillRouter,
    ReplicaSync,
    Route,
    Router,
    RouteRequest,
    RouterMetrics,
    RouterSettings,
    make_router,
)
from kvbaton.router.disagg import Disaggregated
from kvbaton.router.policies import follow
from kvbaton.runtime import Client, DistributedRuntime
from kvbaton.runtime.discovery.base import PrefixWatch
from kvbaton.runtime.errors import ConnectError, NoInstancesError, StreamBrokenError

log = logging.getLogger(__name__)

TOKENIZER_FETCH_TIMEOUT_S = 30.0
PRELOAD_JOIN_S = 60.0  # the tokenizer preload's imports, waited for at close


@dataclass
class PrefillPool:
    """A model's prefill workers: their cards, and the PrefillRouter (and the monitor of their
    loads) once it is made."""

    cards: dict[int, ModelCard] = field(default_factory=dict)
    router: PrefillRouter | None = None
    loads: LoadMonitor | None = None

    def live(self) -> list[int]:
        return self.router.instance_ids(list(self.cards)) if self.router else []


class ServedModel:
    def __init__(
        self,
        card: ModelCard,
        tokenizer: Tokenizer,
        client: Client,
        router: Router,
        prefill: PrefillPool | None = None,
        settings: RouterSettings | None = None,
        migration: MigrationSettings | None = None,
        loads: LoadMonitor | None = None,
        thresholds: BusyThresholds | None = None,
        canary: Canary | None = None,
    ) -> None:
        """`loads` and `thresholds`: load shedding (shedding.py), none without a monitor;
        `canary`: workers that failed theirs are passed over (canary.py)."""
        self.name = card.name
        self.card = card  # the first one seen: context length and block size
        self.tokenizer = tokenizer
        self.client = client
        self.router = router
        self.cards: dict[int, ModelCard] = {card.instance_id: card}
        self.prefill = prefill or PrefillPool()
        self.settings = settings or RouterSettings()
        self.migration = migration or MigrationSettings()
        self.loads = loads
        self.thresholds = thresholds or BusyThresholds()
        self.canary = canary
        self.migrations = 0  # lost attempts whose request was sent again (migrated)

    def instance_ids(self) -> list[int]:
        """Live instances with a card of this model."""
        live = set(self.client.instance_ids())
        return [i for i in self.cards if i in live]

    def generate(
        self,
        request: PreprocessedRequest,
        request_id: str,
        served_by: list[int],
        nvext: NvExt | None = None,
        fork: Fork | None = None,
    ) -> AsyncGenerator[EngineOutput, None]:
        """The worker's outputs, from the worker the router ranks first that takes the request
        (one that refuses it unrun passes it on), or from the one `nvext` names; with none
        left, NoInstancesError. A worker lost mid-request: the request migrates (migration.py).
        The workers that serve it are appended to `served_by` (a prefill worker, then the
        decode worker, when disaggregated). `fork`: one of a prompt's choices (choices.py)."""
        tried: list[int] = []  # the worker each attempt was routed to first

        def lost(exc: Exception, migrates: bool) -> None:
            self.migrations += migrates
            if isinstance(exc, WorkerSilentError) and self.canary is not None and tried:
                self.canary.suspect(tried[-1], str(exc))

        return migrating(
            lambda req, migrated: self._taken(
                req, request_id, served_by, nvext, migrated, tried, fork
            ),
            request,
            request_id,
            self.migration,
            pinned=nvext is not None and nvext.instance_id() is not None,
            on_lost=lost,
        )

    async def _taken(
        self,
        request: PreprocessedRequest,
        request_id: str,
        served_by: list[int],
        nvext: NvExt | None,
        migrated: bool,
        tried: list[int],
        fork: Fork | None,
    ) -> AsyncGenerator[EngineOutput, None]:
        """`_attempt`'s outputs. An attempt that no worker took, because each one it was sent
        to was gone (killed: discovery lists it until its lease ends) or refused it, is made
        again once the workers change (at most a second later), for up to `worker_wait_s`;
        after outputs (a prefill worker's first token, then no decode worker), it is a lost
        stream (StreamBrokenError): the request migrates."""
        deadline = time.monotonic() + self.migration.worker_wait_s
        while True:
            outputs = self._attempt(request, request_id, served_by, nvext, migrated, tried, fork)
            produced = False
            try:
                async with contextlib.aclosing(outputs):
                    async for out in outputs:
                        produced = True
                        yield out
                return
            except (NoInstancesError, ConnectError) as exc:
                if produced:
                    raise StreamBrokenError(f"no worker took the rest of it: {exc}") from exc
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                log.info("request %s: no worker took it (%s); trying again", request_id, exc)
            with contextlib.suppress(TimeoutError):  # at most one try a second
                async with asyncio.timeout(min(remaining, 1.0)):
                    await self.client.wait_for_change()

    async def _attempt(
        self,
        request: PreprocessedRequest,
        request_id: str,
        served_by: list[int],
        nvext: NvExt | None,
        migrated: bool,
        tried: list[int],
        fork: Fork | None,
    ) -> AsyncGenerator[EngineOutput, None]:
        """One try at the request. The first may be refused (503) if every worker is busy; a
        continuation (`migrated`) is not, and goes to a worker it has not been lost on, if any
        is left. The worker routed to first is appended to `tried`; the load shedder counts the
        prompt as waiting there until its first output (or its end).

        A prompt's first choice (`fork.leads`) reports its home at its first output from the
        worker that decodes it; a later choice is not shed, and goes to the home first, if it is
        a candidate, where it is prefilled from the prefix cache (never disaggregated)."""
        prefilled: Callable[[], None] = _nothing
        shed = not migrated and (fork is None or fork.leads)
        override = nvext.router_config_override if nvext else None
        hints = RouteRequest(
            request.token_ids,
            block_extra_keys(request.cache_salt),
            override.overlap_score_weight if override else None,
            override.router_temperature if override else None,
        )
        target = nvext.instance_id() if nvext else None
        if target is None and self.router.mode == "direct":
            raise bad_request(
                "router mode 'direct' needs nvext.backend_instance_id: the worker to use",
                "nvext.backend_instance_id",
            )
        if target is not None and target not in self.instance_ids():
            raise bad_request(
                f"nvext.backend_instance_id: instance {target:x} does not serve model "
                f"{self.name!r}",
                "nvext.backend_instance_id",
            )
        if target is not None:
            route = self.router.pin(hints, target)
            outputs = follow(
                self.client.direct(request, target, request_id=request_id), route, served_by
            )
        else:
            candidates = await wait_for_live(
                self.instance_ids, self.client, self.migration.worker_wait_s, self.name
            )
            if self.canary is not None:
                candidates = self.canary.healthy(candidates)
            if migrated:
                lost_on = set(tried) | set(served_by)
                candidates = [w for w in candidates if w not in lost_on] or candidates
            elif shed:
                what = f"worker of model `{self.name}`"
                candidates = admit(self.loads, self.thresholds, candidates, what)
            route = self.router.route(hints, candidates)
            home = fork.home.worker if fork is not None and not fork.leads else None
            at_home = home is not None and route.prefer(home)
            prefill = [] if at_home else await self._prefill_workers(request, route, shed)
            if route.ranking:
                first = route.ranking[0]
                tried.append(first)
                if self.canary is not None:
                    self.canary.used(first)
                if self.loads is not None and not prefill:
                    size = self.card.kv_block_size
                    blocks = route.overlaps.get(first, 0)
                    if at_home:  # the router may not have heard of the prompt's blocks yet
                        blocks = reusable_blocks(len(request.token_ids), size)
                    if request.sampling.prompt_logprobs is not None:  # computed whole there
                        blocks = 0
                    cached = blocks * size
                    prefilled = self.loads.sent(first, max(0, len(request.token_ids) - cached))
            if prefill:
                assert self.prefill.router is not None
                outputs = Disaggregated(
                    self.prefill.router,
                    self.client,
                    request,
                    request_id,
                    hints,
                    prefill,
                    route,
                    served_by,
                    self.settings.enforce_disagg,
                ).outputs(self.settings.transfer_order)
            else:
                outputs = follow(
                    self.client.ordered(request, route.ranking, request_id=request_id),
                    route,
                    served_by,
                )
        report = fork.home.found if fork is not None and fork.leads else None
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    prefilled()
                    if report is not None and route.taken_by is not None:
                        report(route.taken_by)  # it decodes there: the prompt's KV is there
                        report = None
                    yield out
        finally:
            prefilled()

    async def _prefill_workers(
        self, request: PreprocessedRequest, route: Route, shed: bool
    ) -> list[int]:
        """The prefill workers to disaggregate on (those not busy, if `shed`: 503 if all are);
        none to prefill on the decode worker: no prefill worker lives (with `enforce_disagg`,
        one is waited for as long as for a worker, then 503), or the part of the prompt that
        the decode worker ranked first lacks is short (`max_local_prefill_tokens`), or the
        request wants its prompt's logprobs (read where the prompt is computed)."""
        if request.sampling.prompt_logprobs is not None:
            return []
        live = self.prefill.live()
        if not live and self.settings.enforce_disagg and self.prefill.router is not None:
            try:
                live = await wait_for_live(
                    self.prefill.live,
                    self.prefill.router.client,
                    self.migration.worker_wait_s,
                    self.name,
                    "prefill worker",
                )
            except BaseException:
                route.done()
                raise
        if not live:
            if self.settings.enforce_disagg:
                route.done()
                raise no_workers(self.name, "prefill worker")
            return []
        limit = self.settings.max_local_prefill_tokens
        if limit > 0 and route.ranking:
            cached = route.overlaps.get(route.ranking[0], 0) * self.card.kv_block_size
            if len(request.token_ids) - cached < limit:
                return []
        if not shed:
            return live
        what = f"prefill worker of model `{self.name}`"
        try:
            return admit(self.prefill.loads, self.thresholds, live, what)
        except OpenAIError:
            route.done()
            raise


def _nothing() -> None:
    pass


async def wait_for_live(
    live: Callable[[], list[int]],
    client: Client,
    wait_s: float,
    model: str,
    role: str = "worker",
) -> list[int]:
    """`live()` once it names a worker: while it names none, waits for `client`'s instances to
    change, at most `wait_s` in all; then the 503 (`no_workers`)."""
    deadline = time.monotonic() + wait_s
    while not (ids := live()):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise no_workers(model, role, wait_s)
        with contextlib.suppress(TimeoutError):  # a card may come after its instance: recheck
            async with asyncio.timeout(min(remaining, 1.0)):
                await client.wait_for_change()
    return ids


class ModelManager:
    def __init__(
        self,
        runtime: DistributedRuntime,
        namespace: str,
        router: RouterSettings | None = None,
        router_metrics: RouterMetrics | None = None,
        migration: MigrationSettings | None = None,
        thresholds: BusyThresholds | None = None,
        canary: CanarySettings | None = None,
        sync: ReplicaSync | None = None,
    ) -> None:
        """`thresholds`: load shedding's, shared by every model (changed at run time);
        `sync`: the KV routers count the other frontends' requests too."""
        self.runtime = runtime
        self.migration = migration or MigrationSettings()
        self.canary = canary or CanarySettings()
        self.thresholds = thresholds or BusyThresholds()
        self.namespace = namespace
        self.router_settings = router or RouterSettings()
        self.router_metrics = router_metrics
        self.sync = sync
        self.models: dict[str, ServedModel] = {}
        self._clients: dict[str, Client] = {}
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._pending: dict[str, dict[int, ModelCard]] = {}  # cards of models still loading
        self._watch: PrefixWatch | None = None
        self._follow: asyncio.Task[None] | None = None
        self._forgetting: set[asyncio.Task[None]] = set()  # models with no card left
        self._prefill: dict[str, PrefillPool] = {}  # by model name
        self._prefill_loading: dict[str, asyncio.Task[None]] = {}
        self._files_dir: Path | None = None  # made at the first fetch: a killed frontend leaks it
        self._preload: threading.Thread | None = None

    async def start(self) -> None:
        self._preload = preload()  # while no worker registered yet: its tokenizer loads sooner
        self._watch = await self.runtime.discovery.watch_prefix(model_cards_prefix(self.namespace))
        for key, value in self._watch.snapshot.items():
            self._apply("put", key, value)
        self._follow = asyncio.create_task(self._follow_watch(self._watch))

    async def loaded(self, timeout: float) -> bool:
        """Wait until the models registered so far are loaded (or failed to), for at most
        `timeout` seconds; False if some still load then."""
        tasks = [*self._loading.values(), *self._prefill_loading.values()]
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        return not pending

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        tasks = [
            self._follow,
            *self._loading.values(),
            *self._prefill_loading.values(),
            *self._forgetting,
        ]
        for task in tasks:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in tasks if t), return_exceptions=True)
        for model in self.models.values():
            await _close_model(model)
        for pool in self._prefill.values():
            if pool.router is not None:
                await pool.router.close()
            if pool.loads is not None:
                await pool.loads.close()
        if self._files_dir is not None:
            shutil.rmtree(self._files_dir, ignore_errors=True)
        if self._preload is not None:  # an import cut short by the interpreter's exit can crash
            await asyncio.to_thread(self._preload.join, PRELOAD_JOIN_S)

    def get(self, name: str) -> ServedModel | None:
        return self.models.get(name)

    # -- following discovery -----------------------------------------------------------------
    async def _follow_watch(self, watch: PrefixWatch) -> None:
        async for event in watch:
            self._apply(event.kind, event.key, event.value)

    def _apply(self, kind: str, key: str, value: bytes | None) -> None:
        parsed = parse_model_card_key(self.namespace, key)
        if parsed is None:
            return
        name, instance_id = parsed
        if kind == "delete":
            self._pending.get(name, {}).pop(instance_id, None)
            pool = self._prefill.get(name)
            left = pool.cards.pop(instance_id, None) if pool is not None else None
            if pool is not None and left is not None and pool.router is not None:
                pool.router.router.forget_worker(instance_id)
            model = self.models.get(name)
            gone = model.cards.pop(instance_id, None) if model is not None else None
            if model is not None and gone is not None:
                model.router.forget_worker(instance_id)  # its metrics' series, its index slot
                if not model.cards:
                    self._forget_later(model)
            return
        assert value is not None
        try:
            card = ModelCard.from_json(value)
        except Exception as exc:
            log.warning("ignoring a bad model card at %s: %s", key, exc)
            return
        if card.role == "prefill":
            pool = self._prefill.setdefault(name, PrefillPool())
            pool.cards[instance_id] = card
            if pool.router is None and name not in self._prefill_loading:
                self._prefill_loading[name] = asyncio.create_task(self._load_prefill(pool, card))
            return
        if name in self.models:
            self.models[name].cards[instance_id] = card
            return
        self._pending.setdefault(name, {})[instance_id] = card
        if name not in self._loading:
            self._loading[name] = asyncio.create_task(self._load(name, card))

    def _forget_later(self, model: ServedModel) -> None:
        """Stop serving `model` once `worker_wait_s` passed with no card of it back."""
        wait_s = self.migration.worker_wait_s
        log.info("model %s: no worker left; waiting %g s for one to come back", model.name, wait_s)

        async def forget() -> None:
            await asyncio.sleep(wait_s)
            if model.cards or self.models.get(model.name) is not model:
                return
            log.info("model %s: no worker came back; no longer served", model.name)
            del self.models[model.name]
            await _close_model(model)

        task = asyncio.create_task(forget())
        self._forgetting.add(task)
        task.add_done_callback(self._forgetting.discard)

    async def _load(self, name: str, card: ModelCard) -> None:
        router: Router | None = None
        loads: LoadMonitor | None = None
        try:
            client = await self._client(card.endpoint)
            tokenizer = await self._tokenizer(card)
            router = make_router(
                self.router_settings, self.runtime, card, self.router_metrics, self.sync
            )
            await router.start()
            loads = LoadMonitor(self.runtime, card.component, functools.partial(self._cards, name))
            await loads.start()
        except Exception as exc:
            log.error("model %s: could not load it: %s", name, exc)
            await _close_started(router, loads)
            return
        finally:
            self._loading.pop(name, None)
        prefill = self._prefill.setdefault(name, PrefillPool())
        model = ServedModel(
            card,
            tokenizer,
            client,
            router,
            prefill,
            self.router_settings,
            self.migration,
            loads,
            self.thresholds,
            self._canary(client, card, tokenizer, loads),
        )
        cards = self._pending.pop(name, {})
        if not cards:
            await _close_model(model)
            return  # every worker of it went while it loaded
        model.cards = cards
        self.models[name] = model
        log.info("model %s: served (%d worker(s)), router %s", name, len(cards), router.mode)

    def _cards(self, name: str) -> dict[int, ModelCard]:
        """The cards of model `name`'s workers (served, or waiting for it to load)."""
        model = self.models.get(name)
        return model.cards if model is not None else self._pending.get(name, {})

    def _canary(
        self, client: Client, card: ModelCard, tokenizer: Tokenizer, loads: LoadMonitor
    ) -> Canary | None:
        if not self.canary.period_s:
            return None
        prompt = tokenizer.encode("ping")
        canary = Canary(client, card.name, prompt, self.canary, loads.working)
        canary.start()
        return canary

    async def _load_prefill(self, pool: PrefillPool, card: ModelCard) -> None:
        router: Router | None = None
        loads: LoadMonitor | None = None
        try:
            client = await self._client(card.endpoint)
            settings = self.router_settings
            if settings.mode == "direct":  # a request names its decode worker, not this one
                settings = dataclasses.replace(settings, mode=None)
            router = make_router(settings, self.runtime, card, self.router_metrics, self.sync)
            await router.start()
            loads = LoadMonitor(self.runtime, card.component, lambda: pool.cards)
            await loads.start()
            pool.loads = loads
            pool.router = PrefillRouter(self.runtime, client, router)
            log.info("model %s: prefill workers found; disaggregating", card.name)
        except Exception as exc:
            log.error("model %s: could not follow its prefill workers: %s", card.name, exc)
            await _close_started(router, loads)
        finally:
            self._prefill_loading.pop(card.name, None)

    async def _client(self, endpoint: str) -> Client:
        if endpoint not in self._clients:
            self._clients[endpoint] = await self.runtime.endpoint(endpoint).client(
                response_type=EngineOutput
            )
        return self._clients[endpoint]

    async def _tokenizer(self, card: ModelCard) -> Tokenizer:
        local = Path(card.model_path)
        if card.model_path and all((local / f).is_file() for f in card.tokenizer_files):
            return await asyncio.to_thread(Tokenizer, local)
        return await asyncio.to_thread(Tokenizer, await self.fetch_tokenizer_files(card))

    async def fetch_tokenizer_files(self, card: ModelCard) -> Path:
        """Copy the model's tokenizer files from the worker that registered `card`."""
        client = await self.runtime.endpoint(f"{card.component}.tokenizer_files").client()
        try:
            await client.wait_for_instances(TOKENIZER_FETCH_TIMEOUT_S)
            files: dict[str, Any] = await client.direct(
                None, card.instance_id, timeout=TOKENIZER_FETCH_TIMEOUT_S
            ).__anext__()
        finally:
            await client.close()
        if self._files_dir is None:
            self._files_dir = Path(tempfile.mkdtemp(prefix="kvbaton-frontend-"))
        target = self._files_dir / f"{card.instance_id:x}"
        target.mkdir(parents=True, exist_ok=True)
        for file_name, data in files.items():
            if "/" in file_name or file_name.startswith("."):
                raise ValueError(f"bad tokenizer file name {file_name!r}")
            (target / file_name).write_bytes(data)
        log.info("model %s: fetched %d tokenizer files from its worker", card.name, len(files))
        return target


async def _close_started(router: Router | None, loads: LoadMonitor | None) -> None:
    """What a load that failed half way had started."""
    if router is not None:
        await router.close()
    if loads is not None:
        await loads.close()


async def _close_model(model: ServedModel) -> None:
    if model.canary is not None:
        await model.canary.close()
    await model.router.close()
    if model.loads is not None:
        await model.loads.close()
