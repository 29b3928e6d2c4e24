"""config.json -> ModelConfig: the layer schedule from `layer_types` + `compress_rates` (transformers >= 5.23)
and the clear errors for schedules the engine cannot run."""

import json

import pytest

from engine.loading.make_model import default_model_dir
from engine.model.config import ModelConfig


def _raw(**changes) -> dict:
    with open(f"{default_model_dir()}/config.json") as f:
        raw = json.load(f)
    raw.pop("compress_ratios", None)
    raw.update(changes)
    return raw


def test_layer_types_take_their_rates():
    raw = _raw(
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
    )
    assert ModelConfig.from_dict(raw).compress_ratios == (0, 4, 32, 4)


@pytest.mark.parametrize(
    "rates,match",
    [
        ({"compressed_sparse_attention": 8, "heavily_compressed_attention": 128}, "must use rate 4, got 8"),
        ({"compressed_sparse_attention": 4, "heavily_compressed_attention": 4}, "need a rate other than 4"),
    ],
)
def test_schedules_the_engine_cannot_run_are_clear_errors(rates, match):
    raw = _raw(
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "sliding_attention",
        ],
        compress_rates=rates,
    )
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(raw)
