"""The ingress deployment: FastAPI routes under `@serve.ingress`, auth, body parsing, and the fan-out
of each request to its model's replica through a streaming DeploymentHandle call.

One handle call per request (all n choices ride it). The first TokenBatch is awaited before the
HTTP status is sent, so engine-side rejections are still proper 4xx responses; after that, errors
travel in the SSE stream. Leaving the stream (client gone, timeout) cancels the call, and the
replica aborts the request and frees its blocks; a choice ended at a stop string is ended on the
replica by a message naming its last token (`Generation`)."""


import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from replicas.niceness import LoadPriority
from replicas.request import GenerateRequest, MultiModalItem, TokenBatch
from replicas.status_board import BoardReader, app_name_here
from serve_app import (admission, chat, multimodal, openapi, reasoning_formats, sampling,
                       tool_choice)
from serve_app.admission import Admission, Ticket
from serve_app.auth import APIKeys, client_id, read_key_file, require_api_key
from serve_app.channels import ChannelHub, Subscription
from serve_app.config import AppConfig
from serve_app.errors import APIError, install_handlers, validation_error
from serve_app.media import MediaFetcher, MediaPolicy
from serve_app.metrics import Metrics
from serve_app.models import ModelRegistry, ServedModel, load_model
from serve_app.preprocess import Preprocessor
from serve_app.protocol import (ChatChoice, ChatCompletion, ChatCompletionChunk,
                                ChatCompletionRequest, ChoiceLogprobs, ChunkChoice, Completion,
                                CompletionChoice, CompletionRequest, CompletionTokensDetails, Delta,
                                DeltaToolCall, DeltaToolCallFunction, DetokenizeRequest,
                                ModelCard, ModelList, PromptTokensDetails, ResponseFunctionCall,
                                ResponseMessage, ResponseToolCall, TokenizeRequest, Usage)
from serve_app.shedding import Shedding
from serve_app.stream import (DONE, ChoiceDelta, ChoiceState, ContentChunks, TokenText,
                              completion_logprobs, prompt_logprobs_json, sse)
from serve_app.tool_parser import OutputParser
from structured.errors import ConstraintError
from structured.schema_check import check_constraint
from structured.spec import Constraint

logger = logging.getLogger(__name__)
VERSION = "0.1.0"
MAX_JSON_DEPTH = 64
# after its queue-wait deadline, the engine has failed an unscheduled request itself; this is
# how much longer the ingress waits for a first output (a prefill that started just in time)
# before it gives up on a call that never reached an engine
FIRST_OUTPUT_GRACE_S = 1.0
# how long a call whose choices were stopped through the status board may take to end by itself
STOP_DRAIN_S = 2.0
_DRAINS: set[asyncio.Task] = set()  # those calls' readers (a task needs a reference kept)
T = TypeVar("T", bound=BaseModel)

app = FastAPI(title="shardserve", version=VERSION, dependencies=[Depends(require_api_key)])
install_handlers(app)
openapi.install(app)
app.add_middleware(Shedding)


def check_constraint_early(constraint: Constraint) -> None:
    """The cheap checks (schema validity, unsupported keywords, regex syntax) before the hop;
    compiling happens on the replica, which owns the vocabulary."""
    try:
        check_constraint(constraint)
    except ConstraintError as exc:
        raise APIError(exc.message, param=exc.param) from None


def _json_depth(obj: Any, limit: int) -> bool:
    """True when nesting stays within `limit` (iterative: deep bodies must not blow the stack)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return True


def _replica_id() -> str:
    """This ingress replica's id on the status board (a fresh one outside Serve)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (unit tests)
        return uuid.uuid4().hex


def _decode(body: bytes, model: type[T]) -> T:
    """JSON body -> request model (a 4 MiB body takes tens of ms: run it off the event loop)."""
    try:
        obj = json.loads(body)
    except UnicodeDecodeError:
        raise APIError("the body is not valid UTF-8", 400) from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise APIError(f"the body is not valid JSON: {exc}", 400) from None
    if not isinstance(obj, dict):
        raise APIError("the body must be a JSON object", 400)
    if not _json_depth(obj, MAX_JSON_DEPTH):
        raise APIError(f"the body is nested deeper than {MAX_JSON_DEPTH} levels", 400)
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise validation_error(exc) from None  # type: ignore[arg-type]


class Generation:
    """One in-flight handle call: the first batch already received, the rest to iterate.

    A choice this side ends at a stop string is ended on its replica too (`stop_choice` through
    the status board, which names the tokens the client got), rather than by cancelling the
    call: the replica then frees that choice's row while the others go on, and takes the tokens
    it generated past the stop back out of its counters. A stop found before the replica is
    known (a channeled request's first batches can come before its call names the replica) is
    sent once it is. The call then ends by itself; it is cancelled only if it does not within
    STOP_DRAIN_S, or the board is unreachable."""

    def __init__(self, call: Subscription, first: tuple[TokenBatch, ...], request_id: str,
                 board: BoardReader) -> None:
        self.call = call
        self.first: tuple[TokenBatch, ...] | None = first
        self.request_id = request_id
        self.board = board

    @property
    def replica(self) -> str | None:
        """The replica serving it, once known (stop_choice goes there)."""
        return self.call.replica

    async def __aiter__(self) -> AsyncIterator[tuple[TokenBatch, ...]]:
        if self.first is not None:
            first, self.first = self.first, None
            yield first
        async for batches in self.call:
            yield batches

    def cancel(self) -> None:
        with contextlib.suppress(Exception):  # cancel re-raises the call's own failure
            self.call.cancel()

    async def deltas(self, states: list[ChoiceState],
                     timeout: float) -> AsyncIterator[tuple[ChoiceState, ChoiceDelta]]:
        """Feeds every batch to its choice's state and yields the deltas, until every choice is
        done or `timeout` passes; failures come out as APIError (408 for the timeout). The call
        is cancelled when this ends before every choice has, however it ends, so the replica
        frees the request; once every choice has ended there, it ends by itself."""
        loop = asyncio.get_running_loop()
        # one timer for the request, which queues a TimeoutError behind the batches that came
        # before it: the limit then fires only where the loop waits for the next batch, never
        # in what the consumer does between yields (an `asyncio.timeout` around each wait
        # scheduled and cancelled a timer per SSE event: 5 us a token, warm)
        expiry = loop.call_at(loop.time() + timeout, self.call.expire)
        batches_in = aiter(self)
        ended = drain = finished = False
        pending = False  # a choice stopped here whose replica has not been told
        try:
            while True:
                try:
                    batches = await anext(batches_in)
                except StopAsyncIteration:
                    ended = True
                    break
                for b in batches:
                    st = states[b.choice_index]
                    delta = st.on_batch(b)
                    if st.stopped_at is not None and not st.stop_sent:
                        pending = True
                    if delta is not None:
                        yield st, delta
                if pending:
                    pending = not self._send_stops(states)
                if all(s.done for s in states):
                    # stopped choices the replica is told of end its stream by themselves
                    drain = any(s.stopped_at is not None for s in states)
                    # every choice ended on the replica: its call ends by itself, and a
                    # cancel would be one more RPC each way (8% of the ingress's CPU per
                    # request)
                    finished = not drain
                    break
        except TimeoutError:
            raise APIError(f"the request took longer than its {timeout:g} s timeout", 408,
                           param="inference_timeout") from None
        except APIError:
            raise
        except Exception as exc:
            raise APIError.from_exception(exc) from None
        finally:
            expiry.cancel()
            if drain:
                # off the response: the client has its answer already
                task = loop.create_task(self._drain(batches_in, states))
                _DRAINS.add(task)
                task.add_done_callback(_DRAINS.discard)
            elif not ended:
                if finished:
                    self.call.close()
                else:
                    self.cancel()
                with contextlib.suppress(Exception):
                    await batches_in.aclose()

    def _send_stops(self, states: list[ChoiceState]) -> bool:
        """Tells the replica (once known) of each choice stopped here that it has not heard of;
        whether it now knows of them all."""
        unsent = [st for st in states if st.stopped_at is not None and not st.stop_sent]
        replica = self.replica
        if replica is not None:
            for st in unsent:
                st.stop_sent = self.board.stop_choice(replica, self.request_id, st.index,
                                                      st.stopped_at)
        return all(st.stop_sent for st in unsent)

    async def _drain(self, batches_in: AsyncIterator[tuple[TokenBatch, ...]],
                     states: list[ChoiceState]) -> None:
        """Tells the replica of the stops it has not heard of once it is known, then reads the
        call to its end (the replica finishing the stopped choices); cancels it when a stop
        cannot be sent, or after STOP_DRAIN_S."""
        try:
            async with asyncio.timeout(STOP_DRAIN_S):
                if not self._send_stops(states):
                    await self.call.replica_known.wait()
                    if not self._send_stops(states):
                        raise LookupError("the status board or the replica is unknown")
                async for _ in batches_in:
                    pass
        except Exception:  # noqa: BLE001 (a timeout or a failure: either way, cancel)
            self.cancel()
        finally:
            with contextlib.suppress(Exception):
                await batches_in.aclose()


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(app)
class Ingress:
    def __init__(self, config: AppConfig, handles: dict[str, Any]) -> None:
        self.config = config
        keys = list(config.api_keys)
        if config.api_key_file:
            keys += read_key_file(config.api_key_file)
        app.state.api_keys = APIKeys(keys)
        self.registry = ModelRegistry([load_model(m, handles[m.name]) for m in config.models])
        self.metrics = Metrics()
        self.admission = Admission(config)
        self.priority = LoadPriority(config.front_niceness)
        app.state.check_room = self._check_room
        self.pre = Preprocessor(config)
        self.media = MediaFetcher(MediaPolicy(
            tuple(d.lower().rstrip(".") for d in config.allowed_media_domains)
            if config.allowed_media_domains is not None else None,
            config.allow_private_media_urls,
            Path(config.allowed_local_media_path) if config.allowed_local_media_path else None,
            config.media_fetch_timeout_s, config.max_media_bytes, config.max_image_pixels))
        # the replicas' engine state, kept fresh off the request path (/metrics, admission);
        # the reads are this ingress's heartbeat for /health (serve_app/health.py)
        self.board = BoardReader(app_name_here(), ingress=_replica_id(),
                                 models=tuple(self.registry.models))
        with contextlib.suppress(RuntimeError):  # no running loop outside Serve
            self.board.start()
        self.channels = {name: ChannelHub(h.options(stream=True), _replica_id())
                         for name, h in handles.items()}

    # ---- plumbing ------------------------------------------------------------------------------
    async def _parse(self, request: Request, model: type[T]) -> T:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
            raise APIError(f"request body larger than {self.config.max_body_bytes} bytes", 413)
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip()
        if ctype not in ("application/json", "") and not ctype.endswith("+json"):
            raise APIError(f"content type {ctype!r} is not supported: send application/json", 415)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.config.max_body_bytes:
                raise APIError(f"request body larger than {self.config.max_body_bytes} bytes", 413)
        return await self.pre.run(_decode, bytes(body), model)

    async def _info(self, served: ServedModel) -> dict[str, Any]:
        """The replica's model facts: from the status board when it has them (no request slot
        needed), else one call to a replica."""
        if served.info is None:
            for stats in self.board.fresh(served.name):
                if "max_model_len" in stats:
                    served.info = {"max_model_len": stats["max_model_len"],
                                   "vocab_size": stats["vocab_size"]}
                    break
        try:
            return await served.ensure_info()
        except Exception as exc:
            raise self._rejection(served, exc) from None

    async def _limits(self, served: ServedModel) -> sampling.ServerLimits:
        info = await self._info(served)
        return sampling.ServerLimits(
            info["max_model_len"], min(info["vocab_size"], len(served.tokenizer)),
            self.config.max_n, served.config.priority_scheduling,
            frozenset(self.config.logits_processors), served.defaults)

    def _check_room(self) -> None:
        """The shedding layer's question: raises the refusal, for which the ingress takes the
        core's CPU priority until the burst is over."""
        try:
            self.admission.check_room(self.board.draining)
        except APIError:
            self.priority.refused()
            raise

    def _admit(self, served: ServedModel, request: Request) -> Ticket:
        return self.admission.admit(served.name, getattr(request.state, "api_key", None))

    async def _start(self, served: ServedModel, gen: GenerateRequest) -> Generation:
        """Sends the request to a replica and waits for its first output, within the request's
        queue-wait deadline (plus a grace for a prefill that started just in time)."""
        wait = max(0.0, (gen.deadline or time.time()) - time.time()) + FIRST_OUTPUT_GRACE_S
        hub = self.channels[served.name]
        if hub.pace is None:  # the model's config: the same in every report
            for stats in self.board.fresh(served.name):
                if "stream_messages_per_s" in stats:
                    hub.pace = (stats["stream_messages_per_s"], stats["stream_floor_s"])
                    break
        sub = hub.subscribe(gen.request_id, gen.n, served.config.stream_interval)
        try:
            # Serve's router may refuse at once (BackPressureError: its queue is full)
            sub.attach(hub.handle.generate.remote(gen, hub.ingress))
            async with asyncio.timeout(wait):
                first = await anext(sub)
        except StopAsyncIteration:
            raise APIError("the engine returned no output", 500) from None
        except Exception as exc:
            sub.cancel()
            raise self._rejection(served, exc) from None
        return Generation(sub, first, gen.request_id, self.board)

    async def _start_beside(self, served: ServedModel, gen: GenerateRequest) -> Generation:
        """`_start` for one of several calls a request makes at once, run as a task of its own.
        Serve gives every handle call made while serving a request that request's internal id,
        and its router indexes pending calls by that id: a third concurrent call from one
        request was never routed (Ray 2.60). So this task's calls get an id of their own."""
        from ray.serve.context import _set_request_context  # Serve's, to work around the above
        _set_request_context(_internal_request_id=uuid.uuid4().hex)
        return await self._start(served, gen)

    def _rejection(self, served: ServedModel, exc: BaseException) -> APIError:
        """Maps a failed start to its error, counting the ingress's overload refusals."""
        reason = None
        if isinstance(exc, TimeoutError):
            reason, error = admission.QUEUE_WAIT, APIError(
                "the server is overloaded: the request was not scheduled within the queue-wait "
                "limit; retry later", 503, retry_after=admission.RETRY_AFTER_S)
        elif isinstance(exc, BackPressureError):
            reason, error = admission.ROUTER_QUEUE_FULL, APIError(
                "the server is overloaded: the model's request queue is full; retry later", 503,
                retry_after=admission.RETRY_AFTER_S)
        elif isinstance(exc, DeploymentUnavailableError):
            reason, error = admission.REPLICA_UNAVAILABLE, APIError(
                "no replica of the model is available; retry later", 503,
                retry_after=admission.RETRY_AFTER_S)
        else:  # the engine's own refusals are counted by the engine
            error = APIError.from_exception(exc)
        if reason is not None:
            self.admission.count_rejection(served.name, reason)
        return error

    @staticmethod
    def _id_header(body: Any, request: Request) -> dict[str, str]:
        """Serve's proxy already answers with X-Request-Id (the client's, or its own id, which
        is our default request id); only a body `request_id` that differs needs ours."""
        if body.request_id and body.request_id != request.headers.get("x-request-id"):
            return {"X-Request-Id": body.request_id}
        return {}

    def _request_id(self, prefix: str, body: Any, request: Request) -> str:
        rid = body.request_id or request.headers.get("x-request-id")
        return f"{prefix}-{rid}" if rid else f"{prefix}-{uuid.uuid4().hex}"

    @staticmethod
    def _engine_key(rid: str) -> str:
        """The engine's key for a request: the client's id (as echoed) made unique, so a client
        that retries with the same X-Request-Id while the first try still runs is served."""
        return f"{rid}@{uuid.uuid4().hex[:12]}"

    # ---- routes --------------------------------------------------------------------------------
    @app.get("/ping")
    async def ping(self) -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version(self) -> dict:
        """The server's version and, per served model whose replicas reported, what it computes
        with: dtype, the KV cache's dtype, CPU kernel level (None on GPUs), its linears' weight
        formats and kernels, and what its 4-bit linears multiply (None without them) (from the
        replicas' stats: answered at peak without a call to them)."""
        self.board.start()
        models = {}
        for served in self.registry.models.values():
            for stats in self.board.fresh(served.name):
                if "weights" in stats:
                    models[served.name] = {k: stats.get(k) for k in (
                        "dtype", "kv_cache_dtype", "isa", "weights", "quant_activations")}
                    break
        return {"version": VERSION, "models": models}

    @app.get("/metrics")
    async def metrics(self) -> Response:
        self.board.start()
        for served in self.registry.models.values():
            self.metrics.set_engine_stats(served.name, self.board.fresh(served.name))
            self.metrics.set_admission(served.name, self.admission)
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    @app.get("/v1/models")
    async def list_models(self) -> ModelList:
        cards = []
        for served in self.registry.models.values():
            info = await self._info(served)
            cards.append(ModelCard(id=served.name, created=served.created, root=served.config.model,
                                   max_model_len=info["max_model_len"]))
        return ModelList(data=cards)

    @app.get("/v1/models/{model_id:path}")
    async def get_model(self, model_id: str) -> ModelCard:
        served = self.registry.resolve(model_id)
        info = await self._info(served)
        return ModelCard(id=served.name, created=served.created, root=served.config.model,
                         max_model_len=info["max_model_len"])

    @app.post("/tokenize", openapi_extra=openapi.body(TokenizeRequest))
    async def tokenize(self, request: Request) -> dict:
        body = await self._parse(request, TokenizeRequest)
        served = self.registry.resolve(body.model)
        info = await self._info(served)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            refs: list[multimodal.MediaRef] = []
            rendered = await self.pre.render(
                served.tokenizer, chat.to_template_messages(body.messages, served.modalities,
                                                            refs), tools=tools,
                chat_template=body.chat_template, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                add_special_tokens=bool(body.add_special_tokens),
                template_kwargs=body.chat_template_kwargs, client=client_id(request))
            # media parts count as the placeholder tokens the model sees for them
            ids, _ = await self._media_items(served, rendered.token_ids, refs,
                                             body.mm_processor_kwargs)
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await self.pre.run(served.tokenizer.encode, body.prompt,
                                     add_special_tokens=add)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": info["max_model_len"],
                               "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = served.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize", openapi_extra=openapi.body(DetokenizeRequest))
    async def detokenize(self, request: Request) -> dict:
        body = await self._parse(request, DetokenizeRequest)
        served = self.registry.resolve(body.model)
        limit = len(served.tokenizer)
        bad = [t for t in body.tokens if t >= limit]
        if bad:
            raise APIError(f"token ids {bad[:5]} are out of the vocabulary (size {limit})",
                           param="tokens")
        return {"prompt": served.tokenizer.decode(body.tokens)}

    @staticmethod
    async def _admitted(ticket: Ticket, handler: Any) -> Response:
        """Runs a generation route's handler for an admitted request; its place is given back
        when the response is complete (a stream: when it ends, however it ends)."""
        try:
            response = await handler
        except BaseException:
            ticket.release()
            raise
        if not isinstance(response, StreamingResponse):
            ticket.release()
            return response
        body = response.body_iterator

        async def stream() -> AsyncIterator[Any]:
            try:
                async for part in body:
                    yield part
            finally:
                ticket.release()
        response.body_iterator = stream()
        # a stream the server never starts (the client left first) never runs its finally
        weakref.finalize(response.body_iterator, ticket.release)
        return response

    @app.post("/v1/chat/completions",
              openapi_extra=openapi.body(ChatCompletionRequest, streams=True))
    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        served = self.registry.resolve(body.model)
        ticket = self._admit(served, request)
        return await self._admitted(ticket, self._chat(request, body, served, ticket))

    async def _media_items(self, served: ServedModel, ids: list[int],
                           refs: list[multimodal.MediaRef], kwargs: dict[str, Any] | None
                           ) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """A rendered prompt with one placeholder per media item -> the prompt with each
        expanded, and the items' encoder inputs (fetched, decoded and processed here)."""
        if served.media is None:
            if kwargs:
                raise APIError("mm_processor_kwargs is not supported: the served model takes "
                               "text only", param="mm_processor_kwargs")
            return ids, ()
        multimodal.check_limits(refs, self.config.limit_mm_per_prompt)
        multimodal.check_embeds(refs, self.config.enable_mm_embeds)
        media = await multimodal.load_media(self.media, served.media, refs,
                                            self.config.max_image_pixels, self.pre.run)
        return await self.pre.run(served.media.process, ids, media, refs, kwargs)

    async def _chat(self, request: Request, body: ChatCompletionRequest, served: ServedModel,
                    ticket: Ticket) -> Response:
        limits = await self._limits(served)
        refs: list[multimodal.MediaRef] = []
        rendered = await self.pre.render(
            served.tokenizer, **chat.render_args(body, served.modalities, refs),
            client=client_id(request))
        full, items = await self._media_items(served, rendered.token_ids, refs,
                                              body.mm_processor_kwargs)
        ids = chat.truncate(full, body.truncate_prompt_tokens, limits.max_model_len)
        items = multimodal.truncate_items(full, ids, items)
        media = served.media
        mrope = (multimodal.mrope_positions(len(ids), items, media.spatial_merge,
                                            media.tokens_per_second)
                 if items and media is not None and media.uses_mrope else None)
        # bad_words are tokenized here
        params, options = await self.pre.run(sampling.build, body, prompt_len=len(ids),
                                             limits=limits, tokenizer=served.tokenizer, chat=True)
        if body.modalities and any(m != "text" for m in body.modalities) or body.audio:
            raise APIError("audio output is not supported by this model", param="modalities")
        constraint = sampling.constraint_of(body)
        if body.tool_choice not in (None, "none") and not body.tools:
            raise APIError("tool_choice needs tools", param="tool_choice")
        forced_tool = tool_choice.tool_constraint(body, served.tool_format)
        if forced_tool is not None and constraint is not None:
            raise APIError("an output constraint cannot be combined with tool_choice "
                           "'required' or a named tool", param="tool_choice")
        constraint = forced_tool or constraint
        if constraint is not None:
            await self.pre.run(check_constraint_early, constraint)
        predicted = await self.pre.run(sampling.prediction_ids, body, served.tokenizer, limits)
        rid = self._request_id("chatcmpl", body, request)
        n_gen = options.best_of or body.n
        in_think = reasoning_formats.starts_in_reasoning(served.reasoning_format, rendered.text)
        constraint_after = None
        if constraint is not None and in_think:
            constraint_after = served.tokenizer.convert_tokens_to_ids("</think>")
        gen = GenerateRequest(self._engine_key(rid), tuple(ids), params, constraint, n_gen, body.priority,
                              body.cache_salt, constraint_after, ticket.deadline,
                              client_id(request), predicted, items, mrope)
        started = time.monotonic()
        generation = await self._start(served, gen)
        tools = served.tool_format if body.tools and body.tool_choice != "none" else None
        if tools is not None and tools.needs_special_tokens and any(
                m in served.tokenizer.all_special_tokens for m in tools.opens):
            # the family's marker is a special token: as vLLM, the text keeps special tokens
            options = dataclasses.replace(options, skip_special_tokens=False)
        schemas = {t.function.name: t.function.parameters or {} for t in body.tools or ()}
        token_text = TokenText(served.tokenizer, options.return_tokens_as_token_ids)

        def parser() -> OutputParser:
            return OutputParser(served.reasoning_format, body.include_reasoning, tools,
                                start_in_reasoning=in_think,
                                parallel_tool_calls=body.parallel_tool_calls, schemas=schemas)
        states = [ChoiceState(i, served.tokenizer, served.fast, options, parser(), token_text,
                              predicted=body.prediction is not None)
                  for i in range(n_gen)]
        echo = ""
        # vLLM echoes the last message when its role is the response's role: the assistant's,
        # or the last message's own when no generation prompt opens a new turn
        if options.echo and (not body.add_generation_prompt
                             or body.messages[-1].role == "assistant"):
            echo = chat.text_of(body.messages[-1], len(body.messages) - 1,
                                skip_media=True) or ""
        headers = self._id_header(body, request)
        timeout = options.timeout_s or self.config.request_timeout_s
        if options.stream:
            return StreamingResponse(
                self._chat_stream(served, generation, states, rid, options, ids, echo, started,
                                  timeout),
                media_type="text/event-stream", headers=headers)
        await self._drain(served, generation, states, timeout, started)
        self.metrics.observe_request(served.name, started, states, len(ids))
        chosen = self._best(states, body.n, options)
        choices = []
        for new_index, st in enumerate(chosen):
            msg = ResponseMessage(content=None, reasoning_content=None)
            content = echo + st.content
            msg.content = content if (content or not st.parser.tool_calls) else None
            if st.reasoning:
                msg.reasoning_content = st.reasoning
            msg.tool_calls = [ResponseToolCall(id=c.id, function=ResponseFunctionCall(
                name=c.name, arguments=c.arguments)) for c in st.parser.tool_calls]
            choices.append(ChatChoice(
                index=new_index, message=msg,
                logprobs=ChoiceLogprobs(content=st.logprobs) if options.logprobs else None,
                finish_reason=st.finish_reason, stop_reason=st.stop_reason,
                token_ids=st.token_ids if options.return_token_ids else None))
        response = ChatCompletion(
            # as vLLM, with best_of only the choices returned count
            id=rid, model=served.name, choices=choices, usage=self._usage(chosen, ids),
            prompt_token_ids=ids if options.return_token_ids else None,
            prompt_logprobs=prompt_logprobs_json(states[0].prompt_logprobs, ids, token_text))
        return JSONResponse(response.model_dump(exclude_none=False), headers=headers)

    @staticmethod
    def _usage(states: list[ChoiceState], ids: list[int]) -> Usage:
        completion = sum(len(s.token_ids) for s in states)
        cached = max((s.num_cached_tokens for s in states), default=0)
        details = None
        if any(s.predicted for s in states):
            details = CompletionTokensDetails(
                accepted_prediction_tokens=sum(s.accepted_prediction_tokens for s in states),
                rejected_prediction_tokens=sum(s.rejected_prediction_tokens for s in states))
        return Usage(prompt_tokens=len(ids), completion_tokens=completion,
                     total_tokens=len(ids) + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                     completion_tokens_details=details)

    @staticmethod
    def _best(states: list[ChoiceState], n: int,
              options: sampling.OutputOptions) -> list[ChoiceState]:
        if options.best_of is None or options.best_of == n:
            return states[:n]
        ranked = sorted(states, key=lambda s: s.score(options.length_penalty), reverse=True)
        return ranked[:n]

    async def _drain(self, served: ServedModel, generation: Generation,
                     states: list[ChoiceState], timeout: float, started: float) -> None:
        """Non-streaming: runs the generation to its end, each state accumulating its output."""
        first = True
        async with contextlib.aclosing(generation.deltas(states, timeout)) as deltas:
            async for _ in deltas:
                if first:
                    first = False
                    self.metrics.observe_first_token(served.name, started)

    async def _chat_stream(self, served: ServedModel, generation: Generation,
                           states: list[ChoiceState], rid: str, options: sampling.OutputOptions,
                           ids: list[int], echo: str, started: float,
                           timeout: float) -> AsyncIterator[str]:
        created = int(time.time())
        sent_role = [False] * len(states)
        # chunks that are a delta's content and nothing else (no logprobs, token ids or usage)
        contents = ContentChunks(rid, created, served.name)
        plain = not (options.logprobs or options.return_token_ids
                     or options.continuous_usage_stats)

        def chunk(choice: ChunkChoice, usage: Usage | None = None,
                  prompt_token_ids: list[int] | None = None) -> str:
            return sse(ChatCompletionChunk(id=rid, created=created, model=served.name,
                                           choices=[choice], usage=usage,
                                           prompt_token_ids=prompt_token_ids))
        try:
            async with contextlib.aclosing(generation.deltas(states, timeout)) as deltas:
                async for st, delta in deltas:
                    if not sent_role[st.index]:
                        sent_role[st.index] = True
                        self.metrics.observe_first_token(served.name, started)
                        # as vLLM, each choice's first chunk carries the prompt's token ids
                        yield chunk(ChunkChoice(index=st.index, delta=Delta(
                            role="assistant", content=echo)),
                            Usage(prompt_tokens=len(ids), completion_tokens=0,
                                  total_tokens=len(ids))
                            if options.continuous_usage_stats else None,
                            ids if options.return_token_ids else None)
                    if not (delta.content or delta.reasoning or delta.tool_calls
                            or delta.finish_reason or delta.logprobs or options.return_token_ids):
                        continue  # held text (a partial character or stop string)
                    if plain and delta.content and not (
                            delta.reasoning or delta.tool_calls or delta.finish_reason
                            or delta.stop_reason is not None):
                        yield contents.event(st.index, delta.content)
                        continue
                    usage = self._usage(states, ids) if options.continuous_usage_stats else None
                    yield chunk(self._chunk_choice(delta, options), usage)
                if options.include_usage:
                    yield sse(ChatCompletionChunk(id=rid, created=created, model=served.name,
                                                  choices=[], usage=self._usage(states, ids)))
                self.metrics.observe_request(served.name, started, states, len(ids))
        except APIError as exc:  # after the 200: the error travels in the stream
            yield exc.sse()
        yield DONE

    @staticmethod
    def _chunk_choice(delta: ChoiceDelta, options: sampling.OutputOptions) -> ChunkChoice:
        d = Delta()
        if delta.content or not (delta.reasoning or delta.tool_calls):
            d.content = delta.content
        if delta.reasoning:
            d.reasoning_content = delta.reasoning
        if delta.tool_calls:
            d.tool_calls = [DeltaToolCall(index=c.index, id=c.id, type="function",
                                          function=DeltaToolCallFunction(name=c.name,
                                                                         arguments=c.arguments))
                            for c in delta.tool_calls]
        return ChunkChoice(
            index=delta.index, delta=d,
            logprobs=ChoiceLogprobs(content=delta.logprobs) if options.logprobs else None,
            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
            token_ids=delta.token_ids if options.return_token_ids else None)

    # ---- /v1/completions -----------------------------------------------------------------------
    @app.post("/v1/completions",
              openapi_extra=openapi.body(CompletionRequest, streams=True))
    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        served = self.registry.resolve(body.model)
        ticket = self._admit(served, request)
        return await self._admitted(ticket, self._complete(request, body, served, ticket))

    async def _complete(self, request: Request, body: CompletionRequest, served: ServedModel,
                        ticket: Ticket) -> Response:
        limits = await self._limits(served)
        prompts = await self.pre.run(self._prompts, body, served, limits)
        if len(prompts) > 1 and body.stream:
            raise APIError("streaming supports one prompt per request", param="prompt")
        constraint = sampling.constraint_of(body)
        if constraint is not None:
            await self.pre.run(check_constraint_early, constraint)
        rid = self._request_id("cmpl", body, request)
        headers = self._id_header(body, request)
        timeout = body.inference_timeout or self.config.request_timeout_s
        started = time.monotonic()
        built = []
        for ids in prompts:  # validate every prompt before starting any
            built.append(await self.pre.run(sampling.build, body, prompt_len=len(ids),
                                            limits=limits, tokenizer=served.tokenizer, chat=False))
        # every prompt is an engine request of its own, all started at once (as vLLM); one that
        # cannot start fails the whole request
        starts = await asyncio.gather(*(self._start_beside(served, GenerateRequest(
            self._engine_key(f"{rid}-{p_index}"), tuple(ids), params, constraint,
            options.best_of or body.n, body.priority, body.cache_salt,
            deadline=ticket.deadline, client=client_id(request)))
            for p_index, (ids, (params, options)) in enumerate(zip(prompts, built))),
            return_exceptions=True)
        failed = next((g for g in starts if isinstance(g, BaseException)), None)
        if failed is not None:
            for g in starts:
                if isinstance(g, Generation):
                    g.cancel()
            raise failed
        options = built[0][1]
        token_text = TokenText(served.tokenizer, options.return_tokens_as_token_ids)
        runs = []
        for ids, (_, options), generation in zip(prompts, built, starts):
            states = [ChoiceState(i, served.tokenizer, served.fast, options,
                                  OutputParser(None, False, None), token_text)
                      for i in range(options.best_of or body.n)]
            runs.append((ids, options, generation, states,
                         served.tokenizer.decode(ids) if options.echo else ""))
        if options.stream:
            ids, options, generation, states, echo = runs[0]
            return StreamingResponse(
                self._completion_stream(served, generation, states, rid, options, ids, echo,
                                        timeout, started, token_text),
                media_type="text/event-stream", headers=headers)
        try:
            async with asyncio.TaskGroup() as group:
                for _, _, generation, states, _ in runs:
                    group.create_task(self._drain(served, generation, states, timeout, started))
        except BaseExceptionGroup as errors:  # the first failure; the others were cancelled
            raise errors.exceptions[0] from None
        choices: list[CompletionChoice] = []
        usage = Usage()
        for ids, options, _, states, echo in runs:
            self.metrics.observe_request(served.name, started, states, len(ids))
            chosen = self._best(states, body.n, options)
            prompt_entries = states[0].prompt_logprobs  # computed once, on choice 0
            for st in chosen:
                echoed = ((ids, prompt_entries, token_text, options.top_logprobs)
                          if options.echo else None)
                choices.append(CompletionChoice(
                    index=len(choices), text=echo + st.content,
                    logprobs=(completion_logprobs(st.logprobs, len(echo), echoed)
                              if options.logprobs else None),
                    finish_reason=st.finish_reason, stop_reason=st.stop_reason,
                    token_ids=st.token_ids if options.return_token_ids else None,
                    prompt_token_ids=ids if options.return_token_ids else None,
                    prompt_logprobs=(prompt_logprobs_json(prompt_entries, ids, token_text)
                                     if body.prompt_logprobs is not None else None)))
            u = self._usage(chosen, ids)  # as vLLM, with best_of only the choices returned
            usage.prompt_tokens += u.prompt_tokens
            usage.completion_tokens += u.completion_tokens
            usage.total_tokens += u.total_tokens
        return JSONResponse(Completion(id=rid, model=served.name, choices=choices,
                                       usage=usage).model_dump(), headers=headers)

    def _prompts(self, body: CompletionRequest, served: ServedModel,
                 limits: sampling.ServerLimits) -> list[list[int]]:
        p = body.prompt
        add = True if body.add_special_tokens is None else body.add_special_tokens
        if isinstance(p, str):
            raw = [served.tokenizer.encode(p, add_special_tokens=add)]
        elif p and all(isinstance(x, int) for x in p):
            raw = [list(p)]  # type: ignore[arg-type]
        elif p and all(isinstance(x, str) for x in p):
            raw = [served.tokenizer.encode(x, add_special_tokens=add) for x in p]  # type: ignore
        elif p and all(isinstance(x, list) for x in p):
            raw = [list(x) for x in p]  # type: ignore[arg-type]
        else:
            raise APIError("prompt must be a string, a list of strings, a list of token ids "
                           "or a list of lists of token ids, and not empty", param="prompt")
        out = []
        for ids in raw:
            if not ids:
                raise APIError("a prompt is empty", param="prompt")
            bad = [t for t in ids if not 0 <= t < limits.vocab_size]
            if bad:
                raise APIError(f"prompt token ids {bad[:5]} are out of the vocabulary "
                               f"(size {limits.vocab_size})", param="prompt")
            out.append(chat.truncate(ids, body.truncate_prompt_tokens, limits.max_model_len))
        return out

    async def _completion_stream(self, served: ServedModel, generation: Generation,
                                 states: list[ChoiceState], rid: str,
                                 options: sampling.OutputOptions, ids: list[int], echo: str,
                                 timeout: float, started: float,
                                 token_text: TokenText) -> AsyncIterator[str]:
        created = int(time.time())
        echoed = [False] * len(states)
        offsets = [len(echo)] * len(states)  # text_offset of each choice's next token

        def chunk(choices: list[dict], usage: Usage | None = None) -> str:
            obj: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                   "model": served.name, "choices": choices}
            if usage is not None:
                obj["usage"] = usage.model_dump()
            return sse(obj)
        try:
            async with contextlib.aclosing(generation.deltas(states, timeout)) as deltas:
                async for st, delta in deltas:
                    text = delta.content
                    first = not echoed[st.index]
                    if first:
                        echoed[st.index] = True
                        self.metrics.observe_first_token(served.name, started)
                        text = echo + text
                    c: dict[str, Any] = {"index": st.index, "text": text,
                                         "finish_reason": delta.finish_reason,
                                         "stop_reason": delta.stop_reason, "logprobs": None}
                    if options.logprobs:
                        prompt = ((ids, states[0].prompt_logprobs, token_text,
                                   options.top_logprobs) if first and options.echo else None)
                        lp = completion_logprobs(delta.logprobs, offsets[st.index], prompt)
                        offsets[st.index] += sum(len(e.token) for e in delta.logprobs)
                        c["logprobs"] = lp.model_dump()
                    if options.return_token_ids:
                        c["token_ids"] = delta.token_ids
                    yield chunk([c], self._usage(states, ids)
                                if options.continuous_usage_stats else None)
                if options.include_usage:
                    yield chunk([], self._usage(states, ids))
                self.metrics.observe_request(served.name, started, states, len(ids))
        except APIError as exc:  # after the 200: the error travels in the stream
            yield exc.sse()
        yield DONE
