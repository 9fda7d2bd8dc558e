"""Where the LangChain and LlamaIndex examples send their turns: the command line's
`--base-url` and `--model`, else the cluster `turnkv up` started. Imported by the examples
run as `python examples/NAME.py` (Python puts examples/ on the path).
"""

from __future__ import annotations

import argparse

import openai


def endpoint_parser(description: str | None) -> argparse.ArgumentParser:
    """The examples' common options: the endpoint, the model, the key, the reply length and
    the session's ttl."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="an OpenAI-compatible endpoint, e.g. a turnkv router")
    parser.add_argument("--model", help="the model to use (default: the cluster's)")
    parser.add_argument("--api-key", default="local")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--ttl", type=float, default=120.0,
                        help="ttl hint: keep the session this long after each turn (s)")
    return parser


def endpoint(args: argparse.Namespace) -> tuple[str, str]:
    """The OpenAI base URL and model: given, or those of the cluster `turnkv up` started."""
    if args.base_url:
        if args.model:
            return args.base_url, args.model
        models = openai.OpenAI(base_url=args.base_url, api_key=args.api_key).models.list()
        return args.base_url, models.data[0].id
    # The serving side is needed only to find the local cluster.
    from turnkv_server.launcher import current_state

    state = current_state()
    if state is None or not state.router:
        raise SystemExit("no cluster is running: start one with `turnkv up`, or pass --base-url")
    return f"{state.router}/v1", args.model or state.served_model_name
