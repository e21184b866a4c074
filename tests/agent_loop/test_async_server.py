import asyncio
import json
import os
from pathlib import Path

import pytest

from arpo.agent_loop.async_server import AsyncEngineServer, build_engine
from arpo.agent_loop.server_manager import ServerManager
from arpo.engine.base import SamplingParams
from tests.agent_loop.helpers import hermes_call
from arpo.testing.scripted_engine import ScriptedEngine

REPO = str(Path(__file__).resolve().parents[2])
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "web search",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def test_openai_client_talks_to_the_in_process_endpoint(tokenizer):
    import openai

    engine = ScriptedEngine(tokenizer, replies=["Paris is the capital.", hermes_call("search", query="Paris")])
    server = AsyncEngineServer(engine, tokenizer=tokenizer, model_name="tiny")

    async def go():
        base = await server.start_http()
        assert base.startswith("http://127.0.0.1:")
        client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
        try:
            models = await client.models.list()
            reply = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "capital of France?"}], max_tokens=32, n=2)
            # second turn: the model's reply is a hermes call, returned as OpenAI tool_calls
            called = await client.chat.completions.create(
                model="tiny", tools=[SEARCH_TOOL], max_tokens=64, messages=[
                    {"role": "user", "content": "capital of France?"},
                    {"role": "assistant", "content": "Paris is the capital."},
                    {"role": "user", "content": "check it"}])
            with pytest.raises(openai.BadRequestError, match="stream"):
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                     stream=True)
            return models, reply, called
        finally:
            await client.close()
            await server.stop_http()

    models, reply, called = asyncio.run(go())
    assert [m.id for m in models.data] == ["tiny"]
    assert len(reply.choices) == 2 and reply.choices[0].message.content == "Paris is the capital."
    assert reply.choices[0].finish_reason == "stop"
    prompt_ids = engine.requests[0].prompt_ids
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == 2 * len(engine.requests[0].output_ids)
    # the server applied the tokenizer's chat template to the messages
    assert tokenizer.decode(prompt_ids, skip_special_tokens=False) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "capital of France?"}], add_generation_prompt=True, tokenize=False)
    assert called.choices[0].finish_reason == "tool_calls"
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "search" and json.loads(call.function.arguments) == {"query": "Paris"}
    assert "<tools>" in tokenizer.decode(engine.requests[-1].prompt_ids)
    assert server.address is None


def test_build_engine_accepts_instances_factories_and_paths(tokenizer):
    engine = ScriptedEngine(tokenizer)
    assert build_engine(engine) is engine
    built = build_engine(ScriptedEngine, {"tokenizer": tokenizer, "replies": ["x"]})
    assert built.replies == ["x"]
    assert build_engine("arpo.testing.scripted_engine:ScriptedEngine", {"tokenizer": tokenizer}).replies is None
    with pytest.raises(ValueError, match="engine_kwargs"):
        build_engine(engine, {"x": 1})
    with pytest.raises(ValueError, match="FactoryName"):
        build_engine("nodots")


@pytest.mark.slow
def test_ray_actors_serve_tokens_and_chat_completions(ray_cluster, tokenizer_dir, tokenizer):
    import openai
    from arpo.agent_loop.async_server import launch_ray_servers

    ray = ray_cluster
    handles = launch_ray_servers(2, "arpo.testing.scripted_engine:ScriptedEngine",
                                 {"tokenizer": tokenizer_dir, "replies": ["from the actor"]},
                                 tokenizer=tokenizer_dir, model_name="tiny", num_cpus=0)
    manager = ServerManager(handles)
    prompt = list(tokenizer.encode("hello there", add_special_tokens=False))

    async def go():
        outs = await asyncio.gather(*(manager.generate(f"s{i}", prompt, SamplingParams(max_tokens=16))
                                      for i in range(6)))
        await manager.reset_prefix_cache()
        return outs

    outs = asyncio.run(go())
    expected = list(tokenizer.encode("from the actor", add_special_tokens=False)) + [tokenizer.eos_token_id]
    assert all(o.token_ids == expected for o in outs)
    assert manager.num_requests == [3, 3]

    base = ray.get(handles[0].start_http.remote())
    assert base.startswith("http://127.0.0.1:")
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    client.close()
    cut = expected[:8] if len(expected) > 8 else expected
    assert reply.choices[0].message.content == tokenizer.decode(cut, skip_special_tokens=True)
    assert reply.usage.completion_tokens == len(cut)
    assert reply.choices[0].finish_reason == ("length" if len(expected) > 8 else "stop")
    ray.get(handles[0].stop_http.remote())
    for h in handles:
        ray.kill(h)
