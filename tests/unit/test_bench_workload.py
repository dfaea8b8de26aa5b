"""The long workload's prompts follow the model: 4k, 8k and 16k where they fit with the output,
else 2k, 4k and the longest that fits (the default model's 8,192 positions: 2,048, 4,096, 8,000)."""

from shardlm.bench.workload import long_lengths, long_prompts


def test_long_prompt_lengths_follow_the_model():
    assert long_lengths(8192, 128) == (2048, 4096, 8000)
    assert long_lengths(131072, 128) == (4096, 8192, 16384)
    assert long_lengths(16384, 128) == (4096, 8192, 16000)
    assert long_lengths(4096, 128) == (2048, 3000)


def test_long_prompts_are_the_same_on_every_run():
    class Tokenizer:
        def __len__(self):
            return 49152
    a, b = long_prompts(Tokenizer(), (10, 20)), long_prompts(Tokenizer(), (10, 20))
    assert a == b and [len(p) for p in a] == [10, 20]
