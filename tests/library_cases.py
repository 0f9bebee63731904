"""Structured extraction through the client libraries people put on top of the OpenAI API: 20 prompts (a
person, a city, an invoice with line items, a list of three things, nested objects, enums, optional fields,
numbers, booleans), each run through instructor (TOOLS, JSON_SCHEMA, JSON), LangChain (with_structured_output
by json_schema and by function_calling, bind_tools) and the OpenAI Agents SDK (output_type), against a forge
daemon. A case parses when the library hands back a valid instance of the model (for bind_tools: a tool call
whose arguments validate). Shared by tests/integration/test_client_libraries.py and the parse-rate script in
scripts/ (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import httpx
import pydantic

MAX_TOKENS = 200
SEED = 7


class Person(pydantic.BaseModel):
    name: str
    age: int


class City(pydantic.BaseModel):
    name: str
    country: str
    population_millions: float


class LineItem(pydantic.BaseModel):
    product: str
    quantity: int
    unit_price: float


class Invoice(pydantic.BaseModel):
    customer: str
    items: list[LineItem]


class Colours(pydantic.BaseModel):
    colours: list[str]


class Review(pydantic.BaseModel):
    product: str
    rating: int
    sentiment: Literal["positive", "negative", "neutral"]


class Book(pydantic.BaseModel):
    title: str
    author: str
    year: int
    in_print: bool


class Address(pydantic.BaseModel):
    street: str
    city: str
    country: str


class Company(pydantic.BaseModel):
    name: str
    headquarters: Address


class Contact(pydantic.BaseModel):
    name: str
    email: str
    phone: str | None = None


class Flight(pydantic.BaseModel):
    number: str
    origin: str
    destination: str
    delayed: bool


@dataclass(frozen=True, slots=True)
class Case:
    model: type[pydantic.BaseModel]
    text: str


CASES = [
    Case(Person, "John Smith is 42 years old."),
    Case(Person, "Our new neighbour, Maria Garcia, turned 31 last week."),
    Case(City, "Paris, the capital of France, has about 2.1 million inhabitants."),
    Case(City, "Tokyo in Japan is home to roughly 14 million people."),
    Case(Invoice, "Invoice for Acme Ltd: 3 hammers at 12.50 each and 2 saws at 30.00 each."),
    Case(Invoice, "Bob bought 1 laptop for 999.99."),
    Case(Colours, "Name three colours of the French flag."),
    Case(Colours, "The traffic light shows red, amber and green."),
    Case(Review, "The Zen headphones are wonderful, five stars, I love them."),
    Case(Review, "The ToastMaster 2000 burnt my bread. One star."),
    Case(Book, "'Dune' by Frank Herbert was published in 1965 and is still in print."),
    Case(Book, "The 1851 novel Moby-Dick by Herman Melville is still sold today."),
    Case(Company, "Globex is headquartered at 12 Main Street, Springfield, in the USA."),
    Case(Company, "Initech has its head office at 4 Elm Road in London, United Kingdom."),
    Case(Contact, "You can reach Ann Lee at ann.lee@example.com or on 555-0100."),
    Case(Contact, "Write to Tom Baker: tom@example.org."),
    Case(Flight, "Flight BA117 from London to New York is delayed by two hours."),
    Case(Flight, "LH400 leaves Frankfurt for New York on time."),
    Case(Person, "Extract the person: Dr. Ahmed Khan, aged 57."),
    Case(City, "Oslo, Norway: population 0.7 million."),
]

INSTRUCTION = "Extract the information from the user's text."

Mode = Callable[[str, str, Case, float], Awaitable[str | None]]   # None: parsed; else why not


def _messages(case: Case) -> list[dict[str, str]]:
    return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": case.text}]


def _sampling(temperature: float) -> dict[str, Any]:
    return {"temperature": temperature, "seed": SEED, "max_tokens": MAX_TOKENS}


def _instructor(mode_name: str) -> Mode:
    async def run(base_url: str, model: str, case: Case, temperature: float) -> str | None:
        import instructor
        import openai

        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as raw:
            client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode_name))
            try:
                out = await client.chat.completions.create(model=model, response_model=case.model, max_retries=0,
                                                           messages=_messages(case), **_sampling(temperature))
            except Exception as exc:
                return _why(exc)
            return None if isinstance(out, case.model) else f"got {out!r}"
    return run


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _langchain(method: str) -> Mode:
    async def run(base_url: str, model: str, case: Case, temperature: float) -> str | None:
        async with httpx.AsyncClient() as http:
            llm = _chat_openai(base_url, model, temperature, http)
            try:
                out = await llm.with_structured_output(case.model, method=method).ainvoke(  # type: ignore[arg-type]
                    _messages(case))
            except Exception as exc:
                return _why(exc)
        return None if isinstance(out, case.model) else f"got {out!r}"
    return run


def _chat_openai(base_url: str, model: str, temperature: float, http: httpx.AsyncClient) -> Any:
    """LangChain's client on an HTTP client the caller closes: its default one is cached for the process
    per base URL and never closed, so a test server's connections would be left for the collector (an
    unclosed-socket ResourceWarning in whichever test runs then)."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model, base_url=base_url, api_key="x", max_retries=0, seed=SEED,  # type: ignore[arg-type]
                      temperature=temperature, max_tokens=MAX_TOKENS, http_async_client=http)  # type: ignore[call-arg]


async def _langchain_bind_tools(base_url: str, model: str, case: Case, temperature: float) -> str | None:
    async with httpx.AsyncClient() as http:
        llm = _chat_openai(base_url, model, temperature, http)
        try:
            reply = await llm.bind_tools([case.model], tool_choice="required").ainvoke(_messages(case))
            calls = reply.tool_calls  # type: ignore[attr-defined]
            if not calls or any(c["name"] != case.model.__name__ for c in calls):
                return f"calls {calls!r}, invalid {getattr(reply, 'invalid_tool_calls', None)!r}"[:300]
            for call in calls:
                case.model.model_validate(call["args"])
        except Exception as exc:
            return _why(exc)
    return None


async def _agents(base_url: str, model: str, case: Case, temperature: float) -> str | None:
    import openai
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        agent = Agent(name="extractor", instructions=INSTRUCTION, output_type=case.model,
                      model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                      model_settings=ModelSettings(temperature=temperature, max_tokens=MAX_TOKENS,
                                                   extra_args={"seed": SEED}))
        try:
            result = await Runner.run(agent, case.text, max_turns=1)
        except Exception as exc:
            return _why(exc)
        return None if isinstance(result.final_output, case.model) else f"got {result.final_output!r}"


# Library mode -> its runner. instructor's JSON mode asks for JSON (response_format json_object) and puts the
# schema in the prompt: the output is constrained to JSON, not to the schema.
MODES: dict[str, Mode] = {
    "instructor TOOLS": _instructor("TOOLS"),
    "instructor JSON_SCHEMA": _instructor("JSON_SCHEMA"),
    "instructor JSON": _instructor("JSON"),
    "langchain json_schema": _langchain("json_schema"),
    "langchain function_calling": _langchain("function_calling"),
    "langchain bind_tools": _langchain_bind_tools,
    "agents output_type": _agents,
}
UNCONSTRAINED = frozenset({"instructor JSON"})
TEMPERATURES = (0.0, 0.7)


async def parse_rates(base_url: str, model: str, modes: list[str] | None = None, *, concurrency: int = 8,
                      temperatures: tuple[float, ...] = TEMPERATURES) -> dict[tuple[str, float], list[str | None]]:
    """(mode, temperature) -> for each case in CASES' order, None if it parsed, else why not; `concurrency`
    requests at a time."""
    out: dict[tuple[str, float], list[str | None]] = {}
    limit = anyio.Semaphore(concurrency)

    async def one(key: tuple[str, float], i: int) -> None:
        async with limit:
            out[key][i] = await MODES[key[0]](base_url, model, CASES[i], key[1])

    async with anyio.create_task_group() as tg:
        for mode in modes or list(MODES):
            for t in temperatures:
                out[(mode, t)] = [None] * len(CASES)
                for i in range(len(CASES)):
                    tg.start_soon(one, (mode, t), i)
    return out
