"""Chat-template tool calls: tools as JSON schemas, calls parsed from the model's text, Python tools behind them.

Tools are declared as OpenAI-style JSON schemas, `{"type": "function", "function": {"name", "description",
"parameters"}}`. `render_prompt` renders them into the prompt with the tokenizer's chat template
(`apply_chat_template(..., tools=...)`); a template without tools support (or a tokenizer without any
template) gets a plain system block instead, `TOOLS_SYSTEM` with the schemas one JSON object a line.

Calls are read in the Hermes/Qwen format, which Qwen2.5/Qwen3, Hermes and many fine-tunes write:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

A turn may hold several calls. Each result goes back as `<tool_response>...</tool_response>`; a call
that does not parse (nesting too deep included), names no known tool, names an argument its tool's
schema does not declare, or whose tool raises is answered with an error in the same block
(`{"error": "..."}`), so the model can try again: the episode goes on.

`ToolEnvironment` is an environment (environment.py) that dispatches calls to Python functions: a turn
without a call is the final answer and ends the episode; subclass it and override `score(sample,
answer)` to give that answer a reward, or `reset` to add a first observation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .environment import StepResult

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)

TOOLS_SYSTEM = (
    "You may call one or more functions to help with the user query. The functions, one JSON schema a line:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, write a JSON object with its name and arguments between <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""The plain system block for a chat template without tools support."""
_TOO_DEEP = "the call nests too deep: write a flat JSON object"


@dataclass
class ToolCall:
    name: str = ""
    arguments: dict[str, Any] | None = None
    error: str = ""
    """Why the call could not be read ("" when it parsed)."""


def tool_schema(name: str, description: str, properties: dict[str, dict], required: list[str] | None = None) -> dict:
    """An OpenAI-style function schema."""
    parameters = {"type": "object", "properties": properties, "required": list(required or properties)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def render_prompt(tokenizer, messages: list[dict], tools: list[dict]) -> str:
    """The prompt text for `messages` with `tools` offered: the chat template's own rendering where it
    renders tools, else the messages under a system block (`TOOLS_SYSTEM`), with the template where there
    is one and as plain `role: content` lines where there is none."""
    names = [t["function"]["name"] for t in tools]
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            if all(n in text for n in names):
                return text
        except Exception:  # a template that fails on `tools`: the plain block below
            pass
    block = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0].get("role") == "system":
        messages = [{"role": "system", "content": messages[0]["content"] + "\n\n" + block}, *messages[1:]]
    else:
        messages = [{"role": "system", "content": block}, *messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The Hermes/Qwen-style calls in `text`, in order; a call that does not parse comes back with its
    `error`. An opening tag without its closing one is a malformed call too."""
    calls = []
    for body in _CALL.findall(text):
        calls.append(_parse_one(body.strip()))
    tail = text[text.rfind(CALL_CLOSE) + len(CALL_CLOSE) :] if CALL_CLOSE in text else text
    if CALL_OPEN in tail:
        calls.append(ToolCall(error=f"a {CALL_OPEN} without its {CALL_CLOSE}"))
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(error=f"the call is not JSON ({exc.msg} at character {exc.pos})")
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return ToolCall(error=_TOO_DEEP)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(error='the call needs {"name": ..., "arguments": {...}}')
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except RecursionError:
            return ToolCall(obj["name"], error=_TOO_DEEP)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], error="arguments must be a JSON object")
    return ToolCall(obj["name"], arguments)


def declared_arguments(schema: dict) -> list[str]:
    """The argument names a tool's schema declares (`function.parameters.properties`, or `parameters.
    properties` of a bare function schema); none for a schema without them."""
    function = schema.get("function", schema) if isinstance(schema, dict) else None
    parameters = function.get("parameters") if isinstance(function, dict) else None
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return list(properties) if isinstance(properties, dict) else []


def tool_response(content: Any) -> str:
    """One result block; `content` as is when a string, else as JSON."""
    body = content if isinstance(content, str) else json.dumps(content)
    return f"{RESPONSE_OPEN}{body}{RESPONSE_CLOSE}"


class ToolEnvironment:
    """Calls Python tools on the model's Hermes/Qwen-style tool calls.

    `tools` maps each name to (its JSON schema, the function); a function gets the call's arguments as
    keywords and returns what goes into the `<tool_response>`. Only the arguments the schema declares
    (`parameters.properties`) reach it: a call naming any other is answered with an error, so the model
    cannot set a parameter the schema leaves out (a default, an option). A turn without a call is the final
    answer: `score(sample, answer)` rewards it (None by default) and the episode ends. `wrap` turns the
    responses of one turn into the observation (for a chat model: close the assistant turn, open a tool
    turn, and open the next assistant turn, as its template writes them)."""

    stop = [CALL_CLOSE]
    counts = ("tool_calls", "tool_errors")
    tools: dict[str, tuple[dict, Callable[..., Any]]] = {}

    def reset(self, sample: dict) -> str:
        self.sample = sample
        return ""

    def schemas(self) -> list[dict]:
        return [schema for schema, _ in self.tools.values()]

    def wrap(self, responses: list[str]) -> str:
        return "\n" + "\n".join(responses) + "\n"

    def score(self, sample: dict, answer: str) -> float | None:
        return None

    def step(self, action_text: str) -> StepResult:
        calls = parse_tool_calls(action_text)
        if not calls:
            return StepResult(reward=self.score(self.sample, action_text), done=True)
        responses, errors = [], 0
        for call in calls:
            result = self.call(call)
            errors += isinstance(result, dict) and "error" in result
            responses.append(tool_response(result))
        return StepResult(self.wrap(responses), info={"tool_calls": len(calls), "tool_errors": errors})

    def call(self, call: ToolCall) -> Any:
        """The tool's result, or {"error": ...} for a call that cannot run."""
        if call.error:
            return {"error": call.error}
        if call.name not in self.tools:
            return {"error": f"unknown tool {call.name!r}; the tools are {', '.join(self.tools) or 'none'}"}
        schema, fn = self.tools[call.name]
        declared = declared_arguments(schema)
        unknown = [name for name in call.arguments if name not in declared]
        if unknown:  # a tool function's other parameters (defaults, options) are not the model's to set
            return {
                "error": f"{call.name} takes no argument {', '.join(repr(n)[:80] for n in unknown[:5])}; "
                f"its arguments are {', '.join(declared) or 'none'}"
            }
        try:
            return fn(**call.arguments)
        except Exception as exc:  # the model wrote a bad call: tell it, and let it try again
            return {"error": f"{type(exc).__name__}: {exc}"}
