"""Chat messages -> prompt token ids, one way for serving and for training data.

The drafter is trained on what datagen fed the target and verified against what `LLM` (and
the server) feed it, so both must tokenise a conversation identically: the target's chat
template with the assistant's turn opened, then the tokenizer without adding special tokens
again (the template already wrote them).
"""

from __future__ import annotations

from dspark_trt.errors import InvalidRequestError

Messages = list[dict[str, str]]


def render_chat(tokenizer, messages: Messages, target_name: str = "") -> str:
    """The chat template applied to `messages`, ready for the assistant's reply (`target_name`
    names the target in the error when it has no template)."""
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(f"the target {target_name or tokenizer.name_or_path} has no chat template", "messages")
    from jinja2 import TemplateError  # transformers' chat templates are jinja

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as exc:  # a template may refuse a conversation (roles out of order, ...)
        raise InvalidRequestError(f"the chat template refused these messages: {exc}", "messages") from None


def encode_chat(tokenizer, messages: Messages, target_name: str = "") -> list[int]:
    return tokenizer(render_chat(tokenizer, messages, target_name), add_special_tokens=False).input_ids
