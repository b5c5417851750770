"""`policy_caps`: the config's policies and adapters within the caps when it loads, and
the launcher starts no more policy trainers than `max_policies` (the runtime creation is
tested over HTTP in tests/security/test_policy_caps.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from areal_service.config import ServiceConfig
from launcher.policy_trainers import within_cap

LORA = {"default_policy": {"lora": {"rank": 4}}}


def test_a_config_over_the_caps_does_not_load() -> None:
    two = [{"name": "a"}, {"name": "b"}]
    with pytest.raises(ValidationError, match=r"at most 1 named policies"):
        ServiceConfig.model_validate({**LORA, "policies": two, "policy_caps": {"max_policies": 1}})
    ServiceConfig.model_validate({**LORA, "policies": two, "policy_caps": {"max_policies": 2}})
    with pytest.raises(ValidationError, match=r"lora.rank 128 is over .* cap of 64"):
        ServiceConfig.model_validate({"default_policy": {"lora": {"rank": 128}}})
    wide = [{"name": "a", "lora": {"rank": 32, "alpha": 4096}}]
    with pytest.raises(ValidationError, match=r"policy 'a': lora.alpha 4096 is over"):
        ServiceConfig.model_validate({**LORA, "policies": wide})
    ServiceConfig.model_validate(
        {**LORA, "policies": wide, "policy_caps": {"max_lora_alpha": 4096}}
    )


def test_the_launcher_starts_no_trainer_past_the_cap() -> None:
    assert within_cap([], ["a", "b", "c"], 2) == (["a", "b"], ["c"])
    assert within_cap(["a", "b"], ["a", "b", "c"], 2) == ([], ["c"])
    assert within_cap(["a"], ["a", "b", "b"], 5) == (["b"], [])
    assert within_cap(["a", "b", "c"], ["d"], 2) == ([], ["d"])  # the cap lowered since
