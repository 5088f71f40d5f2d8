"""A tokenizer's chat template, rendered and read for token-exact encoding.

`ChatTemplate` renders conversations exactly as `apply_chat_template` does and answers what the encoder
asks: `end_of_turn` (the added tokens closing an assistant turn, found in the template's own rendering),
`spans` (where trainable messages sit: for an assistant turn, from the end of the generation prompt
through its end-of-turn), `continuation` (the text after a sampled turn) and `check_rendered` (no TOOL
message dropped, found with a marker per message). Spans are (message index, start, end) character
offsets into one rendered string. Every "cannot" raises a ValueError naming the cause and the fix.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict

import jinja2

SENTINEL = "\u2063STLR\u2063SENTINEL\u2063"  # invisible separators: never trimmed, never in real text
BASE_SENTINEL = "\u2063STLR\u2063BASE\u2063"  # the sampled turn's content in a continuation's base
TOOL_SENTINEL = "\u2063STLR\u2063TOOL{}\u2063"  # message i's content while checking TOOL messages are rendered
_BASE_USER = {"role": "user", "content": "Hi"}
_MEMO_SIZE = 4096
_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError)
_THINK = re.compile(r"</think>|<think>", re.S)


def _key(obj) -> str:
    return repr(obj)  # message dicts are built in one order (Message.to_dict), so repr is a stable key


def _roles(chat: list[dict]) -> str:
    return "[" + ", ".join(m["role"] for m in chat) + "]"


def _variants(content: str) -> list[str]:
    """How a template may print a content string: verbatim or trimmed."""
    return list(dict.fromkeys([content, content.strip(), content.lstrip(), content.rstrip()]))


def _rendered(content: str, text: str) -> bool:
    """Does `text` show `content` (verbatim, trimmed, or JSON-escaped as some templates do)?"""
    if not content.strip():
        return True
    core = content.strip()
    return core in text or json.dumps(core, ensure_ascii=False)[1:-1] in text or json.dumps(core)[1:-1] in text


def _shows(text: str, marker: str) -> bool:
    """Does `text` show `marker`, verbatim or JSON-escaped (templates that `tojson` tool results)?"""
    return marker in text or json.dumps(marker)[1:-1] in text


def _tool_names(message: dict) -> list[str]:
    names = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names


class ChatTemplate:
    """One tokenizer's chat template with one rollout's options (tools, template kwargs)."""

    def __init__(self, tokenizer, tools=None, template_kwargs: dict | None = None):
        from transformers.utils.chat_template_utils import render_jinja_template

        self._render_jinja = render_jinja_template
        self.tokenizer = tokenizer
        self.tools = tools
        self.source = tokenizer.get_chat_template(None, tools)
        self.template_kwargs = dict(template_kwargs or {})
        self.kwargs = {**tokenizer.special_tokens_map, **self.template_kwargs}
        self._memo: OrderedDict = OrderedDict()
        self._memo_lock = threading.Lock()
        added = tokenizer.added_tokens_decoder.values()
        self._added = sorted({str(a) for a in added if str(a)}, key=len, reverse=True)  # longest first
        self._special = frozenset(str(a) for a in added if getattr(a, "special", False) and str(a))
        self.end_of_turn: tuple[str, ...] = self._find_end_of_turn()
        self.has_generation_prompt = self._find_generation_prompt()
        self.turn_end_ids = self._turn_end_ids()
        self.anchor = self._anchor()

    def without_tools(self) -> ChatTemplate:
        return chat_template_for(self.tokenizer, None, self.template_kwargs)

    # ------------------------------------------------------------------ rendering

    def render(self, chat: list[dict], generation_prompt: bool = False) -> str:
        """`apply_chat_template(chat, tokenize=False, ...)`, memoized; template errors name the conversation."""
        tools = self.tools
        key = (_key(chat), generation_prompt)
        with self._memo_lock:  # a producer thread and the trainer may encode at once
            hit = self._memo.get(key)
            if hit is not None:
                self._memo.move_to_end(key)
                return hit
        if not chat and not generation_prompt:
            return ""
        try:
            text = self._render_jinja([chat], tools=tools, chat_template=self.source,
                                      add_generation_prompt=generation_prompt, **self.kwargs)[0][0]
        except _TEMPLATE_ERRORS as e:
            raise ValueError(
                f"the chat template rejects the conversation {_roles(chat)}: {e}. The template does not accept "
                "this order of roles or these fields; reorder or merge the messages (e.g. fold tool results into "
                "a user message) or use a template that allows them"
            ) from e
        with self._memo_lock:
            self._memo[key] = text
            if len(self._memo) > _MEMO_SIZE:
                self._memo.popitem(last=False)
        return text

    def _try_render(self, chat, generation_prompt=False) -> str | None:
        try:
            return self.render(chat, generation_prompt)
        except ValueError:
            return None

    # ------------------------------------------------------------------ what closes a turn

    def _find_end_of_turn(self) -> tuple[str, ...]:
        """Added tokens right after an assistant turn's content, as last turn and as history."""
        asst = {"role": "assistant", "content": SENTINEL}
        found: dict[str, None] = {}
        for prefix in ([_BASE_USER], [{"role": "system", "content": "S"}, _BASE_USER]):
            for chat in (prefix + [asst], prefix + [asst, {"role": "user", "content": "Ok"}]):
                text = self._try_render(chat)
                if text is None or text.count(SENTINEL) != 1:
                    continue
                tok = self._added_token_at(text, text.index(SENTINEL) + len(SENTINEL))
                if tok is not None:
                    found[tok] = None
            if found:
                break
        # a tool-call turn may close with a token of its own (gpt-oss: <|call|>): the first special token after it
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call00001", "function": {"name": "probe", "arguments": {"a": SENTINEL}}}]}
        text = self._try_render([_BASE_USER, call, {"role": "tool", "content": "r", "tool_call_id": "call00001"}])
        if text is not None and text.count(SENTINEL) == 1:
            tok = self._special_token_after(text, text.index(SENTINEL) + len(SENTINEL))
            if tok is not None:
                found[tok] = None
        return tuple(found)

    def _special_token_after(self, text: str, pos: int) -> str | None:
        hits = [(i, s) for s in self._special if (i := text.find(s, pos)) >= 0]
        return min(hits)[1] if hits else None

    def _added_token_at(self, text: str, pos: int) -> str | None:
        """The (longest) added token that starts at `pos` after optional whitespace, if any."""
        while pos < len(text) and text[pos].isspace():
            pos += 1
        return next((s for s in self._added if text.startswith(s, pos)), None)

    def next_end_of_turn(self, text: str, pos: int) -> tuple[int, int] | None:
        """(start, end) of the first end-of-turn token at or after `pos`."""
        hits = [(i, i + len(t)) for t in self.end_of_turn if (i := text.find(t, pos)) >= 0]
        return min(hits) if hits else None

    def _find_generation_prompt(self) -> bool:
        plain, with_prompt = self._try_render([_BASE_USER]), self._try_render([_BASE_USER], True)
        return plain is not None and with_prompt is not None and with_prompt != plain

    def _turn_end_ids(self) -> frozenset[int]:
        """Ids that end a sampled turn: the template's end-of-turn tokens, EOS, and any special added token."""
        tok = self.tokenizer
        ids = {tok.convert_tokens_to_ids(t) for t in (*self._special, *self.end_of_turn)}
        if tok.eos_token_id is not None:
            ids.add(tok.eos_token_id)
        return frozenset(i for i in ids if i is not None)

    def _anchor(self) -> str:
        """Text that ends in an added token: anchor + piece is tokenized as the piece would be mid-text.

        A letter comes first so that the piece is not the text's first section (SentencePiece tokenizers
        put a space marker before the first section only); the added token splits the text there.
        """
        for t in (*self.end_of_turn, self.tokenizer.eos_token, self.tokenizer.bos_token):
            if t:
                return "x" + t
        raise ValueError("the tokenizer has a chat template but no end-of-turn, EOS or BOS token to anchor pieces on")

    # ------------------------------------------------------------------ spans of trainable messages

    def spans(self, chat: list[dict], indices: list[int], text: str,
              generation_prompt: bool) -> list[tuple[int, int, int]]:
        """(index, start, end) in `text` = render(chat, generation_prompt) for each message index."""
        return [(i, *self._span(chat, i, text, generation_prompt)) for i in indices]

    def _span(self, chat: list[dict], i: int, text: str, generation_prompt: bool) -> tuple[int, int]:
        msg, span = chat[i], None
        if msg["role"] == "assistant" and self.end_of_turn and self.has_generation_prompt:
            head = self._try_render(chat[:i], True) if i > 0 else None
            if head is not None and text.startswith(head):
                span = self._assistant_span(msg, text, len(head))
        if span is None:
            span = self._content_span(chat, i, text, generation_prompt)
        self._check_ends_before_next(chat, i, text, generation_prompt, span[1])
        return span

    def _check_ends_before_next(self, chat, i, text, generation_prompt, end) -> None:
        """A span must not reach into the next message's content (an end-of-turn token we do not know)."""
        if i + 1 >= len(chat):
            return
        probe = self._try_render(chat[: i + 1] + [dict(chat[i + 1], content=SENTINEL)] + chat[i + 2:],
                                 generation_prompt)
        if probe is None or probe.count(SENTINEL) != 1:
            return
        p = probe.index(SENTINEL)
        if text.startswith(probe[:p]) and end > p:
            raise ValueError(f"message {i} ({chat[i]['role']}): the chat template closes this turn with a token "
                             f"that is not one of its end-of-turn tokens {list(self.end_of_turn)}, so the turn's "
                             "end cannot be found; the turn cannot be trained")

    def _assistant_span(self, msg: dict, text: str, start: int) -> tuple[int, int] | None:
        """From the end of the generation prompt through the first end-of-turn, if the turn's content is there."""
        eot = self.next_end_of_turn(text, start)
        if eot is None:
            return None
        region = text[start: eot[0]]
        content, names = msg["content"], _tool_names(msg)
        if "</think>" in content:  # a template may reformat the reasoning block; both parts must be there
            answer = content.split("</think>")[-1].strip()
            reasoning = content.split("</think>")[0].split("<think>")[-1].strip()
            ok = reasoning in region and region.rstrip().endswith(answer) and not names
            return (start, eot[1]) if ok else None
        for x in _variants(content):
            if names:
                at = region.find(x)
                ok = at >= 0 and all(n in region[at + len(x):] for n in names)
            else:
                ok = region.rstrip().endswith(x.rstrip()) if x.strip() else not region.strip()
            if ok:
                return start, eot[1]
        return None

    def _content_span(self, chat: list[dict], i: int, text: str, generation_prompt: bool) -> tuple[int, int]:
        """The content located by rendering a sentinel in its place, plus a following end-of-turn token."""
        msg = chat[i]
        probe = self.render(chat[:i] + [dict(msg, content=SENTINEL)] + chat[i + 1:], generation_prompt)
        if probe.count(SENTINEL) != 1:
            raise ValueError(self._dropped(chat, i))
        start = probe.index(SENTINEL)
        if not text.startswith(probe[:start]):
            raise ValueError(self._rewritten(chat, i))
        for x in _variants(msg["content"]):
            if not text.startswith(x, start):
                continue
            end = start + len(x)
            names = _tool_names(msg)
            eot = self.next_end_of_turn(text, end)
            gap = text[end: eot[0]] if eot is not None else ""
            if names and not (eot is not None and all(n in gap for n in names)):
                raise ValueError(f"message {i} (assistant): the chat template drops its structured tool_calls "
                                 f"{names} (they are not rendered in its turn), so they cannot be trained; put the "
                                 "call in the content as text or use a template that renders tool_calls")
            if eot is not None and (names or not gap.strip()):
                return start, eot[1]
            closing = self._added_token_at(text, end)  # a special token right after the content closes the turn
            if closing in self._special:
                return start, text.index(closing, end) + len(closing)
            return start, end
        raise ValueError(self._rewritten(chat, i))

    def check_rendered(self, chat: list[dict], text: str, generation_prompt: bool = False, offset: int = 0) -> None:
        """A TOOL message the template drops would leave the model answering a result it never saw.

        `text` = render(chat, generation_prompt). Each TOOL message's content is replaced by a marker of
        its own and the conversation rendered again: a missing marker is a dropped message, whatever its
        text (empty, or also written elsewhere in the conversation). chat[i] is message i + offset of
        the rollout (errors name that). If the template rejects the markers, the content is searched for.
        """
        tools = [i for i, m in enumerate(chat) if m["role"] == "tool"]
        if not tools:
            return
        probe = self._try_render([dict(m, content=TOOL_SENTINEL.format(i)) if i in tools else m
                                  for i, m in enumerate(chat)], generation_prompt)
        for i in tools:
            shown = _shows(probe, TOOL_SENTINEL.format(i)) if probe is not None else _rendered(chat[i]["content"], text)
            if not shown:
                raise ValueError(self._dropped(chat, i, i + offset))

    def _dropped(self, chat, i, number: int | None = None) -> str:
        """Why message i (message `number` of the rollout, default i) is not where it can be found."""
        role, number = chat[i]["role"], i if number is None else number
        if role == "tool":
            return (f"message {number} (tool): the chat template drops TOOL messages (or their content), so the "
                    "model would never see this tool result and the encoded ids would silently lack it; use a "
                    "template with a tool role, or send tool results as user messages (MessageType.MESSAGE)")
        if role == "system":
            return (f"message {i} (system): the chat template does not render the system prompt as a message of "
                    "its own here; do not train it (trainable=False) or put it in the first user message")
        if chat[i].get("tool_calls") and chat[i]["content"].strip():
            return (f"message {i} (assistant): the chat template renders only the tool_calls of this turn and "
                    "drops its content; leave the content empty or put the call in the content as text")
        if chat[i].get("tool_calls"):
            return (f"message {i} (assistant): the chat template renders only the tool_calls of this turn and has "
                    "no generation prompt that marks where the turn starts, so it cannot be located; train it as "
                    "sampled (token_ids on the message)")
        return (f"message {i} ({role}): the chat template does not render this message's content where it can be "
                "located; it cannot be trained")

    def _rewritten(self, chat, i) -> str:
        msg = chat[i]
        if msg["role"] == "assistant" and _THINK.search(msg["content"]):
            return (f"message {i} (assistant): the chat template strips the reasoning (<think>...</think>) of this "
                    "turn when later turns follow, so the text it renders is not the turn's content. Train it as "
                    "sampled (keep the generator's token_ids on the message), or end the rollout at this turn")
        return (f"message {i} ({msg['role']}): the chat template rewrites this message's content (or renders the "
                "conversation before it differently when the content changes), so its tokens cannot be located; "
                "train it as sampled (token_ids on the message) or use a template that prints content verbatim")

    # ------------------------------------------------------------------ after a sampled turn

    def _end_of_content(self, full: str) -> int | None:
        """Where the base turn's content ends in `full`; where its header ends if the template drops content."""
        if full.count(BASE_SENTINEL) == 1:
            return full.index(BASE_SENTINEL) + len(BASE_SENTINEL)
        head = self._try_render([_BASE_USER], self.has_generation_prompt)
        if head is not None and full.startswith(head) and self.end_of_turn:
            return len(head)
        return None

    def continuation(self, previous: dict, block: list[dict], generation_prompt: bool, ended: bool,
                     trainable: list[int], first: int = 0) -> tuple[str, list[tuple[int, int, int]]]:
        """Text after a sampled assistant turn: its unsampled closing, `block` rendered alone, the prompt.

        The template's own rendering of just the new messages: a fixed conversation
        (a user turn, then `previous` with a sentinel for its content) rendered with and
        without `block`; the text after the sampled turn's end-of-turn token is theirs.
        ended: the sampled ids end with a turn-ending token (then only what follows it is added); otherwise
        the template's end-of-turn is added too. Returns the text and the spans of the block's trainable
        messages (indices into `block`) in it. first: the rollout index of block[0], for error messages.
        """
        if self.tools is not None:  # tool definitions belong to the first prompt, not to later turns
            return self.without_tools().continuation(previous, block, generation_prompt, ended, trainable, first)
        base = [_BASE_USER, dict(previous, content=BASE_SENTINEL)]
        full = self.render(base + block, generation_prompt)
        after = self._end_of_content(full)
        if after is None:
            raise ValueError("the chat template renders a sampled MODEL turn with these tool_calls in a way whose "
                             "end cannot be found, so the text that follows it cannot be placed; leave tool_calls "
                             "unset on sampled turns (their text is in the sampled ids)")
        eot = self.next_end_of_turn(full, after)
        if eot is None:
            cut = after
        elif ended:
            cut = eot[1]
        else:
            cut = after if not full[after: eot[0]].strip() else eot[0]
        text = full[cut:]
        self.check_rendered(base + block, full, generation_prompt, first - len(base))
        spans = [(j - 2, a - cut, b - cut) for j, a, b in
                 self.spans(base + block, [2 + k for k in trainable], full, generation_prompt)]
        if any(a < 0 for _, a, _ in spans):
            raise ValueError("a trainable message after a sampled turn is rendered before that turn's end")
        return text, spans


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.RLock()
MAX_TEMPLATES = 64  # per tokenizer: the templates of the most recently used (tools, options), oldest dropped


def chat_template_for(tokenizer, tools=None, template_kwargs: dict | None = None) -> ChatTemplate:
    """A cached `ChatTemplate` per tokenizer, template source and options (the last MAX_TEMPLATES of each
    tokenizer: a server that sees a new tool set per request keeps a bounded number)."""
    key = (repr(tokenizer.chat_template), _key(tools), _key(template_kwargs or {}))
    with _CACHE_LOCK:
        try:
            per_tok = _CACHE.setdefault(tokenizer, OrderedDict())
        except TypeError:  # not weak-referenceable: no cache
            per_tok = OrderedDict()
        ct = per_tok.get(key)
        if ct is None:
            ct = per_tok[key] = ChatTemplate(tokenizer, tools, template_kwargs)
            while len(per_tok) > MAX_TEMPLATES:
                per_tok.popitem(last=False)
        else:
            per_tok.move_to_end(key)
        return ct
