"""Tools a model may call during a rollout: the ``Tool`` type, the built-in tools and user tools.

Built-in: ``python`` (runs code in the sandbox of ``relax.rollout.agentic.sandbox``) and ``calculator`` (exact
arithmetic). A user tool is a plain function named by a dotted path in ``--tools`` (``pkg.module:function``); its
name, description and JSON-schema parameters come from its signature and Google-style docstring
(``transformers.utils.get_json_schema``), and it may be ``async def``. Which tools a prompt offers is given by the
row's ``--tool-key`` column (names or OpenAI-style specs) or, for rows without one, by ``--tools``.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import json
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax.rollout.agentic.sandbox import run_python
from relax.utils.dotted_path import load_dotted_function


class ToolError(Exception):
    """A tool ran and failed; the message is what the model is shown."""


@dataclass(frozen=True)
class Tool:
    """``function(**arguments)`` returns the result (text, or anything JSON-serialisable) or raises ``ToolError``;
    it may be ``async def``. ``parameters`` is the JSON schema of the arguments object."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]

    def spec(self) -> dict[str, Any]:
        """The OpenAI-style function spec that chat templates take (``apply_chat_template(tools=...)``)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    async def call(self, arguments: dict[str, Any]) -> str:
        """Run the tool; raises ``ToolError`` for missing or unknown arguments and for the tool's own failure.
        A plain function runs in a worker thread so it does not stall the rollout's event loop."""
        self._check_arguments(arguments)
        if inspect.iscoroutinefunction(self.function):
            result = await self.function(**arguments)
        else:
            result = await asyncio.to_thread(self.function, **arguments)
        return result if isinstance(result, str) else json.dumps(result, default=str)

    def _check_arguments(self, arguments: dict[str, Any]) -> None:
        properties = self.parameters.get("properties", {})
        missing = [name for name in self.parameters.get("required", []) if name not in arguments]
        unknown = [name for name in arguments if properties and name not in properties]
        if missing or unknown:
            problems = ([f"missing {', '.join(missing)}"] if missing else []) + (
                [f"unknown {', '.join(unknown)}"] if unknown else [])
            raise ToolError(f"{self.name}: bad arguments ({'; '.join(problems)}); expected {sorted(properties)}")


# --- python ------------------------------------------------------------------------------------------------------

def python_tool(timeout_s: float, memory_mb: int) -> Tool:
    def python(code: str) -> str:
        result = run_python(code, timeout_s, memory_mb)
        output = "\n".join(part.rstrip() for part in (result.stdout, result.stderr) if part.strip())
        if result.ok:
            return output or "(no output)"
        if result.error not in result.stderr:  # a timeout or a kill leaves no traceback of its own
            output = f"{output}\nError: {result.error}".strip()
        raise ToolError(output)

    return Tool(
        name="python",
        description=(f"Run a Python 3 program and return what it prints (stdout and stderr). Each call is a fresh "
                     f"process without network: {timeout_s:g} s, {memory_mb} MB; only its working directory is "
                     "writable. Use print() to see results."),
        parameters={"type": "object", "properties": {"code": {"type": "string", "description": "The program."}},
                    "required": ["code"]},
        function=python,
    )


# --- calculator --------------------------------------------------------------------------------------------------

MAX_INTEGER_BITS = 14_000  # about 4,200 digits: below Python's 4,300-digit limit on int -> str
_BINARY_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                     ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                     ast.Pow: operator.pow}
_UNARY_OPERATORS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_arithmetic(expression: str) -> float:
    """The value of ``expression`` (numbers, + - * / // % **, parentheses) by walking its syntax tree, without
    ``eval``; integers stay exact. Raises ToolError for anything else, and for results too large to print."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"calculator: invalid expression ({err.msg})") from None
    except (ValueError, RecursionError, MemoryError):  # a null byte, or nesting deeper than the parser takes
        raise ToolError("calculator: invalid expression") from None
    try:
        return _evaluate_node(tree.body)
    except (ZeroDivisionError, OverflowError) as err:
        raise ToolError(f"calculator: {err}") from None
    except RecursionError:
        raise ToolError("calculator: expression nested too deeply") from None


def _evaluate_node(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPERATORS:
        return _UNARY_OPERATORS[type(node.op)](_evaluate_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPERATORS:
        left, right = _evaluate_node(node.left), _evaluate_node(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power_size(left, right)
        return _check_size(_BINARY_OPERATORS[type(node.op)](left, right))
    raise ToolError(f"calculator: unsupported element {ast.unparse(node)!r}; use numbers, + - * / // % ** and "
                    "parentheses")


def _check_power_size(base: float, exponent: float) -> None:
    """Refuse before computing: ``9 ** 9 ** 9`` would take minutes and gigabytes."""
    exact = isinstance(base, int) and isinstance(exponent, int)
    if exact and abs(base) > 1 and exponent > 0 and exponent * math.log2(abs(base)) > MAX_INTEGER_BITS:
        raise ToolError(f"calculator: result too large (over {MAX_INTEGER_BITS} bits)")


def _check_size(value: float) -> float:
    if isinstance(value, complex):  # a negative number to a fractional power
        raise ToolError("calculator: the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INTEGER_BITS:
        raise ToolError(f"calculator: result too large (over {MAX_INTEGER_BITS} bits)")
    return value


def calculator_tool() -> Tool:
    def calculator(expression: str) -> str:
        return str(evaluate_arithmetic(expression))

    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.",
        parameters={"type": "object",
                    "properties": {"expression": {"type": "string", "description": "e.g. (2**64 + 1) % 641"}},
                    "required": ["expression"]},
        function=calculator,
    )


# --- registry ----------------------------------------------------------------------------------------------------

BUILTIN_TOOLS = ("calculator", "python")


@functools.cache
def load_user_tool(path: str) -> Tool:
    """The function at ``path`` (``pkg.module:function``) as a tool, described by its type hints and docstring."""
    from transformers.utils import get_json_schema

    function = load_dotted_function(path, "--tools")
    try:
        spec = get_json_schema(function)["function"]
    except Exception as err:  # transformers raises its own exception types for undocumented arguments
        raise ValueError(f"--tools {path!r}: cannot describe the function to the model: {err} (give every "
                         "argument a type hint and a line under 'Args:' in the docstring)") from None
    return Tool(name=spec["name"], description=spec.get("description", ""), parameters=spec["parameters"],
                function=function)


def available_tools(args: Any) -> dict[str, Tool]:
    """Every tool a run can execute, by name: the built-ins, configured by ``--tool-timeout`` and
    ``--python-tool-memory-mb``, and the user tools of ``--tools``."""
    tools = {"calculator": calculator_tool(), "python": python_tool(args.tool_timeout, args.python_tool_memory_mb)}
    for entry in args.tools:
        if entry not in BUILTIN_TOOLS:
            tool = load_user_tool(entry)
            tools[tool.name] = tool
    return tools


def default_tool_names(args: Any) -> list[str]:
    """The tools of ``--tools`` by name (a user tool's name is its function's name)."""
    return [entry if entry in BUILTIN_TOOLS else load_user_tool(entry).name for entry in args.tools]


def tool_name(entry: Any, where: str) -> str:
    """The name in a tool column entry: a name, or an OpenAI-style spec (``{"type": "function", "function":
    {"name": ...}}`` or the bare ``{"name": ...}``). ``where`` names the row and field in the error."""
    if isinstance(entry, str) and entry:
        return entry
    if isinstance(entry, dict):
        function = entry.get("function", entry)
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    raise ValueError(f"{where}: expected a tool name or an OpenAI-style function spec, got {entry!r:.80}")


def select_tools(entries: list[Any], available: dict[str, Tool], where: str) -> list[Tool]:
    """The tools a sample offers, from its tool entries; an unknown name fails naming ``where``."""
    tools = []
    for entry in entries:
        name = tool_name(entry, where)
        if name not in available:
            raise ValueError(f"{where}: unknown tool {name!r}; known: {', '.join(sorted(available))} "
                             "(add your own with --tools pkg.module:function)")
        tools.append(available[name])
    return tools


def prompt_tool_settings(args: Any) -> dict[str, Any]:
    """The tool fields of ``relax.data.dataset.PromptFormat`` for a config: the column, the spec of every known
    tool by name, and the default tools of rows without the column."""
    available = available_tools(args) if (args.tool_key or args.tools) else {}
    return {"tool_key": args.tool_key, "tool_specs": {name: tool.spec() for name, tool in available.items()},
            "default_tools": tuple(default_tool_names(args))}
