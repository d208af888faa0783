import math

import pytest
import torch

from fastrl import PolicyLossConfig
from fastrl._checks import check_float, check_mask, check_same_device, check_scalar, resolve_backend


def test_presets_match_published_settings():
    assert PolicyLossConfig.preset("dapo").clip_high == 0.28
    assert PolicyLossConfig.preset("grpo").kl_coef == 0.04
    assert PolicyLossConfig.preset("gspo").ratio_level == "sequence"
    assert PolicyLossConfig.preset("dr_grpo", norm_length=1024).loss_agg == "seq-mean-token-sum-norm"
    assert PolicyLossConfig.preset("dapo", kl_coef=0.01).kl_coef == 0.01


@pytest.mark.parametrize(
    "field,value",
    [("clip_low", math.nan), ("clip_low", 1.0), ("dual_clip", 1.0), ("kl_estimator", "k4"),
     ("loss_agg", "sum"), ("norm_length", 0.0), ("is_cap", -1.0), ("kl_coef", math.inf)],
)
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**{field: value})


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset"):
        PolicyLossConfig.preset("a2c")


def test_checks_name_the_argument():
    with pytest.raises(TypeError, match="logp"):
        check_float("logp", torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="mask"):
        check_mask("mask", torch.ones(2, 4), (2, 3))
    with pytest.raises(ValueError, match="gamma"):
        check_scalar("gamma", float("nan"))
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda", torch.device("cpu"))
    a = torch.zeros(1)
    assert check_same_device(a=a, b=None, c=a) == a.device


def test_auto_backend_is_torch_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"  # interpreter is on in tests


def test_dr_grpo_without_its_constant_is_refused():
    """norm_length=None used to mean "this batch's padded length": micro-batches padded to
    their own lengths then silently gave another update than the full batch."""
    with pytest.raises(ValueError, match="norm_length is required"):
        PolicyLossConfig.preset("dr_grpo")
    with pytest.raises(ValueError, match="norm_length is required"):
        PolicyLossConfig(loss_agg="seq-mean-token-sum-norm")
    cfg = PolicyLossConfig.preset("dr_grpo", norm_length=512)
    with pytest.raises(ValueError, match="norm_length is required"):
        cfg.replace(norm_length=None)
