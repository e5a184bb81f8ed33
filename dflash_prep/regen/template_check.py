"""One template everywhere: does the server render a chat request as the extraction renders the row?

The `openai` engine's start-up probe (openai_engine.PROBE_MESSAGES, a one-token answer) is rendered here with the
extraction's renderer (`data.chat_template`, `data.chat_template_kwargs`, the tokenizer of `model.tokenizer` /
`model.name_or_path`). A server that returned the probe's prompt ids is compared token for token; one that did not,
by its prompt token count (a count can agree where the tokens do not: the check is then partial, and says so). A
difference is a warning naming both, once per run: the answers were then written for a prompt the extraction does
not reproduce (docs/ON_POLICY.md says how to give the server the recipe's template).
"""

from __future__ import annotations

import logging

from dflash_prep.data.chat import ChatRenderer
from dflash_prep.data.conversation import prompt_conversation
from dflash_prep.data.rows import read_chat_template
from dflash_prep.recipe.schema import Recipe
from dflash_prep.regen.engine import Answer

log = logging.getLogger("dflash_prep")


def our_prompt_ids(tokenizer, recipe: Recipe, messages: list[dict], chat_template_kwargs: dict) -> list[int]:
    """The prompt ids the extraction's renderer gives `messages` (OpenAI form) with the generation prompt."""
    renderer = ChatRenderer(tokenizer, read_chat_template(recipe.data), chat_template_kwargs)
    conv = prompt_conversation(messages)
    return renderer.served_prompt_ids(renderer.template_messages(conv), conv.tools)


def compare(ours: list[int], answer: Answer | None) -> str | None:
    """None when the server's rendering of the probe agrees with ours (as far as it can be told), else one line."""
    if answer is None or answer.rejected is not None:
        return None
    if answer.prompt_token_ids is not None:
        if answer.prompt_token_ids == ours:
            return None
        at = next((k for k, (a, b) in enumerate(zip(ours, answer.prompt_token_ids)) if a != b),
                  min(len(ours), len(answer.prompt_token_ids)))
        return (f"the server's prompt ids of the probe conversation differ from the extraction's rendering from "
                f"token {at} on ({len(answer.prompt_token_ids)} tokens there, {len(ours)} here)")
    if answer.prompt_tokens and answer.prompt_tokens != len(ours):
        return (f"the server counts {answer.prompt_tokens} prompt tokens for the probe conversation, the "
                f"extraction's rendering has {len(ours)}")
    return None


def check_server_template(engine, recipe: Recipe, chat_template_kwargs: dict) -> str | None:
    """Warn (once) when the server renders the probe conversation otherwise than the extraction would; returns the
    warning, or None. A tokenizer that cannot be loaded here skips the check (logged)."""
    from dflash_prep.regen.openai_engine import PROBE_MESSAGES
    from dflash_prep.target.model import load_tokenizer

    try:
        tokenizer = load_tokenizer(recipe.model)
        ours = our_prompt_ids(tokenizer, recipe, PROBE_MESSAGES, chat_template_kwargs)
    except Exception as e:  # noqa: BLE001 - no local tokenizer: nothing to compare with
        log.info("regenerate: the server's template is not checked (no tokenizer here: %s)", e)
        return None
    problem = compare(ours, getattr(engine, "probe_answer", None))
    if problem is not None:
        log.warning("regenerate: %s: the server does not render chats with the recipe's template; start it with "
                    "the same template (docs/ON_POLICY.md, \"One template\")", problem)
    return problem
