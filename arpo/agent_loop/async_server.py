"""An engine server: token-in-token-out ``generate`` plus an OpenAI ``/v1/chat/completions`` endpoint.

:class:`AsyncEngineServer` owns one engine. Used directly it is an in-process server; wrapped with
``ray.remote`` (see :func:`launch_ray_servers`) it is one actor per engine replica, built inside the
actor process so the engine (vLLM, CUDA state) never crosses a pickle boundary. The HTTP endpoint runs
on the same event loop as the engine, so chat-completions traffic shares the engine's batching and
prefix cache with the trainer's token-level calls.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import socket
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from arpo.agent_loop.tool_parsers import HERMES_CLOSE, HERMES_OPEN, HermesToolParser
from arpo.engine.base import GenerationEngine, GenerationOutput, SamplingParams

logger = logging.getLogger(__name__)

EngineSpec = GenerationEngine | Callable[..., GenerationEngine] | str


def build_engine(engine: EngineSpec, engine_kwargs: dict[str, Any] | None = None) -> GenerationEngine:
    """An engine from an instance, a class/factory (called with ``engine_kwargs``) or "module:attr"."""
    if isinstance(engine, str):
        module_name, sep, attr = engine.partition(":") if ":" in engine else engine.rpartition(".")
        if not sep or not module_name or not attr:
            raise ValueError(f"engine={engine!r}: use 'package.module:FactoryName'")
        engine = getattr(importlib.import_module(module_name), attr)
    if isinstance(engine, type) or (callable(engine) and not hasattr(engine, "generate")):
        engine = engine(**(engine_kwargs or {}))
    elif engine_kwargs:
        raise ValueError("engine_kwargs given with an engine instance; pass the class or factory instead")
    if not hasattr(engine, "generate"):
        raise ValueError(f"{type(engine).__name__} has no generate(); it must implement GenerationEngine")
    return engine  # type: ignore[return-value]


class AsyncEngineServer:
    """One engine replica with the GenerationEngine methods and an optional chat-completions endpoint."""

    def __init__(self, engine: EngineSpec, engine_kwargs: dict[str, Any] | None = None,
                 tokenizer: Any = None, model_name: str = "arpo-policy"):
        self.engine = build_engine(engine, engine_kwargs)
        self._tokenizer = tokenizer
        self.model_name = model_name
        self._http: Any = None
        self._http_task: asyncio.Task | None = None
        self.address: str | None = None

    # ------------------------------------------------------------------ GenerationEngine methods

    async def generate(self, prompt_ids: list[int], sampling_params: SamplingParams,
                       request_id: str) -> GenerationOutput:
        return await self.engine.generate(prompt_ids, sampling_params, request_id)

    async def update_weights(self, weights: Any) -> None:
        await self.engine.update_weights(weights)

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    # ------------------------------------------------------------------------------------- HTTP

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise ValueError("the chat-completions endpoint needs a tokenizer: pass tokenizer= (object or path)")
        if isinstance(self._tokenizer, str):
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer)
        return self._tokenizer

    async def start_http(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve ``/v1/chat/completions`` on ``host:port`` (0: a free port); returns the base URL ``…/v1``."""
        if self.address is not None:
            return self.address
        import uvicorn
        self.tokenizer  # fail now, not on the first request
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        config = uvicorn.Config(build_chat_app(self), log_level="warning", lifespan="off")
        self._http = uvicorn.Server(config)
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()  # re-raises the startup error
                raise RuntimeError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)
        bound_host, bound_port = sock.getsockname()[:2]
        self.address = f"http://{bound_host}:{bound_port}/v1"
        logger.info("chat completions at %s", self.address)
        return self.address

    async def stop_http(self) -> None:
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            await self._http_task
        self._http, self._http_task, self.address = None, None, None

    def get_address(self) -> str | None:
        return self.address

    async def chat_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """One OpenAI chat-completions request (the JSON body) → the response JSON."""
        req = _ChatRequest.parse(body)
        tok = self.tokenizer
        text = tok.apply_chat_template(req.messages, tools=req.tools, add_generation_prompt=True, tokenize=False)
        prompt_ids = list(tok.encode(text, add_special_tokens=False))
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_tokens,
                                stop=req.stop, seed=req.seed)
        outs = await asyncio.gather(*(self.engine.generate(prompt_ids, params, f"chatcmpl-{uuid.uuid4().hex}")
                                      for _ in range(req.n)))
        tool_names = [t["function"]["name"] for t in (req.tools or []) if "function" in t]
        choices = [self._choice(i, out, tool_names) for i, out in enumerate(outs)]
        completion_tokens = sum(len(o.token_ids) for o in outs)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or self.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens},
        }

    def _choice(self, index: int, out: GenerationOutput, tool_names: list[str]) -> dict[str, Any]:
        text = self.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = out.finish_reason if out.finish_reason in ("stop", "length") else "stop"
        if tool_names and HERMES_OPEN in text:
            calls = [c for c in HermesToolParser(tool_names).parse(text) if c.error is None]
            if calls:
                message["tool_calls"] = [
                    {"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
                     "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
                head = text.split(HERMES_OPEN, 1)[0].strip()
                tail = text.rsplit(HERMES_CLOSE, 1)[-1].strip()
                message["content"] = " ".join(p for p in (head, tail) if p) or None
                finish = "tool_calls"
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": None}


class _ChatRequest:
    """The chat-completions fields we honour; anything unsupported is refused with a 400, not ignored."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)

    @classmethod
    def parse(cls, body: Any) -> "_ChatRequest":
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of chat messages")
        if body.get("stream"):
            raise ValueError("'stream': true is not supported; request a complete response")
        n = int(body.get("n") or 1)
        if n < 1:
            raise ValueError("'n' must be >= 1")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 256
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        temperature = body.get("temperature")
        top_p = body.get("top_p")
        return cls(
            model=body.get("model"),
            messages=[_plain_message(m) for m in messages],
            tools=body.get("tools") or None,
            n=n,
            max_tokens=int(max_tokens),
            stop=stop,
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            seed=body.get("seed"),
        )


def _plain_message(message: Any) -> dict[str, Any]:
    """Flatten OpenAI content parts to text, which is what text chat templates expect."""
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"each message needs a 'role': got {message!r}")
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out = {**message, "content": content if content is not None else ""}
    if out.get("tool_calls"):  # templates expect arguments as objects, the API sends JSON strings
        calls = []
        for call in out["tool_calls"]:
            fn = dict(call.get("function", {}))
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


def build_chat_app(server: AsyncEngineServer):
    """The FastAPI app: ``POST /v1/chat/completions`` and ``GET /v1/models``."""
    app = FastAPI(title="arpo engine server")

    def error(status: int, message: str, kind: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            status_code=status)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return error(400, "the request body is not valid JSON", "invalid_request_error")
        try:
            return JSONResponse(await server.chat_completion(body))
        except ValueError as err:
            return error(400, str(err), "invalid_request_error")
        except Exception as err:  # report, do not kill the server
            logger.exception("chat completion failed")
            return error(500, f"{type(err).__name__}: {err}", "server_error")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "arpo"}]}

    return app


def launch_ray_servers(num_servers: int, engine: EngineSpec, engine_kwargs: dict[str, Any] | None = None,
                       tokenizer: str | None = None, model_name: str = "arpo-policy",
                       num_cpus: float = 1, num_gpus: float = 0) -> list[Any]:
    """Start ``num_servers`` AsyncEngineServer actors (Ray must be initialised); returns their handles."""
    import ray

    if num_servers < 1:
        raise ValueError(f"num_servers={num_servers}: must be >= 1")
    actor_cls = ray.remote(AsyncEngineServer).options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=4096)
    handles = [actor_cls.remote(engine, engine_kwargs, tokenizer, model_name) for _ in range(num_servers)]
    ray.get([h.get_address.remote() for h in handles])  # surface constructor errors here
    return handles
