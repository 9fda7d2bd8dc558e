"""The correctness oracle: greedy output through turnkv equals a single engine's, token by token.

Run engines in float32. Even there, a different chunking of the same prompt rounds differently,
and greedy decoding may flip where the reference's two best tokens nearly tie. A divergence is
accepted only at such a near-tie, and the verdict says where it happened and by how much.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

# Largest gap (in nats) between the reference's two best log-probabilities that still counts as
# a near-tie. float32 rounding differences between chunkings are orders of magnitude smaller;
# corrupted KV moves logits by far more.
NEAR_TIE_NATS = 0.01


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    # Per generated token: best minus second-best log-probability.
    top2_gaps: list[float] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)


@dataclass
class Verdict:
    equal: bool
    diverged_at: int | None = None
    gap: float | None = None

    @property
    def acceptable(self) -> bool:
        return self.equal or (self.gap is not None and self.gap < NEAR_TIE_NATS)

    def describe(self) -> str:
        if self.equal:
            return "identical"
        kind = "near-tie" if self.acceptable else "MISMATCH"
        return f"{kind}: diverged at generated token {self.diverged_at}, top-2 gap {self.gap:.2e}"


def greedy_chat(
    base_url: str, model: str, messages: list[dict[str, Any]], max_tokens: int,
    client: httpx.Client | None = None, extra: dict[str, Any] | None = None,
) -> Completion:
    """One non-streaming greedy chat completion with token IDs and top-2 log-probabilities."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
        **(extra or {}),
    }
    http = client or httpx.Client(timeout=300)
    response = http.post(f"{base_url}/v1/chat/completions", json=body)
    response.raise_for_status()
    data = response.json()
    choice = data["choices"][0]
    gaps = []
    for entry in (choice.get("logprobs") or {}).get("content") or []:
        top = sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True)
        gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return Completion(
        token_ids=list(choice.get("token_ids") or []),
        text=choice["message"]["content"] or "",
        top2_gaps=gaps,
        usage=data.get("usage") or {},
    )


def compare(reference: Completion, candidate: Completion) -> Verdict:
    ref, cand = reference.token_ids, candidate.token_ids
    if ref == cand:
        return Verdict(equal=True)
    for i, (a, b) in enumerate(zip(ref, cand, strict=False)):
        if a != b:
            gap = reference.top2_gaps[i] if i < len(reference.top2_gaps) else float("inf")
            return Verdict(equal=False, diverged_at=i, gap=gap)
    # One is a prefix of the other: a stop decision differed, judged at the first extra token.
    i = min(len(ref), len(cand))
    gap = reference.top2_gaps[i] if i < len(reference.top2_gaps) else float("inf")
    return Verdict(equal=False, diverged_at=i, gap=gap)


@dataclass
class RoutedCompletion:
    """A completion through the router: the output plus the router's turn stats."""

    completion: Completion
    stats: dict[str, Any]
    headers: dict[str, str]


def routed_chat(
    base_url: str, model: str, messages: list[dict[str, Any]], max_tokens: int, *,
    session: dict[str, Any] | None, stream: bool, client: httpx.Client,
    headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None,
) -> RoutedCompletion:
    """A greedy chat turn through the router, streaming or not, with token IDs."""
    body: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "stream": stream, **(extra or {}),
    }
    if session is not None:
        body["turnkv"] = session
    if stream:
        body["stream_options"] = {"include_usage": True}
    if not stream:
        response = client.post(f"{base_url}/v1/chat/completions", json=body, headers=headers)
        response.raise_for_status()
        data = response.json()
        choice = data["choices"][0]
        return RoutedCompletion(
            Completion(list(choice.get("token_ids") or []), choice["message"]["content"] or "",
                       usage=data.get("usage") or {}),
            data["turnkv"], dict(response.headers))
    token_ids: list[int] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    stats: dict[str, Any] = {}
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                       headers=headers) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            stats = chunk.get("turnkv") or stats
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                token_ids.extend(choice.get("token_ids") or [])
                text.append((choice.get("delta") or {}).get("content") or "")
        return RoutedCompletion(Completion(token_ids, "".join(text), usage=usage), stats,
                                dict(response.headers))
