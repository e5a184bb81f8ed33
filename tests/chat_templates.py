"""Chat templates written for the tests, each reproducing one model family's public format (none has a
`{% generation %}` block, like the official ones). Shortened where the text does not matter (tool instructions),
faithful where it does: headers, end-of-turn markers, reasoning blocks and which turns keep them, tool calls.
"""

# Qwen3: ChatML; reasoning (<think>) kept only for assistant turns after the last real user query, always
# rendered (possibly empty) for the last message; tool calls as JSON in <tool_call>; tool results as user turns.
QWEN3 = r"""
{%- if tools %}{{- '<|im_start|>system\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions.\n\n<tools>" }}{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools><|im_end|>\n" }}
{%- else %}{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
{%- elif message.role == "assistant" %}
{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}
{%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}
{%- elif '</think>' in content %}{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}
{%- if loop.index0 > ns.last_query_index %}
{%- if loop.last or (not loop.last and reasoning_content) %}
{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}
{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}
{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}
{%- if (loop.first and content) or (not loop.first) %}{{- '\n' }}{%- endif %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}{%- endfor %}{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}
"""

# Qwen3.5 / Qwen3.6: ChatML, the same reasoning rule as Qwen3, tool calls as XML (<function=...><parameter=...>).
QWEN36 = r"""
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content }}
{%- if tools %}{{- '\n\n# Tools\n\n<tools>' }}{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}{{- '\n</tools>' }}{%- endif %}
{{- '<|im_end|>\n' }}{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if not ns.found and message.role == "user" %}{%- set ns.found = true %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == "user" %}{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == "assistant" %}
{%- set content = message.content if message.content is string else '' %}
{%- set reasoning_content = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}
{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}
{%- if (loop.first and content) or (not loop.first) %}{{- '\n\n' }}{%- endif %}
{%- set tool_call = tool_call.function %}
{{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
{%- for name, value in tool_call.arguments.items() %}{{- '<parameter=' + name + '>\n' }}
{{- value if value is string else value | tojson }}{{- '\n</parameter>\n' }}{%- endfor %}
{{- '</function>\n</tool_call>' }}{%- endfor %}{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{%- if messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- else %}{{- '<think>\n' }}{%- endif %}{%- endif %}
"""

# Qwen3.6 as released: it refuses a conversation with no user query (raise_exception), so an assistant turn that
# opens a row renders only with a user turn after it.
QWEN36_STRICT = QWEN36.replace(
    "{%- for message in messages %}",
    "{%- if not ns.found %}{{- raise_exception('No user query found in messages.') }}{%- endif %}\n"
    "{%- for message in messages %}", 1)

# Llama-3.1: header ids, <|eot_id|>, a dated system block, JSON tool calls, `ipython` tool results.
LLAMA31 = r"""
{{- '<|begin_of_text|>' }}
{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}{{- 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' }}
{%- if tools %}{{- 'You have access to the following functions.\n\n' }}{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\n\n' }}{%- endfor %}{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}' + '<|eot_id|>' }}
{%- elif message.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

# Mistral (v7 / Magistral style): [INST] ... [/INST], </s> ends an answer, [THINK] reasoning, [TOOL_CALLS],
# [TOOL_RESULTS]; the system prompt in [SYSTEM_PROMPT]; no generation prompt at all.
MISTRAL = r"""
{{- '<s>' }}
{%- if messages[0].role == 'system' %}{{- '[SYSTEM_PROMPT]' + messages[0].content + '[/SYSTEM_PROMPT]' }}{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- for message in loop_messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.first %}{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST]' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' %}
{%- if message.reasoning_content %}{{- '[THINK]' + message.reasoning_content + '[/THINK]' }}{%- endif %}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- if message.tool_calls %}{{- '[TOOL_CALLS]' }}{%- for tc in message.tool_calls %}{{- tc.function.name + '[ARGS]' + tc.function.arguments | tojson }}{%- endfor %}{%- endif %}
{{- '</s>' }}
{%- elif message.role == 'tool' %}{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
{%- endif %}{%- endfor %}
"""

# Gemma: <start_of_turn>user / model, <end_of_turn>; the system prompt goes into the first user turn.
GEMMA = r"""
{{- '<bos>' }}
{%- if messages[0].role == 'system' %}{%- set first_user_prefix = messages[0].content + '\n\n' %}{%- set loop_messages = messages[1:] %}
{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}
{%- for message in loop_messages %}
{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}
{%- set role = 'model' if message.role == 'assistant' else message.role %}
{{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message.content | trim + '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}
"""

# DeepSeek (V3.1 style): <｜User｜> / <｜Assistant｜>, <｜end▁of▁sentence｜>; the turn after the last user message
# keeps its reasoning (<think>...</think>), earlier ones render `</think>` only; the generation prompt opens
# `<think>`; tool calls and outputs in DeepSeek's own markers.
DEEPSEEK = r"""
{%- set ns = namespace(system_prompt='', last_user=-1) %}
{%- for message in messages %}{%- if message.role == 'system' %}{%- set ns.system_prompt = message.content %}{%- endif %}
{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{{- '<｜begin▁of▁sentence｜>' + ns.system_prompt }}
{%- for message in messages %}
{%- if message.role == 'user' %}{{- '<｜User｜>' + message.content }}
{%- elif message.role == 'assistant' %}
{{- '<｜Assistant｜>' }}
{%- if loop.index0 > ns.last_user %}{{- '<think>' + (message.reasoning_content or '') + '</think>' }}{%- else %}{{- '</think>' }}{%- endif %}
{{- message.content or '' }}
{%- if message.tool_calls %}{{- '<｜tool▁calls▁begin｜>' }}{%- for tc in message.tool_calls %}
{{- '<｜tool▁call▁begin｜>' + tc.function.name + '<｜tool▁sep｜>' + tc.function.arguments | tojson + '<｜tool▁call▁end｜>' }}
{%- endfor %}{{- '<｜tool▁calls▁end｜>' }}{%- endif %}
{{- '<｜end▁of▁sentence｜>' }}
{%- elif message.role == 'tool' %}{{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>' }}{%- endif %}
"""

# gpt-oss (harmony): <|start|>role ... <|message|> ... <|end|>; assistant channels analysis / commentary / final;
# analysis kept for tool-call turns and the last message only; a tool call ends with <|call|>, the last final
# message with <|return|>; tools in a developer message.
GPT_OSS = r"""
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nReasoning: medium\n\n# Valid channels: analysis, commentary, final.<|end|>' }}
{%- if messages[0].role == 'system' or tools %}{{- '<|start|>developer<|message|>' }}
{%- if messages[0].role == 'system' %}{{- '# Instructions\n\n' + messages[0].content }}{%- endif %}
{%- if tools %}{{- '\n\n# Tools\n\nnamespace functions {\n' }}{%- for t in tools %}{{- '// ' + t.function.description + '\ntype ' + t.function.name + ' = (_: any) => any;\n' }}{%- endfor %}{{- '} // namespace functions' }}{%- endif %}
{{- '<|end|>' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
{%- elif message.role == 'assistant' %}
{%- if message.thinking and (message.tool_calls or loop.last) %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}
{%- if message.tool_calls %}{%- set tc = message.tool_calls[0].function %}
{{- '<|start|>assistant<|channel|>commentary to=functions.' + tc.name + ' <|constrain|>json<|message|>' + tc.arguments | tojson + '<|call|>' }}
{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + ('<|return|>' if loop.last else '<|end|>') }}{%- endif %}
{%- elif message.role == 'tool' %}
{{- '<|start|>functions.' + messages[loop.index0 - 1].tool_calls[0].function.name + ' to=assistant<|channel|>commentary<|message|>' + message.content + '<|end|>' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""

# Phi-3.5 / Phi-4-mini: <|system|>, <|user|>, <|assistant|>, each turn closed by <|end|> and a newline.
PHI = r"""
{%- for message in messages %}{{- '<|' + message.role + '|>\n' + message.content + '<|end|>\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}
"""

# Phi-3.5-mini: as PHI, and a conversation rendered without a generation prompt ends with eos_token (the template
# closes what it was not asked to continue).
PHI35 = r"""
{%- for message in messages %}
{%- if message['role'] == 'system' and message['content'] %}{{- '<|system|>\n' + message['content'] + '<|end|>\n' }}
{%- elif message['role'] == 'user' %}{{- '<|user|>\n' + message['content'] + '<|end|>\n' }}
{%- elif message['role'] == 'assistant' %}{{- '<|assistant|>\n' + message['content'] + '<|end|>\n' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- else %}{{- eos_token }}{%- endif %}
"""

# Phi-4-mini: <|role|>content<|end|> with no newlines, eos_token when no generation prompt is asked for.
PHI4_MINI = r"""
{%- for message in messages %}{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- else %}{{- eos_token }}{%- endif %}
"""

# Phi-3-mini (first release) / Phi-3-medium: the user turn writes the assistant header; an assistant turn is its
# text and <|end|>; system messages are not rendered; no generation-prompt branch.
PHI3_MINI = r"""
{%- for message in messages %}
{%- if message['role'] == 'user' %}{{- '<|user|>\n' + message['content'] + '<|end|>\n<|assistant|>\n' }}
{%- elif message['role'] == 'assistant' %}{{- message['content'] + '<|end|>\n' }}
{%- endif %}{%- endfor %}
"""

# DeepSeek-V3: tool-call arguments are concatenated as a string (an object makes the template fail), a null content
# is tested with `is none`; tool outputs are grouped and the reply after them has no <｜Assistant｜> header.
DEEPSEEK_V3 = r"""
{%- set ns = namespace(system_prompt='', is_tool=false) %}
{%- for message in messages %}{%- if message['role'] == 'system' %}{%- set ns.system_prompt = message['content'] %}
{%- endif %}{%- endfor %}
{{- '<｜begin▁of▁sentence｜>' + ns.system_prompt }}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{%- set ns.is_tool = false %}{{- '<｜User｜>' + message['content'] }}
{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}
{%- set ns.is_tool = false %}
{%- if message['content'] is none %}{{- '<｜Assistant｜><｜tool▁calls▁begin｜>' }}
{%- else %}{{- '<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜>' }}{%- endif %}
{%- for tool in message['tool_calls'] %}
{{- '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n```json\n'
    + tool['function']['arguments'] + '\n```<｜tool▁call▁end｜>' }}
{%- if not loop.last %}{{- '\n' }}{%- endif %}
{%- endfor %}
{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
{%- elif message['role'] == 'assistant' %}
{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}
{%- set ns.is_tool = false %}
{%- else %}{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{%- endif %}
{%- elif message['role'] == 'tool' %}
{%- if not ns.is_tool %}{{- '<｜tool▁outputs▁begin｜>' }}{%- set ns.is_tool = true %}{%- endif %}
{{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}
{%- endif %}{%- endfor %}
{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}
{%- if add_generation_prompt and not ns.is_tool %}{{- '<｜Assistant｜>' }}{%- endif %}
"""

# GLM-4: [gMASK]<sop>, <|role|> headers and no end-of-turn token: the model ends a turn by generating the next
# role's token (<|user|>, <|observation|>: stop ids of its generation_config.json); the generation prompt is
# <|assistant|> and a reply starts with a newline; a tool call is the function name, a newline and the arguments.
GLM4 = r"""
{{- '[gMASK]<sop>' }}
{%- if tools %}{{- '<|system|>\n# Tools' }}
{%- for tool in tools %}{{- '\n\n## ' + tool.function.name + '\n\n' + tool.function | tojson }}{%- endfor %}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{{- '<|system|>\n' + message.content }}
{%- elif message.role == 'user' %}{{- '<|user|>\n' + message.content }}
{%- elif message.role == 'assistant' %}{{- '<|assistant|>' }}
{%- if message.tool_calls %}
{%- for tc in message.tool_calls %}{{- tc.function.name + '\n' + tc.function.arguments | tojson }}{%- endfor %}
{%- else %}{{- '\n' + message.content }}{%- endif %}
{%- elif message.role == 'tool' %}{{- '<|observation|>\n' + message.content }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}
"""

# Llama-2 / Mistral-v1 style: [INST] ... [/INST], then the template writes a space before the reply (the served model
# generates it after [/INST]); </s> ends an answer; no generation prompt.
LLAMA2 = r"""
{%- if messages[0]['role'] == 'system' %}{%- set system = '<<SYS>>\n' + messages[0]['content'] + '\n<</SYS>>\n\n' %}
{%- set loop_messages = messages[1:] %}
{%- else %}{%- set system = '' %}{%- set loop_messages = messages %}{%- endif %}
{%- for message in loop_messages %}
{%- if message['role'] == 'user' %}
{{- '<s>[INST] ' + (system if loop.first else '') + message['content'] | trim + ' [/INST]' }}
{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] | trim + ' </s>' }}{%- endif %}
{%- endfor %}
"""

# ChatML templates with {% generation %} blocks that disagree with the convention: one wraps the role header (as
# SmolLM3-style templates do), one the newline after <|im_end|>.
CHATML_TAGGED_HEADER = r"""
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- generation %}{{- '<|im_start|>assistant\n' + message.content + '<|im_end|>' }}{%- endgeneration %}{{- '\n' }}
{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
CHATML_TAGGED_NEWLINE = r"""
{%- for message in messages %}
{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}
{%- generation %}{{- message.content + '<|im_end|>\n' }}{%- endgeneration %}
{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# The marker strings each family's tokenizer holds as single (special) tokens.
SPECIAL_TOKENS = {
    "qwen3": ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
    "qwen36": ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
    "llama31": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "mistral": ["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[THINK]", "[/THINK]",
                "[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"],
    "gemma": ["<bos>", "<start_of_turn>", "<end_of_turn>"],
    "deepseek": ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>",
                 "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"],
    "gpt_oss": ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>"],
    "phi": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    "deepseek_v3": ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                    "<｜tool▁output▁end｜>"],
    "glm4": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
    "llama2": ["<s>", "</s>", "[INST]", "[/INST]"],
}
# The stop ids of each family's generation_config.json, as token strings (the eos_token of the tests' tokenizer,
# <|endoftext|>, is one too).
STOP_TOKENS = {"phi": ["<|end|>", "<|assistant|>"], "glm4": ["<|user|>", "<|observation|>"]}
