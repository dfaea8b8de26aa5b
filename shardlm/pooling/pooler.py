"""One step's final hidden states -> one result per pooling request.

The step's tokens are its requests' whole prompts, one after another. Each request's rows are
pooled (CLS: the first; LAST: the last; MEAN: their mean; ALL: every row; STEP: the rows at the
step tag token), put through the model's head (an embedder's is nothing, a classifier's its
class logits), then finished as the request's task asks: embeddings truncated to `dimensions`
and normalized, class logits through sigmoid or softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlm.messages import PooledData, ScheduledChunk
from shardlm.pooling.config import PoolerConfig
from shardlm.pooling.params import PoolingParams

TOKEN_TASKS = ("token_embed", "token_classify")


def pool_step(model, config: PoolerConfig, hidden: torch.Tensor, chunks: list[ScheduledChunk],
              params: dict[str, PoolingParams]) -> dict[str, PooledData]:
    """hidden: [tokens, hidden] of the whole step, in chunk order -> req_id -> its result."""
    starts, at = [], 0
    for c in chunks:
        starts.append(at)
        at += len(c.token_ids)
    # (a request without params: the CUDA memory profile's, pooled as the model's own task)
    params = {c.req_id: params.get(c.req_id) or PoolingParams(task=config.task) for c in chunks}
    vectors, vector_ids, results = [], [], {}
    for c, start in zip(chunks, starts):
        rows = hidden[start:start + len(c.token_ids)]
        p = params[c.req_id]
        if p.task in TOKEN_TASKS or config.pooling_type in ("ALL", "STEP"):
            if config.pooling_type == "STEP" and config.step_tag_id is not None:
                rows = rows[torch.tensor(c.token_ids, device=rows.device) == config.step_tag_id]
            results[c.req_id] = _finish(model.pool_head(rows).float(), config, p)
            continue
        vector_ids.append(c.req_id)
        if config.pooling_type == "CLS":
            vectors.append(rows[0])
        elif config.pooling_type == "LAST":
            vectors.append(rows[-1])
        else:                                   # MEAN
            vectors.append(rows.float().mean(dim=0).to(rows.dtype))
    if vectors:
        heads = model.pool_head(torch.stack(vectors)).float()
        for req_id, row in zip(vector_ids, heads):
            results[req_id] = _finish(row, config, params[req_id])
    return {req_id: PooledData(list(t.shape), t.contiguous().cpu().numpy().tobytes()) for req_id, t in results.items()}


def _finish(x: torch.Tensor, config: PoolerConfig, p: PoolingParams) -> torch.Tensor:
    """The model's output for one request (a vector, or a matrix of one per token) as its task wants it."""
    if config.task == "embed":
        if p.dimensions is not None:
            x = x[..., :p.dimensions]
        if p.normalize if p.normalize is not None else config.normalize:
            x = F.normalize(x, p=2, dim=-1)
        return x
    if p.use_activation if p.use_activation is not None else config.use_activation:
        x = torch.sigmoid(x) if config.activation == "sigmoid" else torch.softmax(x, dim=-1)
    return x
