"""Real checkpoints' chat templates and a tool round, shared by the chat-template tests
(`support.chat_templates`)."""

from __future__ import annotations

import shutil
from pathlib import Path

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
"""SmolLM2-135M-Instruct's `chat_template.jinja`, verbatim."""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

TOOL_ROUND = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
"""A tool round as OpenAI clients send it back: the assistant turn's content is null."""


def tokenizer_dir_with_template(src: Path, dst: Path, template: str) -> Path:
    """The tokenizer files of checkpoint `src` in `dst`, with `template` as the
    checkpoint's own chat template."""
    dst.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, dst / name)
    (dst / "chat_template.jinja").write_text(template)
    return dst


# Family templates, written for these tests from each family's published chat template
# (Qwen3-Coder's, Llama 3.1's, Mistral Small 3.x's, DeepSeek V3's and Kimi K2's, shipped
# with their checkpoints) and reduced to what the tests use:
# the tool list, the assistant turn with its calls, tool results. The assistant-turn parts
# are the published text; what a template writes around them (default system prompts,
# dates, built-in tools) is left out. No package ships these templates (vLLM's
# `examples/` are not in its wheel), so they are written here, under the project's licence.

QWEN3_CODER_TEMPLATE = """\
{%- if tools is iterable and tools | length > 0 %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool.function | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content is defined and message.content is string and message.content | trim | length > 0 %}
            {{- '\\n' + message.content | trim + '\\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\\n' }}
                    {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                    {{- args_value }}
                    {{- '\\n</parameter>\\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}{{- '<|im_start|>user\\n' }}{%- endif %}
        {{- '<tool_response>\\n' + message.content + '\\n</tool_response>\\n' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}{{- '<|im_end|>\\n' }}
        {%- elif loop.last %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
"""Qwen3-Coder's template, reduced (see above): XML tool calls, arguments read as a
mapping (`arguments|items`), scalars written with `|string`."""

LLAMA31_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' and loop.first and tools is not none %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
        {{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n" }}
        {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
        {{- "Do not use variables.\\n\\n" }}
        {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
        {{- message.content | trim + '<|eot_id|>' }}
    {%- elif not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n'+ message.content | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
"""Llama 3.1 Instruct's template, reduced (see above): JSON calls written as
`{"name": ..., "parameters": ARGS|tojson}`, one call per turn."""

MISTRAL_TOOLS_TEMPLATE = """\
{%- set user_messages = messages | selectattr("role", "equalto", "user") | list %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if tools and message == user_messages[-1] %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}
        {{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.content is string %}{{- message.content }}{%- endif %}
        {%- for tool in message.tool_calls or [] %}
            {%- set arguments = tool.function.arguments %}
            {%- if arguments is not string %}{%- set arguments = arguments|tojson|safe %}
            {%- elif arguments == '' %}{%- set arguments = '{}' %}{%- endif %}
            {{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + arguments }}
        {%- endfor %}
        {{- eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""
"""Mistral Small 3.x's (v11 tokenizer) template, reduced (see above): content, then
`[TOOL_CALLS]NAME[ARGS]ARGUMENTS` per call, a string `arguments` written verbatim."""

DEEPSEEK_V3_TEMPLATE = """\
{{- bos_token }}
{%- if tools %}{{- '## Tools\\n' + (tools | tojson) + '\\n\\n' }}{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{{- '<｜User｜>' + message.content }}
    {%- elif message.role == 'assistant' %}
        {{- '<｜Assistant｜>' + message.content }}
        {%- for tool in message.tool_calls or [] %}
            {%- if loop.first %}{{- '<｜tool▁calls▁begin｜>' }}{%- else %}{{- '\\n' }}{%- endif %}
            {{- '<｜tool▁call▁begin｜>' + tool.type + '<｜tool▁sep｜>' + tool.function.name + '\\n```json\\n' + tool.function.arguments + '\\n```<｜tool▁call▁end｜>' }}
            {%- if loop.last %}{{- '<｜tool▁calls▁end｜>' }}{%- endif %}
        {%- endfor %}
        {{- eos_token }}
    {%- elif message.role == 'tool' %}{{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}
"""
"""DeepSeek V3's template, reduced (see above): content, then the calls section, each
call's string arguments written verbatim in a json fence, consecutive calls on new lines."""

KIMI_K2_TEMPLATE = """\
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>
        {{- message['content'] }}
        {%- if message['tool_calls'] -%}<|tool_calls_section_begin|>
            {%- for tool_call in message['tool_calls'] -%}
                {%- set formatted_id = tool_call['id'] -%}
<|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
            {%- endfor -%}
<|tool_calls_section_end|>
        {%- endif -%}<|im_end|>
    {%- elif message['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ message.tool_call_id }}
{{ message['content'] }}<|im_end|>
    {%- else -%}<|im_user|>user<|im_middle|>{{ message['content'] }}<|im_end|>
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""
"""Kimi K2 Instruct's template, reduced (see above): content, then the calls section, each
call's id (`functions.NAME:I`) and string arguments written verbatim."""

MINIMAX_LIKE_TEMPLATE = """\
{%- if tools %}{{- ']~b]system\\n' + (tools | tojson) + '[e~[\\n' }}{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}{{- ']~b]ai\\n' + message.content }}
        {%- for tool in message.tool_calls or [] %}{{- '<minimax:tool_call>\\n<invoke name="' + tool.function.name + '">' + tool.function.arguments + '</invoke>\\n</minimax:tool_call>' }}{%- endfor %}
        {{- '[e~[\\n' }}
    {%- else %}{{- ']~b]' + message.role + '\\n' + message.content + '[e~[\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- ']~b]ai\\n' }}{%- endif %}
"""
"""MiniMax M2's tool-call markers in a minimal template: a format the gateway recognizes
but does not parse (the start-up warning's case)."""

GPT_OSS_LIKE_TEMPLATE = """\
{%- if tools %}{{- '<|start|>developer<|message|>' + (tools | tojson) + '<|end|>' }}{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|start|>assistant<|channel|>commentary to=functions.' + message.tool_calls[0].function.name + ' <|constrain|>json<|message|>' + message.tool_calls[0].function.arguments + '<|call|>' }}
    {%- else %}{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""
"""gpt-oss's harmony channels in a minimal template (the registry's choice)."""
