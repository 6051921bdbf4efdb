"""Tool calling: the Hermes/Qwen parser, the Python sandbox (real subprocesses, real limits), the tool registry,
ToolEnv, and tools from a dataset column rendered by a Qwen-style chat template."""

import asyncio
import json
import os
import socket
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from relax.config import RelaxConfig
from relax.data.dataset import DatasetError, PromptFormat, load_prompt_samples
from relax.data.sample import Sample
from relax.rollout.agentic import sandbox, tool_env
from relax.rollout.agentic.env import load_env_builder
from relax.rollout.agentic.sandbox import run_python
from relax.rollout.agentic.tool_env import ToolEnv, build_env, episode_tool_stats
from relax.rollout.agentic.tool_parser import (
    ToolCall,
    format_tool_responses,
    get_tool_call_parser,
    parse_hermes_tool_calls,
    tool_results_message,
)
from relax.rollout.agentic.tools import (
    Tool,
    ToolError,
    available_tools,
    calculator_tool,
    evaluate_arithmetic,
    prompt_tool_settings,
    select_tools,
)
from tests.support.runs import ROOT
from tests.support.tiny_assets import build_tokenizer

# The tool parts of Qwen2.5's template, shortened: tools listed in a system turn, tool messages as user turns.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def tool_args(**overrides):
    return SimpleNamespace(**{"tools": [], "tool_key": None, "tool_call_parser": "hermes", "tool_timeout": 5.0,
                              "python_tool_memory_mb": 256, "tokenizer": None, **overrides})


def lookup_capital(country: str) -> str:
    """The capital of a country.

    Args:
        country: the country's English name
    """
    return {"France": "Paris"}.get(country, "unknown")


# --- parser ------------------------------------------------------------------------------------------------------

def test_hermes_parser_reads_several_calls_and_the_content_before_them():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(2)\\"}"}</tool_call>')
    parsed = parse_hermes_tool_calls(text)
    assert parsed.content == "Let me compute."
    assert parsed.tool_calls == [ToolCall("calculator", {"expression": "1+1"}),
                                 ToolCall("python", {"code": "print(2)"})]
    assert parsed.errors == []
    assert parse_hermes_tool_calls("  The answer is 4. ").content == "The answer is 4."
    assert parse_hermes_tool_calls("The answer is 4.").tool_calls == []


def test_malformed_calls_are_parse_errors_not_exceptions():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
            '<tool_call>["calculator"]</tool_call><tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "python", "arguments": 3}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>'
            '<tool_call>{"name": "python"')
    parsed = parse_hermes_tool_calls(text)
    assert parsed.tool_calls == [ToolCall("calculator", {"expression": "2"})]
    assert [error.split(":")[0] for error in parsed.errors] == [f"tool call {n}" for n in (1, 2, 3, 4, 6)]
    assert "invalid JSON" in parsed.errors[0] and "expected a JSON object" in parsed.errors[1]
    assert '"name"' in parsed.errors[2] and "must be an object" in parsed.errors[3]
    assert "missing </tool_call>" in parsed.errors[4]


def test_parser_registry_and_tool_response_rendering():
    assert get_tool_call_parser("qwen25") is get_tool_call_parser("qwen3") is parse_hermes_tool_calls
    with pytest.raises(ValueError, match="--tool-call-parser 'nope'.*hermes"):
        get_tool_call_parser("nope")
    with pytest.raises(ValueError, match="tool_call_parser"):
        RelaxConfig(tool_call_parser="nope")
    assert format_tool_responses(["4", "x"]) == ("<tool_response>\n4\n</tool_response>\n"
                                                 "<tool_response>\nx\n</tool_response>")
    assert tool_results_message(["4"], QWEN_STYLE_TEMPLATE)["role"] == "user"  # the template would wrap twice
    assert tool_results_message(["4"], None)["role"] == "tool"


def test_one_user_message_of_blocks_renders_like_qwens_consecutive_tool_messages():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (  # Qwen2.5's tool branch, verbatim: consecutive tool messages share one user turn
        "{%- for message in messages %}{%- if message.role == 'tool' %}"
        "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
        "{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
        "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
        "{%- endif %}{%- endfor %}"
    )
    as_tool_messages = tokenizer.apply_chat_template([{"role": "tool", "content": r} for r in ("1", "2")],
                                                     tokenize=False)
    as_one_message = tokenizer.apply_chat_template([tool_results_message(["1", "2"], tokenizer.chat_template)],
                                                   tokenize=False)
    assert as_one_message == as_tool_messages


# --- sandbox -----------------------------------------------------------------------------------------------------

def test_sandbox_runs_code_and_removes_its_scratch_directory():
    result = run_python("import os\nprint(2**100)\nopen('notes.txt', 'w').write('kept here')\nprint(os.getcwd())",
                        timeout_s=10, memory_mb=256)
    assert result.ok and result.exit_code == 0 and not result.timed_out
    value, scratch = result.stdout.split()
    assert value == str(2**100) and not Path(scratch).exists()


def test_infinite_loop_is_killed_by_the_timeout():
    result = run_python("import os\nprint(os.getpid(), flush=True)\nwhile True:\n    pass", timeout_s=2, memory_mb=256)
    assert result.timed_out and "timed out after 2 s" in result.error
    # killed and reaped: nothing is left running (on a loaded machine the interpreter may not have reached its print
    # within the timeout; the timeout held all the same)
    if result.stdout.split():
        with pytest.raises(ProcessLookupError):
            os.kill(int(result.stdout.split()[0]), 0)


def test_huge_allocation_fails_with_the_memory_limit():
    result = run_python("x = bytearray(10**10)\nprint('allocated')", timeout_s=10, memory_mb=256)
    assert not result.ok and "allocated" not in result.stdout
    assert "MemoryError" in result.error and "256 MB" in result.error


@pytest.mark.parametrize("target", ["/tmp/relax-sandbox-escape-{}", str(ROOT / "sandbox-escape-{}.txt")])
def test_writes_outside_the_scratch_directory_are_refused(target):
    path = Path(target.format(uuid.uuid4().hex))
    for code in (f"open({str(path)!r}, 'w').write('x')", f"import os; os.open({str(path)!r}, os.O_WRONLY | os.O_CREAT)",
                 f"import os; open('x', 'w').close(); os.rename('x', {str(path)!r})",
                 f"import pathlib; pathlib.Path({str(path)!r}).write_text('x')"):
        result = run_python(code, timeout_s=10, memory_mb=256)
        assert not result.ok and "not allowed" in result.error, code
        assert not path.exists()


def test_deleting_and_reading_outside_are_refused(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    result = run_python(f"import os; os.remove({str(keep)!r})", timeout_s=10, memory_mb=256)
    assert "os.remove outside the scratch directory is not allowed" in result.error and keep.exists()
    result = run_python(f"print(open({str(keep)!r}).read())", timeout_s=10, memory_mb=256)
    assert "reading outside" in result.error and "precious" not in result.stdout


def test_parent_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2-do-not-leak")
    code = ("import os\nprint(os.environ.get('SECRET_TOKEN'))\n"
            f"print(open('/proc/{os.getpid()}/environ').read())")
    result = run_python(code, timeout_s=10, memory_mb=256)
    assert result.stdout.splitlines()[0] == "None"
    assert "hunter2" not in result.stdout + result.stderr and "reading outside" in result.error


@pytest.mark.parametrize("namespace", [True, False], ids=["netns-if-available", "audit-hook-only"])
def test_network_is_refused(monkeypatch, namespace):
    if not namespace:
        monkeypatch.setattr(sandbox, "network_isolation_prefix", lambda: ())
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')",
                            timeout_s=10, memory_mb=256)
        assert "network access is not allowed" in result.error and "in" not in result.stdout
        with pytest.raises(BlockingIOError):  # nobody connected
            server.accept()


def test_processes_are_refused_and_output_is_truncated():
    result = run_python("import subprocess; subprocess.run(['touch', 'x'])", timeout_s=10, memory_mb=256)
    assert "starting processes is not allowed" in result.error
    result = run_python("print('y' * 50_000)", timeout_s=10, memory_mb=256, max_output_chars=100)
    assert result.ok and result.stdout.startswith("y" * 100) and "output truncated: 50001 bytes" in result.stdout


# --- tools -------------------------------------------------------------------------------------------------------

def test_calculator_is_exact_and_safe():
    assert evaluate_arithmetic("2**100 + 1") == 2**100 + 1
    assert evaluate_arithmetic("(7 + 3) * -2 // 3 % 5") == ((7 + 3) * -2 // 3) % 5
    assert evaluate_arithmetic("1 / 4 + 0.5") == 0.75
    for expression, message in (("1/0", "division by zero"), ("__import__('os')", "unsupported element"),
                                ("9**9**9", "too large"), ("2 +", "invalid expression"), ("True + 1", "unsupported")):
        with pytest.raises(ToolError, match=message):
            evaluate_arithmetic(expression)


def test_tool_call_checks_arguments_and_user_tools_load_by_dotted_path():
    calculator = calculator_tool()
    assert asyncio.run(calculator.call({"expression": "6*7"})) == "42"
    with pytest.raises(ToolError, match="missing expression"):
        asyncio.run(calculator.call({"expr": "1"}))
    tools = available_tools(tool_args(tools=["python", "tests.rollout.agentic.test_agentic_tools:lookup_capital"]))
    assert sorted(tools) == ["calculator", "lookup_capital", "python"]
    spec = tools["lookup_capital"].spec()["function"]
    assert spec["parameters"]["required"] == ["country"] and spec["description"] == "The capital of a country."
    assert asyncio.run(tools["lookup_capital"].call({"country": "France"})) == "Paris"
    with pytest.raises(ValueError, match=r"row 3: field 'tools': unknown tool 'search'; known: calculator"):
        select_tools(["calculator", {"type": "function", "function": {"name": "search"}}], tools,
                     "row 3: field 'tools'")


# --- ToolEnv -----------------------------------------------------------------------------------------------------

def call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_tool_env_runs_calls_reports_errors_and_ends_on_a_final_answer():
    env = ToolEnv([calculator_tool()], parse_hermes_tool_calls, timeout_s=5, chat_template=QWEN_STYLE_TEMPLATE)
    observation, done, info = asyncio.run(env.step("Compute. " + call("calculator", expression="6*7") +
                                                   call("calculator", expression="1/0") + call("search", q="x")))
    assert not done and observation["role"] == "user"
    blocks = observation["obs_str"].split("\n</tool_response>")
    assert blocks[0] == "<tool_response>\n42" and "division by zero" in blocks[1]
    assert "unknown tool 'search'" in blocks[2]
    assert info["tool_stats"] == {"calls": 3, "successful_calls": 1, "parse_errors": 0, "success_rate": 1 / 3}
    observation, done, info = asyncio.run(env.step('<tool_call>{"name": </tool_call>'))
    assert not done and "could not parse the tool call" in observation["obs_str"]
    observation, done, info = asyncio.run(env.step("The answer is 42."))
    assert done and info["tool_stats"]["parse_errors"] == 1 and env.stats.success_rate == 0.25
    traces = [{"env_info": {"tool_stats": {"calls": 1}}}, {"env_info": info}, {"finish_reason": "length"}]
    assert episode_tool_stats(Sample(metadata={"rollout_traces": traces})) == env.stats.as_dict()
    assert episode_tool_stats(Sample()) is None


def test_tool_env_caps_the_calls_of_one_turn():
    # (a timeout far from anything a calculator takes: under a loaded suite one of eight calls once ran past 5 s,
    # waiting for a worker thread)
    env = ToolEnv([calculator_tool()], parse_hermes_tool_calls, timeout_s=120)
    observation, _, info = asyncio.run(env.step(call("calculator", expression="1") * (tool_env.MAX_CALLS_PER_TURN + 2)))
    assert observation["obs_str"].count("did not run") == 2
    assert info["tool_stats"]["calls"] == tool_env.MAX_CALLS_PER_TURN + 2
    assert info["tool_stats"]["successful_calls"] == tool_env.MAX_CALLS_PER_TURN


def test_tool_env_bounds_a_slow_tool(monkeypatch):
    monkeypatch.setattr(tool_env, "CLEANUP_GRACE_S", 0.0)

    async def wait(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "woke"

    slow = Tool("wait", "Sleep.", {"type": "object", "properties": {"seconds": {"type": "number"}}}, wait)
    env = ToolEnv([slow], parse_hermes_tool_calls, timeout_s=0.2)
    observation, _, info = asyncio.run(env.step(call("wait", seconds=30)))
    assert "wait timed out after 0.2 s" in observation["obs_str"] and observation["role"] == "tool"
    assert info["tool_stats"]["successful_calls"] == 0


def test_build_env_takes_the_samples_tools_and_runs_the_python_tool():
    assert load_env_builder("relax.rollout.agentic.tool_env") is build_env  # --rollout-interaction-env-path
    args = tool_args(tools=["calculator"])
    env = build_env(Sample(index=7, metadata={"tools": [{"type": "function", "function": {"name": "python"}}]}), args)
    assert list(env.tools) == ["python"]
    observation, _, info = asyncio.run(env.step(call("python", code="print(sum(range(10)))")))
    assert observation["obs_str"] == "<tool_response>\n45\n</tool_response>" and info["tool_stats"]["success_rate"] == 1
    assert list(build_env(Sample(index=8), args).tools) == ["calculator"]  # --tools for rows without the column
    with pytest.raises(ValueError, match=r"sample 9: metadata\['tools'\]: unknown tool 'search'"):
        build_env(Sample(index=9, metadata={"tools": ["search"]}), args)


# --- dataset -----------------------------------------------------------------------------------------------------

def test_tool_column_is_rendered_into_the_prompt_and_kept_in_metadata(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    lookup_spec = {"type": "function", "function": {"name": "lookup_capital", "parameters": {}}}
    rows = [{"input": "2+2=", "tools": ["calculator"]}, {"input": "capital?", "tools": json.dumps([lookup_spec])},
            {"input": "no tools column"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = tool_args(tool_key="tools", tools=["python", "tests.rollout.agentic.test_agentic_tools:lookup_capital"])
    fmt = PromptFormat(apply_chat_template=True, **prompt_tool_settings(args))
    samples = load_prompt_samples(str(path), tokenizer, fmt)
    assert samples[0].prompt.startswith("<|im_start|>system\n# Tools\n<tools>") and '"calculator"' in samples[0].prompt
    assert samples[0].metadata["tools"] == [calculator_tool().spec()]
    assert samples[1].metadata["tools"] == [lookup_spec] and '"lookup_capital"' in samples[1].prompt
    assert [spec["function"]["name"] for spec in samples[2].metadata["tools"]] == ["python", "lookup_capital"]
    assert list(build_env(samples[1], args).tools) == ["lookup_capital"]


def test_bad_tool_columns_name_the_row_and_field(tmp_path):
    tokenizer = build_tokenizer()
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input": "a", "tools": ["calculator"]}) + "\n" +
                    json.dumps({"input": "b", "tools": ["calculator", "search"]}) + "\n")
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    fmt = PromptFormat(apply_chat_template=True, **prompt_tool_settings(tool_args(tool_key="tools")))
    with pytest.raises(DatasetError, match=r"d.jsonl: row 2: field 'tools': unknown tool 'search'; known: calculator"):
        load_prompt_samples(str(path), tokenizer, fmt)
    path.write_text(json.dumps({"input": "a", "tools": "{not json"}) + "\n")
    with pytest.raises(DatasetError, match=r"row 1: field 'tools': invalid JSON"):
        load_prompt_samples(str(path), tokenizer, fmt)
    path.write_text(json.dumps({"input": "a", "tools": ["calculator"]}) + "\n")
    tokenizer.chat_template = build_tokenizer().chat_template  # plain ChatML: it would drop the tools
    with pytest.raises(DatasetError, match="row 1.*does not render `tools`"):
        load_prompt_samples(str(path), tokenizer, fmt)
