"""The ``tools`` embedded model (``--model-size tools``): demo answers in format at chance, and tool
calls that copy the names a request lists, names its warm-up never used."""

import json
import re
from pathlib import Path
from typing import Any

import pytest

from agentjet_server.embedded.recipe import _NAME_WORDS
from tests.conftest import ServerProcess

# tools as real agents list them: none of these names is made of the warm-up's name words only, so
# the model can only get them right by copying them out of the request
HELD_OUT = [
    ("get_stock_price", ["symbol"]),
    ("send_email", ["recipient"]),
    ("convert_currency", ["amount"]),
    ("translate_text", ["language"]),
    ("current_time", ["timezone"]),
    ("search_web", ["query"]),
    ("read_file", ["path"]),
    ("run_sql", ["statement"]),
    ("lookup_user", ["user_id"]),
    ("multiply", ["x", "y"]),
    ("calculator", ["expression"]),
    ("fetch_url", ["url"]),
    ("list_files", ["directory"]),
    ("set_alarm", ["hour", "minute"]),
    ("roll_dice", ["sides"]),
    ("resize_image", ["width", "height"]),
    ("book_flight", ["origin", "destination"]),
    ("create_event", ["title", "date"]),
    ("get_forecast", ["city"]),
    ("sum_numbers", ["a", "b"]),
]
ASK = [{"role": "user", "content": "Please help me with 3 and 4."}]
# three builds of the format-6 recipe (this machine with 2 threads and with 1, and another seed)
# measured: the listed name 17-19 of 20, with its parameters 13-18, probability of the name at
# temperature 1 0.85-0.93, one of two listed names 11-17 of 20; one build of format 7 (schemas as
# frameworks send them too): 20, 14 and 0.92; the tiny model: 0 of 20 on each (it calls its own
# warm-up tools).
# The bounds leave room for builds on other CPUs, whose float sums differ.
MIN_NAMED, MIN_WITH_PARAMS, MIN_NAME_PROBABILITY, MIN_TWO_TOOLS = 13, 9, 0.6, 8


def spec_of(name: str, params: list[str]) -> list[dict[str, Any]]:
    properties = {p: {"type": "integer"} for p in params}
    return [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}
    ]


# what each parameter's docstring line says, for the schemas frameworks generate from docstrings
DESCRIBED = {
    "symbol": "the ticker to look up",
    "recipient": "who gets the message",
    "amount": "how much to convert",
    "language": "the target language",
    "timezone": "an IANA zone name",
    "query": "what to search for",
    "path": "the file to read",
    "statement": "one SQL statement",
    "user_id": "the user's id",
    "x": "the first factor",
    "y": "the second factor",
    "expression": "an arithmetic expression",
    "url": "the address to fetch",
    "directory": "where to list",
    "hour": "0 to 23",
    "minute": "0 to 59",
    "sides": "how many sides",
    "width": "in pixels",
    "height": "in pixels",
    "origin": "the airport to leave from",
    "destination": "where to fly",
    "title": "the event's title",
    "date": "the day of the event",
    "city": "the city's name",
    "a": "the first number",
    "b": "the second number",
}


def framework_spec_of(name: str, params: list[str], framework: str) -> list[dict[str, Any]]:
    """The tool as a framework generates it from a Python function: LangChain's ``@tool`` (keys
    sorted, bare properties), AgentScope's ``FunctionTool`` (each property described from the
    docstring), the OpenAI Agents SDK's ``@function_tool`` (described, pydantic titles, a strict
    schema). The shapes were read off the real packages (langchain-core 1.x, agentscope 2.x,
    openai-agents 0.x)."""
    properties: dict[str, Any] = {}
    for p in params:
        if framework == "langchain":
            properties[p] = {"type": "integer"}
        elif framework == "agentscope":
            properties[p] = {"description": DESCRIBED[p], "type": "integer"}
        else:
            properties[p] = {"description": DESCRIBED[p], "title": p.title(), "type": "integer"}
    schema: dict[str, Any] = {"properties": properties, "required": list(params)}
    if framework == "agents":
        schema["title"] = f"{name}_args"
    schema["type"] = "object"
    if framework == "agents":
        schema["additionalProperties"] = False
    function = {"name": name, "description": "Does what its name says.", "parameters": schema}
    return [{"type": "function", "function": function}]


@pytest.fixture(scope="module", params=["shipped", pytest.param("rebuilt", marks=pytest.mark.slow)])
def loaded(
    request: pytest.FixtureRequest, tools_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Any]:
    """The shipped ``tools`` model, and (``--slow``: 11-14 minutes) one this machine builds from the
    same recipe: float sums differ between CPUs, so the rebuild is held to what the shipped one does,
    not to its bits."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model_dir = tools_model_dir if request.param == "shipped" else rebuild("tools", tmp_path_factory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    return tokenizer, AutoModelForCausalLM.from_pretrained(model_dir).eval()


def rebuild(size: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model of ``size`` built here from its recipe."""
    from agentjet_server.embedded import EMBEDDED_SPECS
    from agentjet_server.embedded.recipe import build_model

    spec = EMBEDDED_SPECS[size]
    return build_model(spec, tmp_path_factory.mktemp("rebuilt") / spec.name, lambda message: None)


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def greedy_call(loaded: tuple[Any, Any], tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    import torch

    tokenizer, model = loaded
    prompt = prompt_ids(tokenizer, ASK, tools)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=48, do_sample=False, eos_token_id=end, pad_token_id=end
        )
    text = tokenizer.decode(out[0, len(prompt) :])
    found = re.search(r"<tool_call>(.*?)</tool_call>", text)
    try:
        call = json.loads(found.group(1)) if found else None
    except json.JSONDecodeError:
        return None
    return call if isinstance(call, dict) else None


def probability(loaded: tuple[Any, Any], prompt: list[int], continuation: str) -> float:
    """Probability that sampling at temperature 1 writes ``continuation`` next."""
    import torch

    tokenizer, model = loaded
    tail = tokenizer.encode(continuation, add_special_tokens=False)
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt + tail])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    return float(logprobs[torch.arange(len(tail)), torch.tensor(tail)].sum().exp())


def test_held_out_names_were_not_warm_up_names() -> None:
    for name, _ in HELD_OUT:
        assert any(part not in _NAME_WORDS for part in name.split("_")), name


def test_tool_calls_copy_names_the_warm_up_never_used(loaded: tuple[Any, Any]) -> None:
    calls = [greedy_call(loaded, spec_of(name, params)) for name, params in HELD_OUT]
    named = [c for c, (name, _) in zip(calls, HELD_OUT, strict=True) if c and c.get("name") == name]
    with_params = [
        c
        for c, (name, params) in zip(calls, HELD_OUT, strict=True)
        if c and c.get("name") == name and set(c.get("arguments") or {}) == set(params)
    ]
    shown = [json.dumps(c) for c in calls]
    assert len(named) >= MIN_NAMED, shown
    assert len(with_params) >= MIN_WITH_PARAMS, shown
    # sampled at temperature 1: the listed name comes out most of the time
    tokenizer, _ = loaded
    p_name = [
        probability(loaded, prompt_ids(tokenizer, ASK, spec_of(name, params)), f'<tool_call>{{"name": "{name}", "')
        for name, params in HELD_OUT
    ]
    assert sum(p_name) / len(p_name) >= MIN_NAME_PROBABILITY, p_name


# one build (format 7): LangChain's shape 20 of 20 named, 20 with parameters; AgentScope's 20 and 18;
# the Agents SDK's 15 and 8. Warmed up on bare properties only (format 6), the same model named
# 15, 16 and 6 and gave the parameters 5, 3 and 2 times: it copied the descriptions' words
# where a parameter's name belongs (``{"propertiescription": 3}``).
FRAMEWORK_BOUNDS = {
    "langchain": (MIN_NAMED, MIN_WITH_PARAMS),
    "agentscope": (MIN_NAMED, MIN_WITH_PARAMS),
    "agents": (9, 4),
}


@pytest.mark.parametrize("framework", list(FRAMEWORK_BOUNDS))
def test_schemas_as_frameworks_generate_them_get_calls_with_the_listed_parameters(
    loaded: tuple[Any, Any], framework: str
) -> None:
    calls = [greedy_call(loaded, framework_spec_of(name, params, framework)) for name, params in HELD_OUT]
    named = [c for c, (name, _) in zip(calls, HELD_OUT, strict=True) if c and c.get("name") == name]
    with_params = [
        c
        for c, (name, params) in zip(calls, HELD_OUT, strict=True)
        if c and c.get("name") == name and set(c.get("arguments") or {}) == set(params)
    ]
    min_named, min_with_params = FRAMEWORK_BOUNDS[framework]
    shown = [json.dumps(c) for c in calls]
    assert len(named) >= min_named, shown
    assert len(with_params) >= min_with_params, shown


def test_with_several_tools_the_call_names_one_of_them(loaded: tuple[Any, Any]) -> None:
    pairs = [(HELD_OUT[i], HELD_OUT[(i + 7) % len(HELD_OUT)]) for i in range(len(HELD_OUT))]
    calls = [greedy_call(loaded, spec_of(*first) + spec_of(*second)) for first, second in pairs]
    listed = [
        c for c, (first, second) in zip(calls, pairs, strict=True) if c and c.get("name") in (first[0], second[0])
    ]
    assert len(listed) >= MIN_TWO_TOOLS, [json.dumps(c) for c in calls]


def demo_answers(loaded: tuple[Any, Any], kind: str) -> tuple[list[float], list[float]]:
    """Per demo prompt of ``kind``: the probability of answering with a digit, and of the right one."""
    import torch

    from agentjet_server.embedded import demo_tasks

    tokenizer, model = loaded
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    on_digits, on_right = [], []
    for question, answer in demo_tasks(kind):
        prompt = prompt_ids(tokenizer, [{"role": "user", "content": question}])
        with torch.no_grad():
            probs = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        on_digits.append(float(probs[digits].sum()))
        on_right.append(float(probs[digits[int(answer)]]))
    return on_digits, on_right


def test_demo_answers_are_one_digit_at_chance(loaded: tuple[Any, Any]) -> None:
    on_digits, on_right = demo_answers(loaded, "words")
    assert min(on_digits) > 0.9, on_digits  # the format is taught
    assert 0.03 < sum(on_right) / 10 < 0.25, on_right  # the answers are not: RL finds them


@pytest.mark.parametrize("build", ["shipped", pytest.param("rebuilt", marks=pytest.mark.slow)])
@pytest.mark.parametrize("size", ["tiny", "small"])
def test_the_format_models_answer_in_format_and_know_only_their_prior(
    size: str, build: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``tiny`` and ``small`` answer the demo with one digit at chance; ``small`` also repeats a digit
    it is asked to about a third of the time (its weak prior for examples/planner_executor)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from agentjet_server.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model(size=size) if build == "shipped" else rebuild(size, tmp_path_factory)
    loaded = PreTrainedTokenizerFast.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()
    on_digits, on_right = demo_answers(loaded, "words")
    assert min(on_digits) > 0.9, on_digits
    assert 0.03 < sum(on_right) / 10 < 0.25, on_right
    if size == "small":
        on_digits, on_right = demo_answers(loaded, "copy")
        assert min(on_digits) > 0.9, on_digits
        assert 0.15 < sum(on_right) / 10 < 0.6, on_right


def test_served_by_agentjet_server_up_its_calls_name_the_listed_tools(tools_model_dir: Path, tmp_path: Path) -> None:
    """``agentjet-server up --model-size tools`` serves it; the OpenAI SDK gets parsed calls to the
    tools it listed (greedy, so the rate is the one measured above)."""
    from openai import OpenAI

    server = ServerProcess(["--model-size", "tools"], tmp_path / "server.log")
    try:
        with OpenAI(base_url=server.url + "/v1", api_key="unused") as sdk:
            assert [m.id for m in sdk.models.list().data] == ["agentjet-tools"]
            named = 0
            for name, params in HELD_OUT:
                reply = sdk.chat.completions.create(
                    model="agentjet-tools", messages=ASK, tools=spec_of(name, params), max_tokens=48, temperature=0.0
                )
                calls = reply.choices[0].message.tool_calls or []
                named += any(call.function.name == name for call in calls)
        assert named >= MIN_NAMED, named
    finally:
        server.stop()
