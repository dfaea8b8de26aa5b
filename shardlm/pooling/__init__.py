"""Pooling models: embeddings, classification, scores and rerank beside generation.

    params.py      PoolingParams: what a request wants back (task, dimensions, normalize, ...)
    config.py      which runner a checkpoint gets (--runner, --convert) and how it pools
                   (sentence-transformers' files, --pooler-config, the model's defaults)
    pooler.py      the step's final hidden states -> one result per request (CLS, LAST, MEAN, ALL, STEP)
    bert.py        bidirectional encoders (BERT, XLM-RoBERTa): no KV cache, whole prompts per step
    decoder.py     decoder models as embedders and classifiers (last-token pooling, causal attention)
    scoring.py     score / rerank: cross-encoder pairs, or the cosine of two embeddings

A pooling request runs one step: its whole prompt is computed at once (the scheduler never
splits it), the pooler reads the step's hidden states, and it ends with its result instead of a
sampled token.
"""
