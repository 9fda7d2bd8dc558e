"""Where the examples send their turns: the command line's `--base-url` and `--model`, else the
cluster `turnkv up` started. Imported by the examples run as `python examples/NAME.py` (Python
puts examples/ on the path).
"""

from __future__ import annotations

import argparse

import openai

# The OpenAI API's path under a router's URL: the OpenAI clients take it as their base URL;
# the Anthropic client takes the router's own and adds /v1/messages itself.
OPENAI_PATH = "/v1"


def endpoint_parser(description: str | None, *, max_tokens: int | None = 96,
                    ttl: bool = True, path: str = OPENAI_PATH) -> argparse.ArgumentParser:
    """The examples' common options: the endpoint (the router's URL, and `path` under it), the
    model, the key, the reply length (`max_tokens` by default; None: the model's own) and,
    where the example tags its turns itself (`ttl`), the session's ttl hint."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help=f"a turnkv router (http://HOST:PORT{path}), or "
                                           "another server of the same API")
    parser.add_argument("--model", help="the model to use (default: the cluster's)")
    parser.add_argument("--api-key", default="local")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    if ttl:
        parser.add_argument("--ttl", type=float, default=120.0,
                            help="ttl hint: keep the session this long after each turn (s)")
    return parser


def endpoint(args: argparse.Namespace, path: str = OPENAI_PATH) -> tuple[str, str]:
    """The base URL (the router's, and `path` under it) and the model: given (the model, else
    the first the endpoint serves), or those of the cluster `turnkv up` started."""
    if args.base_url:
        if args.model:
            return args.base_url, args.model
        served = args.base_url.rstrip("/").removesuffix(path) + OPENAI_PATH
        models = openai.OpenAI(base_url=served, api_key=args.api_key).models.list()
        return args.base_url, models.data[0].id
    # The serving side is needed only to find the local cluster.
    from turnkv_server.launcher import current_state

    state = current_state()
    if state is None or not state.router:
        raise SystemExit("no cluster is running: start one with `turnkv up`, or pass --base-url")
    return f"{state.router}{path}", args.model or state.served_model_name
