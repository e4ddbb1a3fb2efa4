"""Chat templates of our own, written to behave like the real families' (none has generation markers), and tiny
tokenizers built in-process with each family's special tokens. Used by test_masks.py."""

from __future__ import annotations

from functools import lru_cache


def family_tokenizer(template: str | None, special: tuple[str, ...], eos: str, bos: str | None = None,
                     plain: tuple[str, ...] = ()):
    """A small byte-level BPE with `special` as special tokens and `plain` as added non-special tokens (Qwen's
    `<think>`), wrapped as a HF fast tokenizer."""
    return _family_tokenizer(template, tuple(special), eos, bos, tuple(plain))


@lru_cache(maxsize=None)
def _family_tokenizer(template, special, eos, bos, plain):
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from hsx.demo import _CORPUS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = list(_CORPUS) + ["user assistant model think the end hi hello", "\n\n\n", "  hi  "]
    tok.train_from_iterator(corpus, trainer)
    if plain:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos,
                                                pad_token=special[0], chat_template=template)


# Qwen3: reasoning is kept only for the turns after the last user query; the last turn always gets a think block
# (an empty one when there is no reasoning); reasoning_content or <think>...</think> in content; tool calls as
# <tool_call> JSON; tool results inside a user turn.
QWEN3 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content if message.content is string else '' %}{%- set reasoning = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}{%- set f = call.function if call.function else call %}"
    "{%- if loop.first and content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments if f.arguments is string "
    "else f.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Qwen3.5/3.6: the generation prompt opens a think block; a turn after the last user query shows its reasoning
# only when it has some; every other turn is plain.
QWEN35 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query_index=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- set reasoning = reasoning | trim %}"
    "{%- if loop.index0 > ns.last_query_index and reasoning %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}{%- set f = call.function if call.function else call %}"
    "{{- '<tool_call>\\n<function=' + f.name + '>\\n</function>\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + content + "
    "'\\n</tool_response><|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)

# Llama 3.1: a system block with a date line always; role headers; tool calls as JSON; tool results as 'ipython'.
LLAMA3 = (
    "{{- bos_token }}{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n\\n' + system + "
    "'<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{%- set f = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + f.name + '\", \"parameters\": ' + "
    "(f.arguments if f.arguments is string else f.arguments | tojson) + '}<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + "
    "'<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Gemma 3: the system prompt is folded into the first user turn; the assistant is 'model'; roles must alternate.
GEMMA3 = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# GPT-OSS harmony: a system block; a first system or developer message is the developer message (later ones are
# dropped); the last assistant turn (training form) renders its analysis channel and
# ends with <|return|>, earlier turns only their final channel ending with <|end|>; a tool call goes to the
# commentary channel and ends with <|call|> (its analysis is dropped once a later final message exists).
HARMONY = (
    "{{- '<|start|>system<|message|>You are a model.\\nReasoning: medium\\n\\n# Valid channels: analysis, "
    "commentary, final.<|end|>' }}"
    "{%- if messages[0].role in ('system', 'developer') %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + "
    "messages[0].content + '<|end|>' }}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set last = namespace(name=none) %}"
    "{%- for message in loop_messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- if 'tool_calls' in message %}"
    "{%- set future = namespace(found=false) %}{%- for m in loop_messages[loop.index:] %}"
    "{%- if m.role == 'assistant' and 'tool_calls' not in m %}{%- set future.found = true %}{%- endif %}"
    "{%- endfor %}{%- set call = message.tool_calls[0].function %}"
    "{%- if message.thinking and not future.found %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' + "
    "(call.arguments if call.arguments is string else call.arguments | tojson) + '<|call|>' }}"
    "{%- set last.name = call.name %}"
    "{%- elif loop.last and not add_generation_prompt %}"
    "{%- if 'thinking' in message %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- endif %}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|start|>functions.' + last.name + ' to=assistant<|channel|>commentary<|message|>' + "
    "message.content | tojson + '<|end|>' }}"
    "{%- elif message.role == 'user' -%}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)

# DeepSeek R1: no headers of its own for the system prompt; every assistant turn drops what comes before
# </think>; the generation prompt opens a think block.
DEEPSEEK_R1 = (
    "{%- set ns = namespace(system='') %}{%- for message in messages %}{%- if message.role == 'system' %}"
    "{%- set ns.system = message.content %}{%- endif %}{%- endfor %}{{- bos_token + ns.system }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<｜User｜>' + message.content }}"
    "{%- elif message.role == 'assistant' %}{%- set content = message.content %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\\n' }}{%- endif %}"
)

# Llama 2: no generation prompt; the system prompt folded into the first user turn; ' ' + answer + ' </s>'.
LLAMA2 = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = '<<SYS>>\\n' + messages[0]['content'] + "
    "'\\n<</SYS>>\\n\\n' %}{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- for message in messages %}{%- set content = system + message['content'] if loop.first "
    "else message['content'] %}"
    "{%- if message['role'] == 'user' %}{{- bos_token + '[INST] ' + content | trim + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + content | trim + ' ' + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

# Mistral (v3-tekken / Nemo style): no generation prompt; the system prompt and the tool list go on the last user
# turn; tool calls as '[TOOL_CALLS]' + JSON list, call ids of 9 characters; tool results in [TOOL_RESULTS].
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools and message == user_messages[-1] %}{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}"
    "{%- if message == user_messages[-1] and system_message is defined %}"
    "{{- '[INST]' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST]' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}{{- '[TOOL_CALLS][' }}"
    "{%- for call in message.tool_calls %}{%- if call.id is not defined or call.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- {'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id} | tojson }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']' + eos_token }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS]{\"content\": ' + message['content'] | tojson + ', \"call_id\": \"' + message.tool_call_id + "
    "'\"}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('Only user, assistant and tool roles are supported!') }}{%- endif %}"
    "{%- endfor %}"
)

# Phi-3.5-mini: <|role|>\n ... <|end|>\n; a render without the generation prompt ends with eos.
PHI35 = (
    "{%- for message in messages %}{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- else %}{{- eos_token }}{%- endif %}"
)

# Phi-3-mini (first release): every user turn is followed by the assistant header; add_generation_prompt adds
# nothing.
PHI3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<|user|>\\n' + message['content'] + '<|end|>\\n<|assistant|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + '<|end|>\\n' }}{%- endif %}{%- endfor %}"
)

# Qwen2.5: ChatML with a default system prompt when the conversation has none; tool calls as <tool_call> JSON.
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}{%- set f = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + f.arguments | tojson + "
    "'}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1 as shipped: the system header always carries 'Cutting Knowledge Date' and 'Today Date'; tools go into
# the first user turn; one tool call per message, arguments through `tojson`; tool results as 'ipython'.
LLAMA31 = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools is not none and tools %}{%- set first_user_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON for "
    "a function call.\\n\\n' }}{%- for t in tools %}{{- t | tojson(indent=4) + '\\n\\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}{%- if not message.tool_calls | length == 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
    "{{- '}' }}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping or message.content is iterable and message.content is not string %}"
    "{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# DeepSeek V3: full-width special tokens; tool calls in <｜tool▁calls▁begin｜> blocks with the arguments
# concatenated as a string; an answer after tool outputs has no <｜Assistant｜> header (the outputs' end token is
# the prompt's last token), and no generation prompt follows tool outputs.
DEEPSEEK_V3 = (
    "{%- set ns = namespace(system='', is_tool=false, is_output_first=true) %}"
    "{%- for message in messages %}{%- if message.role == 'system' %}{%- set ns.system = message.content %}"
    "{%- endif %}{%- endfor %}{{- bos_token + ns.system }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.is_tool = false %}{{- '<｜User｜>' + message.content }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{%- set ns.is_tool = false %}"
    "{{- '<｜Assistant｜>' + (message.content or '') + '<｜tool▁calls▁begin｜>' }}"
    "{%- for tool in message.tool_calls %}{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<｜tool▁call▁begin｜>' + tool.type + '<｜tool▁sep｜>' + tool.function.name + '\\n```json\\n' + "
    "tool.function.arguments + '\\n```<｜tool▁call▁end｜>' }}{%- endfor %}"
    "{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' + message.content + '<｜end▁of▁sentence｜>' }}"
    "{%- set ns.is_tool = false %}{%- else %}{{- '<｜Assistant｜>' + message.content + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if not ns.is_tool %}{{- '<｜tool▁outputs▁begin｜>' }}{%- endif %}{%- set ns.is_tool = true %}"
    "{{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}"
    "{%- if add_generation_prompt and not ns.is_tool %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

# DeepSeek V3-0324 / R1-0528: the user turn renders '<｜Assistant｜>' after itself, so add_generation_prompt adds
# nothing after a user turn (only after an assistant turn); tool outputs are closed by the next assistant turn.
DEEPSEEK_V3_0324 = (
    "{%- set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', "
    "is_last_user=false) %}"
    "{%- for message in messages %}{%- if message.role == 'system' %}"
    "{%- set ns.system_prompt = ns.system_prompt + message.content %}{%- endif %}{%- endfor %}"
    "{{- bos_token + ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.is_tool = false %}{%- set ns.is_first = false %}"
    "{%- set ns.is_last_user = true %}{{- '<｜User｜>' + message.content + '<｜Assistant｜>' }}{%- endif %}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined and message.tool_calls is not none %}"
    "{%- set ns.is_last_user = false %}{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}"
    "{%- set ns.is_first = false %}{%- set ns.is_tool = false %}{%- set ns.is_output_first = true %}"
    "{%- for tool in message.tool_calls %}{%- if not ns.is_first %}"
    "{%- if message.content is none %}{{- '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' }}"
    "{%- else %}{{- message.content + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' }}{%- endif %}"
    "{%- set ns.is_first = true %}{%- else %}{{- '\\n<｜tool▁call▁begin｜>' }}{%- endif %}"
    "{{- tool.type + '<｜tool▁sep｜>' + tool.function.name + '\\n```json\\n' + tool.function.arguments + "
    "'\\n```<｜tool▁call▁end｜>' }}{%- endfor %}{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}{%- endif %}"
    "{%- if message.role == 'assistant' and (message.tool_calls is not defined or message.tool_calls is none) %}"
    "{%- set ns.is_last_user = false %}"
    "{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' + message.content + '<｜end▁of▁sentence｜>' }}"
    "{%- set ns.is_tool = false %}{%- else %}{{- message.content + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endif %}"
    "{%- if message.role == 'tool' %}{%- set ns.is_last_user = false %}{%- set ns.is_tool = true %}"
    "{%- if ns.is_output_first %}{{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message.content + "
    "'<｜tool▁output▁end｜>' }}{%- set ns.is_output_first = false %}"
    "{%- else %}{{- '\\n<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}"
    "{%- if add_generation_prompt and not ns.is_last_user and not ns.is_tool %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

# GLM-4 (0414): '[gMASK]<sop>' prefix; '<|role|>\n' headers and no end-of-turn token: a turn ends where the next
# role token starts (the model stops by generating <|user|> or <|observation|>); tool calls as the function's
# name and JSON arguments; tool results as <|observation|>.
GLM4 = (
    "[gMASK]<sop>{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{- '<|system|>\\n' + m.content }}"
    "{%- elif m.role == 'user' %}{{- '<|user|>\\n' + m.content }}"
    "{%- elif m.role == 'assistant' %}{{- '<|assistant|>\\n' + (m.content or '') }}"
    "{%- for call in m.tool_calls or [] %}{{- '\\n' if m.content else '' }}"
    "{{- call.function.name + '\\n' + call.function.arguments | tojson }}{%- endfor %}"
    "{%- elif m.role == 'tool' %}{{- '<|observation|>\\n' + m.content }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

# SmolLM3: a system block always (reasoning mode flag and 'Knowledge Cutoff Date'); enable_thinking (default true)
# or '/no_think' in the system prompt switches thinking off: then the generation prompt and every assistant turn
# carry an empty think block; with thinking on, history turns are plain.
SMOLLM3 = (
    "{%- set reasoning_mode = '/think' %}{%- if enable_thinking is defined and enable_thinking is false %}"
    "{%- set reasoning_mode = '/no_think' %}{%- endif %}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- if '/no_think' in system %}{%- set reasoning_mode = '/no_think' %}{%- set system = system.replace("
    "'/no_think', '') | trim %}{%- endif %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n## Metadata\\n\\nKnowledge Cutoff Date: June 2025\\nReasoning Mode: ' + "
    "reasoning_mode + '\\n\\n## Custom Instructions\\n\\n' + system + '\\n\\n<|im_end|>\\n' }}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if reasoning_mode == '/think' %}{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{%- if reasoning_mode == '/think' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n' }}{%- endif %}{%- endif %}"
)

QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_PLAIN = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
FAMILIES = {
    "qwen3": dict(template=QWEN3, special=QWEN_SPECIAL, eos="<|im_end|>", plain=QWEN_PLAIN),
    "qwen3.5": dict(template=QWEN35, special=QWEN_SPECIAL, eos="<|im_end|>", plain=QWEN_PLAIN),
    "llama3": dict(template=LLAMA3, special=("<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|end_of_text|>",
                                             "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                   eos="<|eot_id|>", bos="<|begin_of_text|>"),
    "gemma3": dict(template=GEMMA3, special=("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
                   eos="<eos>", bos="<bos>"),
    "harmony": dict(template=HARMONY, special=("<|endoftext|>", "<|start|>", "<|message|>", "<|channel|>",
                                               "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"),
                    eos="<|return|>"),
    "deepseek-r1": dict(template=DEEPSEEK_R1, special=("<｜▁pad▁｜>", "<｜begin▁of▁sentence｜>",
                                                       "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
                        eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>", plain=("<think>", "</think>")),
    "llama2": dict(template=LLAMA2, special=("<unk>", "<s>", "</s>"), eos="</s>", bos="<s>"),
    "mistral": dict(template=MISTRAL, special=("<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                                               "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                                               "[/TOOL_RESULTS]"), eos="</s>", bos="<s>"),
    "phi3.5": dict(template=PHI35, special=("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                   eos="<|endoftext|>"),
    "phi3": dict(template=PHI3, special=("<unk>", "<s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"),
                 eos="<|endoftext|>", bos="<s>"),
    "qwen2.5": dict(template=QWEN25, special=QWEN_SPECIAL, eos="<|im_end|>", plain=QWEN_PLAIN),
    "llama3.1": dict(template=LLAMA31, special=("<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|end_of_text|>",
                                                "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                                "<|eom_id|>", "<|python_tag|>"), eos="<|eot_id|>",
                     bos="<|begin_of_text|>"),
    "deepseek-v3": dict(template=DEEPSEEK_V3, special=(
        "<｜▁pad▁｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>"), eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>"),
    "deepseek-v3-0324": dict(template=DEEPSEEK_V3_0324, special=(
        "<｜▁pad▁｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>"), eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>"),
    "glm4": dict(template=GLM4, special=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>",
                                         "<|assistant|>", "<|observation|>"), eos="<|endoftext|>"),
    "smollm3": dict(template=SMOLLM3, special=QWEN_SPECIAL, eos="<|im_end|>", plain=QWEN_PLAIN),
}


def family(name: str, template: str | None = None):
    spec = dict(FAMILIES[name])
    if template is not None:
        spec["template"] = template
    return family_tokenizer(**spec)
