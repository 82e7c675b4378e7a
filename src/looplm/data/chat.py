"""The chat template looplm serves (`looplm serve`, and vLLM through the exported tokenizer).

Each message is rendered as `role: content` on its own line ("developer" as "system"), then
`assistant:` opens the reply; a reply stops where the template's next turn would start.
"""

CHAT_TEMPLATE = "{role}: {content}\n"
"""Each message is rendered as `role: content` on its own line, then `assistant:` opens the reply."""
CHAT_STOP = ("\nuser:", "\nsystem:")
"""Stop strings added to every chat request, so the reply ends where the template's next turn would start."""
CHAT_TEMPLATE_JINJA = (
    "{%- for message in messages -%}"
    "{{- ('system' if message['role'] == 'developer' else message['role']) + ': ' + message['content'] + '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant:{%- endif -%}"
)
"""`CHAT_TEMPLATE` as the Jinja chat template `looplm export` writes into the tokenizer (vLLM's chat endpoint)."""
