"""Scripted agent sessions (W1 math, W2 coding agent, W4 mail/calendar agent) and the context edits agent harnesses make between turns.

The client supplies every assistant turn's text, so all systems see the same requests
whatever the model generates: request *i* of a session is the scripted conversation up to
its *i*-th assistant message (after the workload's context edits), and the server decodes
a fixed number of tokens (``ignore_eos``) for it, as many as that scripted reply holds. The
scripted reply, not the model's output, then enters the history.

Sizes are budgets in *nominal tokens*: ``CHARS_PER_TOKEN`` (4) characters of text per token,
about what the BPE tokenizers of Qwen3 and DeepSeek produce on English prose and code; chat
template tokens come on top. A model's real count differs by its tokenizer (the tests' tiny
384-entry BPE spends 1.8 to 3.7 tokens per nominal token). At ``scale=1`` (rounded):

- **W1**, single turn, long decode (paper's AIME math): one request, a 250-token problem
  prompt, 1,536 decode tokens. No edits.
- **W2**, coding-agent session (paper's OpenCode + SWE issue): an 8.9k-token floor (6.0k
  system prompt with environment block and file tree, 2.8k for 10 tool schemas), three user
  turns, 14 tool calls (glob, grep, 3 file reads, 5 test runs, 2 edits, a write, a diff:
  14.1k tokens of tool output) and 3 answers: 17 requests, every assistant turn with a
  ``<think>`` segment; the prompt grows from 9.5k to 29.7k tokens; 194 to 757 decode tokens
  per request (6.7k in all). Default edit: ``placeholder`` (OpenCode, window 4).
- **W4**, mail/calendar agent (paper's OpenClaw + email/calendar kit): a 24.6k-token floor
  (2.5k instructions, 14.5k mailbox dump of 65 messages, 6.5k calendar dump of 150 events,
  1.1k for 6 tool schemas), 13 short user turns, 7 tool calls: 20 requests; the prompt
  grows from 24.6k to 31.6k tokens; 162 to 468 decode tokens per request (6.2k in all).
  Default edit: ``drop_thinking`` (OpenClaw).

``scale`` multiplies every text budget (floors of 2 tokens keep each block non-empty) and
every decode length (at least 2 tokens); the turns, tool calls and edits stay. Below
``COMPACT_TOOLS_BELOW`` (0.25) the tool lists shrink to the tools the script calls. At
``scale=0.01`` the workloads fit the 4,096-token context of the tiny test checkpoints:
W1 69 nominal tokens (219 tiny-tokenizer tokens) and 15 decode tokens; W2 from 562 to
1,066 nominal (1,947 to 3,908 tiny) tokens of prompt, 9 to 41 decode tokens; W4 from 518
to 1,098 nominal (1,737 to 3,615 tiny), 8 to 46 decode tokens.

Context edits (paper §3.1) are pure functions on an OpenAI message list:
``drop_thinking`` (OpenClaw: thinking segments of every assistant turn but the latest are
stripped), ``placeholder`` (OpenCode: tool outputs older than the last ``window`` ones are
replaced by a fixed placeholder), ``last_n`` (SWE-agent: all but the last ``n``
observations are elided, each to a line-count note).
"""

from __future__ import annotations

import copy
import json
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

CHARS_PER_TOKEN = 4
WORKLOADS = ("W1", "W2", "W4")

# ---------------------------------------------------------------------------------------
# Context edits
# ---------------------------------------------------------------------------------------

THINK_RE = re.compile(r"<think>.*?</think>\n*", re.DOTALL)
OPENCODE_PLACEHOLDER = "[Old tool result content cleared]"
SWE_AGENT_ELISION = "Old environment output: ({n} lines omitted)"


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def drop_thinking(messages: List[dict]) -> List[dict]:
    """OpenClaw: remove the ``<think>...</think>`` block (and the newlines after it) from
    every assistant message except the latest one. Returns a new list; tool calls and the
    visible text stay."""
    out = copy.deepcopy(messages)
    last = max((i for i, m in enumerate(out) if m.get("role") == "assistant"), default=None)
    for i, m in enumerate(out):
        if m.get("role") == "assistant" and i != last and isinstance(m.get("content"), str):
            m["content"] = THINK_RE.sub("", m["content"])
    return out


def placeholder_old_tool_outputs(
    messages: List[dict], window: int = 4, placeholder: str = OPENCODE_PLACEHOLDER
) -> List[dict]:
    """OpenCode: replace the content of every ``role: tool`` message but the last ``window``
    ones with ``placeholder``. Returns a new list."""
    out = copy.deepcopy(messages)
    idx = [i for i, m in enumerate(out) if m.get("role") == "tool"]
    for i in idx[: max(0, len(idx) - window)]:
        out[i]["content"] = placeholder
    return out


def keep_last_observations(
    messages: List[dict], n: int = 5, polling: int = 1
) -> List[dict]:
    """SWE-agent ``LastNObservations``: elide every observation (``role: tool`` message) but
    the last ``n`` to ``Old environment output: (K lines omitted)``, K its line count.

    ``polling`` > 1 moves the cut only every ``polling`` observations (SWE-agent's option to
    keep the prefix stable for prompt caching), so between ``n`` and ``n + polling - 1``
    observations stay. Returns a new list."""
    out = copy.deepcopy(messages)
    idx = [i for i, m in enumerate(out) if m.get("role") == "tool"]
    n_elide = max(0, len(idx) - n)
    if polling > 1:
        n_elide = (n_elide // polling) * polling
    for i in idx[:n_elide]:
        lines = _text(out[i].get("content")).count("\n") + 1
        out[i]["content"] = SWE_AGENT_ELISION.format(n=lines)
    return out


EDITS: Dict[str, Callable[..., List[dict]]] = {
    "drop_thinking": drop_thinking,
    "placeholder": placeholder_old_tool_outputs,
    "last_n": keep_last_observations,
}
# The harness each edit stands for (paper §3.1).
EDIT_HARNESS = {"drop_thinking": "OpenClaw", "placeholder": "OpenCode", "last_n": "SWE-agent"}
_EDIT_PARAM = {"placeholder": "window", "last_n": "n"}


def parse_edits(spec) -> Tuple[str, ...]:
    """``"placeholder:3+drop_thinking"`` (or a sequence of such items) -> a tuple of edit
    specs; ``""``, ``"none"`` or None -> no edits. An item is ``name`` or ``name:int``
    (the window of ``placeholder``, the ``n`` of ``last_n``).

    Raises:
        ValueError: unknown edit name or a bad parameter.
    """
    if spec is None:
        return ()
    items = spec.split("+") if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        item = item.strip()
        if not item or item == "none":
            continue
        name, _, arg = item.partition(":")
        if name not in EDITS:
            raise ValueError(f"unknown context edit {name!r}; choose from {sorted(EDITS)}")
        if arg:
            if name not in _EDIT_PARAM or not arg.isdigit():
                raise ValueError(f"bad parameter in context edit {item!r}")
        out.append(item)
    return tuple(out)


def apply_edits(messages: List[dict], edits: Sequence[str]) -> List[dict]:
    """Apply the edit specs (see ``parse_edits``) in order; returns a new list."""
    out = copy.deepcopy(messages)
    for item in edits:
        name, _, arg = item.partition(":")
        kwargs = {_EDIT_PARAM[name]: int(arg)} if arg else {}
        out = EDITS[name](out, **kwargs)
    return out


# ---------------------------------------------------------------------------------------
# Deterministic text
# ---------------------------------------------------------------------------------------

_WORDS = (
    "the a an of to in for on with by from as at into over under about after before "
    "expert cache layer token router slot buffer request response server client session "
    "value result error state config option path file module function class method "
    "return check update build read write load store parse format render compute "
    "should must can will may never always first then next finally also only each every "
    "user agent tool call output input message turn context prompt history window "
    "small large fast slow new old same different current previous empty full valid "
    "test case suite patch branch commit change issue fix bug report log trace step "
    "time date week day hour meeting project team review plan note draft reply "
    "memory disk network thread process queue task job worker batch stream chunk"
).split()
_VERBS = "get set load save parse build check apply merge split render fetch update resolve compute find".split()
_NOUNS = "config cache token path request session record buffer layer index entry schema header payload".split()
_FIRST = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert Sybil Trent Victor Walter Yolanda".split()
_LAST = "Chen Garcia Kim Novak Patel Rossi Silva Tanaka Weber Young Okafor Larsen".split()
_TOPICS = "budget review|quarterly planning|offsite logistics|hiring loop|design doc|release notes|customer escalation|vendor contract|team lunch|security audit|roadmap sync|travel booking|board deck|onboarding".split("|")
_DAYS = "Mon Tue Wed Thu Fri Sat Sun".split()


class _Text:
    """Seeded generator of prose, code, tool outputs, mail and calendar text."""

    def __init__(self, seed: str, scale: float):
        self.rng = random.Random(seed)
        self.scale = scale

    def tokens(self, n: float, floor: int = 2) -> int:
        """A budget of ``n`` nominal tokens at scale 1, scaled (at least ``floor``)."""
        return max(floor, int(round(n * self.scale)))

    def _fill(self, unit: Callable[[], str], tokens: int, sep: str = "\n") -> str:
        """Join ``unit()`` outputs until ``tokens`` nominal tokens, then cut to exactly that
        many characters' worth at a whitespace boundary."""
        limit = tokens * CHARS_PER_TOKEN
        parts, size = [], 0
        while size < limit:
            p = unit()
            parts.append(p)
            size += len(p) + len(sep)
        text = sep.join(parts)
        if len(text) > limit:
            cut = text[:limit]
            ws = max(cut.rfind("\n"), cut.rfind(" "))
            text = cut[:ws] if ws > limit // 2 else cut
        return text.rstrip()

    def words(self, k: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(k))

    def sentence(self) -> str:
        s = self.words(self.rng.randint(7, 16))
        return s[0].upper() + s[1:] + "."

    def prose(self, tokens: int) -> str:
        return self._fill(lambda: " ".join(self.sentence() for _ in range(self.rng.randint(2, 5))), tokens)

    def ident(self) -> str:
        return f"{self.rng.choice(_VERBS)}_{self.rng.choice(_NOUNS)}"

    def code(self, tokens: int, numbered: bool = False) -> str:
        def unit() -> str:
            fn = self.ident()
            args = ", ".join(sorted({self.rng.choice(_NOUNS) for _ in range(self.rng.randint(1, 3))}))
            body = [f"def {fn}({args}):", f'    """{self.sentence()}"""']
            for _ in range(self.rng.randint(2, 6)):
                v = self.rng.choice(_NOUNS)
                body.append(self.rng.choice([
                    f"    {v} = {self.ident()}({self.rng.choice(_NOUNS)})",
                    f"    if {v} is None:\n        raise ValueError(\"{self.words(4)}\")",
                    f"    for item in {v}:\n        {self.ident()}(item)",
                    f"    # {self.words(self.rng.randint(4, 9))}",
                ]))
            body.append(f"    return {self.rng.choice(_NOUNS)}\n")
            return "\n".join(body)

        text = self._fill(unit, tokens)
        if numbered:
            lines = text.split("\n")
            text = "\n".join(f"{i + 1:5d}\t{l}" for i, l in enumerate(lines))
            # numbering adds characters; cut back to the budget
            text = text[: tokens * CHARS_PER_TOKEN].rsplit("\n", 1)[0] if len(lines) > 1 else text
        return text

    def test_output(self, tokens: int, failing: int) -> str:
        """``pytest -v`` style: one line per test, a traceback per failure, a summary."""
        n = {"i": 0}

        def unit() -> str:
            n["i"] += 1
            mod = self.rng.choice(_NOUNS)
            status = "FAILED" if n["i"] <= failing else "PASSED"
            line = f"tests/test_{mod}.py::test_{self.ident()} {status}"
            if status == "FAILED":
                line += (f"\n    assert {self.ident()}({mod}) == {self.rng.randint(1, 99)}"
                         f"\nE   AssertionError: {self.sentence()}")
            return line

        body = self._fill(unit, max(1, tokens - 8))
        passed = max(0, n["i"] - failing)
        return body + f"\n{failing} failed, {passed} passed in {self.rng.uniform(0.5, 9):.2f}s"

    def listing(self, tokens: int) -> str:
        return self._fill(
            lambda: f"src/{self.rng.choice(_NOUNS)}/{self.ident()}.py", tokens)

    def grep(self, tokens: int, pattern: str) -> str:
        return self._fill(
            lambda: f"src/{self.rng.choice(_NOUNS)}/{self.ident()}.py:{self.rng.randint(1, 900)}:"
                    f"    {pattern}({self.rng.choice(_NOUNS)})  # {self.words(4)}", tokens)

    def diff(self, tokens: int, path: str) -> str:
        head = f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"

        def unit() -> str:
            a = self.rng.randint(1, 500)
            return (f"@@ -{a},4 +{a},5 @@\n {self.words(5)}\n-    {self.ident()}({self.rng.choice(_NOUNS)})"
                    f"\n+    {self.ident()}({self.rng.choice(_NOUNS)}, strict=True)\n+    # {self.words(5)}")

        return head + self._fill(unit, max(1, tokens - len(head) // CHARS_PER_TOKEN))

    def person(self) -> str:
        f, l = self.rng.choice(_FIRST), self.rng.choice(_LAST)
        return f"{f} {l} <{f.lower()}.{l.lower()}@example.com>"

    def date(self) -> str:
        d = self.rng.randint(1, 28)
        return f"{_DAYS[(d + 2) % 7]}, {d:02d} Oct 2026 {self.rng.randint(7, 19):02d}:{self.rng.choice(['00', '15', '30', '45'])}"

    def mailbox(self, tokens: int) -> str:
        k = {"i": 0}

        def unit() -> str:
            k["i"] += 1
            return (f"--- message {k['i']} ---\nFrom: {self.person()}\nTo: me <me@example.com>\n"
                    f"Date: {self.date()}\nSubject: Re: {self.rng.choice(_TOPICS)}\n"
                    f"{self.prose(self.rng.randint(120, 260))}\n")

        return "## Mailbox (inbox, newest last)\n" + self._fill(unit, tokens)

    def calendar(self, tokens: int) -> str:
        def unit() -> str:
            return (f"- {self.date()} ({self.rng.choice([30, 45, 60, 90])} min) {self.rng.choice(_TOPICS)}: "
                    f"{self.person()}, {self.person()}; {self.words(self.rng.randint(4, 12))}")

        return "## Calendar (October 2026)\n" + self._fill(unit, tokens)


# Below this scale a workload's tool list holds only the tools its script calls, with only
# their required parameters, undescribed (a tool schema costs ~50 nominal tokens of JSON
# whatever the scale), and the scripted tool calls leave out their optional arguments.
COMPACT_TOOLS_BELOW = 0.25


def _tool(name: str, description: str, params: Dict[str, str], required: Sequence[str],
          compact: bool = False) -> dict:
    if compact:
        props = {k: {"type": "string"} for k in params if k in required}
    else:
        props = {k: {"type": "string", "description": v} for k, v in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(required)},
        },
    }


def _tool_list(g: "_Text", table, used: Sequence[str], desc_tokens: int) -> List[dict]:
    compact = g.scale < COMPACT_TOOLS_BELOW
    out = []
    for name, desc, params, req in table:
        if compact and name not in used:
            continue
        text = desc if compact else desc + " " + g.prose(g.tokens(desc_tokens))
        out.append(_tool(name, text, params, req, compact))
    return out


def _nominal(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


# ---------------------------------------------------------------------------------------
# Sessions
# ---------------------------------------------------------------------------------------


@dataclass
class Request:
    """One chat completion of a session: the messages sent (edits applied), the tools, and
    ``max_tokens`` decode tokens (``ignore_eos``)."""

    workload: str
    index: int  # 0-based position in the session
    user_turn: int  # 0-based user turn this request serves
    step: int  # 0-based agent step within the user turn
    kind: str  # "tool_call" (the scripted reply calls a tool) or "answer"
    messages: List[dict]
    tools: Optional[List[dict]]
    max_tokens: int
    edits: Tuple[str, ...] = ()

    def body(self, model: str, temperature: float = 0.0) -> dict:
        """The ``/v1/chat/completions`` JSON body: streaming, usage in the last chunk,
        ``ignore_eos`` (SGLang sampling parameter) so exactly ``max_tokens`` are decoded."""
        b = {
            "model": model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        if self.tools:
            b["tools"] = self.tools
        return b


@dataclass
class Workload:
    """A scripted session: the full conversation (``script``, OpenAI messages including the
    scripted assistant replies), the tools, and per assistant reply its decode length."""

    name: str
    title: str
    script: List[dict]
    tools: Optional[List[dict]]
    decode_tokens: List[int]  # per assistant message of ``script``, in order
    default_edits: Tuple[str, ...] = ()
    turn_of: List[Tuple[int, int]] = field(default_factory=list)  # (user_turn, step) per reply
    scale: float = 1.0
    floor_tokens: int = 0  # nominal tokens of the system context + tool schemas

    @property
    def reply_indices(self) -> List[int]:
        return [i for i, m in enumerate(self.script) if m["role"] == "assistant"]

    def requests(self, edits=None, decode_cap: Optional[int] = None) -> List[Request]:
        """The session's requests in order. ``edits``: None for the workload's default, else
        an edit spec (see ``parse_edits``; ``"none"`` for no edits). ``decode_cap`` caps
        every request's decode tokens."""
        eds = self.default_edits if edits is None else parse_edits(edits)
        out = []
        for k, j in enumerate(self.reply_indices):
            n = self.decode_tokens[k]
            if decode_cap is not None:
                n = max(1, min(n, decode_cap))
            ut, st = self.turn_of[k] if self.turn_of else (0, k)
            out.append(Request(
                workload=self.name, index=k, user_turn=ut, step=st,
                kind="tool_call" if self.script[j].get("tool_calls") else "answer",
                messages=apply_edits(self.script[:j], eds),
                tools=copy.deepcopy(self.tools), max_tokens=n, edits=tuple(eds),
            ))
        return out

    def sizes(self) -> dict:
        """Nominal-token sizes (``CHARS_PER_TOKEN`` chars per token, no template tokens):
        floor (system context + tool schemas), prompt per request (no edits), decode per
        request, and the final context (all messages)."""
        tools = _nominal(json.dumps(self.tools)) if self.tools else 0

        def size(msgs):
            n = tools
            for m in msgs:
                n += _nominal(_text(m.get("content")))
                for tc in m.get("tool_calls") or []:
                    n += _nominal(tc["function"]["arguments"])
            return n

        prompts = [size(self.script[:j]) for j in self.reply_indices]
        return {
            "requests": len(prompts),
            "floor": self.floor_tokens,
            "first_prompt": prompts[0],
            "last_prompt": prompts[-1],
            "final_context": size(self.script),
            "decode_total": sum(self.decode_tokens),
            "decode_min": min(self.decode_tokens),
            "decode_max": max(self.decode_tokens),
            "prompts": prompts,
        }


def _assistant(g: _Text, think_tokens: int, text: str = "", call: Optional[Tuple[str, str, dict]] = None) -> dict:
    thought = g.prose(g.tokens(think_tokens))
    msg = {"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{text}"}
    if call is not None:
        cid, name, args = call
        msg["tool_calls"] = [{"id": cid, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args)}}]
    return msg


def _reply_tokens(msg: dict) -> int:
    n = _nominal(msg["content"])
    for tc in msg.get("tool_calls") or []:
        n += _nominal(tc["function"]["arguments"]) + 8  # the call's framing
    return n


def build_w1(scale: float = 1.0, seed: int = 0) -> Workload:
    """W1: one math problem (250 nominal tokens at scale 1), 1,536 decode tokens."""
    g = _Text(f"W1:{seed}", scale)
    a, b, c = g.rng.randint(2, 9), g.rng.randint(10, 99), g.rng.randint(100, 999)
    problem = (
        f"Let S be the set of positive integers n less than {c * 10} such that n^2 + {a}n + {b} "
        f"is divisible by {c}. Find the remainder when the sum of the elements of S is divided "
        f"by 1000. "
    )
    context = g.prose(max(4, g.tokens(250) - _nominal(problem) - 20))
    user = (f"{problem}\nBackground notes: {context}\n"
            "Please reason step by step, and put your final answer within \\boxed{}.")
    script = [{"role": "user", "content": user},
              {"role": "assistant", "content": "<think>\n" + g.prose(g.tokens(1536)) + "\n</think>"}]
    return Workload("W1", "single turn, long decode (math)", script, None,
                    [max(2, int(round(1536 * scale)))], (), [(0, 0)], scale, 0)


_W2_TOOLS = [
    ("read", "Read a file from the local filesystem with line numbers.", {"filePath": "absolute path", "offset": "first line", "limit": "number of lines"}, ["filePath"]),
    ("edit", "Replace an exact string in a file with a new string.", {"filePath": "absolute path", "oldString": "text to replace", "newString": "replacement"}, ["filePath", "oldString", "newString"]),
    ("write", "Write a file to the local filesystem, overwriting it.", {"filePath": "absolute path", "content": "file content"}, ["filePath", "content"]),
    ("bash", "Run a shell command in a persistent session with an optional timeout.", {"command": "the command", "timeout": "milliseconds", "description": "what it does"}, ["command"]),
    ("grep", "Search file contents with a regular expression.", {"pattern": "regex", "path": "directory", "include": "file glob"}, ["pattern"]),
    ("glob", "Find files by name pattern.", {"pattern": "glob pattern", "path": "directory"}, ["pattern"]),
    ("list", "List a directory tree.", {"path": "directory", "ignore": "globs to skip"}, []),
    ("todowrite", "Create and update the session's task list.", {"todos": "JSON list of tasks"}, ["todos"]),
    ("webfetch", "Fetch a URL and return its content as markdown.", {"url": "address", "format": "text, markdown or html"}, ["url"]),
    ("task", "Launch a sub-agent for a self-contained search task.", {"description": "short description", "prompt": "the task"}, ["description", "prompt"]),
]


def build_w2(scale: float = 1.0, seed: int = 0) -> Workload:
    """W2: coding-agent session, 17 requests over 3 user turns (see the module docstring)."""
    g = _Text(f"W2:{seed}", scale)
    tools = _tool_list(g, _W2_TOOLS, ("glob", "grep", "read", "bash", "edit", "write"), 200)
    system = (
        "You are an interactive coding agent that helps users with software engineering "
        "tasks. Use the instructions below and the tools available to you.\n\n"
        + "\n\n".join(f"# {h}\n{g.prose(g.tokens(820))}" for h in (
            "Tone and style", "Proactiveness", "Following conventions", "Doing tasks",
            "Tool usage policy", "Code references"))
        + "\n\n<env>\nWorking directory: /repo\nIs directory a git repo: yes\nPlatform: linux\n"
        + "Today's date: 2026-10-14\n</env>\n<project>\n" + g.listing(g.tokens(1000)) + "\n</project>"
    )
    floor = _nominal(system) + _nominal(json.dumps(tools))
    path_a, path_b = "/repo/src/cache.py", "/repo/src/router.py"
    test_path = "/repo/tests/test_cache.py"
    compact = scale < COMPACT_TOOLS_BELOW

    def sh(cmd: str, what: str) -> dict:
        return {"command": cmd} if compact else {"command": cmd, "description": what}

    # (tool, args, output, think tokens) per step; sizes in nominal tokens at scale 1
    turns = [
        (
            "Issue #4127: resolving a cache entry after a layer reload returns a stale slot.\n"
            + g.prose(g.tokens(520)) + "\nTraceback (most recent call last):\n" + g.code(g.tokens(80)),
            [
                ("glob", {"pattern": "src/**/*.py"}, lambda: g.listing(g.tokens(300)), 180),
                ("grep", {"pattern": "resolve_entry"}, lambda: g.grep(g.tokens(500), "resolve_entry"), 220),
                ("read", {"filePath": path_a}, lambda: g.code(g.tokens(2500), numbered=True), 300),
                ("read", {"filePath": path_b}, lambda: g.code(g.tokens(2000), numbered=True), 350),
                ("bash", sh("pytest tests/test_cache.py -x", "run the failing test"), lambda: g.test_output(g.tokens(1500), 2), 250),
                ("edit", None, lambda: f"Edit applied successfully to {path_a}.\n" + g.prose(g.tokens(130)), 450),
                ("bash", sh("pytest tests/test_cache.py", "re-run the test"), lambda: g.test_output(g.tokens(800), 0), 150),
            ],
            300,
        ),
        (
            "Thanks. The fix breaks reloading while a request is in flight; add a regression test for it.\n"
            + g.prose(g.tokens(120)),
            [
                ("read", {"filePath": test_path}, lambda: g.code(g.tokens(2000), numbered=True), 300),
                ("write", None, lambda: f"Wrote file successfully: {test_path}", 400),
                ("bash", sh("pytest -k reload", "run reload tests"), lambda: g.test_output(g.tokens(1200), 1), 250),
                ("edit", None, lambda: f"Edit applied successfully to {path_b}.\n" + g.prose(g.tokens(130)), 350),
                ("bash", sh("pytest -k reload", "re-run reload tests"), lambda: g.test_output(g.tokens(600), 0), 150),
            ],
            250,
        ),
        (
            "Clean up, run the full suite, and summarize the change.",
            [
                ("bash", sh("git diff", "show the change"), lambda: g.diff(g.tokens(900), "src/cache.py"), 200),
                ("bash", sh("pytest", "run the full suite"), lambda: g.test_output(g.tokens(1500), 0), 200),
            ],
            400,
        ),
    ]
    script: List[dict] = [{"role": "system", "content": system}]
    decode, turn_of = [], []
    k = 0
    for ut, (user, steps, answer_tokens) in enumerate(turns):
        script.append({"role": "user", "content": user})
        for st, (name, args, output, think) in enumerate(steps):
            k += 1
            if args is None:  # edit / write carry code in the arguments
                if name == "edit":
                    args = {"filePath": path_a if ut == 0 else path_b,
                            "oldString": g.code(g.tokens(100)), "newString": g.code(g.tokens(140))}
                else:
                    args = {"filePath": test_path, "content": g.code(g.tokens(300))}
            msg = _assistant(g, think, g.prose(g.tokens(15)), (f"call_w2_{k}", name, args))
            script.append(msg)
            decode.append(_reply_tokens(msg))
            turn_of.append((ut, st))
            script.append({"role": "tool", "tool_call_id": f"call_w2_{k}", "content": output()})
        msg = _assistant(g, think_tokens=200, text=g.prose(g.tokens(answer_tokens)))
        script.append(msg)
        decode.append(_reply_tokens(msg))
        turn_of.append((ut, len(steps)))
    decode = [max(2, d) for d in decode]
    return Workload("W2", "coding-agent session", script, tools, decode, ("placeholder",),
                    turn_of, scale, floor)


_W4_TOOLS = [
    ("mail_search", "Search the mailbox.", {"query": "search terms", "folder": "folder name"}, ["query"]),
    ("mail_read", "Read one message in full.", {"message_id": "message number"}, ["message_id"]),
    ("mail_send", "Send or reply to a message.", {"to": "recipients", "subject": "subject", "body": "message body", "in_reply_to": "message number"}, ["to", "body"]),
    ("calendar_list", "List calendar events in a date range.", {"start": "ISO date", "end": "ISO date"}, ["start"]),
    ("calendar_create", "Create a calendar event.", {"title": "title", "start": "ISO date-time", "duration_min": "minutes", "attendees": "comma-separated emails"}, ["title", "start"]),
    ("calendar_update", "Move or edit an existing event.", {"event": "event title or id", "start": "new ISO date-time", "note": "change note"}, ["event"]),
]

_W4_TURNS = [
    ("What's on my calendar on Tuesday?", None),
    ("Did Grace send anything about the budget review?", ("mail_search", {"query": "from:grace budget review"})),
    ("Summarize the three most recent messages in one line each.", None),
    ("Put a 30 minute design doc review with Bob on Thursday at 10.", ("calendar_create", {"title": "design doc review", "start": "2026-10-15T10:00", "duration_min": "30", "attendees": "bob.kim@example.com"})),
    ("Reply to Ivan that I can join the offsite and ask for the agenda.", ("mail_send", {"to": "ivan.novak@example.com", "subject": "Re: offsite logistics", "body": "__BODY__"})),
    ("Which meetings this week have no agenda in the invite?", None),
    ("Find the vendor contract thread and tell me the renewal date.", ("mail_search", {"query": "vendor contract renewal"})),
    ("Do I have any conflicts on Friday afternoon?", None),
    ("Move the roadmap sync to Monday at 14:00 and note why.", ("calendar_update", {"event": "roadmap sync", "start": "2026-10-19T14:00", "note": "__BODY__"})),
    ("Draft (do not send) a polite decline to the team lunch.", None),
    ("Send Carol the security audit notes from last week's thread.", ("mail_send", {"to": "carol.chen@example.com", "subject": "security audit notes", "body": "__BODY__"})),
    ("How many hours of meetings do I have next week?", None),
    ("Block two hours on Wednesday morning for focus time.", ("calendar_create", {"title": "focus time", "start": "2026-10-21T09:00", "duration_min": "120", "attendees": ""})),
]


def build_w4(scale: float = 1.0, seed: int = 0) -> Workload:
    """W4: mail/calendar agent, 24.5k-token floor, 13 user turns, 20 requests."""
    g = _Text(f"W4:{seed}", scale)
    used = [c[0] for _, c in _W4_TURNS if c is not None]
    tools = _tool_list(g, _W4_TOOLS, used, 95)
    system = (
        "You are a personal assistant with access to the user's mailbox and calendar. "
        "Act through the tools; never invent messages or events.\n\n"
        + "\n\n".join(f"## {h}\n{g.prose(g.tokens(620))}" for h in ("Persona", "Safety", "Tools", "Memory"))
        + "\n\n" + g.mailbox(g.tokens(14500)) + "\n\n" + g.calendar(g.tokens(6500))
    )
    floor = _nominal(system) + _nominal(json.dumps(tools))
    script: List[dict] = [{"role": "system", "content": system}]
    decode, turn_of = [], []
    for ut, (user, call) in enumerate(_W4_TURNS):
        script.append({"role": "user", "content": user})
        step = 0
        if call is not None:
            name, args = call
            args = {k: (g.prose(g.tokens(90)) if v == "__BODY__" else v) for k, v in args.items()}
            msg = _assistant(g, g.rng.randint(120, 260), g.prose(g.tokens(15)), (f"call_w4_{ut}", name, args))
            script.append(msg)
            decode.append(_reply_tokens(msg))
            turn_of.append((ut, 0))
            if name == "mail_search":
                out = "\n".join(f"[{g.rng.randint(1, 60)}] {g.date()} {g.person()}: {g.words(8)}"
                                for _ in range(max(1, int(round(6 * scale)))))
                out += "\n" + g.prose(g.tokens(150))
            else:
                out = json.dumps({"ok": True, "id": f"evt-{g.rng.randint(1000, 9999)}"}) + "\n" + g.prose(g.tokens(60))
            script.append({"role": "tool", "tool_call_id": f"call_w4_{ut}", "content": out})
            step = 1
        msg = _assistant(g, g.rng.randint(100, 300), g.prose(g.tokens(g.rng.randint(60, 250))))
        script.append(msg)
        decode.append(_reply_tokens(msg))
        turn_of.append((ut, step))
    decode = [max(2, d) for d in decode]
    return Workload("W4", "mail/calendar agent", script, tools, decode, ("drop_thinking",),
                    turn_of, scale, floor)


BUILDERS: Dict[str, Callable[..., Workload]] = {"W1": build_w1, "W2": build_w2, "W4": build_w4}


def build(name: str, scale: float = 1.0, seed: int = 0) -> Workload:
    """The workload ``name`` (``W1``, ``W2`` or ``W4``) at ``scale``.

    Raises:
        ValueError: unknown workload.
    """
    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose from {list(BUILDERS)}")
    if scale <= 0:
        raise ValueError("scale must be positive")
    return BUILDERS[name](scale=scale, seed=seed)


# ---------------------------------------------------------------------------------------
# Local rendering (what SGLang's chat endpoint feeds the model)
# ---------------------------------------------------------------------------------------


def server_view(messages: List[dict], tools: Optional[List[dict]]) -> Tuple[List[dict], Optional[List[dict]]]:
    """The messages and tools as SGLang 0.5.17's ``/v1/chat/completions`` hands them to the
    chat template: pydantic-normalized tools (``strict``, ``defer_loading`` fields), tool-call
    arguments parsed from JSON strings to objects, ``None`` fields dropped."""
    try:
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

        req = ChatCompletionRequest(model="x", messages=messages, tools=tools)
        msgs = [m.model_dump() for m in req.messages]
        tl = [t.model_dump() for t in req.tools] if req.tools else None
    except ImportError:  # same shapes, written out
        msgs = copy.deepcopy(messages)
        tl = None
        if tools:
            tl = [{"type": "function",
                   "function": {"description": t["function"].get("description"),
                                "name": t["function"]["name"],
                                "parameters": t["function"].get("parameters"),
                                "strict": False},
                   "defer_loading": None} for t in tools]
    out = []
    for m in msgs:
        m = {k: v for k, v in m.items() if v is not None}
        m.setdefault("content", "")
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"])
        out.append(m)
    return out, tl


def render_text(tokenizer, request: Request) -> str:
    """The prompt text of ``request`` under the tokenizer's chat template, with the
    generation prompt, as SGLang renders it."""
    msgs, tools = server_view(request.messages, request.tools)
    return tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)


def render_ids(tokenizer, request: Request) -> List[int]:
    """The prompt token ids of ``request`` (``len`` of it is the prompt tokens SGLang
    reports for a ChatML-style template that adds no BOS)."""
    return tokenizer.encode(render_text(tokenizer, request), add_special_tokens=False)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id lists (tokens)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
