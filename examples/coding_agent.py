"""A coding agent over a local folder, with every turn in one turnkv session.

The agent answers a few questions about the files of a folder with three tools: list files,
read a file, search the files. The default folder is a tiny sample project
(examples/agent/sample_project): each question's answer is a short fact in one short file, so
that SmolLM2-135M, the model `make demo` serves, can find it and copy it into its answer.
Each question takes a few turns (call a tool, read its result, answer), and the whole
conversation is resent every turn: the case turnkv is for. Before each tool run the agent tells
the router when the next turn will come (`next_turn_in`), and `final` ends the session.
Replies stream as they come, each turn followed by a line that says, in words, where its
prompt tokens came from; at the end a table shows every turn, then the session's totals.

    python examples/coding_agent.py --start-cluster     # starts its own SmolLM2 cluster
    python examples/coding_agent.py                     # the cluster `turnkv up` started
    python examples/coding_agent.py --base-url http://HOST:PORT/v1 --model NAME

Tool calls: OpenAI `tools` where the server returns `tool_calls`, else one line of text
(`CALL read_file protocol.md` / `ANSWER: ...`). Against vLLM, structured outputs hold replies
to that format (`--constrain`, on by default there): a question's first reply is a call that
names a real file or a word of the question (not one whose result the conversation already
holds), its last one an answer. Without that, a 135M model drifts off the format within a turn
or two; a reply the agent cannot read is told back to the model and the loop goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import textwrap
from collections.abc import Iterable
from pathlib import Path

import openai
from agent import explain, sample
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    tools = FolderTools(Path(args.folder))
    questions = args.question or sample.QUESTIONS
    console.print(explain.intro(_shown(tools.root), len(questions)))
    console.print()
    try:
        with contextlib.ExitStack() as stack:
            base_url, model = _endpoint(args, console, stack)
            client = turnkv.OpenAI(base_url=base_url, api_key=args.api_key)
            info = probe(client, model, args.tool_format)
            constrain = (args.constrain == "on" or (args.constrain == "auto" and info.is_vllm)
                         ) and not info.native_tools
            config = AgentConfig(
                model=info.model, questions=questions,
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
                console.print(Text(explain.LEGEND, style="dim"))
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
    previous: turnkv.TurnStats | None = None
    for event in events:
        if isinstance(event, QuestionStarted):
            console.rule(f"question {event.index + 1}/{questions}")
            console.print(f"[bold cyan]question[/] {event.question}")
        elif isinstance(event, TurnStarted):
            notes = f" ({explain.final_note()})" if event.final else ""
            console.print(f"[bold green]turn {event.index}{notes}[/] ", end="")
        elif isinstance(event, TextDelta):
            console.print(event.text, end="", markup=False, highlight=False)
        elif isinstance(event, TurnDone):
            stats = event.turn.stats
            console.print()
            _note(console, explain.turn_line(stats), "dim")
            broke = explain.prefix_break(stats, previous)
            if broke is not None:
                _note(console, broke, "yellow")
            previous = stats
        elif isinstance(event, ToolStarted):
            console.print(f"  [magenta]tool[/] {event.call.describe()}")
            if event.next_turn_in is not None:
                _note(console, explain.hint(event.next_turn_in, event.call.name), "dim")
        elif isinstance(event, ToolDone):
            lines = event.result.splitlines()
            shown = "\n".join(f"    {line}" for line in lines[:4])
            more = f"\n    ... {len(lines) - 4} more lines" if len(lines) > 4 else ""
            console.print(Text(shown + more, style="dim" if event.ok else "red"))
            console.print(Text(f"  ({event.call.name} took {explain.duration(event.seconds)})",
                               style="dim"))
        elif isinstance(event, Reported):
            console.print(Text.assemble(("  reported to the model: ", "yellow"),
                                        event.problem))
        elif isinstance(event, Answered) and event.answer is None:
            console.print("  [yellow]no answer within the question's turns[/]")


def _note(console: Console, text: str, style: str) -> None:
    """A line about the turn, indented under it, wrapped lines too (rich's Padding would fill
    every line with spaces to the console's width)."""
    wrapped = textwrap.fill(text, width=max(40, console.width - 1), initial_indent="  ",
                            subsequent_indent="  ")
    console.print(Text(wrapped, style=style))


def _shown(folder: Path) -> str:
    """The folder as the reader knows it: relative to the working directory if inside it."""
    try:
        return str(folder.relative_to(Path.cwd()))
    except ValueError:
        return str(folder)


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
    parser.add_argument("--folder", default=str(sample.FOLDER),
                        help="the folder to explore (default: a tiny sample project)")
    parser.add_argument("--question", action="append",
                        help="a question about the folder (repeat for several)")
    parser.add_argument("--start-cluster", action="store_true",
                        help="start a local cluster for the run and stop it at the end")
    parser.add_argument("--mode", default="turnkv",
                        help="the serving mode of a cluster started here")
    parser.add_argument("--base-url", help="an OpenAI-compatible endpoint, e.g. a turnkv router")
    parser.add_argument("--model", help="the model to serve (with --start-cluster) or to use")
    parser.add_argument("--api-key", default="local")
    # The agent's own defaults: the integration test runs the demo's agent with them.
    parser.add_argument("--max-turns", type=int, default=AgentConfig.max_turns)
    parser.add_argument("--turns-per-question", type=int,
                        default=AgentConfig.turns_per_question)
    parser.add_argument("--max-tokens", type=int, default=AgentConfig.max_tokens)
    parser.add_argument("--ttl", type=float, help="ttl hint: keep the session this long (s)")
    parser.add_argument("--tool-format", choices=["auto", "native", "text"], default="auto")
    parser.add_argument("--constrain", choices=["auto", "on", "off"], default="auto",
                        help="hold text-format replies to the format (vLLM structured outputs)")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
