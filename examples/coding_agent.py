"""A coding agent over a local folder, with every turn in one turnkv session.

The agent answers a few questions about the files of a folder (default: this repository's
docs/) with three tools: list files, read a file, search the files. Each question takes a few
turns (call a tool, read its result, answer), and the whole conversation is resent every turn:
the case turnkv is for. Before each tool run the agent tells the router when the next turn
will come (`next_turn_in`); the last turn carries `final`. Replies stream as they come; at the
end a table shows every turn's time to first token and where its prompt tokens came from, then
the session's totals.

    python examples/coding_agent.py --start-cluster     # starts its own SmolLM2 cluster
    python examples/coding_agent.py                     # the cluster `turnkv up` started
    python examples/coding_agent.py --base-url http://HOST:PORT/v1 --model NAME

Tool calls: OpenAI `tools` where the server returns `tool_calls`, else one line of text
(`CALL read_file protocol.md` / `ANSWER: ...`). Against vLLM, structured outputs hold replies
to that format (`--constrain`, on by default there): a question's first reply is a call that
names a real file or a word of the question, its last one an answer. Without that, a 135M model
drifts off the format within a turn or two; a reply the agent cannot read is told back to the
model and the loop goes on.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterable
from pathlib import Path

import openai
from agent.loop import (
    Agent,
    AgentConfig,
    Answered,
    Event,
    QuestionStarted,
    Reported,
    TextDelta,
    ToolDone,
    ToolStarted,
    TurnDone,
    TurnStarted,
)
from agent.server import probe
from agent.tools import FolderTools
from rich.console import Console
from rich.table import Table
from rich.text import Text

import turnkv

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "Which serving modes can a turnkv cluster run in?",
    "What does the router do when an engine fails during a turn?",
    "Which command starts a local cluster, and which one stops it?",
]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    tools = FolderTools(Path(args.folder))
    try:
        with contextlib.ExitStack() as stack:
            base_url, model = _endpoint(args, console, stack)
            client = turnkv.OpenAI(base_url=base_url, api_key=args.api_key)
            info = probe(client, model, args.tool_format)
            constrain = (args.constrain == "on" or (args.constrain == "auto" and info.is_vllm)
                         ) and not info.native_tools
            config = AgentConfig(
                model=info.model, questions=args.question or QUESTIONS,
                max_turns=args.max_turns, turns_per_question=args.turns_per_question,
                max_tokens=args.max_tokens, native_tools=info.native_tools,
                constrain=constrain)
            tool_format = "native tool_calls" if info.native_tools else "text" + (
                ", held to the format by structured outputs" if constrain else "")
            console.print(f"model {info.model} at {base_url}; tool calls: {tool_format}\n"
                          f"folder {tools.root}\n")
            with client.session(ttl=args.ttl) as session:
                agent = Agent(session, tools, config, folder_name=Path(args.folder).name)
                render(console, agent.run(), len(config.questions))
                console.print()
                console.print(_answers(config.questions, agent.answers))
                console.print(turnkv.stats_table(session.turns,
                                                 title=f"session {session.id}: per turn"))
                console.print(turnkv.session_stats_table(session.stats))
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    except openai.APIError as exc:
        console.print(Text(f"the server failed the turn: {exc}", style="red"))
        return 1
    return 0


def render(console: Console, events: Iterable[Event], questions: int) -> None:
    """Print the agent's events as they happen."""
    for event in events:
        if isinstance(event, QuestionStarted):
            console.rule(f"question {event.index + 1}/{questions}")
            console.print(f"[bold cyan]question[/] {event.question}")
        elif isinstance(event, TurnStarted):
            notes = " (final)" if event.final else ""
            console.print(f"[bold green]turn {event.index}{notes}[/] ", end="")
        elif isinstance(event, TextDelta):
            console.print(event.text, end="", markup=False, highlight=False)
        elif isinstance(event, TurnDone):
            console.print()
            console.print(f"  [dim]{_turn_line(event.turn.stats)}[/]")
        elif isinstance(event, ToolStarted):
            hint = "" if event.next_turn_in is None else (
                f"  [dim](hint: next turn in {_seconds(event.next_turn_in)})[/]")
            console.print(f"  [magenta]tool[/] {event.call.describe()}{hint}")
        elif isinstance(event, ToolDone):
            lines = event.result.splitlines()
            shown = "\n".join(f"    {line}" for line in lines[:4])
            more = f"\n    ... {len(lines) - 4} more lines" if len(lines) > 4 else ""
            console.print(Text(shown + more, style="dim" if event.ok else "red"))
            console.print(f"  [dim]({event.seconds * 1000:.1f} ms)[/]")
        elif isinstance(event, Reported):
            console.print(Text.assemble(("  reported to the model: ", "yellow"),
                                        event.problem))
        elif isinstance(event, Answered) and event.answer is None:
            console.print("  [yellow]no answer within the question's turns[/]")


def _seconds(value: float) -> str:
    return f"{value:g} s" if value >= 1 else f"{value * 1000:.1f} ms"


def _turn_line(stats: turnkv.TurnStats) -> str:
    ttft = "-" if stats.client_ttft_ms is None else f"{stats.client_ttft_ms:.0f} ms"
    parts = [f"TTFT {ttft}", f"prompt {stats.prompt_tokens.total} tokens"]
    if stats.reused_tokens is not None:
        parts.append(f"{stats.reused_tokens} reused, {stats.computed_tokens} computed")
    if stats.fallback:
        parts.append(f"fallback {stats.fallback}")
    if stats.prefix_break_at is not None:
        parts.append(f"history differs from token {stats.prefix_break_at}")
    return " | ".join(parts)


def _answers(questions: list[str], answers: list[str | None]) -> Table:
    table = Table(title="answers", show_lines=True)
    table.add_column("question")
    table.add_column("answer")
    for question, answer in zip(questions, answers, strict=False):
        table.add_row(question, answer if answer is not None else "[dim]-[/]")
    return table


def _endpoint(args: argparse.Namespace, console: Console,
              stack: contextlib.ExitStack) -> tuple[str, str | None]:
    """The OpenAI base URL and model: given, a cluster started here, or `turnkv up`'s."""
    if args.base_url:
        return args.base_url, args.model
    # The serving side is needed only to find or start a local cluster.
    from turnkv_server.launcher import Cluster, ClusterConfig, current_state

    if args.start_cluster:
        config = ClusterConfig(mode=args.mode, model=args.model or "smollm2")
        console.rule(f"starting a {args.mode} cluster with {config.model}")
        state = stack.enter_context(Cluster(config, console=console))
        console.print(f"cluster up: router {state.router}, logs in {state.run_dir}")
        return f"{state.router}/v1", state.served_model_name
    state = current_state()
    if state is None or not state.router:
        raise SystemExit("no cluster is running: start one with `turnkv up`, or pass "
                         "--start-cluster or --base-url")
    return f"{state.router}/v1", args.model or state.served_model_name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=str(REPO / "docs"), help="the folder to explore")
    parser.add_argument("--question", action="append",
                        help="a question about the folder (repeat for several)")
    parser.add_argument("--start-cluster", action="store_true",
                        help="start a local cluster for the run and stop it at the end")
    parser.add_argument("--mode", default="turnkv",
                        help="the serving mode of a cluster started here")
    parser.add_argument("--base-url", help="an OpenAI-compatible endpoint, e.g. a turnkv router")
    parser.add_argument("--model", help="the model to serve (with --start-cluster) or to use")
    parser.add_argument("--api-key", default="local")
    parser.add_argument("--max-turns", type=int, default=12)
    parser.add_argument("--turns-per-question", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--ttl", type=float, help="ttl hint: keep the session this long (s)")
    parser.add_argument("--tool-format", choices=["auto", "native", "text"], default="auto")
    parser.add_argument("--constrain", choices=["auto", "on", "off"], default="auto",
                        help="hold text-format replies to the format (vLLM structured outputs)")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
