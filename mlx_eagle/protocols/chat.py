"""A conversation in OpenAI's chat shapes as the prompt every chat protocol sends the engine."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..errors import UserError
from ..replies import ReplySplitter, chat_prompt, check_messages
from . import RequestError


def chat_ids(engine, messages: Any, tools: Optional[List[Dict[str, Any]]], tool_choice: Any,
             thinking: Optional[bool] = None, where: str = "messages",
             counting: bool = False) -> Tuple[List[int], ReplySplitter]:
    """The prompt's tokens and the reply's reader for a conversation in OpenAI's shapes
    (messages, function tools, tool_choice), checked: a 400 names the field at fault
    (``where``: the request's name for the conversation). ``counting``: only its tokens are
    wanted, so a prompt longer than the context is counted, not refused (a client counts
    to decide when to compact a conversation)."""
    try:
        checked = check_messages(messages, where)
    except UserError as error:
        raise RequestError(400, str(error), where) from None
    ids, splitter = chat_prompt(engine.tokenizer, checked, tools, tool_choice, thinking,
                                getattr(engine, "escape_special_text", False))
    limit = engine.context_length or 1 << 30
    if len(ids) >= limit and not counting:
        raise RequestError(400, f"the prompt is {len(ids)} tokens; the model's context holds {limit}", where,
                           "context_length_exceeded")
    return ids, splitter
