"""What real client libraries get from a running server: the openai SDK (`.parse`, the stream
helper, tools), langchain (`with_structured_output`, `bind_tools`, streaming), instructor and
litellm, each as its README shows it, against one model at its served defaults.

The libraries are not shardserve's dependencies: run this from a venv that has them
(`pip install openai langchain-openai instructor litellm`):

    python benchmarks/client_checks.py --base-url http://127.0.0.1:8000/v1 \\
        --model shardserve/smollm2-135m-instruct

Each check prints ok or what went wrong (an exception, a reply cut at max_tokens, a value that
does not validate); the last line counts them."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

MAX_TOKENS = 200


class Person(BaseModel):
    name: str
    age: int


class Fruits(BaseModel):
    fruits: list[str] = Field(max_length=5)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
PERSON_PROMPT = "Ann is 30 years old. Give her name and age."
WEATHER_PROMPT = "What is the weather in Paris?"


def _complete(choice: Any) -> None:
    if choice.finish_reason == "length":
        raise AssertionError(f"cut at max_tokens: {choice.message.content!r:.80}")


def checks(base_url: str, model: str) -> dict[str, Callable[[], str]]:
    from openai import OpenAI
    client = OpenAI(base_url=base_url, api_key="none")
    user = [{"role": "user", "content": "What is the capital of France?"}]

    def openai_create() -> str:
        r = client.chat.completions.create(model=model, messages=user, max_tokens=MAX_TOKENS)
        _complete(r.choices[0])
        assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
        return r.choices[0].message.content

    def openai_parse() -> str:
        r = client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": PERSON_PROMPT}],
            response_format=Person, max_tokens=MAX_TOKENS)
        _complete(r.choices[0])
        assert isinstance(r.choices[0].message.parsed, Person)
        return repr(r.choices[0].message.parsed)

    def openai_stream_helper() -> str:
        with client.chat.completions.stream(model=model, messages=user,
                                            max_tokens=MAX_TOKENS) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        _complete(final.choices[0])
        return final.choices[0].message.content

    def openai_tool(choice: Any) -> Callable[[], str]:
        def run() -> str:
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": WEATHER_PROMPT}],
                tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=MAX_TOKENS)
            calls = r.choices[0].message.tool_calls
            assert calls, f"no tool call: {r.choices[0].message.content!r:.80}"
            args = json.loads(calls[0].function.arguments)
            assert calls[0].function.name == "get_weather" and "city" in args, args
            return f"{calls[0].function.name}({args})"
        return run

    def langchain_llm() -> Any:
        from langchain_openai import ChatOpenAI
        return ChatOpenAI(model=model, base_url=base_url, api_key="none",
                          max_tokens=MAX_TOKENS)

    def langchain_invoke() -> str:
        reply = langchain_llm().invoke("What is the capital of France?")
        assert "Paris" in reply.content, reply.content
        return reply.content

    def langchain_stream() -> str:
        text = "".join(chunk.content for chunk in langchain_llm().stream("Say hello."))
        assert text.strip(), "empty stream"
        return text

    def langchain_structured(method: str) -> Callable[[], str]:
        def run() -> str:
            out = langchain_llm().with_structured_output(Person, method=method).invoke(
                PERSON_PROMPT)
            assert isinstance(out, Person), out
            return repr(out)
        return run

    def langchain_tools() -> str:
        from langchain_core.tools import tool

        @tool
        def get_weather(city: str) -> str:
            """Current weather in a city"""
            return "sunny"

        reply = langchain_llm().bind_tools([get_weather], tool_choice="any").invoke(
            WEATHER_PROMPT)
        assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather", reply
        return repr(reply.tool_calls[0])

    def instructor_model(response_model: type[BaseModel], prompt: str) -> Callable[[], str]:
        def run() -> str:
            import instructor
            patched = instructor.from_openai(OpenAI(base_url=base_url, api_key="none"),
                                             mode=instructor.Mode.JSON_SCHEMA)
            out = patched.chat.completions.create(
                model=model, response_model=response_model, max_retries=0,
                messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS)
            assert isinstance(out, response_model), out
            return repr(out)
        return run

    def litellm_call(stream: bool) -> Callable[[], str]:
        def run() -> str:
            import litellm
            r = litellm.completion(model=f"openai/{model}", api_base=base_url, api_key="none",
                                   messages=user, max_tokens=MAX_TOKENS, stream=stream)
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in r)
            else:
                _complete(r.choices[0])
                text = r.choices[0].message.content
            assert "Paris" in text, text
            return text
        return run

    return {
        "openai create": openai_create,
        "openai .parse (Person)": openai_parse,
        "openai stream helper": openai_stream_helper,
        "openai tools, tool_choice=required": openai_tool("required"),
        "openai tools, named tool_choice": openai_tool(
            {"type": "function", "function": {"name": "get_weather"}}),
        "langchain invoke": langchain_invoke,
        "langchain stream": langchain_stream,
        "langchain with_structured_output (json_schema)": langchain_structured("json_schema"),
        "langchain with_structured_output (function_calling)":
            langchain_structured("function_calling"),
        "langchain bind_tools": langchain_tools,
        "instructor (Person)": instructor_model(Person, PERSON_PROMPT),
        "instructor (Fruits, list of at most 5)": instructor_model(
            Fruits, "List some fruits."),
        "litellm completion": litellm_call(False),
        "litellm stream": litellm_call(True),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="shardserve/smollm2-135m-instruct")
    args = p.parse_args()
    passed = 0
    todo = checks(args.base_url, args.model)
    for name, check in todo.items():
        started = time.monotonic()
        try:
            detail = check()
            passed += 1
            status = "ok  "
        except Exception as exc:  # any failure is a result to print, not a crash
            detail, status = f"{type(exc).__name__}: {exc}", "FAIL"
        print(f"{status} {name} ({time.monotonic() - started:.1f} s): "
              f"{' '.join(str(detail).split())[:120]}", flush=True)
    print(f"{passed} of {len(todo)} checks passed")


if __name__ == "__main__":
    main()
