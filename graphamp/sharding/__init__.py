"""ZeRO and FSDP2 on the host and in the step's graph, in one package.

How a parameter is cut into one row per rank and which block gathers it (``cuts``); which
parameters are graphamp's ZeRO-3 shards and the row each views (``rows``); making a model's
parameters shards and gathering them for eager use (``sharded_params``); the optimizer state
held by rows and torch's format for ``state_dict()`` (``zero_state``); taking over a model the
user wrapped with FSDP2's ``fully_shard`` (``fsdp_adopt``); ZeRO's placement, the plan's
answer to how the step takes each parameter and state tensor (this rank's row), which the
runner and the example inputs ask alike (``row_placement``); and where the step's gathers and
reduce-scatters run (``shard_gathers``, the ZeRO component's rewrite of the assembled step).
What the step does with them is the ZeRO step component (``step/components/zero.py``); the
settings are ``config.enable_zero`` and the ``records/fully_shard.FullyShardWrap`` record.
"""
