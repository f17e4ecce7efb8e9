"""Interactive terminal chat: keeps the conversation, renders it with the checkpoint's chat template,
streams each reply as it is generated.

Commands at the prompt: /reset clears the history, /exit (or end of input) quits. Ctrl-C during a
reply stops that reply (the part already shown is kept in the history); Ctrl-C at the prompt quits.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import TextIO

from moestream.config import SamplingConfig
from moestream.engine.generate import GenerationResult
from moestream.runtime import Runtime

HELP = "type a message; /reset clears the history, /help shows this, /exit quits"


@dataclass
class Conversation:
    """The message history, trimmed from the oldest turn when it no longer fits the context."""

    system: str | None = None
    turns: list[dict] = field(default_factory=list)

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def reset(self) -> None:
        self.turns.clear()

    def drop_oldest_exchange(self) -> bool:
        """Forget the oldest user/assistant pair; False when only the current message is left."""
        if len(self.turns) <= 1:
            return False
        del self.turns[:2]
        return True


def fit_prompt(rt: Runtime, conv: Conversation, max_new: int) -> tuple[list[int], int]:
    """Prompt ids of the conversation and the reply budget, dropping old turns to make room."""
    ctx = rt.generator.context
    while True:
        ids = rt.tokenizer.encode_chat(conv.messages())
        # Keep at least a short reply's worth of room before giving up on old turns.
        if len(ids) + min(max_new, 16) <= ctx or not conv.drop_oldest_exchange():
            return ids, max(min(max_new, ctx - len(ids)), 0)


def reply(rt: Runtime, conv: Conversation, cfg: SamplingConfig, out: TextIO) -> GenerationResult:
    """Generate the assistant's answer to the last user turn, writing it to `out` as it comes."""
    ids, budget = fit_prompt(rt, conv, cfg.max_new_tokens)
    res = GenerationResult(ids)
    if budget == 0:
        print(
            "[the message does not fit the context; /reset or send a shorter one]", file=sys.stderr
        )
        conv.turns.pop()
        return res
    stream = rt.generator.stream(ids, replace(cfg, max_new_tokens=budget), res)
    text = []
    try:
        for piece in stream:
            text.append(piece)
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:
        stream.close()
        out.write(" [stopped]")
    out.write("\n")
    out.flush()
    if res.finish_reason == "length" and budget < cfg.max_new_tokens:
        print("[reply cut: the context is full; /reset to start over]", file=sys.stderr)
    conv.turns.append({"role": "assistant", "content": "".join(text)})
    return res


def stats_line(res: GenerationResult) -> str:
    s = res.stats()
    return (
        f"[prompt {s['prompt_tokens']} tok | reply {s['generated_tokens']} tok, "
        f"{s['decode_tok_s']:.1f} tok/s]"
    )


def read_message(interactive: bool, inp: TextIO) -> str | None:
    """The next non-empty line, or None at end of input."""
    while True:
        if interactive:
            try:
                line = input("> ")
            except EOFError:
                return None
        else:
            line = inp.readline()
            if not line:
                return None
        if line.strip():
            return line.rstrip("\n")


def _unknown_command(line: str) -> bool:
    """A '/word' line that is no command: not sent to the model by mistake."""
    word = line.strip().split(maxsplit=1)[0] if line.strip() else ""
    return word.startswith("/") and word[1:].isalpha()


def run_chat(
    rt: Runtime,
    cfg: SamplingConfig,
    system: str | None = None,
    inp: TextIO = sys.stdin,
    out: TextIO = sys.stdout,
    show_stats: bool = True,
) -> int:
    if not rt.tokenizer.chat_template:
        print(
            "moestream: error: this checkpoint has no chat template; use `moestream generate` instead",
            file=sys.stderr,
        )
        return 2
    interactive = inp.isatty() and out.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        print(HELP, file=sys.stderr)
    conv = Conversation(system)
    try:
        while (line := read_message(interactive, inp)) is not None:
            if line.strip() in ("/exit", "/quit"):
                break
            if line.strip() == "/reset":
                conv.reset()
                print("[history cleared]", file=sys.stderr)
                continue
            if line.strip() == "/help" or _unknown_command(line):
                print(
                    HELP if line.strip() == "/help" else f"[unknown command; {HELP}]",
                    file=sys.stderr,
                )
                continue
            conv.turns.append({"role": "user", "content": line})
            res = reply(rt, conv, cfg, out)
            if show_stats and res.ids:
                print(stats_line(res), file=sys.stderr)
    except KeyboardInterrupt:
        out.write("\n")
    return 0
