"""The trainer: claims scored episodes from the store, trains the policy with decoupled
PPO under FSDP2 and publishes HF weights. Pure tensor pieces live in `advantage.py`,
`loss.py` and `batch.py`; `model.py` owns the FSDP2 model; `step.py` one optimizer step.
Its config is `areal_service.config.TrainerConfig` (torch-free, part of the one config tree).
"""
