"""The suites, in the order `all` runs them: name -> the function that lays out its steps for a context
(--quick picks the smoke-test sizes). Each module keeps the description of what its suites measure."""
from __future__ import annotations

from typing import Callable

from ..core import Context
from ..steps import Step
from . import data, dist, gritlm, kernels, load, lora, moe, training

SUITES: dict[str, Callable[[Context], list[Step]]] = {
    "trainer": training.trainer,
    "bf16_gemm": training.bf16_gemm,
    "profile": training.profile,
    "distill": training.distill,
    "distill_quality": training.distill_quality,
    "adamw8bit": training.adamw8bit,
    "lora": lora.lora,
    "attention": kernels.attention,
    "fused": kernels.fused,
    "stack": training.stack,
    "allocator": training.allocator,
    "moe": moe.moe,
    "moe_budget": moe.moe_budget,
    "moe_quality": moe.moe_quality,
    "gritlm": gritlm.gritlm,
    "gritlm_quality": gritlm.gritlm_quality,
    "estimator": kernels.estimator,
    "planner": kernels.planner,
    "data": data.data,
    "tokenizer": data.tokenizer,
    "dist": dist.dist,
    "collectives": dist.collectives,
    "load": load.load,
}
