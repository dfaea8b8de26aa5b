"""How logprobs are written in OpenAI responses: completions' token/offset lists, chat's content
entries with their bytes, vLLM's prompt_logprobs; tokens named by their text or as token_id:N,
and -inf (a token a processor ruled out) as -9999.0, which JSON can carry."""

from __future__ import annotations

from shardlm.outputs import Logprob, RequestOutput


def prompt_position_logprobs(out: RequestOutput, tokenizer) -> list:
    """Prompt logprobs in the per-position form of generated tokens (the first position: no logprob)."""
    return [pos if pos is not None else {tid: Logprob(None, None, tokenizer.decode([tid]))}
            for tid, pos in zip(out.prompt_token_ids, out.prompt_logprobs)]


def _chosen(position: dict) -> tuple[int, Logprob]:
    """The token a position is for and its entry: listed first (then come the top-k)."""
    return next(iter(position.items()))


def prompt_logprobs_json(positions) -> list | None:
    """vLLM's prompt_logprobs: per prompt position (the first: null) {token id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if pos is None else {str(t): {"logprob": _json_logprob(v.logprob), "rank": v.rank,
                                               "decoded_token": v.decoded_token} for t, v in pos.items()}
            for pos in positions]


def _json_logprob(value: float | None) -> float | None:
    """A logprob JSON can carry: a token a processor ruled out (-inf) as -9999.0, as vLLM's."""
    return max(value, -9999.0) if value is not None else None


def _utf8(text: str | None) -> list[int] | None:
    return list(text.encode()) if text is not None else None


def _token_name(token_id: int, lp: Logprob, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or token_id:N (--return-tokens-as-token-ids)."""
    return f"token_id:{token_id}" if as_ids else lp.decoded_token


def completion_logprobs(positions, as_ids: bool = False) -> dict | None:
    if positions is None:
        return None
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for pos in positions:
        tid, lp = _chosen(pos)
        tokens.append(_token_name(tid, lp, as_ids))
        token_lps.append(_json_logprob(lp.logprob))
        tops.append({_token_name(t, v, as_ids): _json_logprob(v.logprob) for t, v in pos.items()}
                    if lp.logprob is not None else None)
        offsets.append(offset)
        offset += len(lp.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(positions, k: int, as_ids: bool = False) -> dict | None:
    if positions is None:
        return None
    content = []
    for pos in positions:
        tid, lp = _chosen(pos)
        top = sorted(((t, v) for t, v in pos.items() if v.rank is not None and v.rank <= k), key=lambda e: e[1].rank)
        content.append({"token": _token_name(tid, lp, as_ids), "logprob": _json_logprob(lp.logprob),
                        "bytes": _utf8(lp.decoded_token),
                        "top_logprobs": [{"token": _token_name(t, v, as_ids), "logprob": _json_logprob(v.logprob),
                                          "bytes": _utf8(v.decoded_token)} for t, v in top]})
    return {"content": content}
