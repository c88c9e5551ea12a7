"""The defaults that follow other settings, and the helpers sections use to say so (config/sections.py).

A leaf of the config package: what a default is, measured where the comments say.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from diloco_node.registry import CODEC_DEFAULTS, CODECS

DEFAULT_STATUS_PORT = 7780
DILOCO_MOMENTUM = 0.9  # DiLoCo's outer Nesterov momentum (docs/architecture.md §3)
# Under eager, half of each step (the others' Δ) lands a round late, which already carries momentum;
# 0.6 kept eager within 1 % of blocking in benchmarks/wide_area.py, 0.9 did not (see docs/configuration.md,
# sync modes).
EAGER_MOMENTUM = 0.6
# Delayed applies every Δ one round late, and its inner phases start from a φ that lacks the last
# one; momentum on top overshoots: at H=100 it ended 1.73× blocking's eval loss with 0.9, 1.39× with
# 0.3, 1.17× with 0 (benchmarks/eager_loss.py --modes
# blocking,delayed:0.9,delayed:0.6,delayed:0.3,delayed:0 --repeats 1).
DELAYED_MOMENTUM = 0.0
# DiLoCo with a blocking exchange takes plain averaging (outer lr 1, no momentum) of inner phases at
# 4x the inner lr the other modes keep. The learning simulator (benchmarks/results/learning_b2.md:
# llama-2m, 4 workers of 2 x 128 tokens a step, H = 50, 3 seeds) ended at eval 5.40-5.42 with it, 1.97x
# fewer tokens per worker than one node alone; the published step (inner 4e-4, outer 0.7, Nesterov 0.9)
# ended at 5.58 at H = 30, and eager with either step at 5.69-5.96 (0.56-0.94x: no better than alone).
# The halves were measured together, so a run that gives its outer lr or momentum keeps DiLoCo's
# published step for the rest: 1.6e-3 under eager's step lost (5.86), so did momentum 0.5 at 1.6e-3
# under blocking (H = 5: 5.50 against 5.25-5.29; docs/configuration.md, sync modes). The inner lr is
# a node's own (outside the fingerprint), so giving it changes no outer setting.
BLOCKING_STEP = {"inner_lr": 1.6e-3, "outer_lr": 1.0, "outer_momentum": 0.0}
INNER_LR, OUTER_LR = 4e-4, 0.7  # every other mode's
AUTO_BUTTERFLY_FROM = 3  # see NodeConfig.butterfly_from and benchmarks/scale.py
SYNC_MOMENTUM = {"blocking": DILOCO_MOMENTUM, "delayed": DELAYED_MOMENTUM, "eager": EAGER_MOMENTUM}
# With a codec that keeps an error-feedback residual (topk, sign), the residual does momentum's job
# (SparseLoCo): unset outer settings follow. benchmarks/codecs.py, sign at 0.094 B/param, final eval
# loss vs none: Nesterov 0.9 on top of error feedback +8.0 %; momentum 0 with outer lr 1 +2.7 %,
# 1.4 +0.3 %, 1.7 −0.3 %, 2 −0.5 % (β = 0.95; β = 0.9 and 1 within 0.2 % of it).
FEEDBACK_OUTER = {"outer_momentum": 0.0, "outer_lr": 2.0, "ef_decay": 0.95}
FEEDBACK_CODECS = "<error-feedback codecs>"  # in a description: describe() names them (registry.CODECS)


def codec_default(key: str) -> Callable[[], Any]:
    """The codec's own default for one of its parameters (CodecConfig's), read on first use."""
    return lambda: CODEC_DEFAULTS.get()[key]


def keeps_residual(compression: Any) -> bool:
    """Whether a codec, by name, drops values and keeps an error-feedback residual (its spec's `feedback`)."""
    return isinstance(compression, str) and compression in CODECS.names() and CODECS[compression].feedback


def unset(text: str) -> dict[str, Any]:
    """A Field's json_schema_extra for a setting whose Field default does not say what a node runs
    with when it is left unset (None, or a value NodeConfig._defaults_that_follow replaces from other
    settings): --help and the configuration reference show `text` as its default (`unset_default`)."""
    return {"unset": text}
