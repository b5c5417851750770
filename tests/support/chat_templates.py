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
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""SmolLM2-135M-Instruct's `chat_template.jinja`, verbatim."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

TOOL_ROUND = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
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


# Llama 4 (pythonic calls), GLM-4.5 and gpt-oss, reduced the same way. Llama 4's is vLLM's
# `examples/tool_chat_template_llama4_pythonic.jinja` (Apache-2.0; Llama 4's own template
# writes JSON calls), GLM-4.5's the one shipped with zai-org/GLM-4.5 (MIT), gpt-oss's the
# one shipped with openai/gpt-oss-20b (Apache-2.0); the assistant-turn parts are verbatim.

LLAMA4_PYTHONIC_TEMPLATE = """\
{{- bos_token }}
{%- if tools is not none and tools %}
    {{- "<|header_start|>system<|header_end|>\\n\\nHere is a list of functions in JSON format that you can invoke. Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]\\n" }}
    {{- tools | tojson(indent=4) }}{{- "\\n<|eot|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or ('tool_calls' in message and  message.tool_calls|length != 0 )) %}
    {{- '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}
        {{- message['content'] }}
        {{- "<|eot|>" }}
    {%- elif 'tool_calls' in message%}
        {{- '<|header_start|>assistant<|header_end|>\\n\\n' -}}
        {{- message['content'] }}
         {{- "[" }}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{-  tool_call.name + '(' -}}
            {%- for param in tool_call.arguments %}
                {{- param + '="' -}}
                {{- "%s" | format(tool_call.arguments[param]) -}}
               {{- '"' -}}
                {% if not loop.last %}, {% endif %}
            {%- endfor %}
            {{- ')' -}}
            {% if not loop.last %}, {% endif %}
        {%- endfor %}
        {{- "]<|eot|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|header_start|>ipython<|header_end|>\\n\\n" }}
        {{-  message.content  | tojson }}
        {{- "<|eot|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|header_start|>assistant<|header_end|>\\n\\n' }}
{%- endif %}
"""
"""vLLM's Llama 4 pythonic template, reduced (see above): the calls as
`[NAME(KEY="VALUE", ...)]`, every value written as a quoted string (`"%s"|format`), so
only a call whose values the model wrote as strings renders back to its tokens."""

GLM45_TEMPLATE = """\
[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>{%- endif -%}
{%- macro visible_text(content) -%}
    {%- if content is string -%}
        {{- content }}
    {%- else -%}
        {{- content }}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {% set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{{ visible_text(m.content) }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
{%- endif %}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{ '\\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '\\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ '\\n' + content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if m.content is string -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\\n<tool_response>\\n' }}
{{- m.content }}
{{- '\\n</tool_response>' }}
{% endif -%}
{%- elif m.role == 'system' -%}
<|system|>
{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>
{%- endif -%}
"""
"""GLM-4.5's template, reduced (see above): an assistant turn is `\\n<think>R</think>`
(an empty block for turns before the last user message: their reasoning is dropped),
`\\n` + content, then `\\n<tool_call>NAME` and `<arg_key>`/`<arg_value>` lines, values
not strings written with `tojson`. A turn has no end marker of its own: the model stops
on the next message's role token (`<|observation|>` before tool results)."""

GPT_OSS_TEMPLATE = """\
{%- if tools %}
{{- '<|start|>developer<|message|># Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}
{%- for tool in tools %}{%- set tool = tool.function %}
{{- '// ' + tool.description + '\\ntype ' + tool.name + ' = (_: ' + (tool.parameters | tojson) + ') => any;\\n\\n' }}
{%- endfor %}
{{- '} // namespace functions<|end|>' }}
{%- endif %}
{%- set last_tool_call = namespace(name=none) %}
{%- for message in messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if "tool_calls" in message %}
            {%- if message.tool_calls|length > 1 %}
                {{- raise_exception("Only one tool call per assistant message is supported") }}
            {%- endif %}
            {%- set tool_call = message.tool_calls[0] %}
            {%- if tool_call.function %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if message.content and message.thinking %}
                {{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls! Put the analysis message in one or the other, but not both.") }}
            {%- elif message.content %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" }}
            {%- elif message.thinking %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=" }}
            {{- "functions." + tool_call.name + "<|channel|>commentary " }}
            {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}
            {{- tool_call.arguments|tojson }}
            {{- "<|call|>" }}
            {%- set last_tool_call.name = tool_call.name %}
        {%- elif loop.last and not add_generation_prompt %}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
            {%- set last_tool_call.name = none %}
        {%- endif %}
    {%- elif message.role == 'tool' -%}
        {%- if last_tool_call.name is none %}
            {{- raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") }}
        {%- endif %}
        {{- "<|start|>functions." + last_tool_call.name }}
        {{- " to=assistant<|channel|>commentary<|message|>" + message.content|tojson + "<|end|>" }}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}
"""
"""gpt-oss's template, reduced (see above): a call is the `analysis` message (from the
message's `thinking`), then `<|start|>assistant to=functions.NAME<|channel|>commentary
json<|message|>ARGS|tojson<|call|>`; a final answer in history ends `<|end|>` where the
model wrote `<|return|>`, and its reasoning is dropped (harmony's design)."""
