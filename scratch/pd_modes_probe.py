#!/usr/bin/env python3
"""Probe the request flows a router must use for vLLM 0.32's two NIXL P/D modes.

Standalone (standard library only). Given a prefill and a decode engine URL, runs a 3-turn
greedy chat and prints per turn: prompt tokens, the prefill engine's
usage.prompt_tokens_details.cached_tokens, and the `vllm:prompt_tokens_by_source_total`
deltas (local_compute / local_cache_hit / external_kv_transfer) of both engines, plus whether
the P/D output matches a cache-free reference on the prefill engine (cache_salt).

Modes (the engines must have been started for that mode, see the docstring of main()):

  bidirectional  NixlConnector, {"bidirectional_kv_xfer": true} on both engines.
      turn N: P(max_tokens=1, kv_transfer_params={do_remote_decode: true, ...None}) ->
              D(kv_transfer_params = P's returned params) -> D returns params
              {do_remote_decode: true, remote_block_ids, remote_num_tokens, ...} (non-stream)
      turn N+1: P(kv_transfer_params = D's returned params, guarded) -> P READs from D.
      --stream: D is streamed (no kv_transfer_params in a stream); afterwards a "capture"
              request (non-streamed /v1/completions, prompt = prompt ids + output ids,
              max_tokens=1, kv_transfer_params={"do_remote_decode": false,
              "do_remote_prefill": false}) makes D pin the same (prefix-cached) blocks and
              return params covering the whole conversation so far.
      --edit: adds turns with an edited history, unguarded (shows wrong KV being read) and
              guarded (LCP-truncated params).

  push  NixlPushConnector on both engines, fixed engine_id on the prefill engine.
      P and D are sent concurrently with the same X-Request-Id; D carries
      {do_remote_prefill: true, remote_engine_id, remote_host, remote_port, tp_size, pp_size,
       remote_request_id}; P carries {do_remote_decode: true}.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import re
import sys
import threading
import time
import urllib.request
import uuid

MODEL = "tiny"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

WORDS = (
    "river mountain cloud garden window paper silver market engine forest candle violet "
    "harbor signal copper meadow lantern thunder pebble orchard canvas whistle marble "
    "falcon compass velvet quarry saddle beacon tundra ember glacier cactus"
).split()


def user_text(turn: int, n_words: int = 120, salt: str = "") -> str:
    rng = random.Random(f"{salt}turn{turn}")
    return f"Turn {turn}. " + " ".join(rng.choice(WORDS) for _ in range(n_words))


# --------------------------------------------------------------------------- HTTP helpers


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 300) -> dict:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url} -> {e.code}: {e.read()[:500]!r}") from None


def post_stream(url: str, body: dict, headers: dict | None = None, timeout: float = 300):
    """Yield (t_since_start, parsed SSE chunk)."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield time.perf_counter() - t0, json.loads(data)


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


_METRIC_RE = re.compile(r'^vllm:prompt_tokens_by_source_total\{([^}]*)\}\s+([0-9.eE+-]+)')


def by_source(base: str) -> dict[str, float]:
    out = dict.fromkeys(SOURCES, 0.0)
    for line in get_text(base + "/metrics").splitlines():
        m = _METRIC_RE.match(line)
        if m:
            src = re.search(r'source="([^"]+)"', m.group(1)).group(1)
            out[src] = out.get(src, 0.0) + float(m.group(2))
    return out


def block_size(base: str) -> int:
    for line in get_text(base + "/metrics").splitlines():
        if line.startswith("vllm:cache_config_info{"):
            m = re.search(r'block_size="(\d+)"', line)
            if m:
                return int(m.group(1))
    raise RuntimeError("block_size not found in /metrics cache_config_info")


def delta(a: dict, b: dict) -> dict:
    return {k: int(b[k] - a[k]) for k in SOURCES}


def fmt(d: dict) -> str:
    return "compute={local_compute} cache={local_cache_hit} external={external_kv_transfer}".format(
        **d
    )


def tokenize(base: str, messages: list[dict]) -> list[int]:
    r = post(
        base + "/tokenize",
        {"model": MODEL, "messages": messages, "add_generation_prompt": True},
    )
    return r["tokens"]


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ----------------------------------------------------------------------- request bodies

# What a prefill request carries in plain P/D (first turn of bidirectional, and push).
P_PARAMS_FRESH = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def chat_body(messages, max_tokens, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def reference(prefill: str, messages, max_tokens) -> list[int]:
    """Greedy output computed from scratch (cache_salt defeats the prefix cache)."""
    r = post(
        prefill + "/v1/chat/completions",
        chat_body(messages, max_tokens, cache_salt=f"ref-{uuid.uuid4().hex}"),
    )
    return r["choices"][0]["token_ids"]


def guard_params(held: dict, new_ids: list[int], bs: int) -> tuple[dict, int]:
    """Truncate D's returned params to the prefix the new prompt really shares.

    held = {"params": D's kv_transfer_params, "ids": the token ids those params cover}.
    Upstream reads min(remote_num_tokens, len(prompt)) tokens' worth of blocks and pairs
    P's newly allocated blocks with the *last* remote blocks (end-trim), with no token check:
    remote_num_tokens and remote_block_ids must both be cut to the common prefix.
    """
    p = copy.deepcopy(held["params"])
    k = min(lcp(held["ids"], new_ids), p["remote_num_tokens"], len(new_ids) - 1)
    nb = math.ceil(k / bs) if k > 0 else 0
    p["remote_num_tokens"] = k
    p["remote_block_ids"] = [list(g[:nb]) for g in p["remote_block_ids"]]
    return p, k


# ------------------------------------------------------------------------ bidirectional


def bidir_turn(args, messages, held, guard: bool, bs: int):
    P, D = args.prefill, args.decode
    new_ids = tokenize(P, messages)
    info = {"prompt_tokens": len(new_ids)}
    if held is None:
        kvp = dict(P_PARAMS_FRESH)
    elif guard:
        kvp, k = guard_params(held, new_ids, bs)
        info["shared_prefix"] = k
    else:
        kvp = copy.deepcopy(held["params"])
        info["shared_prefix(unguarded)"] = lcp(held["ids"], new_ids)
    if held is not None:
        info["held_remote_num_tokens"] = held["params"]["remote_num_tokens"]
        info["sent_remote_num_tokens"] = kvp["remote_num_tokens"]

    m0p, m0d = by_source(P), by_source(D)
    t0 = time.perf_counter()
    pr = post(P + "/v1/chat/completions", chat_body(messages, 1, kv_transfer_params=kvp))
    t_p = time.perf_counter() - t0
    d_kvp = pr["kv_transfer_params"]
    info["prefill_cached_tokens"] = pr["usage"]["prompt_tokens_details"]["cached_tokens"]
    info["prefill_s"] = round(t_p, 3)

    if not args.stream:
        dr = post(D + "/v1/chat/completions", chat_body(messages, args.max_tokens, kv_transfer_params=d_kvp))
        out_ids = dr["choices"][0]["token_ids"]
        prompt_ids = dr["prompt_token_ids"]
        next_params = dr["kv_transfer_params"]
        covered = (prompt_ids + out_ids)[: next_params["remote_num_tokens"]]
        info["ttft_s"] = None
    else:
        out_ids, prompt_ids, first = [], None, None
        last_chunk = None
        for t, ch in post_stream(
            D + "/v1/chat/completions",
            chat_body(
                messages,
                args.max_tokens,
                kv_transfer_params=d_kvp,
                stream=True,
                stream_options={"include_usage": True},
            ),
        ):
            last_chunk = ch
            if ch.get("prompt_token_ids"):
                prompt_ids = ch["prompt_token_ids"]
            for c in ch.get("choices") or []:
                if c.get("token_ids"):
                    if first is None:
                        first = t
                    out_ids += c["token_ids"]
        info["ttft_s"] = round(t_p + (first or 0), 3)
        info["stream_final_chunk_has_kv_transfer_params"] = "kv_transfer_params" in (last_chunk or {})
        # Capture: a tiny non-streamed request on D over prompt+output; it hits the blocks the
        # streamed request left pinned (prefix cache), computes < 1 block, is delay-freed by
        # the connector (any non-empty kv_transfer_params on a bidirectional D does that) and
        # returns params covering all len(prompt)+len(output) tokens.
        full = prompt_ids + out_ids
        m_cap = by_source(D)
        t1 = time.perf_counter()
        cr = post(
            D + "/v1/completions",
            {
                "model": MODEL,
                "prompt": full,
                "max_tokens": 1,
                "temperature": 0.0,
                "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": False},
            },
        )
        info["capture_s"] = round(time.perf_counter() - t1, 3)
        info["capture_D"] = fmt(delta(m_cap, by_source(D)))
        next_params = cr["kv_transfer_params"]
        covered = full[: next_params["remote_num_tokens"]]

    info["P"] = fmt(delta(m0p, by_source(P)))
    info["D"] = fmt(delta(m0d, by_source(D)))
    info["returned_params"] = {
        k: (v if k != "remote_block_ids" else f"{len(v)} group(s) x {len(v[0])} blocks")
        for k, v in next_params.items()
    }
    if args.check:
        ref = reference(P, messages, args.max_tokens)
        n = lcp(ref, out_ids)
        info["matches_reference"] = n == len(ref) == len(out_ids) or f"diverges at {n}"
    return out_ids, {"params": next_params, "ids": covered}, info


def run_bidirectional(args):
    bs = block_size(args.prefill)
    print(f"# bidirectional  block_size={bs}  stream={args.stream}")
    messages: list[dict] = []
    held = None
    history = []
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": user_text(turn, salt=args.salt)})
        out_ids, held, info = bidir_turn(args, messages, held, guard=True, bs=bs)
        text = detok(args.prefill, out_ids)
        messages.append({"role": "assistant", "content": text})
        history.append(info)
        print(f"turn {turn}: {json.dumps(info)}")
    if args.edit:
        # (a) Guarded edit: the last assistant reply's tail is edited (a "regenerate/edit"),
        # so the new prompt shares most of the held tokens and diverges inside the reply.
        ed = copy.deepcopy(messages)
        words = ed[-1]["content"].split(" ")
        ed[-1]["content"] = " ".join(words[: max(1, len(words) * 3 // 4)]) + " EDITED tail"
        ed.append({"role": "user", "content": user_text(98, salt=args.salt)})
        out_ids, held, info = bidir_turn(args, ed, held, guard=True, bs=bs)
        print(f"edited turn (guarded, reply tail edited): {json.dumps(info)}")
        ed.append({"role": "assistant", "content": detok(args.prefill, out_ids)})
        # (b) Unguarded edit: the first user message changes (diverges a few tokens in);
        # D's params are passed through untouched, as upstream's proxy example does.
        ed2 = copy.deepcopy(ed)
        ed2[0]["content"] = user_text(1, salt=args.salt + "edited")
        ed2.append({"role": "user", "content": user_text(99, salt=args.salt)})
        out_ids, held, info = bidir_turn(args, ed2, held, guard=False, bs=bs)
        print(f"edited turn (UNGUARDED, first user msg edited): {json.dumps(info)}")
        # (c) Is P's prefix cache poisoned? Same prompt, plain request, no kv params.
        r = post(args.prefill + "/v1/chat/completions", chat_body(ed2, args.max_tokens))
        ref = reference(args.prefill, ed2, args.max_tokens)
        n = lcp(ref, r["choices"][0]["token_ids"])
        print(
            "P prefix cache after the unguarded turn: "
            + json.dumps({
                "plain_request_cached_tokens": r["usage"]["prompt_tokens_details"]["cached_tokens"],
                "plain_request_matches_reference": n == len(ref) or f"diverges at {n}",
            })
        )


def detok(base: str, ids: list[int]) -> str:
    return post(base + "/detokenize", {"model": MODEL, "tokens": ids})["prompt"]


# ----------------------------------------------------------------------------------- push


def run_push(args):
    print(f"# push  order={args.push_order}")
    P, D = args.prefill, args.decode
    messages: list[dict] = []
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": user_text(turn, salt=args.salt)})
        rid = f"probe-{uuid.uuid4().hex}"
        hdr = {"X-Request-Id": rid}
        p_body = chat_body(messages, 1, kv_transfer_params=dict(P_PARAMS_FRESH))
        d_body = chat_body(
            messages,
            args.max_tokens,
            kv_transfer_params={
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": args.prefill_engine_id,
                "remote_host": args.prefill_side_host,
                "remote_port": args.prefill_side_port,
                "tp_size": 1,
                "pp_size": 1,
                # D's heartbeats name this id; P's real id has a random suffix, so they
                # never match (harmless; P's lease is kv_lease_duration, 30 s default).
                "remote_request_id": f"chatcmpl-{rid}",
                "remote_block_ids": [],
            },
        )
        m0p, m0d = by_source(P), by_source(D)
        res: dict = {}

        def do(name, url, body):
            t = time.perf_counter()
            try:
                res[name] = post(url + "/v1/chat/completions", body, hdr)
            except Exception as e:  # noqa: BLE001
                res[name] = {"error": str(e)}
            res[name + "_s"] = round(time.perf_counter() - t, 3)

        t0 = time.perf_counter()
        if args.push_order == "concurrent":
            th = [
                threading.Thread(target=do, args=("P", P, p_body)),
                threading.Thread(target=do, args=("D", D, d_body)),
            ]
            for x in th:
                x.start()
            for x in th:
                x.join()
        elif args.push_order == "prefill-first":
            do("P", P, p_body)
            do("D", D, d_body)
        else:  # decode-first: D registers, P comes 1 s later
            th = threading.Thread(target=do, args=("D", D, d_body))
            th.start()
            time.sleep(1.0)
            do("P", P, p_body)
            th.join()
        wall = round(time.perf_counter() - t0, 3)
        pr, dr = res["P"], res["D"]
        if "error" in pr or "error" in dr:
            print(f"turn {turn}: ERROR P={pr.get('error')} D={dr.get('error')}")
            return
        out_ids = dr["choices"][0]["token_ids"]
        info = {
            "prompt_tokens": dr["usage"]["prompt_tokens"],
            "prefill_cached_tokens": pr["usage"]["prompt_tokens_details"]["cached_tokens"],
            "P": fmt(delta(m0p, by_source(P))),
            "D": fmt(delta(m0d, by_source(D))),
            "P_s": res["P_s"],
            "D_s": res["D_s"],
            "wall_s": wall,
            "prefill_returned_params": pr.get("kv_transfer_params"),
            "decode_returned_params": dr.get("kv_transfer_params"),
        }
        if args.check:
            ref = reference(P, messages, args.max_tokens)
            n = lcp(ref, out_ids)
            info["matches_reference"] = n == len(ref) == len(out_ids) or f"diverges at {n}"
        print(f"turn {turn}: {json.dumps(info)}")
        messages.append({"role": "assistant", "content": detok(P, out_ids)})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("bidirectional", "push"))
    ap.add_argument("--prefill", required=True, help="e.g. http://127.0.0.1:8100")
    ap.add_argument("--decode", required=True, help="e.g. http://127.0.0.1:8200")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--salt", default="", help="changes the conversation text")
    ap.add_argument("--stream", action="store_true", help="bidirectional: stream D + capture")
    ap.add_argument("--edit", action="store_true", help="bidirectional: edited-history turns")
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip the cache-free reference comparison")
    ap.add_argument("--prefill-engine-id", default="turnkv-prefill")
    ap.add_argument("--prefill-side-host", default="127.0.0.1")
    ap.add_argument("--prefill-side-port", type=int, default=5600)
    ap.add_argument("--push-order", choices=("concurrent", "prefill-first", "decode-first"),
                    default="concurrent")
    args = ap.parse_args()
    args.prefill = args.prefill.rstrip("/")
    args.decode = args.decode.rstrip("/")
    if args.mode == "bidirectional":
        run_bidirectional(args)
    else:
        run_push(args)


if __name__ == "__main__":
    sys.exit(main())
